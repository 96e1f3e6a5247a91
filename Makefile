# Two commands on a fresh machine:  `make demo` (train the reference MoE) and `make test`.
# Both create .venv if missing and install the pinned dependencies from PyPI first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ms_efficient-installed
# msrun starts workers with the `python` on PATH, so the venv's bin goes first.
export PATH := $(abspath $(VENV))/bin:$(PATH)

# The tests run Python with mimalloc preloaded (cmeel-mimalloc, from requirements.txt): MindSpore's
# graph compiler spends about a quarter of its CPU time in glibc's malloc on this suite, and
# every test and msrun worker compiles graphs (docs/testing.md). Without the library, plain malloc.
MIMALLOC = $(firstword $(wildcard $(abspath $(VENV))/lib/python3*/site-packages/cmeel.prefix/lib/libmimalloc.so.3))
FAST_MALLOC = $(if $(MIMALLOC),LD_PRELOAD=$(MIMALLOC) MIMALLOC_ALLOW_THP=0 MIMALLOC_PURGE_DELAY=-1)
# ... and end pytest without the interpreter's teardown of every compiled graph (tests/conftest.py).
export MS_EFFICIENT_TESTS_FAST_EXIT := 1
# ... and let Python cache the byte code of what it imports (some environments set
# PYTHONDONTWRITEBYTECODE, and then every test and worker process compiles every module of
# ms_efficient and the tests from source again). The install skips pip's byte compilation
# (`--no-compile`: the requirements took 22.9 s without it, 27.5 s with it, in a fresh venv;
# most of it on modules no run imports); the first process importing a module writes its cache.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install demo test test-fast clean

install: $(STAMP)

$(STAMP): setup.py requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -r requirements.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: install
	$(VENV)/bin/ms-efficient train configs/gpt_moe_tiny.yaml --out runs/demo --overwrite

test: install
	$(FAST_MALLOC) $(PY) tests/run_lanes.py -q --durations=15

test-fast: install
	$(FAST_MALLOC) $(PY) -m pytest -q -m "not slow" tests

clean:
	rm -rf runs build *.egg-info .pytest_cache
