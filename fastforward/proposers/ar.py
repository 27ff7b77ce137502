"""Autoregressive decoding: the proposer that proposes nothing (one token per target forward)."""

from ..engine import Proposer
from . import register


@register("ar", "autoregressive decoding, one token per forward (the baseline)", source="-")
def autoregressive(target) -> Proposer:
    return Proposer()
