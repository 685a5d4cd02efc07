# Two commands do all set-up on a fresh machine (Python 3.11+ and make needed):
#   make quickstart   # creates .venv, installs, runs examples/quickstart.py
#   make test         # creates .venv, installs, runs ruff, the docs build and the test suite
PYTHON ?= python3
VENV ?= .venv
DATTRI_VENV ?= .venv-dattri
BERGSON_VENV ?= .venv-bergson
KRONFLUENCE_VENV ?= .venv-kronfluence
BIN := $(VENV)/bin

.PHONY: quickstart test lint docs install clean bench bench-setup

$(BIN)/.installed: pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints-cpu.txt -e ".[dev,jax,hf,s3,search]"
	touch $@

install: $(BIN)/.installed

quickstart: install
	$(BIN)/python examples/quickstart.py

lint: install
	$(BIN)/ruff check .

docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -q -d build/site

test: lint docs
	$(BIN)/python -m pytest -q

# Benchmarks (tens of minutes at full size; BENCH_ARGS=--quick for a few): captum in .venv,
# dattri 0.3.0 in an environment of its own so its pins never touch ours.
bench-setup: install
	$(BIN)/python -m pip install -q -c constraints-cpu.txt -e ".[bench]"
	test -x $(DATTRI_VENV)/bin/python || $(PYTHON) -m venv $(DATTRI_VENV)
	$(DATTRI_VENV)/bin/python -m pip install -q -c constraints-cpu.txt dattri==0.3.0 torch
	# bergson's metadata asks for torchvision, torchaudio and bitsandbytes (CUDA builds), which
	# it never imports: install it without dependencies, then the ones it imports.
	test -x $(BERGSON_VENV)/bin/python || $(PYTHON) -m venv $(BERGSON_VENV)
	$(BERGSON_VENV)/bin/python -m pip install -q -c constraints-cpu.txt torch transformers \
		peft accelerate datasets numpy safetensors simple-parsing jaxtyping torchopt ml_dtypes \
		natsort psutil tqdm pyarrow scipy pyyaml petname jinja2 huggingface-hub
	$(BERGSON_VENV)/bin/python -m pip install -q -c constraints-cpu.txt --no-deps bergson==2.5.1
	# kronfluence (quality_lm.py's peer) likewise asks for torchvision, never imported by it, whose
	# build for this torch breaks imports: without dependencies, then the ones it imports.
	test -x $(KRONFLUENCE_VENV)/bin/python || $(PYTHON) -m venv $(KRONFLUENCE_VENV)
	$(KRONFLUENCE_VENV)/bin/python -m pip install -q -c constraints-cpu.txt torch transformers \
		accelerate einops einconv opt-einsum safetensors tqdm
	$(KRONFLUENCE_VENV)/bin/python -m pip install -q -c constraints-cpu.txt --no-deps \
		kronfluence==1.0.1
	# and tracinfunc's own dependencies (not its extras), so that curvature_fit.py runs both
	# libraries with the same packages installed: an RSS gap is then the libraries'
	$(KRONFLUENCE_VENV)/bin/python -m pip install -q -c constraints-cpu.txt -e .

bench: bench-setup
	DATTRI_PYTHON=$(DATTRI_VENV)/bin/python $(BIN)/python benchmarks/run_all.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(DATTRI_VENV) $(BERGSON_VENV) $(KRONFLUENCE_VENV) build *.egg-info
