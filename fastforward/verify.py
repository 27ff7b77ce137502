"""Choosing what to keep from a verified tree.

* Greedy: the deepest node whose every token (root excluded) equals the target's argmax at its parent; the bonus
  token is the target's argmax at that node.
* Sampling, lossless: walk down from the root. At each node the target's distribution ``p`` (temperature, top-k,
  top-p applied exactly as for autoregressive sampling) decides among the children:

  - children with draft probabilities ``q`` (sampled i.i.d. from ``q``): recursive rejection -- accept child x
    with probability ``min(1, p(x)/q(x))``, otherwise replace ``p`` by the normalised residual ``max(p - q, 0)``
    and try the next child; when all are rejected, sample the bonus token from the residual;
  - children without probabilities (deterministic guesses): sample ``y ~ p`` and move to the child holding ``y``;
    if none does, ``y`` is the bonus token. For point-mass drafts this *is* rejection sampling.

  Either way every emitted token is distributed exactly as autoregressive sampling would draw it.

**Keyed draws.** Autoregressive sampling and the walk over guesses draw the token at sequence position t by
inverting ``p``'s cumulative distribution at a uniform number that depends only on (seed, t)
(:class:`PositionKeyedUniforms`). The token a seeded request gets at t is then the one autoregressive sampling with
that seed gets, *whatever was drafted*: the same samples for every method without draft probabilities, at any
draft size -- so a server may cut a sampled sequence's draft to what it is worth in a shared forward without
changing its answer. Recursive rejection (drafts with probabilities) consumes the run's generator instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import UsageError
from .tree import DraftTree


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen from the target's logits; temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise UsageError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise UsageError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise UsageError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p, along the last dimension (float64 for exact sums)."""
    x = logits.double() / cfg.temperature
    if cfg.top_k and cfg.top_k < x.shape[-1]:
        kth = x.topk(cfg.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        sorted_p = sorted_x.softmax(-1)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        drop_sorted = mass_before >= cfg.top_p  # keep the smallest prefix whose mass reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


_MASK64 = (1 << 64) - 1


class PositionKeyedUniforms:
    """Uniform numbers in [0, 1) keyed by (seed, sequence position): splitmix64 of the pair, 53 bits."""

    def __init__(self, seed: int):
        self.seed = seed & _MASK64

    def at(self, position: int) -> float:
        z = (self.seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D192ED03) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
        return (z >> 11) / float(1 << 53)


def sample_at(probs: torch.Tensor, u: float) -> int:
    """The token where the cumulative distribution ``probs`` first exceeds ``u`` (in [0, 1)) of its total."""
    cdf = probs.double().cumsum(0)
    index = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
    return min(index, probs.numel() - 1)


_NATIVE: dict = {}  # the native argmax_rows and greedy_verify, once looked up (None without the kernels)


def _native(name: str):
    if name not in _NATIVE:
        from .kernels import load_native

        native = load_native()
        for op in ("argmax_rows", "greedy_verify"):
            _NATIVE[op] = getattr(native, op, None)
    return _NATIVE[name]


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of logits [n, V] (the first largest value's column, or the first NaN's): natively for
    fp32 rows where the kernels built (a few microseconds a row against torch's ~40 over a vocabulary)."""
    op = _native("argmax_rows")
    if op is not None and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1]:
        return op(logits)
    return logits.argmax(-1)


def next_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None,
               keyed: PositionKeyedUniforms | None = None, position: int = 0) -> int:
    """The autoregressive choice from one row of logits (the token at sequence ``position``: with ``keyed``
    uniforms, drawn with the one of that position)."""
    if cfg.greedy:
        return int(argmax_rows(logits.reshape(1, -1))[0])
    probs = target_probs(logits, cfg)
    return sample(probs, generator) if keyed is None else sample_at(probs, keyed.at(position))


@dataclass
class Verdict:
    path: list[int]  # accepted node indices, root first
    bonus: int  # the token the target chooses after the last accepted node

    @property
    def accepted(self) -> int:
        """Accepted draft tokens (the root and the bonus token excluded)."""
        return len(self.path) - 1


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> Verdict:
    """Longest path of tokens that equal the target's argmax at their parents (the first such node of the greatest
    depth), and the argmax after it: natively in one call for fp32 logits where the kernels built, reading only the
    rows whose argmax decides something."""
    n = len(tree)
    op = _native("greedy_verify")
    if op is not None and logits.dtype == torch.float32:
        out = op(logits, tree.tokens, tree.shape.parents).tolist()
        return Verdict(out[:-1], out[-1])
    pred = argmax_rows(logits[:n])
    if n == 1:
        return Verdict([0], int(pred[0]))
    shape = tree.shape
    if shape.is_chain:
        ok = (tree.tokens[1:] == pred[:-1]).long().cumprod(0)
        k = int(ok.sum())
        return Verdict(list(range(k + 1)), int(pred[k]))
    wrong = torch.zeros(n, dtype=torch.bool)
    wrong[1:] = tree.tokens[1:] != pred[shape.parents[1:]]
    reachable = ~(shape.ancestor_mask & wrong.unsqueeze(0)).any(1)
    best = int(torch.where(reachable, shape.depths, -1).argmax())  # first node of the greatest depth
    return Verdict(shape.path_to(best), int(pred[best]))


def verify_sampling(
    tree: DraftTree, logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None,
    keyed: PositionKeyedUniforms | None = None, root_position: int = 0,
) -> Verdict:
    """Lossless speculative sampling over a tree (see the module docstring). With ``keyed`` uniforms, a tree
    without draft probabilities draws the token after a node of depth d with the uniform of position
    ``root_position + d + 1``."""
    shape = tree.shape
    path = [0]
    node = 0
    p_cache: dict[int, torch.Tensor] = {}
    guesses = tree.draft_probs is None

    def draw(p: torch.Tensor) -> int:
        if keyed is not None and guesses:
            return sample_at(p, keyed.at(root_position + len(path)))
        return sample(p, generator)

    while True:
        p = p_cache.get(node)
        if p is None:
            p = target_probs(logits[node], cfg)
        kids = shape.children(node)
        if kids.numel() == 0:
            return Verdict(path, draw(p))
        if guesses:
            y = draw(p)
            match = (tree.tokens[kids] == y).nonzero()
            if match.numel() == 0:
                return Verdict(path, y)
            node = int(kids[match[0, 0]])
            path.append(node)
            continue
        chosen = None
        for kid in kids.tolist():
            q = tree.draft_probs[kid].double()
            x = int(tree.tokens[kid])
            px, qx = float(p[x]), float(q[x])
            if qx <= 0:
                raise UsageError("a drafted token has zero draft probability")
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if u < min(1.0, px / qx):
                chosen = kid
                break
            residual = (p - q).clamp_min_(0)
            total = float(residual.sum())
            if total <= 0:  # p == q up to rounding: rejection had probability 0; keep p
                continue
            p = residual / total
        if chosen is None:
            return Verdict(path, sample(p, generator))
        node = chosen
        path.append(node)


def verify(tree: DraftTree, logits: torch.Tensor, cfg: SamplingConfig, generator=None,
           keyed: PositionKeyedUniforms | None = None, root_position: int = 0) -> Verdict:
    if cfg.greedy:
        return verify_greedy(tree, logits)
    return verify_sampling(tree, logits, cfg, generator, keyed, root_position)
