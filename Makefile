# Two commands on a fresh machine:  `make demo` (train the reference MoE) and `make test`.
# Both create .venv if missing and install the pinned dependencies from PyPI first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ms_efficient-installed
# msrun starts workers with the `python` on PATH, so the venv's bin goes first.
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: install demo test test-fast clean

install: $(STAMP)

$(STAMP): setup.py requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: install
	$(VENV)/bin/ms-efficient train configs/gpt_moe_tiny.yaml --out runs/demo --overwrite

test: install
	$(PY) -m pytest -q --durations=15 tests

test-fast: install
	$(PY) -m pytest -q -m "not slow" tests

clean:
	rm -rf runs build *.egg-info .pytest_cache
