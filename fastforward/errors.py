"""Errors that reach users as one clear line (the CLI turns them into exit code 2)."""


class FastForwardError(Exception):
    """A problem with the user's input or environment, explained in one line."""


class UsageError(FastForwardError, ValueError):
    """A wrong argument value: empty prompt, negative temperature, unknown method, ..."""


class ModelNotFoundError(FastForwardError, FileNotFoundError):
    """The model name or path does not resolve to anything loadable."""
