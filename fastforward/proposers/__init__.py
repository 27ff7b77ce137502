"""Decoding methods by name.

A method registers a factory ``factory(target, **options)`` -- returning a :class:`~fastforward.engine.Proposer` (a
draft-then-verify method), or another :class:`~fastforward.engine.Method` that builds its own kind of run (PASTA) --
with the schema of its options
(:class:`~fastforward.proposers._options.Option`: type, range or allowed set, default, description). The factory's
keyword-only parameters are the options with their defaults (the schema names the same ones, with the same
defaults); the CLI, the API, the server and the benchmark pass options through by name, and every value is checked
against the schema (:func:`check_method_options`) before any work -- before the model is loaded where it can be.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from ..engine import Method
from ..errors import UsageError
from ._options import Option

__all__ = ["METHODS", "MethodInfo", "Option", "available_methods", "check_method_options", "make_proposer",
           "register"]


@dataclass(frozen=True)
class MethodInfo:
    name: str
    factory: Callable
    summary: str
    lossless: bool = True
    source: str = ""
    schema: tuple[Option, ...] = ()
    #: checks across options, each ``check(method, options)`` on the options with the defaults filled in; a problem
    #: is a one-line :class:`UsageError` (such as ``min_ngram`` above ``max_ngram``, or a forward's rows)
    checks: tuple[Callable[[str, dict], None], ...] = ()

    def options(self) -> dict:
        """``{name: default}`` of the method's options (the factory's keyword-only parameters)."""
        sig = inspect.signature(self.factory)
        return {
            p.name: p.default
            for p in list(sig.parameters.values())[1:]
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        }

    def option(self, name: str) -> Option | None:
        return next((o for o in self.schema if o.name == name), None)


METHODS: dict[str, MethodInfo] = {}
# Modules that register methods when imported; a later issue adds its file here.
_METHOD_MODULES = ["ar", "jacobi", "pld", "rest", "lookahead", "tr_jacobi", "eagle", "sps", "fasteagle", "falcon",
                   "pasta", "auto"]


def register(name: str, summary: str, *, lossless: bool = True, source: str = "", options: tuple[Option, ...] = (),
             checks: tuple[Callable[[str, dict], None], ...] = ()):
    """Register ``factory`` as method ``name``; ``options`` is its schema (one :class:`Option` per keyword-only
    parameter of the factory) and ``checks`` its checks across options (see :class:`MethodInfo`)."""
    names = [o.name for o in options]
    if len(set(names)) != len(names):
        raise ValueError(f"method {name}: an option is declared twice in {names}")

    def wrap(factory):
        METHODS[name] = MethodInfo(name, factory, summary, lossless, source, tuple(options), tuple(checks))
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


def is_method(value) -> bool:
    """Whether ``value`` is a ready method instance (a :class:`~fastforward.engine.Proposer`, or another
    :class:`~fastforward.engine.Method`): it builds runs."""
    return callable(getattr(value, "new_run", None))


def make_proposer(method, target, **options) -> Method:
    """The method ``method`` (a registered name or a ready method instance) for ``target``, its options checked
    against the method's schema first (the checks that need the model, such as a forward's rows against its context,
    are the factory's): a :class:`~fastforward.engine.Proposer`, or a method with its own kind of run."""
    if is_method(method):
        if options:
            raise UsageError("options cannot be given with a ready proposer instance")
        return method
    info = check_method_options(method, options)
    return info.factory(target, **options)


def check_method_options(method, options: dict) -> MethodInfo:
    """The registered method ``method`` after checking ``options`` against its schema: every name is one of its
    options, every value has the option's type and lies in its range or allowed set, and the checks across options
    hold. A problem is one line naming the option and what it takes (:class:`UsageError`); nothing is loaded."""
    methods = available_methods()
    if not isinstance(method, str) or method not in methods:
        raise UsageError(f"unknown method '{method}'; available: {', '.join(methods)}")
    info = methods[method]
    known = info.options()
    unknown = sorted(set(options) - set(known))
    if unknown:
        opts = ", ".join(known) or "none"
        raise UsageError(f"method '{method}' has no option {', '.join(unknown)} (its options: {opts})")
    for name, value in options.items():
        option = info.option(name)
        if option is not None:
            option.check(method, value)
    if info.checks:
        given = {**known, **options}
        for check in info.checks:
            check(method, given)
    return info
