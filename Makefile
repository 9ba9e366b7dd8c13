# Two entry points: `make demo` and `make test`. Both create .venv and install what they need; both idempotent.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: demo test lint setup corpus clean gpu-check

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
	$(VENV)/bin/lint-imports
	# mypy sees the repository root as the gputravel package through a link (it cannot follow the
	# editable install's import hook)
	mkdir -p build/mypy && ln -sfn "$(CURDIR)" build/mypy/gputravel
	MYPYPATH=build/mypy $(VENV)/bin/mypy -p gputravel.core --strict

# every check that needs a GPU (scripts/gpu_check.py) into gpu-report.json; without CUDA it writes
# {"cuda": false, "reason": ...} and exits 0. GPU_CHECK_ARGS: e.g. --quick, --only tests,gpu_aes
gpu-check: setup
	$(PY) scripts/gpu_check.py --output gpu-report.json $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
