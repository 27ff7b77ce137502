"""Command-line options several commands share, declared once: the model to load, the method options, and the
argparse types for counts.

The parsing of method options (``KEY=VALUE`` strings) is a library concern the benchmark uses too, so it lives in
:mod:`fastforward.proposers._options`; it is re-exported here for the commands.
"""

from __future__ import annotations

import argparse

from ..model import DEFAULT_MODEL
from ..proposers._options import parse_options

__all__ = [
    "add_method_option_argument",
    "add_model_argument",
    "add_model_arguments",
    "add_threads_argument",
    "parse_options",
    "positive_float",
    "positive_int",
]

BACKENDS = ("auto", "lean", "hf")
WEIGHTS = ("auto", "fp32", "bf16", "int8")


def positive_int(text: str) -> int:
    """argparse ``type=``: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse ``type=``: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: '{text}'") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def add_model_argument(p, what: str = "") -> None:
    """``--model``: an alias, a local HF folder or a .gguf file (``what`` prefixes the help, e.g. 'base model')."""
    lead = f"{what}: " if what else ""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"{lead}alias, local HF folder or .gguf file (default: %(default)s)")


def add_threads_argument(p, help: str = "torch threads (default: torch's choice)") -> None:
    p.add_argument("--threads", type=positive_int, default=None, help=help)


def add_model_arguments(p, *, threads_help: str | None = None, weights_help: str | None = None) -> None:
    """``--model``, ``--backend``, ``--threads``, ``--weights``: every command that loads a model for decoding."""
    add_model_argument(p)
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="target forward (default: auto)")
    if threads_help:
        add_threads_argument(p, threads_help)
    else:
        add_threads_argument(p)
    p.add_argument("--weights", default="auto", choices=WEIGHTS,
                   help=weights_help or "weight storage: auto (a GGUF's own quantised blocks, packed; an HF folder's "
                        "fp32), fp32 (a GGUF dequantised), bf16 / int8 (HF folders, opt-in: a different model, "
                        "reproduced exactly by every method) (default: auto)")


def add_method_option_argument(p, help: str = "a method option, e.g. -o k=10 (repeatable)") -> None:
    """``-o/--option KEY=VALUE`` (repeatable), read with :func:`parse_options`."""
    p.add_argument("-o", "--option", action="append", metavar="KEY=VALUE", help=help)
