"""fastforward: lossless parallel decoding for causal language models.

    import fastforward as ff
    model = ff.load()                                   # SmolLM2-135M-Instruct, or a local HF folder / .gguf
    result = ff.generate(model, "Explain KV caches.", method="pld", max_new_tokens=128)
    print(result.text, result.stats.tau)
"""

from __future__ import annotations

from .api import batch_token_budget, generate, generate_batch, stream
from .engine import Generation, GenerationResult, GenerationStats, Proposal, Proposer
from .errors import FastForwardError, ModelNotFoundError, UsageError
from .model import DEFAULT_MODEL, TargetModel, from_hf, load
from .proposers import available_methods, make_proposer
from .request import GenerationRequest
from .tree import DraftTree, TreeShape, load_choices, tree_from_choices
from .verify import SamplingConfig
from .version import __version__ as __version__

__all__ = [
    "DEFAULT_MODEL",
    "DraftTree",
    "FastForwardError",
    "Generation",
    "GenerationRequest",
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
    "batch_token_budget",
    "generate",
    "generate_batch",
    "load",
    "load_choices",
    "make_proposer",
    "stream",
    "tree_from_choices",
]
