"""Method options: declared once per method as a schema of :class:`Option` (type, range or allowed set, default,
description, and why the upper bound is what it is), parsed from ``KEY=VALUE`` strings (the CLI's ``-o``, the
benchmark's method specs) and validated against the schema wherever they enter (they also arrive from Python callers
and server requests): :func:`fastforward.proposers.check_method_options`.
"""

from __future__ import annotations

import ast
import math
import os
from dataclasses import dataclass

from ..errors import UsageError
from ..validation import MAX_PROPOSAL_ROWS

#: the kinds of option value
KINDS = ("int", "float", "bool", "choice", "str", "path")
_SHOWN_CHARS = 60  # the most characters of a refused value an error message repeats


def shown(value) -> str:
    """``repr(value)`` for an error message, cut to a few dozen characters (a refused value may be huge)."""
    try:
        text = repr(value)
    except ValueError:  # an int beyond Python's digit limit for str()
        return f"an integer of about {int(value.bit_length() * math.log10(2))} digits"
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Option:
    """One option of a decoding method.

    ``kind`` is one of :data:`KINDS`. Numbers lie in ``[low, high]`` (``[low, high)`` with ``high_open``); every
    numeric option has a finite ``high``, and ``bound`` says what it is derived from (rows per forward, the model's
    context, memory). ``special`` lists values accepted besides the range (such as 0 = sized by this machine's cost
    curve, or None = chosen by the method), their meaning given in ``help``. A ``choice`` takes one of ``choices``.
    A ``path`` names a file or folder on disk (or None: the method's default); ``accepts`` lists the types of
    in-memory values it takes instead (a choices list for a tree, a loaded model for a draft model).
    """

    name: str
    kind: str
    default: object
    low: float | None = None
    high: float | None = None
    choices: tuple = ()
    help: str = ""
    bound: str = ""
    special: tuple = ()
    high_open: bool = False
    accepts: tuple = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"option {self.name}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind in ("int", "float"):
            if self.low is None or self.high is None or not math.isfinite(self.high):
                raise ValueError(f"option {self.name}: a numeric option needs a finite low and high")
            if not self.bound:
                raise ValueError(f"option {self.name}: say what its upper bound {self.high} is derived from")
        if self.kind == "choice" and not self.choices:
            raise ValueError(f"option {self.name}: a choice needs its choices")

    @property
    def numeric(self) -> bool:
        return self.kind in ("int", "float")

    def range_text(self) -> str:
        """What the option takes, in words: ``an integer in [1, 32]``, ``one of a, b``, ..."""
        if self.kind == "int":
            text = f"an integer in [{self.low}, {self.high}]"
        elif self.kind == "float":
            text = f"a number in [{self.low}, {self.high}{')' if self.high_open else ']'}"
        elif self.kind == "bool":
            text = "True or False"
        elif self.kind == "choice":
            text = "one of " + ", ".join(map(str, self.choices))
        elif self.kind == "path":
            text = "a path" + (" or a " + " or ".join(t.__name__ for t in self.accepts) if self.accepts else "")
        else:
            text = "a string"
        if self.special:
            text += " or " + " or ".join(repr(v) if isinstance(v, str) else str(v) for v in self.special)
        return text

    def _valid(self, value) -> bool:
        if self.kind == "int":
            return isinstance(value, int) and not isinstance(value, bool) and self.low <= value <= self.high
        if self.kind == "float":
            if not _number(value) or (isinstance(value, float) and not math.isfinite(value)):
                return False
            return self.low <= value and (value < self.high if self.high_open else value <= self.high)
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "choice":
            return isinstance(value, str) and value in self.choices
        if self.kind == "path":
            return value is None or isinstance(value, (str, os.PathLike, *self.accepts))
        return isinstance(value, str)

    def check(self, method: str, value):
        """``value`` if the option takes it, else a one-line :class:`UsageError` naming the option and its range."""
        if self._valid(value) or any(value is v or (type(value) is type(v) and value == v) for v in self.special):
            return value
        raise UsageError(f"{method}: option {self.name} must be {self.range_text()}, got {shown(value)}")

    def describe(self) -> dict:
        """The option as JSON-ready data (``fastforward methods --json``, the server's model card)."""
        data = {"kind": self.kind, "default": self.default, "range": self.range_text(), "help": self.help}
        if self.numeric:
            data.update(low=self.low, high=self.high, bound=self.bound)
        if self.choices:
            data["choices"] = list(self.choices)
        if self.special:
            data["special"] = list(self.special)
        return data


# -- options and checks several methods share ------------------------------------------------------------------

#: the most nodes of a draft tree that tree-drafting methods (eagle, falcon, rest) verify in one forward
MAX_TREE_NODES = 256
_TREE_ROWS = (f"rows per forward: the tree's nodes are the target's rows ({MAX_TREE_NODES}, a quarter of the "
              f"engine's {MAX_PROPOSAL_ROWS:,}-row cap: the tree's attention mask grows as its square, and on a CPU "
              "a forward of more rows costs more than a larger tree gains)")
#: the longest back-off, in steps
MAX_BACKOFF = 1024


