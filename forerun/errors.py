"""User-facing errors: one clear message, no traceback from the CLI."""


class ForerunError(Exception):
    """A problem with the user's input or environment, explained in its message."""


class ModelLoadError(ForerunError):
    """A model path, file or format that forerun cannot load."""


class ConfigError(ForerunError):
    """An absurd or inconsistent parameter (sampling, speculative, dtype...)."""


class FieldError(ConfigError, ValueError):
    """A request field whose value forerun refuses; `field` names it the way the request spells it
    ("response_format.json_schema.schema", "guided_regex"), so a server can answer 400 with `param`.
    >>> e = FieldError("guided_regex", "matches no text"); (e.field, str(e))
    ('guided_regex', 'guided_regex: matches no text')
    """

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


class ContextLengthError(ForerunError):
    """A prompt that does not fit the model's context."""


def did_you_mean(word: str, choices) -> str:
    """' (did you mean X?)' for the closest of `choices` (difflib), else ''; for messages.
    >>> did_you_mean("smollm-135m", ["smollm2-135m", "gemma3-270m"]), did_you_mean("zzz", ["ngram"])
    (" (did you mean 'smollm2-135m'?)", '')
    """
    import difflib

    close = difflib.get_close_matches(str(word).lower(), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
