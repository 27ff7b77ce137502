"""Peers: what users run today, timed in the same process, on the same prompts, the same way as our methods.

* ``hf-generate`` -- ``transformers`` ``model.generate`` (greedy, or sampling at temperature > 0).
* ``hf-pld``      -- the same with HF's prompt lookup decoding (``prompt_lookup_num_tokens=10`` by default).

Both get a clean ``GenerationConfig`` (nothing inherited from the model's, such as a repetition penalty), the
target's EOS tokens, and the same thread count. ``decoding_steps`` counts the HF model's forward calls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .methods import MethodSpec, TurnOutcome


@dataclass(frozen=True)
class PeerInfo:
    name: str
    summary: str
    options: dict = field(default_factory=dict)


PEERS = {
    "hf-generate": PeerInfo("hf-generate", "transformers model.generate (greedy)"),
    "hf-pld": PeerInfo(
        "hf-pld", "transformers model.generate with prompt lookup decoding",
        {"prompt_lookup_num_tokens": 10, "max_matching_ngram_size": None},
    ),
}


class PeerRunner:
    def __init__(self, spec: MethodSpec):
        self.spec = spec
        self.lossless = True
        self.options = {**PEERS[spec.method].options, **spec.options}

    def _config(self, target, max_new_tokens: int, temperature: float):
        from transformers import GenerationConfig

        eos = sorted(target.eos_token_ids)
        pad = eos[0] if eos else 0
        kw = dict(max_new_tokens=max_new_tokens, eos_token_id=eos or None, pad_token_id=pad)
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            kw.update(do_sample=False)
        if self.spec.method == "hf-pld":
            kw["prompt_lookup_num_tokens"] = int(self.options["prompt_lookup_num_tokens"])
            if self.options.get("max_matching_ngram_size"):
                kw["max_matching_ngram_size"] = int(self.options["max_matching_ngram_size"])
        return GenerationConfig(**kw)

    def generate(self, target, prompt_ids, *, max_new_tokens: int, temperature: float, seed) -> TurnOutcome:
        model = target.hf_model
        config = self._config(target, max_new_tokens, temperature)
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        mask = torch.ones_like(ids)
        if seed is not None:
            torch.manual_seed(seed)
        calls = [0]

        def count(module, args, kwargs):
            calls[0] += 1

        handle = model.register_forward_pre_hook(count, with_kwargs=True)
        try:
            t0 = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            wall = time.perf_counter() - t0
        finally:
            handle.remove()
        new = out[0, ids.shape[1]:].tolist()
        eos = target.eos_token_ids
        reason = "eos" if new and new[-1] in eos else "length"
        steps = calls[0]
        return TurnOutcome(token_ids=new, wall_time=wall, decoding_steps=steps, finish_reason=reason)
