"""``fastforward train METHOD ...``: one sub-command per training method.

A method is a module with ``SUMMARY``, ``add_arguments(parser)`` and ``run(args) -> int``, registered in
:data:`METHODS`; adding one (``train cllm``) is one line here.
"""

from __future__ import annotations

import importlib

from ..errors import UsageError

# method -> module (SUMMARY, add_arguments, run)
METHODS = {
    "msn": "fastforward.train.msn",
    "cllm": "fastforward.train.cllm",
}


def add_arguments(p, name: str) -> None:
    sub = p.add_subparsers(dest="train_method", metavar="METHOD", parser_class=type(p))
    for method, module in METHODS.items():
        mod = importlib.import_module(module)
        mp = sub.add_parser(method, help=mod.SUMMARY, description=mod.SUMMARY)
        mp.set_defaults(_train_module=module)
        mod.add_arguments(mp)


def run(args, name: str) -> int:
    module = getattr(args, "_train_module", None)
    if module is None:
        raise UsageError(f"give a training method: {', '.join(METHODS)} (see 'fastforward train --help')")
    return int(importlib.import_module(module).run(args) or 0)
