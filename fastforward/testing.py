"""Tiny randomly initialised models for tests (no downloads), usable by fastforward's tests and by users' own."""

from __future__ import annotations

from pathlib import Path

import torch

from .gguf_file import read_gguf, unpermute_rows
from .kernels import load_native
from .model import TargetModel, _quiet_transformers


class TinyTokenizer:
    """A stand-in tokenizer: token i is the word ``t{i}``; no chat template; optional EOS id."""

    chat_template = None

    def __init__(self, vocab_size: int, eos_token_id: int | None = None):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    def __call__(self, text, add_special_tokens=True):
        ids = [int(w[1:]) % self.vocab_size for w in text.split() if w.startswith("t") and w[1:].isdigit()]
        return {"input_ids": ids or [1]}

    def decode(self, ids, skip_special_tokens=True):
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(f" t{i}" for i in ids if not (skip_special_tokens and i == self.eos_token_id))


def tiny_llama_hf(vocab_size=96, hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128,
                  max_positions=512, seed=0, dtype=torch.float64, init_std=0.3, model_type="llama"):
    """A tiny random HF Llama (or Qwen2) causal LM. A large init std keeps logits far from ties."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=intermediate_size, max_position_embeddings=max_positions,
        initializer_range=init_std, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    return model


def tiny_target(backend="lean", eos_token_id=None, **kw) -> TargetModel:
    """A :class:`TargetModel` over a tiny random Llama; float64 by default so argmax ties never decide a test."""
    model = tiny_llama_hf(**kw)
    tok = TinyTokenizer(model.config.vocab_size, eos_token_id)
    if eos_token_id is not None:
        model.config.eos_token_id = eos_token_id
        model.generation_config.eos_token_id = eos_token_id
    return TargetModel("tiny-llama", model, tok, backend=backend)


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer_hf():
    """A real, self-contained HF fast tokenizer: byte-level (every UTF-8 text encodes, one token per byte, ids
    0-255), plus ``<|endoftext|>`` (256, pad), ``<|im_start|>`` (257) and ``<|im_end|>`` (258, EOS), and a
    ChatML-style chat template. Built in code; nothing is downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: _byte_of(ch))
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def _byte_of(ch: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's printable byte mapping)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    if ord(ch) in printable:
        return ord(ch)
    others = [b for b in range(256) if b not in printable]
    return others[ord(ch) - 256]


def tiny_hf_folder(path, *, max_positions=512, seed=0, hidden_size=64, layers=2, **kw):
    """Save a tiny random fp32 Llama and :func:`tiny_tokenizer_hf` as a local HF folder at ``path`` (a model
    ``fastforward.load(path)``, ``fastforward generate --model path`` and ``fastforward train`` accept); return it.

    The vocabulary is 260 (259 tokens, padded); ``<|im_end|>`` is the EOS of tokenizer, config and generation
    config. Extra keyword arguments go to :func:`tiny_llama_hf`.
    """
    _quiet_transformers()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer_hf()
    model = tiny_llama_hf(vocab_size=260, hidden_size=hidden_size, layers=layers, max_positions=max_positions,
                          seed=seed, dtype=torch.float32, **kw)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.config.eos_token_id = eos
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_tiny_make_data(folder, *, records: int = 10, response_lengths=(6, 14), vocab: int = 250,
                         seed: int = 0) -> Path:
    """A ``make-data``-shaped folder of random token records (every 5th held out) for training tests."""
    import json
    import random

    rng = random.Random(seed)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "responses.jsonl", "w") as f:
        for i in range(records):
            f.write(json.dumps({"key": f"k{i}", "source": "hand", "split": "heldout" if i % 5 == 0 else "train",
                                "prompt": "", "prompt_ids": [rng.randrange(vocab) for _ in range(rng.randrange(3, 9))],
                                "response_ids": [rng.randrange(vocab) for _ in range(rng.randrange(*response_lengths))],
                                "finish_reason": "length"}) + "\n")
    return folder


