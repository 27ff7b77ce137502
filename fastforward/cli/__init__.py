"""The ``fastforward`` command line: the top layer of the package.

Each subcommand lives in a module of this package that provides ``add_arguments(parser, name)`` and
``run(args, name) -> int``; the libraries it drives (``fastforward.bench``, ``fastforward.train``,
``fastforward.evaluate``, ``fastforward.tree_builder``, ``fastforward.costs``) take plain values, never an argparse
namespace, and never import this package. Options several commands share are declared once, in :mod:`.options`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ..errors import FastForwardError
from ..version import __version__

# name -> (module, one-line help)
COMMANDS = {
    "generate": ("fastforward.cli.generate", "generate text from a prompt with a decoding method"),
    "methods": ("fastforward.cli.generate", "list the decoding methods and their options"),
    "profile": ("fastforward.cli.profile", "measure the target forward's cost per number of new tokens"),
    "bench": ("fastforward.cli.bench", "benchmark methods side by side on question files"),
    "train": ("fastforward.cli.train", "fine-tune a model for faster parallel decoding (train msn ...)"),
    "eval": ("fastforward.cli.eval", "task quality of a model: held-out NLL, GSM8K accuracy, HumanEval pass@1"),
    "build-tree": ("fastforward.cli.tree", "measure and build a TR-Jacobi tree sized for this machine"),
    "collect-trajectories": ("fastforward.cli.trajectories", "collect Jacobi trajectories for CLLM training"),
}


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr and exit code 2."""

    def error(self, message):  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="fastforward",
        description="Lossless parallel decoding for causal language models: the same output, sooner.",
    )
    parser.add_argument("--version", action="version", version=f"fastforward {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module, _command=name)
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if not exc.name or not (module == exc.name or module.startswith(exc.name + ".")):
                raise
            p.set_defaults(_missing=True)
            continue
        mod.add_arguments(p, name)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed in one line
        return int(exc.code or 0)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    if getattr(args, "_missing", False):
        print(f"fastforward: error: the '{args.command}' command is not available in this build", file=sys.stderr)
        return 2
    try:
        mod = importlib.import_module(args._module)
        return int(mod.run(args, args._command) or 0)
    except FastForwardError as exc:
        sys.stdout.flush()
        print(f"fastforward: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("\nfastforward: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 1
    except Exception as exc:  # a bug, not bad input: say so in one line unless debugging
        if os.environ.get("FASTFORWARD_DEBUG"):
            raise
        sys.stdout.flush()
        print(
            f"fastforward: internal error: {type(exc).__name__}: {exc} (set FASTFORWARD_DEBUG=1 for a traceback)",
            file=sys.stderr,
        )
        return 1

