# Two entry points for a newcomer: `make demo` (set up, then speculative decoding on the
# embedded model) and `make test` (set up, then the whole test suite). Both are idempotent.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.forerun-installed

.PHONY: setup demo test clean

setup: $(STAMP)

# torch is pinned and installed first, so no dependency range can pull a CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: setup
	$(VENV)/bin/forerun generate

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