def write_tiny_gguf(path, *, vocab_size=96, hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128,
                    max_positions=512, seed=0, init_std=0.3, linear_type="Q4_1", embed_type="Q8_0",
                    tied=True, rope_theta=10000.0, eps=1e-5, types=None):
    """Write a tiny random Llama GGUF file as llama.cpp's converter lays one out (quantised linears, Q/K rows
    permuted for interleaved RoPE, tied or separate output head; ``types`` maps a tensor kind such as ``attn_v`` to
    its own format, as mixed files like Q4_K_M do). Returns the HF-order fp32 weights the file dequantises to (a dict
    of HF state-dict names), so tests can build the reference model."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    g = torch.Generator().manual_seed(seed)
    qlin, qemb = GGMLQuantizationType[linear_type], GGMLQuantizationType[embed_type]
    head_dim = hidden_size // heads
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(max_positions)
    writer.add_embedding_length(hidden_size)
    writer.add_feed_forward_length(intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(eps)
    writer.add_rope_freq_base(rope_theta)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab_size)
    state = {}

    def quantised(name, hf_name, out_f, in_f, qtype, permute=None):
        kind = name.split(".")[-2]
        if types and kind in types:
            qtype = GGMLQuantizationType[types[kind]]
        if qtype.name in ("Q4_K", "Q5_K", "Q6_K"):  # gguf-py cannot quantise these: random blocks of that scale
            seed_k = int(torch.randint(0, 2**31 - 1, (1,), generator=g))
            data = random_gguf_blocks(int(qtype), out_f, in_f, seed=seed_k, scale=init_std).numpy()
        else:
            w = (torch.randn(out_f, in_f, generator=g) * init_std).numpy().astype(np.float32)
            data = quants.quantize(w, qtype)
        deq = torch.from_numpy(quants.dequantize(data, qtype).reshape(out_f, in_f).astype(np.float32))
        if permute is not None:  # the file holds llama.cpp's row order; HF's is data[unpermute_rows]
            order = unpermute_rows(out_f, permute)
            stored = np.empty_like(data)
            stored[order.numpy()] = data
            data = stored
        writer.add_tensor(name, data, raw_dtype=qtype)
        state[hf_name] = deq

    def norm(name, hf_name, n):
        v = (1.0 + 0.1 * torch.randn(n, generator=g)).numpy().astype(np.float32)
        writer.add_tensor(name, v)
        state[hf_name] = torch.from_numpy(v.copy())

    quantised("token_embd.weight", "model.embed_tokens.weight", vocab_size, hidden_size, qemb)
    for i in range(layers):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        norm(p + "attn_norm.weight", h + "input_layernorm.weight", hidden_size)
        quantised(p + "attn_q.weight", h + "self_attn.q_proj.weight", heads * head_dim, hidden_size, qlin, heads)
        quantised(p + "attn_k.weight", h + "self_attn.k_proj.weight", kv_heads * head_dim, hidden_size, qlin,
                  kv_heads)
        quantised(p + "attn_v.weight", h + "self_attn.v_proj.weight", kv_heads * head_dim, hidden_size, qlin)
        quantised(p + "attn_output.weight", h + "self_attn.o_proj.weight", hidden_size, heads * head_dim, qlin)
        norm(p + "ffn_norm.weight", h + "post_attention_layernorm.weight", hidden_size)
        quantised(p + "ffn_gate.weight", h + "mlp.gate_proj.weight", intermediate_size, hidden_size, qlin)
        quantised(p + "ffn_up.weight", h + "mlp.up_proj.weight", intermediate_size, hidden_size, qlin)
        quantised(p + "ffn_down.weight", h + "mlp.down_proj.weight", hidden_size, intermediate_size, qlin)
    norm("output_norm.weight", "model.norm.weight", hidden_size)
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    else:
        quantised("output.weight", "lm_head.weight", vocab_size, hidden_size, qemb)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


def tiny_gguf_target(path, arithmetic: str = "exact", native="load", **kw):
    """(packed target over a freshly written tiny GGUF, the fp32 HF model with the weights it dequantises to).

    ``arithmetic`` is the packed target's ('exact' or 'q8'); ``native=None`` builds it without the native kernels
    (the plain PyTorch paths). The packed target's ``hf_model`` is that fp32 model, so peers and references see the
    same weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    state = write_tiny_gguf(path, **kw)
    gguf_model = read_gguf(path)
    hp = gguf_model.hparams
    config = AutoConfig.for_model(
        "llama", vocab_size=state["model.embed_tokens.weight"].shape[0], hidden_size=hp["hidden_size"],
        num_hidden_layers=hp["n_layers"], num_attention_heads=hp["n_heads"], num_key_value_heads=hp["n_kv_heads"],
        intermediate_size=hp["intermediate_size"], max_position_embeddings=hp["max_positions"],
        rms_norm_eps=hp["eps"], rope_theta=hp["rope_theta"], tie_word_embeddings=kw.get("tied", True),
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    hf = AutoModelForCausalLM.from_config(config).float().eval()
    hf.load_state_dict(state, strict=False)
    tok = TinyTokenizer(config.vocab_size)
    target = TargetModel.from_gguf("tiny-gguf", gguf_model, tok, load_native() if native == "load" else native,
                                   hf_loader=lambda: hf, arithmetic=arithmetic)
    return target, hf


# Byte offsets of each GGUF format's fp16 scales inside a block (random bytes there could be inf/nan).
SCALE_OFFSETS = {2: [0], 3: [0, 2], 6: [0], 7: [0, 2], 8: [0], 12: [0, 2], 13: [0, 2], 14: [208]}
BLOCK_SHAPES = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 12: (256, 144), 13: (256, 176),
                14: (256, 210)}


