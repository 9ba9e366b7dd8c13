# Two entry points: `make demo` and `make test`. Both create .venv and install what they need; both idempotent.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast test-slow lint setup corpus clean gpu-check

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

# Test processes (pytest-xdist): TEST_WORKERS=2 by default (CI's two cores), each module whole on one worker
# (--dist loadfile), so its module fixtures (sshd and its system users, torchrun nodes, device services) start once;
# the likely long modules go first (tests/conftest.py, longest_modules_first). TEST_WORKERS=1 runs the tests in
# pytest's own process. (--dist loadgroup would do nothing more here: xdist 3.8 marks a group by rewriting
# Node._nodeid, which pytest 9 no longer reads.)
TEST_WORKERS ?= 2
XDIST := $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile,)
# One torch (OpenMP/MKL) thread in every test process: two workers already fill two cores, and a device service on
# two threads beside another worker's would only wait for the core (and a GEMM's sums may split differently).
TEST_ENV := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

# The gate (lint), then the default suite and the slow set (gpt2 end to end, torchrun restarts, the kill sweeps) in
# one pytest run, so neither worker waits for the other between them.
test: setup lint
	$(TEST_ENV) $(PY) -m pytest -q -p no:cacheprovider -m 'slow or not slow' $(XDIST)

# The fast tier: no test that starts a process (device service, agents, SSH, ranks, the CLI) and none of the slow set.
test-fast: setup
	$(TEST_ENV) $(PY) -m pytest -q -p no:cacheprovider -m 'not process and not slow' $(XDIST)

test-slow: setup
	$(TEST_ENV) $(PY) -m pytest -q -p no:cacheprovider -m slow $(XDIST)

# The gate before the tests: style (ruff), the import contracts (import-linter) and types (mypy --strict over
# all three packages). mypy sees the repository root as the gputravel package through a link (it cannot follow
# the editable install's import hook).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	mkdir -p build/mypy && ln -sfn "$(CURDIR)" build/mypy/gputravel
	MYPYPATH=build/mypy $(VENV)/bin/mypy -p gputravel.core -p gputravel.agents -p gputravel.console --strict

# Every check that needs a GPU (scripts/gpu_check.py) into gpu-report.json; without CUDA it writes
# {"cuda": false, "reason": ...} and exits 0. GPU_CHECK_ARGS: e.g. --quick, --only tests,gpu_aes, --plan
# (tests/scripts/test_gpu_check.py runs `make -n gpu-check`, so the recipe cannot go missing again).
gpu-check: setup
	$(PY) scripts/gpu_check.py --output gpu-report.json $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
