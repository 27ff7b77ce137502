"""PASTA: learned asynchronous decoding -- the model marks independent parts of its answer with PASTA-LANG tags and
the interpreter decodes them as concurrent threads (:mod:`fastforward.pasta.interpreter`). Not lossless: the answer
is the PASTA model's own, decoded asynchronously. A model without PASTA-LANG tokens is refused (so that
``bench --methods all`` leaves it out), unless ``plain=True``: then it decodes exactly as ``ar``."""

from ..errors import UsageError
from ..pasta.interpreter import PastaProposer
from . import register
from ._options import check_bool, check_int


@register("pasta", "PASTA asynchronous decoding: threads for the promised blocks a PASTA-trained model writes, "
          "one forward per step over every live thread", lossless=False, source="arXiv 2502.11517 (ICML'25)")
def pasta(target, *, max_forks: int = 8, plain: bool = False) -> PastaProposer:
    check_int("pasta", "max_forks", max_forks, 1, 64)
    check_bool("pasta", "plain", plain)
    if target.backend_name != "lean":
        raise UsageError("method pasta needs the lean backend (threads share one KV pool with explicit slots)")
    proposer = PastaProposer(target, max_forks=max_forks)
    if proposer.vocab is None and not plain:
        raise UsageError(f"method pasta: {target.name} has no PASTA-LANG tokens (it was never trained for PASTA); "
                         "use --model smollm2-135m-pasta (the default model's shipped PASTA adapter) or a model from "
                         "'fastforward train pasta-sft'; -o plain=True decodes its main thread only, exactly ar")
    return proposer