def random_gguf_blocks(fmt: int, n_out: int, n_in: int, seed: int = 0, scale: float = 0.05) -> torch.Tensor:
    """Random GGUF rows ``[n_out, row_bytes]`` of a block format (GGML type id): random quants and sub-block scales,
    fp16 block scales (and mins) uniform in +-``scale`` / 16 for the K-quants (whose sub-block scales multiply them
    by up to 63) -- for formats gguf-py cannot quantise, and for kernels that must take any bytes a file may hold."""
    import numpy as np

    qk, nb = BLOCK_SHAPES[fmt]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n_out, n_in // qk, nb), dtype=np.uint8)
    span = scale / 16 if qk == 256 else scale
    scales = rng.uniform(-span, span, size=(n_out, n_in // qk, len(SCALE_OFFSETS[fmt]))).astype(np.float16)
    for j, off in enumerate(SCALE_OFFSETS[fmt]):
        raw[:, :, off : off + 2] = scales[:, :, j : j + 1].view(np.uint8)
    return torch.from_numpy(raw.reshape(n_out, -1))


# ------------------------------------------------------------------------------------------------------------------
# Sampling checks: is a method's output distributed as the target's? (chi-square against the exact joint)
# ------------------------------------------------------------------------------------------------------------------


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty upper quantile of chi-square with ``df`` degrees of freedom (z = 3.719: alpha = 1e-4)."""
    import math

    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def exact_joint(target, prompt, cfg, steps: int = 3) -> dict[tuple, float]:
    """The exact probability of every ``steps``-token continuation of ``prompt`` under autoregressive sampling with
    ``cfg`` (a :class:`~fastforward.verify.SamplingConfig`); for tiny vocabularies."""
    from .verify import target_probs

    probs = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for seq, p in probs.items():
            ids = torch.tensor(list(prompt) + list(seq))
            logits = target.forward(ids, torch.arange(ids.numel()), target.new_cache(ids.numel() + 1)).logits[-1]
            for tok, q in enumerate(target_probs(logits, cfg).tolist()):
                if q > 0:
                    nxt[seq + (tok,)] = p * q
        probs = nxt
    return probs


def sampled_continuations(target, prompt, new_proposer, cfg, samples: int, steps: int = 3):
    """Decode ``steps`` tokens after ``prompt`` ``samples`` times (seeds 0, 1, ...) with a fresh proposer from
    ``new_proposer()`` each time: (counts of each continuation, runs that drafted at depth 1, accepted draft tokens)
    -- the observed side of a chi-square test against :func:`exact_joint`, and proof the drafted path ran."""
    from .engine import GenerationStats, decode_steps

    counts: dict[tuple, int] = {}
    drafted = accepted = 0
    for seed in range(samples):
        stats = GenerationStats("sampled")
        toks = tuple(t for chunk in decode_steps(target, prompt, new_proposer(), max_new_tokens=steps, sampling=cfg,
                                                 seed=seed, stats=stats) for t in chunk)
        counts[toks] = counts.get(toks, 0) + 1
        drafted += bool(stats.depth_attempts and stats.depth_attempts[0])
        accepted += sum(stats.depth_accepts)
    return counts, drafted, accepted


def pooled_chi2(exact: dict[tuple, float], counts: dict[tuple, int]) -> tuple[float, int]:
    """Pearson chi-square of observed ``counts`` against ``exact`` probabilities, cells with an expected count under 5
    pooled into one; returns (chi2, number of unpooled cells)."""
    samples = sum(counts.values())
    chi2, df, other_e, other_o = 0.0, 0, 0.0, 0
    for seq, p in exact.items():
        e, o = p * samples, counts.get(seq, 0)
        if e < 5:
            other_e, other_o = other_e + e, other_o + o
        else:
            chi2 += (o - e) ** 2 / e
            df += 1
    chi2 += (other_o - other_e) ** 2 / max(other_e, 1e-9)
    return chi2, df


def backoff_outcomes(target, method: str, drafter_dir, stat: str, prompt=(3, 1, 4, 1, 5), max_new_tokens: int = 40):
    """For a drafter method with a ``backoff`` option: ``{backoff: (token ids, proposer stats[stat])}`` at back-off 0
    and 8, plus AR's token ids under ``"ar"`` -- what the back-off tests compare."""
    from . import api
    from .proposers import make_proposer

    outs = {"ar": api.generate(target, list(prompt), "ar", max_new_tokens=max_new_tokens).token_ids}
    for backoff in (0, 8):
        prop = make_proposer(method, target, drafter=str(drafter_dir), backoff=backoff)
        res = api.generate(target, list(prompt), prop, max_new_tokens=max_new_tokens)
        outs[backoff] = (res.token_ids, prop.stats()[stat])
    return outs


# ------------------------------------------------------------------------------------------------------------------
# HF models written as llama.cpp's converter writes them (architecture-aware), for the architecture tests
# ------------------------------------------------------------------------------------------------------------------

#: HF model type -> GGUF architecture (Mistral converts as llama, as llama.cpp's converter does)
GGUF_ARCH_OF = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                "gemma2": "gemma2", "gemma3_text": "gemma3"}


def _llama_cpp_permute(w, n_heads: int):
    """llama.cpp's converter's Q/K row permutation (rotate-half pairs -> interleaved pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(params: dict, head_dim: int):
    """The ``rope_freqs.weight`` factors llama.cpp's converter computes for a Llama 3 rope (float32)."""
    import math

    base = params.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor = params.get("factor", 8.0)
    low, high = params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0)
    old = params.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def write_hf_gguf(model, path, *, linear_type: str = "F32", vocab: bool = True) -> str:
    """Write an HF model (fp32) as a GGUF file under llama.cpp's tensor and metadata names, laid out as llama.cpp's
    converter lays it out per architecture (Llama's permuted Q/K rows and ``rope_freqs``; Qwen2's biases; Qwen3's
    q/k norms; Phi-3's fused ``attn_qkv`` and gate|up ``ffn_up``; Gemma's (1 + w) norms, four per layer, soft-caps
    and local / global layers). Matrices in ``linear_type`` (F32, F16, Q8_0,
    Q4_0, ...), 1-D tensors in F32. ``vocab``: a minimal tokenizer (byte tokens, SentencePiece-style) so llama.cpp
    loads the file. Returns the GGUF architecture."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType, quants

    cfg = model.config
    mt = cfg.model_type
    arch = GGUF_ARCH_OF[mt]
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
    qtype = GGMLQuantizationType[linear_type]
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    params = getattr(cfg, "rope_parameters", None) or {}
    gemma = arch in ("gemma2", "gemma3")
    if "full_attention" in params:  # Gemma 3: global layers' rope, and the local layers' base
        w.add_rope_freq_base_swa(float(params["sliding_attention"]["rope_theta"]))
        params = params["full_attention"]
    w.add_rope_freq_base(float(params.get("rope_theta", 10000.0)))
    w.add_rope_dimension_count(d)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(1 if linear_type == "F16" else 0 if linear_type == "F32" else 7)
    rope_type = params.get("rope_type", "default")
    if rope_type == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(params["factor"]))
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) is not False:
        w.add_sliding_window(int(cfg.sliding_window))
        if arch == "gemma3":
            w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if gemma and getattr(cfg, "attn_logit_softcapping", None):
        w.add_attn_logit_softcapping(float(cfg.attn_logit_softcapping))
    if gemma and getattr(cfg, "final_logit_softcapping", None):
        w.add_final_logit_softcapping(float(cfg.final_logit_softcapping))

    def matrix(name, t):
        t = t.contiguous().numpy().astype(np.float32)
        if qtype == GGMLQuantizationType.F32 or t.shape[-1] % 32:
            w.add_tensor(name, t)
        elif qtype == GGMLQuantizationType.F16:
            w.add_tensor(name, t.astype(np.float16))
        else:
            w.add_tensor(name, quants.quantize(t, qtype), raw_dtype=qtype)

    def vec(name, t):
        if gemma and name.endswith("norm.weight"):  # llama.cpp's converter stores Gemma's (1 + w)
            t = t + 1
        w.add_tensor(name, t.contiguous().numpy().astype(np.float32))

    matrix("token_embd.weight", sd["model.embed_tokens.weight"])
    if rope_type == "llama3":
        vec("rope_freqs.weight", _llama3_rope_factors(params, d))
    permute = arch == "llama"
    for i in range(cfg.num_hidden_layers):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        vec(p + "attn_norm.weight", sd[h + "input_layernorm.weight"])
        if gemma:
            vec(p + "post_attention_norm.weight", sd[h + "post_attention_layernorm.weight"])
            vec(p + "ffn_norm.weight", sd[h + "pre_feedforward_layernorm.weight"])
            vec(p + "post_ffw_norm.weight", sd[h + "post_feedforward_layernorm.weight"])
        else:
            vec(p + "ffn_norm.weight", sd[h + "post_attention_layernorm.weight"])
        if h + "self_attn.qkv_proj.weight" in sd:
            matrix(p + "attn_qkv.weight", sd[h + "self_attn.qkv_proj.weight"])
        else:
            for x, n in (("q", nh), ("k", nkv), ("v", None)):
                wx = sd[h + f"self_attn.{x}_proj.weight"]
                matrix(p + f"attn_{x}.weight", _llama_cpp_permute(wx, n) if permute and n else wx)
                if h + f"self_attn.{x}_proj.bias" in sd:
                    bx = sd[h + f"self_attn.{x}_proj.bias"]
                    vec(p + f"attn_{x}.bias", _llama_cpp_permute(bx, n) if permute and n else bx)
        if h + "self_attn.q_norm.weight" in sd:
            vec(p + "attn_q_norm.weight", sd[h + "self_attn.q_norm.weight"])
            vec(p + "attn_k_norm.weight", sd[h + "self_attn.k_norm.weight"])
        matrix(p + "attn_output.weight", sd[h + "self_attn.o_proj.weight"])
        if h + "mlp.gate_up_proj.weight" in sd:
            matrix(p + "ffn_up.weight", sd[h + "mlp.gate_up_proj.weight"])
        else:
            matrix(p + "ffn_gate.weight", sd[h + "mlp.gate_proj.weight"])
            matrix(p + "ffn_up.weight", sd[h + "mlp.up_proj.weight"])
        matrix(p + "ffn_down.weight", sd[h + "mlp.down_proj.weight"])
    vec("output_norm.weight", sd["model.norm.weight"])
    if not getattr(cfg, "tie_word_embeddings", False) and "lm_head.weight" in sd:
        matrix("output.weight", sd["lm_head.weight"])
    if vocab:
        _add_byte_vocab(w, cfg.vocab_size)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return arch


def _add_byte_vocab(w, vocab_size: int) -> None:
    """A minimal SentencePiece-style vocabulary for llama.cpp: ``<unk>``, ``<s>``, ``</s>``, the 256 byte tokens,
    then unused padding up to ``vocab_size``."""
    from gguf import TokenType

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    while len(tokens) < vocab_size:
        tokens.append(f"<unused{len(tokens)}>")
        types.append(TokenType.UNUSED)
    tokens, types = tokens[:vocab_size], types[:vocab_size]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
