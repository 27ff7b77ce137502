"""Errors that reach users as one clear line (the CLI turns them into exit code 2)."""


class FastForwardError(Exception):
    """A problem with the user's input or environment, explained in one line."""


class UsageError(FastForwardError, ValueError):
    """A wrong argument value: empty prompt, negative temperature, unknown method, ..."""


class ModelNotFoundError(FastForwardError, FileNotFoundError):
    """The model name or path does not resolve to anything loadable."""


class InputTypeError(UsageError, TypeError):
    """An argument of the wrong type (``ff.generate(model, None)``, ``stop=123``): a TypeError and a UsageError."""


class PastaSyntaxError(UsageError):
    """Malformed PASTA-LANG (an unbalanced or nested tag, a promise without its block, a bad attribute, ...)."""
