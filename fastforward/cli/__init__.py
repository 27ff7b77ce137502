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
import traceback
from pathlib import Path

from ..errors import FastForwardError, UsageError
from ..interrupts import Terminated, on_sigterm
from ..validation import check_text
from ..version import __version__

# name -> (module, one-line help)
COMMANDS = {
    "generate": ("fastforward.cli.generate", "generate text from a prompt with a decoding method"),
    "chat": ("fastforward.cli.chat", "talk with a model in the terminal: multi-turn, streaming, slash commands"),
    "methods": ("fastforward.cli.generate", "list the decoding methods and their options"),
    "info": ("fastforward.cli.info", "what this machine gets: CPU features, kernels, cost curve, caches, llama.cpp"),
    "profile": ("fastforward.cli.profile", "measure the target forward's cost per number of new tokens"),
    "bench": ("fastforward.cli.bench", "benchmark methods side by side on question files"),
    "train": ("fastforward.cli.train", "fine-tune a model for faster parallel decoding (train msn ...)"),
    "eval": ("fastforward.cli.eval", "task quality of a model: held-out NLL, GSM8K accuracy, HumanEval pass@1"),
    "build-tree": ("fastforward.cli.tree", "measure and build a TR-Jacobi tree sized for this machine"),
    "collect-trajectories": ("fastforward.cli.trajectories", "collect Jacobi trajectories for CLLM training"),
    "make-data": ("fastforward.cli.make_data", "the target's own responses to training prompts, for drafters"),
    "calibrate": ("fastforward.cli.calibrate", "fit a drafter's greedy acceptance map on held-out make-data records"),
    "pasta": ("fastforward.cli.pasta", "PASTA: annotate answers with PASTA-LANG (pasta annotate IN OUT)"),
    "serve": ("fastforward.cli.serve", "an OpenAI-compatible server: the decoding method per request, shared forwards"),
    "serve-bench": ("fastforward.cli.serve", "a bounded load test of the server: C clients x R requests"),
}


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr and exit code 2."""

    def error(self, message):  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser. With ``command``, only that subcommand's module is imported and its options
    declared (the others are listed by name and help): importing every command's module and declaring every
    option took ~0.25 s of each run's start-up."""
    parser = OneLineParser(
        prog="fastforward",
        description="Lossless parallel decoding for causal language models: the same output, sooner.",
    )
    parser.add_argument("--version", action="version", version=f"fastforward {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module, _command=name)
        if command is not None and name != command:
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if not exc.name or not (module == exc.name or module.startswith(exc.name + ".")):
                raise
            p.set_defaults(_missing=True)
            continue
        mod.add_arguments(p, name)
    return parser


def _model_load_failure(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while reading the model's files (inside ``fastforward.model.loading``): a broken
    model file or folder (a truncated GGUF converted by transformers, ...), not a bug."""
    from ..model import loading

    where = Path(loading.__file__).resolve()
    return any(Path(frame.f_code.co_filename).resolve() == where for frame, _ in traceback.walk_tb(exc.__traceback__))


def _one_line(text) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _stop_on_sigterm():
    """Route SIGTERM through the commands' Ctrl-C path (main thread only); returns a function restoring the handler
    before (``main`` may run inside another program, tests among them)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    before = signal.signal(signal.SIGTERM, on_sigterm)
    return lambda: signal.signal(signal.SIGTERM, before)


def _was_terminated(exc: BaseException | None) -> bool:
    """Whether ``exc`` or an exception it was raised while handling is a SIGTERM (commands re-raise Ctrl-C with
    their own message)."""
    while exc is not None:
        if isinstance(exc, Terminated):
            return True
        exc = exc.__context__
    return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        for i, arg in enumerate(argv, 1):
            check_text(f"argument {i} ({arg!r})", arg)
    except UsageError as exc:  # argv bytes that are not UTF-8 arrive as lone surrogates
        print(f"fastforward: error: {exc}", file=sys.stderr)
        return 2
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
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
    restore = _stop_on_sigterm()
    try:
        mod = importlib.import_module(args._module)
        if isinstance(getattr(args, "model", None), str):
            from .options import check_model_folder

            check_model_folder(args.model)
        return int(mod.run(args, args._command) or 0)
    except FastForwardError as exc:
        sys.stdout.flush()
        print(f"fastforward: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # the command kept what it finished; its message says where
        terminated = _was_terminated(exc)
        sys.stdout.flush()
        print(f"\nfastforward: {'terminated' if terminated else 'interrupted'}"
              f"{': ' + _one_line(exc) if str(exc) else ''}", file=sys.stderr)
        return 143 if terminated else 130
    except BrokenPipeError:
        return 1
    except Exception as exc:  # a bug, not bad input: say so in one line unless debugging
        if os.environ.get("FASTFORWARD_DEBUG"):
            raise
        sys.stdout.flush()
        if _model_load_failure(exc):
            kind = type(exc).__qualname__ if type(exc).__module__ == "builtins" else \
                f"{type(exc).__module__}.{type(exc).__qualname__}"
            print(f"fastforward: error: cannot load the model '{getattr(args, 'model', '')}': its files are "
                  f"truncated, corrupt or of a kind it cannot read ({kind}: {_one_line(exc)})", file=sys.stderr)
            return 2
        print(f"fastforward: internal error: {type(exc).__name__}: {_one_line(exc)} "
              "(set FASTFORWARD_DEBUG=1 for a traceback)", file=sys.stderr)
        return 1
    finally:
        restore()

