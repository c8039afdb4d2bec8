"""Shared fixtures.

The embedded model lives in the real forerun cache (see forerun.embedded), so it is fetched and
converted once per machine, not once per run. If that fails, the tests using it fail with the
ForerunError that says why; they are not skipped.
"""
import pytest

from forerun.embedded import default_model_dir, ensure_default_gguf


@pytest.fixture(scope="session")
def embedded_dir():
    """The converted SmolLM2-135M-Instruct folder (config.json, model.safetensors, tokenizer.json...)."""
    return default_model_dir()


@pytest.fixture(scope="session")
def embedded_gguf():
    """The SmolLM2-135M-Instruct Q4_1 GGUF the folder was converted from."""
    return ensure_default_gguf()
