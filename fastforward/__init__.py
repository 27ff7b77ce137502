"""fastforward: lossless parallel decoding for causal language models.

    import fastforward as ff
    model = ff.load()                                   # SmolLM2-135M-Instruct, or a local HF folder / .gguf
    result = ff.generate(model, "Explain KV caches.", method="pld", max_new_tokens=128)
    print(result.text, result.stats.tau)
"""

from __future__ import annotations

from .engine import Generation, GenerationResult, GenerationStats, Proposal, Proposer
from .errors import FastForwardError, ModelNotFoundError, UsageError
from .model import DEFAULT_MODEL, TargetModel, from_hf, load
from .proposers import available_methods, make_proposer
from .tree import DraftTree, TreeShape, load_choices, tree_from_choices
from .verify import SamplingConfig

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL",
    "DraftTree",
    "FastForwardError",
    "Generation",
    "GenerationResult",
    "GenerationStats",
    "ModelNotFoundError",
    "Proposal",
    "Proposer",
    "SamplingConfig",
    "TargetModel",
    "TreeShape",
    "UsageError",
    "available_methods",
    "from_hf",
    "generate",
    "load",
    "load_choices",
    "make_proposer",
    "stream",
    "tree_from_choices",
]


def _prepare(model, prompt, method, chat, system, method_options, kwargs):
    target = load(model) if isinstance(model, str) else model
    if not isinstance(target, TargetModel):
        raise UsageError("model must be a fastforward TargetModel (fastforward.load) or a model name")
    prompt_ids = target.encode(prompt, chat=chat, system=system)
    proposer = make_proposer(method, target, **(method_options or {}))
    sampling = SamplingConfig(
        temperature=kwargs.pop("temperature", 0.0), top_k=kwargs.pop("top_k", 0), top_p=kwargs.pop("top_p", 1.0)
    )
    return target, prompt_ids, proposer, sampling


def generate(
    model,
    prompt,
    method="ar",
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop=None,
    chat: bool = True,
    system: str | None = None,
    method_options: dict | None = None,
    on_prefill=None,
) -> GenerationResult:
    """Generate a continuation of ``prompt`` (text, chat messages, or token ids) with a decoding ``method``.

    ``on_prefill(done, total)``, if given, is called as the prompt is read (in chunks of 256 tokens).
    Every lossless method returns exactly what ``method="ar"`` returns at temperature 0, and samples from the
    same distribution at temperature > 0.
    """
    target, prompt_ids, proposer, sampling = _prepare(
        model, prompt, method, chat, system, method_options,
        {"temperature": temperature, "top_k": top_k, "top_p": top_p},
    )
    gen = Generation(
        target, prompt_ids, proposer, stop=stop, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
        on_prefill=on_prefill,
    )
    return gen.run()


def stream(
    model,
    prompt,
    method="ar",
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop=None,
    chat: bool = True,
    system: str | None = None,
    method_options: dict | None = None,
    on_prefill=None,
) -> Generation:
    """Like :func:`generate`, but returns a :class:`Generation` to iterate for text deltas (``.result`` after)."""
    target, prompt_ids, proposer, sampling = _prepare(
        model, prompt, method, chat, system, method_options,
        {"temperature": temperature, "top_k": top_k, "top_p": top_p},
    )
    return Generation(
        target, prompt_ids, proposer, stop=stop, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
        on_prefill=on_prefill,
    )
