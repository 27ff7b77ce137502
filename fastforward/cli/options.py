"""Command-line options several commands share, declared once: the model to load, the method options, and the
argparse types for counts.

The parsing of method options (``KEY=VALUE`` strings) is a library concern the benchmark uses too, so it lives in
:mod:`fastforward.proposers._options`; it is re-exported here for the commands.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import UsageError
from ..machine import usable_cpus
from ..model import DEFAULT_MODEL
from ..proposers._options import parse_options as _parse_options
from ..validation import check_max_new_tokens, check_sampling, check_seed

__all__ = [
    "add_method_option_argument",
    "add_model_argument",
    "add_model_arguments",
    "add_threads_argument",
    "check_model_folder",
    "model_load_kwargs",
    "finite_float",
    "int_between",
    "max_new_tokens",
    "nonnegative_int",
    "parse_options",
    "positive_float",
    "positive_int",
    "seed",
    "temperature",
    "thread_count",
]

BACKENDS = ("auto", "lean", "hf")
WEIGHTS = ("auto", "fp32", "bf16", "int8")
ARITHMETICS = ("auto", "exact", "q8")
KV_CACHES = ("auto", "fp32", "fp16")


def _int_at_least(low: int, words: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: '{text}'") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {words}, got {value}")
        return value

    return parse


def int_between(low: int, high: int):
    """argparse ``type=``: an integer from ``low`` to ``high``."""
    at_least = _int_at_least(low, f"an integer from {low} to {high}")

    def parse(text: str) -> int:
        value = at_least(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"must be an integer from {low} to {high}, got {value}")
        return value

    return parse


positive_int = _int_at_least(1, "a positive integer")  # argparse ``type=``: an integer >= 1
nonnegative_int = _int_at_least(0, "an integer >= 0")  # argparse ``type=``: an integer >= 0


def thread_count(text: str) -> int:
    """argparse ``type=``: torch threads, from 1 to the CPUs this process may use (more only slow the forward
    down, and thousands fail to start half-way through loading the model)."""
    value = positive_int(text)
    cpus = usable_cpus()
    if value > cpus:
        raise argparse.ArgumentTypeError(f"must be at most {cpus} (the CPUs this process may use), got {value}")
    return value


def parse_options(pairs: list[str] | None) -> dict:
    """Method options from the command line's ``-o KEY=VALUE`` (see :func:`fastforward.proposers._options.
    parse_options`); an option given twice (``-o k=1 -o k=2``, or ``-o num-pred=1 -o num_pred=2``) is refused rather
    than the last one silently winning."""
    options = {}
    for pair in pairs or []:
        (key, value), = _parse_options([pair]).items()
        if key in options:
            raise UsageError(f"method option {key} is given twice (-o {pair})")
        options[key] = value
    return options


def finite_float(text: str) -> float:
    """argparse ``type=``: a finite number (no nan, no inf); ranges are the command's to check."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: '{text}'") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def _checked(check, value):
    try:
        return check(value)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def max_new_tokens(text: str) -> int:
    """argparse ``type=``: a generation budget (:func:`fastforward.validation.check_max_new_tokens`)."""
    return _checked(check_max_new_tokens, positive_int(text))


def seed(text: str) -> int:
    """argparse ``type=``: a seed (:func:`fastforward.validation.check_seed`)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: '{text}'") from None
    return _checked(check_seed, value)


def temperature(text: str) -> float:
    """argparse ``type=``: a sampling temperature (:func:`fastforward.validation.check_sampling`)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: '{text}'") from None
    return _checked(lambda t: check_sampling(t, 0, 1.0).temperature, value)


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
    p.add_argument("--threads", type=thread_count, default=None, help=help)


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
    p.add_argument("--arithmetic", default="auto", choices=ARITHMETICS,
                   help="how a GGUF file's weights are multiplied, i.e. which model every method reproduces: q8 "
                        "(llama.cpp's 8-bit activation blocks and integer dot products), exact (fp32 activations "
                        "times the exactly dequantised weights); auto: q8 for GGUF files, exact for HF folders")
    p.add_argument("--kv-cache", default="auto", choices=KV_CACHES,
                   help="how the lean forward's KV cache stores keys and values: fp32 (as computed) or fp16 "
                        "(rounded to half precision, llama.cpp's default: half the bytes, a slightly different "
                        "model, reproduced exactly by every method); auto: fp16 with the q8 arithmetic, fp32 "
                        "otherwise (default: %(default)s)")


def model_load_kwargs(args) -> dict:
    """The keyword arguments of :func:`fastforward.load` that :func:`add_model_arguments` declared."""
    return {"backend": args.backend, "threads": args.threads, "weights": args.weights,
            "arithmetic": getattr(args, "arithmetic", "auto"), "kv_cache": getattr(args, "kv_cache", "auto")}


def add_subcommands(p, commands: dict, dest: str, metavar: str) -> None:
    """One sub-parser per entry of ``commands`` (name -> (summary, add_arguments, run)); the chosen name is kept in
    ``args.<dest>`` for :func:`run_subcommand`."""
    sub = p.add_subparsers(dest=dest, metavar=metavar, parser_class=type(p))
    for name, (summary, add, _) in commands.items():
        sp = sub.add_parser(name, help=summary, description=summary)
        sp.set_defaults(**{"_" + dest: name})
        add(sp)


def run_subcommand(args, commands: dict, dest: str, what: str, command: str) -> int:
    """Run the sub-command :func:`add_subcommands` parsed; none given is a one-line error naming the choices."""
    chosen = getattr(args, "_" + dest, None)
    if chosen is None:
        raise UsageError(f"give a {what}: {', '.join(commands)} (see 'fastforward {command} --help')")
    return int(commands[chosen][2](args) or 0)


def add_batch_arguments(p, with_flag: str) -> None:
    """``--batch-tokens`` and ``--no-cut-drafts``: how several sequences share a forward (with ``with_flag``)."""
    p.add_argument("--batch-tokens", type=positive_int, default=None, metavar="N",
                   help=f"with {with_flag}: rows per shared forward (default: sized from this machine's cost curve)")
    p.add_argument("--no-cut-drafts", action="store_true",
                   help=f"with {with_flag}: keep every draft as the method proposes it alone (default: cut each to "
                        "what it is worth in the shared forward; outputs are the same)")


def add_method_option_argument(p, help: str = "a method option, e.g. -o k=10 (repeatable)") -> None:
    """``-o/--option KEY=VALUE`` (repeatable), read with :func:`parse_options`."""
    p.add_argument("-o", "--option", action="append", metavar="KEY=VALUE", help=help)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.pt", "*.pth")


def check_model_folder(name: str) -> None:
    """A local Hugging Face folder given as ``--model`` must hold what loading it needs -- a readable config.json,
    tokenizer files, weights -- said in one line before any work rather than as a loader's traceback. Names that
    are not such a folder (aliases, .gguf files, unknown names) are left to :func:`fastforward.load`."""
    path = Path(name).expanduser()
    if not (path.is_dir() and (path / "config.json").is_file()):
        return
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"--model {path}: config.json is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise UsageError(f"--model {path}: config.json is not a JSON object")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise UsageError(f"--model {path} has no tokenizer: none of {', '.join(TOKENIZER_FILES)} is in the folder")
    if not any(any(path.glob(pattern)) for pattern in WEIGHT_FILES):
        raise UsageError(f"--model {path} has no weights (*.safetensors or *.bin files)")
