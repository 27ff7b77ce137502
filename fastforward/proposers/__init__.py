"""Decoding methods as proposers, by name.

A method registers a factory ``factory(target, **options) -> Proposer``; its keyword-only parameters are the
method's options (with defaults), which the CLI and the benchmark pass through by name.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from ..engine import Proposer
from ..errors import UsageError


@dataclass(frozen=True)
class MethodInfo:
    name: str
    factory: Callable
    summary: str
    lossless: bool = True
    source: str = ""

    def options(self) -> dict:
        sig = inspect.signature(self.factory)
        return {
            p.name: p.default
            for p in list(sig.parameters.values())[1:]
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        }


METHODS: dict[str, MethodInfo] = {}
# Modules that register methods when imported; a later issue adds its file here.
_METHOD_MODULES = ["ar", "jacobi", "pld", "rest", "lookahead", "tr_jacobi", "eagle", "sps", "fasteagle", "falcon",
                   "pasta"]


def register(name: str, summary: str, *, lossless: bool = True, source: str = ""):
    def wrap(factory):
        METHODS[name] = MethodInfo(name, factory, summary, lossless, source)
        return factory

    return wrap


def _load_all() -> None:
    for mod in _METHOD_MODULES:
        try:
            importlib.import_module(f"{__name__}.{mod}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{mod}":
                raise


def available_methods() -> dict[str, MethodInfo]:
    _load_all()
    return dict(METHODS)


def make_proposer(method, target, **options) -> Proposer:
    """A proposer for ``method`` (a registered name or a ready Proposer instance)."""
    if isinstance(method, Proposer):
        if options:
            raise UsageError("options cannot be given with a ready proposer instance")
        return method
    info = check_method_options(method, options)
    return info.factory(target, **options)


def check_method_options(method, options: dict) -> MethodInfo:
    """The registered method ``method`` after checking that it exists and knows every option name in ``options``
    (the values are checked by the method's factory)."""
    methods = available_methods()
    if not isinstance(method, str) or method not in methods:
        raise UsageError(f"unknown method '{method}'; available: {', '.join(methods)}")
    info = methods[method]
    known = info.options()
    unknown = sorted(set(options) - set(known))
    if unknown:
        opts = ", ".join(known) or "none"
        raise UsageError(f"method '{method}' has no option {', '.join(unknown)} (its options: {opts})")
    return info
