"""User-facing errors: one clear message, no traceback from the CLI."""


class ForerunError(Exception):
    """A problem with the user's input or environment, explained in its message."""


class ModelLoadError(ForerunError):
    """A model path, file or format that forerun cannot load."""


class ConfigError(ForerunError):
    """An absurd or inconsistent parameter (sampling, speculative, dtype...)."""


class ContextLengthError(ForerunError):
    """A prompt that does not fit the model's context."""
