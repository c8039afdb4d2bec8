"""forerun: lossless speculative decoding. `from forerun import LLM, SamplingParams, SpeculativeConfig`.

Names load lazily so `import forerun` stays cheap (torch is imported on first use).
"""
__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "forerun.llm",
    "CompletionOutput": "forerun.llm",
    "SamplingParams": "forerun.config",
    "SpeculativeConfig": "forerun.config",
    "ForerunError": "forerun.errors",
    "Logprob": "forerun.logprobs",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'forerun' has no attribute {name!r}")
