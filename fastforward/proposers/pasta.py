"""PASTA: learned asynchronous decoding -- the model marks independent parts of its answer with PASTA-LANG tags and
the interpreter decodes them as concurrent threads (:mod:`fastforward.pasta.interpreter`). Not lossless: the answer
is the PASTA model's own, decoded asynchronously. A model without PASTA-LANG tokens is refused (so that
``bench --methods all`` leaves it out), unless ``plain=True``: then it decodes exactly as ``ar``."""

from ..errors import UsageError
from ..pasta.interpreter import PastaMethod
from . import register
from ._options import Option

#: the most threads decoding at once: each live thread puts up to two rows in the shared forward and holds KV slots
MAX_FORKS = 64


@register("pasta", "PASTA asynchronous decoding: threads for the promised blocks a PASTA-trained model writes, "
          "one forward per step over every live thread", lossless=False, source="arXiv 2502.11517 (ICML'25)",
          options=(
              Option("max_forks", "int", 8, 1, MAX_FORKS, help="the most threads decoding at once",
                     bound=f"rows per forward (1 + 2 x max_forks: {1 + 2 * MAX_FORKS} at {MAX_FORKS}) and memory "
                           "(each thread holds its own KV slots in the shared pool)"),
              Option("plain", "bool", False,
                     help="decode a model without PASTA-LANG tokens as ar (its main thread only)"),
          ))
def pasta(target, *, max_forks: int = 8, plain: bool = False) -> PastaMethod:
    """The values are checked against the schema (:func:`~fastforward.proposers.make_proposer`)."""
    if target.backend_name != "lean":
        raise UsageError("method pasta needs the lean backend (threads share one KV pool with explicit slots)")
    proposer = PastaMethod(target, max_forks=max_forks)
    if proposer.vocab is None and not plain:
        raise UsageError(f"method pasta: {target.name} has no PASTA-LANG tokens (it was never trained for PASTA); "
                         "use --model smollm2-135m-pasta (the default model's shipped PASTA adapter) or a model from "
                         "'fastforward train pasta-sft'; -o plain=True decodes its main thread only, exactly ar")
    return proposer
