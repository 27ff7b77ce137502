"""The ``fastforward`` command line.

Each subcommand lives in a module that provides ``add_arguments(parser)`` and ``run(args) -> int``; they are
imported only when used, so ``fastforward --help`` stays fast.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import sys

from .errors import FastForwardError

# name -> (module, one-line help)
COMMANDS = {
    "generate": ("fastforward.cli_generate", "generate text from a prompt with a decoding method"),
    "methods": ("fastforward.cli_generate", "list the decoding methods and their options"),
    "profile": ("fastforward.profile", "measure the target forward's cost per number of new tokens"),
    "bench": ("fastforward.bench.cli", "benchmark methods side by side on question files"),
    "train": ("fastforward.train.cli", "fine-tune a model for faster parallel decoding (train msn ...)"),
    "eval": ("fastforward.evaluate", "task quality of a model: held-out NLL, GSM8K accuracy, HumanEval pass@1"),
    "build-tree": ("fastforward.cli_tree", "measure and build a TR-Jacobi tree sized for this machine"),
    "collect-trajectories": ("fastforward.train.trajectories", "collect Jacobi trajectories for CLLM training"),
}


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr and exit code 2."""

    def error(self, message):  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_options(pairs: list[str] | None) -> dict:
    """``["k=3", "tree=path.json"]`` -> ``{"k": 3, "tree": "path.json"}`` (values as Python literals when valid)."""
    options = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise FastForwardError(f"method option '{pair}' is not KEY=VALUE")
        try:
            options[key.replace("-", "_")] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key.replace("-", "_")] = value
    return options


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="fastforward",
        description="Lossless parallel decoding for causal language models: the same output, sooner.",
    )
    from . import __version__

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


if __name__ == "__main__":
    sys.exit(main())
