"""PASTA: learned asynchronous decoding -- the model marks independent parts of its answer with PASTA-LANG tags and
the interpreter decodes them as concurrent threads (:mod:`fastforward.pasta.interpreter`). Not lossless: the answer
is the PASTA model's own, decoded asynchronously; a model without PASTA-LANG tokens decodes exactly as ``ar``."""

from ..errors import UsageError
from ..pasta.interpreter import PastaProposer
from . import register
from ._options import check_int


@register("pasta", "PASTA asynchronous decoding: threads for the promised blocks a PASTA-trained model writes, "
          "one forward per step over every live thread", lossless=False, source="arXiv 2502.11517 (ICML'25)")
def pasta(target, *, max_forks: int = 8) -> PastaProposer:
    check_int("pasta", "max_forks", max_forks, 1, 64)
    if target.backend_name != "lean":
        raise UsageError("method pasta needs the lean backend (threads share one KV pool with explicit slots)")
    return PastaProposer(target, max_forks=max_forks)
