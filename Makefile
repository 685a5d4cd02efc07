# Two commands do all set-up on a fresh machine (Python 3.11+ and make needed):
#   make quickstart   # creates .venv, installs, runs examples/quickstart.py
#   make test         # creates .venv, installs, runs ruff and the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: quickstart test lint install clean

$(BIN)/.installed: pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints-cpu.txt -e ".[dev]"
	touch $@

install: $(BIN)/.installed

quickstart: install
	$(BIN)/python examples/quickstart.py

lint: install
	$(BIN)/ruff check .

test: lint
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
