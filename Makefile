# Two commands do all set-up on a fresh machine (Python 3.11+ and make needed):
#   make quickstart   # creates .venv, installs, runs examples/quickstart.py
#   make test         # creates .venv, installs, runs ruff, the docs build and the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: quickstart test lint docs install clean

$(BIN)/.installed: pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints-cpu.txt -e ".[dev,jax]"
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

clean:
	rm -rf $(VENV) build *.egg-info
