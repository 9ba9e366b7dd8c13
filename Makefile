# Two entry points: `make demo` and `make test`. Both create .venv and install what they need; both idempotent.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: demo test lint setup corpus clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,bpe]'
	touch $(STAMP)

corpus: setup
	$(VENV)/bin/gputravel data fetch

demo: corpus
	$(VENV)/bin/gputravel run

test: setup
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -p no:cacheprovider

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