def max_nodes_option(default: int) -> Option:
    return Option("max_nodes", "int", default, 2, MAX_TREE_NODES, bound=_TREE_ROWS,
                  help="the largest tree (root included) the cost curve may choose")


def nodes_option(low: int = 0) -> Option:
    """``nodes``: a fixed tree size, 0 = sized by the cost curve (``low`` 2: sizes 0 or 2.. only)."""
    return Option("nodes", "int", 0, low, MAX_TREE_NODES, special=(0,) if low else (), bound=_TREE_ROWS,
                  help="a fixed tree size, root included (0 = sized by this machine's cost curve, up to max_nodes)")


def backoff_option(default: int = 8) -> Option:
    return Option("backoff", "int", default, 0, MAX_BACKOFF,
                  bound=f"steps: after looks that drafted nothing, skips double up to this; {MAX_BACKOFF:,} steps "
                        "is longer than most answers (a larger value would stop drafting for good)",
                  help="the most steps skipped without drafting after looks that did not pay (0 = never skip)")


def backoff_on_loss_option() -> Option:
    return Option("backoff_on_loss", "bool", True, help="a draft that saved less than it cost backs off too")


#: the prompt tokens the feature drafters read by default (the last ones): a drafter's own prefill grows with the
#: prompt (FastEagle's four layers cost ~4/30 of the default model's, EAGLE's one ~1/30), while acceptance hardly does
#: (EAGLE on 48 questions: drafting 0.48 -> 0.39 ms a step, tokens a step 1.3% fewer, 1.7% faster decoding). Measured
#: in docs/drafters.md#the-prompt-a-drafter-reads
PROMPT_WINDOW = 128
#: the largest prompt window that can be asked for (0 asks for the whole prompt, whatever its length)
MAX_PROMPT_WINDOW = 1 << 20
#: the feature drafters' head rows by default, where the drafter folder ranks its draft tokens: the 8,192 most
#: frequent (the shipped EAGLE drafter's 16,384-row head cut to half: drafting 0.52 -> 0.46 / 0.45 ms a step, tokens
#: a step unchanged, on 24 Spec-Bench questions and 24 held-out chat prompts; measured in docs/drafters.md)
HEAD_VOCAB = 8192
#: the largest draft head that can be asked for (0 asks for the whole of the drafter's head, whatever its size)
MAX_HEAD_VOCAB = 1 << 20


def prompt_window_option(default: int = PROMPT_WINDOW) -> Option:
    return Option("prompt_window", "int", default, 0, MAX_PROMPT_WINDOW,
                  bound=f"tokens: {MAX_PROMPT_WINDOW:,} is longer than any model's context (0 = the whole prompt)",
                  help="the prompt's last tokens the drafter reads before its first draft (0 = the whole prompt); "
                       "the tokens it generates it reads all")


def head_vocab_option(default: int = HEAD_VOCAB) -> Option:
    return Option("head_vocab", "int", default, 0, MAX_HEAD_VOCAB,
                  bound=f"draft tokens: {MAX_HEAD_VOCAB:,} is more than any vocabulary (0 = the whole head)",
                  help="the draft head keeps the rows of its N most frequent tokens where the drafter folder ranks "
                       "them (draft_vocab_frequency.json; 0 = the whole head): a head call reads that share of its "
                       "weights")


def drafter_option(method: str) -> Option:
    return Option("drafter", "path", None,
                  help=f"a 'fastforward train {method}' drafter folder (default: the drafter shipped for the model)")


def weights_option(choices) -> Option:
    return Option("weights", "choice", "auto", choices=tuple(choices),
                  help="the drafter's weights at decode time (auto: Q4_0 blocks where the native kernels build, "
                       "else fp32)")


def head_covers(width: str = "topk"):
    """A check across options: a head cut to ``head_vocab`` rows keeps at least the ``width`` tokens a call ranks."""

    def check(method: str, options: dict) -> None:
        rows, k = options["head_vocab"], options[width]
        if 0 < rows < k:
            raise UsageError(f"{method}: head_vocab ({rows}) must be 0 (the whole head) or at least {width} ({k}): "
                             f"each call ranks the head's {k} best tokens")

    return check


def at_most(small: str, large: str):
    """A check across options: option ``small`` is at most option ``large``."""

    def check(method: str, options: dict) -> None:
        if options[small] > options[large]:
            raise UsageError(f"{method}: option {small} ({options[small]}) cannot exceed {large} ({options[large]})")

    return check


# -- value checks for the factories' own use --------------------------------------------------------------------


def check_int(method: str, name: str, value, low: int, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high]``, else a one-line :class:`UsageError`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise UsageError(f"{method}: option {name} must be an integer {bound}, got {shown(value)}")
    return value


def parse_options(pairs: list[str] | None) -> dict:
    """Method options from ``KEY=VALUE`` strings (the CLI's ``-o``, the benchmark's method specs):
    ``["k=3", "tree=path.json"]`` -> ``{"k": 3, "tree": "path.json"}``. Values are Python literals when they parse
    as one, else strings; ``-`` in a key becomes ``_``."""
    options = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"method option '{pair}' is not KEY=VALUE")
        try:
            options[key.replace("-", "_")] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key.replace("-", "_")] = value
    return options
