"""The native attention kernel's options -- a sliding window, logit soft-capping, a custom query scale -- against a
float64 reference written from transformers' own rules, the bitwise promises (a tree's rows equal each row alone,
independent of threads and of where the prefix ends) with each option, the defaults' bits, the torch reference in
layer_math, the lean forward's per-layer fields, and gelu_tanh_mul."""

import math

import pytest
import torch
import torch.nn.functional as F

from fastforward import kernels
from fastforward.model.layer_math import attend, window_mask
from tests.test_layer_ops import (
    SHAPES,
    _ancestors,
    _inputs,
    _parents_to_visible,
    _random_parents,
    _rel,
    _split_rope,
    _tables,
)


@pytest.fixture(scope="module")
def ops():
    module = kernels.load_native()
    if module is None or not hasattr(module, "gelu_tanh_mul"):
        pytest.skip("the native layer ops are unavailable here")
    return module


def _hf_window(q_positions, key_positions, window):
    """transformers' sliding-window rule itself (masking_utils.sliding_window_overlay), where installed."""
    masking = pytest.importorskip("transformers.masking_utils")
    inner = masking.sliding_window_overlay(window)
    return inner(0, 0, q_positions.view(-1, 1), key_positions.view(1, -1))


def _reference(qkv, positions, k_cache, v_cache, start, visible, nh, nkv, d, window=0, softcap=0.0, scale=0.0):
    """Output [q, nh*d] in float64 from the kernel's inputs: RoPE as the lean forward does it (fp32), the caches
    written at start.., then scores * scale, Gemma 2's capping (s / cap, tanh, * cap), transformers' window rule
    over key positions (prefix slot s: position s; new token j: positions[j]), a softmax over the keys each row
    sees (none: zeros)."""
    q = qkv.shape[0]
    qh, kh, vh = _split_rope(qkv, positions, nh, nkv, d)
    kc, vc = k_cache.clone(), v_cache.clone()
    kc[:, start : start + q] = kh.to(kc.dtype)
    vc[:, start : start + q] = vh.to(vc.dtype)
    local = torch.ones(q, q, dtype=torch.bool).tril() if visible is None else visible
    mask = torch.cat([torch.ones(q, start, dtype=torch.bool), local], dim=1)
    if window:
        key_positions = torch.cat([torch.arange(start), positions])
        mask = mask & _hf_window(positions, key_positions, window)
    g = nh // nkv
    k = kc[:, : start + q].double().repeat_interleave(g, 0)
    v = vc[:, : start + q].double().repeat_interleave(g, 0)
    s = qh.double() @ k.transpose(1, 2) * (scale or 1.0 / math.sqrt(d))
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # a row with no key: zeros
    return (p @ v).transpose(0, 1).reshape(q, nh * d)


def _call(ops, qkv, positions, kc, vc, start, vis, nh, nkv, **options):
    d = kc.shape[2]
    cos, sin = _tables(d)
    return ops.attention(qkv, cos, sin, positions, kc, vc, start, vis, nh, nkv, **options)


def _case(q, start, nh, nkv, d, kind, seed, kv=torch.float32, gain=1.5):
    qkv, kc, vc, g = _inputs(q, start, nh, nkv, d, seed, kv=kv)
    qkv = qkv / 1.5 * gain
    if kind == "causal":
        return qkv, kc, vc, None, torch.arange(start, start + q)
    vis = _parents_to_visible(_random_parents(q, g, roots=kind == "forest"))
    return qkv, kc, vc, vis, start + vis.sum(1) - 1


# ---------------------------------------------------------------------------------------------------------------
# Each option against the reference
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nh,nkv,d", [SHAPES[0], SHAPES[1], SHAPES[3], SHAPES[5]])
@pytest.mark.parametrize("start", [0, 63, 200, 1000])
def test_window_matches_reference(ops, nh, nkv, d, start):
    # windows smaller than a chunk, a chunk, and larger; at start 1000 whole 64-key chunks fall outside them
    for window in (1, 5, 64, 100, 130):
        for q in (1, 5, 16):
            for kind in ("causal", "tree", "forest"):
                qkv, kc, vc, vis, pos = _case(q, start, nh, nkv, d, kind, seed=start * 7 + q + window)
                ref = _reference(qkv, pos, kc, vc, start, vis, nh, nkv, d, window=window)
                full = _reference(qkv, pos, kc, vc, start, vis, nh, nkv, d)
                out = _call(ops, qkv, pos, kc.clone(), vc.clone(), start, vis, nh, nkv, window=window)
                assert torch.isfinite(out).all()
                assert _rel(out, ref) < 2e-6, (window, q, kind)
                if window < start:  # the window matters here: the check can fail
                    assert _rel(full, ref) > 1e-3, (window, q, kind)


@pytest.mark.parametrize("kv", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("nh,nkv,d", [SHAPES[0], SHAPES[3], SHAPES[4]])
def test_softcap_matches_reference(ops, nh, nkv, d, kv):
    for start in (0, 70, 300):
        for softcap in (0.5, 5.0, 50.0):
            for q in (1, 7):
                # large logits, so that the cap bites
                qkv, kc, vc, vis, pos = _case(q, start, nh, nkv, d, "tree", seed=start + q, kv=kv, gain=6.0)
                ref = _reference(qkv, pos, kc, vc, start, vis, nh, nkv, d, softcap=softcap)
                out = _call(ops, qkv, pos, kc.clone(), vc.clone(), start, vis, nh, nkv, softcap=softcap)
                assert _rel(out, ref) < 1e-5, (start, softcap, q)
                if softcap < 50 and start + q > 1:  # the cap matters here: the check can fail
                    assert _rel(_reference(qkv, pos, kc, vc, start, vis, nh, nkv, d), ref) > 1e-3


@pytest.mark.parametrize("nh,nkv,d", [SHAPES[0], SHAPES[2], SHAPES[5]])
def test_scale_matches_reference(ops, nh, nkv, d):
    for scale in (0.01, 1.0 / math.sqrt(256), 0.3):
        for start in (0, 65, 300):
            qkv, kc, vc, vis, pos = _case(6, start, nh, nkv, d, "tree", seed=start)
            ref = _reference(qkv, pos, kc, vc, start, vis, nh, nkv, d, scale=scale)
            out = _call(ops, qkv, pos, kc.clone(), vc.clone(), start, vis, nh, nkv, scale=scale)
            assert _rel(out, ref) < 2e-6, (scale, start)
            assert _rel(_reference(qkv, pos, kc, vc, start, vis, nh, nkv, d), ref) > 1e-3


@pytest.mark.parametrize("kv", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_all_options_together(ops, kv):
    """Gemma 2's local layers: a window, soft-capping and query_pre_attn_scalar**-0.5 at once."""
    nh, nkv, d = 8, 4, 32
    for start in (0, 150, 700):
        for q in (1, 9):
            qkv, kc, vc, vis, pos = _case(q, start, nh, nkv, d, "tree", seed=q + start, kv=kv, gain=4.0)
            opts = dict(window=96, softcap=50.0, scale=256 ** -0.5)
            ref = _reference(qkv, pos, kc, vc, start, vis, nh, nkv, d, **opts)
            out = _call(ops, qkv, pos, kc.clone(), vc.clone(), start, vis, nh, nkv, **opts)
            assert _rel(out, ref) < 1e-5, (start, q)


def test_window_edges(ops):
    nh, nkv, d = 4, 2, 16
    # a row whose window holds no key it sees gives zeros (window 1: only itself, and here it does not see itself)
    qkv, kc, vc, _, _ = _case(3, 0, nh, nkv, d, "causal", seed=1)
    vis = torch.tensor([[1, 0, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    pos = torch.tensor([0, 1, 2])
    out = _call(ops, qkv, pos, kc, vc, 0, vis, nh, nkv, window=1)
    assert torch.equal(out[1], torch.zeros(nh * d)) and out[0].abs().sum() > 0 and out[2].abs().sum() > 0
    ref = _reference(qkv, pos, kc, vc, 0, vis, nh, nkv, d, window=1)
    assert _rel(out, ref) < 2e-6
    # a long prefix entirely outside a window of 1: the row sees itself only, i.e. its own value
    qkv, kc, vc, _, pos = _case(1, 1000, nh, nkv, d, "causal", seed=2)
    out = _call(ops, qkv, pos, kc, vc, 1000, None, nh, nkv, window=1)
    v = qkv[0, (nh + nkv) * d :].view(nkv, d).repeat_interleave(nh // nkv, 0).reshape(-1)
    assert torch.equal(out[0], v)


# ---------------------------------------------------------------------------------------------------------------
# The bitwise promises with each option
# ---------------------------------------------------------------------------------------------------------------

OPTIONS = [dict(window=70), dict(window=3), dict(window=64), dict(softcap=2.0), dict(scale=0.07),
           dict(window=100, softcap=30.0, scale=0.1)]


def _check_alone(ops, parents, prefix, nh, nkv, d, seed, options, kv=torch.float32):
    """Row i of a tree equals token i alone on a cache holding its accepted path at the positions after the
    prefix (as StaticKVCache.keep leaves it)."""
    q = len(parents)
    qkv, kc, vc, _ = _inputs(q, prefix, nh, nkv, d, seed, kv=kv)
    vis = _parents_to_visible(parents)
    positions = prefix + vis.sum(1) - 1
    out = _call(ops, qkv, positions, kc, vc, prefix, vis, nh, nkv, **options)
    ref = _reference(qkv, positions, kc, vc, prefix, vis, nh, nkv, d, **options)
    assert _rel(out, ref) < 1e-5
    for i in range(q):
        path = _ancestors(parents, i)
        start = prefix + len(path) - 1
        k2 = torch.randn(nkv, start + 2, d).to(kv)
        v2 = torch.randn(nkv, start + 2, d).to(kv)
        k2[:, :prefix], v2[:, :prefix] = kc[:, :prefix], vc[:, :prefix]
        for n, j in enumerate(path[:-1]):
            k2[:, prefix + n], v2[:, prefix + n] = kc[:, prefix + j], vc[:, prefix + j]
        alone = _call(ops, qkv[i : i + 1], positions[i : i + 1], k2, v2, start, None, nh, nkv, **options)
        assert torch.equal(alone[0], out[i]), (i, path, prefix, options)


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
@pytest.mark.parametrize("prefix", [0, 62, 130, 1000])
def test_tree_rows_equal_alone(ops, options, prefix):
    g = torch.Generator().manual_seed(prefix)
    _check_alone(ops, list(range(-1, 15)), prefix, 9, 3, 64, prefix, options)  # a chain across chunk boundaries
    _check_alone(ops, [-1] + [0] * 15, prefix, 9, 3, 64, prefix + 1, options)  # a star
    _check_alone(ops, _random_parents(16, g, roots=True), prefix, 6, 1, 40, prefix + 2, options)
    _check_alone(ops, _random_parents(12, g), prefix, 4, 2, 16, prefix + 3, options, kv=torch.float16)


@pytest.mark.parametrize("options", OPTIONS[:1] + OPTIONS[3:], ids=lambda o: "-".join(o))
def test_thread_count_and_batch_independence(ops, options):
    nh, nkv, d, prefix, q = 9, 3, 64, 200, 150
    qkv, kc, vc, _ = _inputs(q, prefix, nh, nkv, d, seed=11)
    positions = torch.arange(prefix, prefix + q)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(_call(ops, qkv, positions, kc.clone(), vc.clone(), prefix, None, nh, nkv, **options))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    whole = results[0]
    assert _rel(whole, _reference(qkv, positions, kc, vc, prefix, None, nh, nkv, d, **options)) < 1e-5
    # a causal prefill in pieces of other sizes (more than 64 rows: several passes inside one call)
    parts, s = [], prefix
    k2, v2 = kc.clone(), vc.clone()
    for n in (1, 3, 12, 70, 64):
        lo = s - prefix
        parts.append(_call(ops, qkv[lo : lo + n], positions[lo : lo + n], k2, v2, s, None, nh, nkv, **options))
        s += n
    assert torch.equal(torch.cat(parts), whole)


def test_attention_many_passes_the_options(ops):
    nh, nkv, d = 9, 3, 64
    cos, sin = _tables(d)
    g = torch.Generator().manual_seed(3)
    seqs = []
    for j, (q, start) in enumerate([(1, 900), (5, 40), (3, 300)]):
        qkv, kc, vc, _ = _inputs(q, start, nh, nkv, d, seed=j)
        vis = _parents_to_visible(_random_parents(q, g))
        seqs.append((qkv, kc.unsqueeze(0), vc.unsqueeze(0), start, vis, start + vis.sum(1) - 1))
    opts = dict(window=80, softcap=3.0, scale=0.2)
    expected = [ops.attention(qkv, cos, sin, pos, k[0].clone(), v[0].clone(), start, vis, nh, nkv, **opts)
                for qkv, k, v, start, vis, pos in seqs]
    rows = [0]
    for s in seqs:
        rows.append(rows[-1] + s[0].shape[0])
    out = ops.attention_many(torch.cat([s[0] for s in seqs]), rows, cos, sin, [s[5] for s in seqs],
                             [s[1] for s in seqs], [s[2] for s in seqs], 0, [s[3] for s in seqs],
                             [s[4] for s in seqs], nh, nkv, [None] * 3, **opts)
    assert torch.equal(out, torch.cat(expected))


# ---------------------------------------------------------------------------------------------------------------
# Defaults: today's bits
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nh,nkv,d", [SHAPES[0], SHAPES[3], SHAPES[5]])
def test_defaults_and_neutral_options_are_bitwise_the_plain_kernel(ops, nh, nkv, d):
    for start in (0, 64, 300):
        qkv, kc, vc, vis, pos = _case(9, start, nh, nkv, d, "tree", seed=start)
        plain = _call(ops, qkv, pos, kc.clone(), vc.clone(), start, vis, nh, nkv)
        assert _rel(plain, _reference(qkv, pos, kc, vc, start, vis, nh, nkv, d)) < 2e-6
        explicit = _call(ops, qkv, pos, kc.clone(), vc.clone(), start, vis, nh, nkv, window=0, softcap=0.0,
                         scale=0.0)
        assert torch.equal(plain, explicit)
        # the default scale given explicitly (the same float), and a window wider than any distance: the same bits
        same_scale = _call(ops, qkv, pos, kc.clone(), vc.clone(), start, vis, nh, nkv,
                           scale=float(torch.tensor(1.0) / torch.tensor(float(d)).sqrt()))
        assert torch.equal(plain, same_scale)
        wide = _call(ops, qkv, pos, kc.clone(), vc.clone(), start, vis, nh, nkv, window=start + 10)
        assert torch.equal(plain, wide)
        assert not torch.equal(plain, _call(ops, qkv, pos, kc.clone(), vc.clone(), start, vis, nh, nkv,
                                            window=start + 1))


# ---------------------------------------------------------------------------------------------------------------
# Argument errors
# ---------------------------------------------------------------------------------------------------------------


def test_bad_options_raise(ops):
    nh, nkv, d = 4, 2, 16
    qkv, kc, vc, vis, pos = _case(3, 10, nh, nkv, d, "tree", seed=0)
    for options, message in [
        (dict(window=-1), "window must be >= 0"),
        (dict(softcap=float("nan")), "softcap must be finite and >= 0"),
        (dict(softcap=-1.0), "softcap must be finite and >= 0"),
        (dict(softcap=float("inf")), "softcap must be finite and >= 0"),
        (dict(softcap=1e-50), "is 0 in float32"),
        (dict(scale=float("nan")), "scale must be finite and >= 0"),
        (dict(scale=-0.5), "scale must be finite and >= 0"),
        (dict(scale=float("inf")), "scale must be finite and >= 0"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            _call(ops, qkv, pos, kc.clone(), vc.clone(), 10, vis, nh, nkv, **options)
    # the options are keyword-only
    cos, sin = _tables(d)
    with pytest.raises(TypeError):
        ops.attention(qkv, cos, sin, pos, kc, vc, 10, vis, nh, nkv, None, 5)
    # a slot pool's earlier-written slot has no known position under a window
    wide = torch.zeros(3, 5, dtype=torch.bool)
    wide[:, 4] = True  # slot 14, not written by this call
    wide[[0, 1, 2], [0, 1, 2]] = True
    slots = torch.tensor([10, 11, 12])
    with pytest.raises(RuntimeError, match="position is unknown"):
        ops.attention(qkv, cos, sin, pos, kc.clone(), vc.clone(), 10, wide, nh, nkv, slots, window=4)
    ops.attention(qkv, cos, sin, pos, kc.clone(), vc.clone(), 10, wide, nh, nkv, slots)  # fine without a window


# ---------------------------------------------------------------------------------------------------------------
# gelu_tanh_mul
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("inter", [1, 7, 8, 9, 64, 1000, 2304])
def test_gelu_tanh_mul(ops, inter):
    g = torch.Generator().manual_seed(inter)
    gu = torch.randn(5, 2 * inter, generator=g) * 3
    gu[0, : min(inter, 6)] = torch.tensor([0.0, -0.0, 1e-30, -12.0, 30.0, -5.0])[: min(inter, 6)]
    out = ops.gelu_tanh_mul(gu)
    gate, up = gu[:, :inter], gu[:, inter:]
    torch_fp32 = F.gelu(gate, approximate="tanh") * up
    assert out.shape == (5, inter)
    assert _rel(out, torch_fp32) < 1e-6
    # elementwise against float64, as the equal g * sigmoid(2u): 0.5 g (1 + tanh(u)) cancels for negative u, in
    # torch's fp32 and even in float64 (around g = -7 not a digit is left)
    x = gate.double()
    exact = x * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)) * up.double()
    assert _rel(out, exact) < 1e-6
    err = (out.double() - exact).abs()
    assert (err <= 2e-6 * exact.abs() + 1e-38)[gate > -3].all()  # the rounding of u grows with |u|
    assert (err <= 2e-5 * exact.abs() + 1e-38).all()
    # rows are independent of the batch
    assert torch.equal(ops.gelu_tanh_mul(gu[2:3]), out[2:3])


def test_gelu_tanh_mul_special_values(ops):
    gu = torch.tensor([[float("nan"), float("inf"), -80.0, 80.0, 1.0, 1.0, 1.0, 1.0]])
    out = ops.gelu_tanh_mul(gu)
    assert math.isnan(out[0, 0]) and out[0, 1] == float("inf") and out[0, 2] == 0.0 and out[0, 3] == 80.0
    with pytest.raises(RuntimeError, match="even number of columns"):
        ops.gelu_tanh_mul(torch.zeros(2, 3))


# ---------------------------------------------------------------------------------------------------------------
# The torch reference in layer_math
# ---------------------------------------------------------------------------------------------------------------


def test_layer_math_window_mask_is_transformers_rule():
    qp, kp = torch.arange(40, 60), torch.arange(0, 60)
    for window in (1, 7, 64):
        assert torch.equal(window_mask(qp, kp, window), _hf_window(qp, kp, window))
    assert window_mask(qp, kp, 0).all()


def test_layer_math_attend_matches_the_kernel_reference(ops):
    nh, nkv, d, start, q = 9, 3, 64, 150, 7
    qkv, kc, vc, vis, pos = _case(q, start, nh, nkv, d, "tree", seed=4, gain=4.0)
    qh, kh, vh = _split_rope(qkv, pos, nh, nkv, d)
    k = torch.cat([kc[:, :start], kh], 1)
    v = torch.cat([vc[:, :start], vh], 1)
    mask = torch.cat([torch.ones(q, start, dtype=torch.bool), vis], 1)
    kp = torch.cat([torch.arange(start), pos])
    # without options: exactly the lean forward's SDPA call
    sdpa = F.scaled_dot_product_attention(qh.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                          enable_gqa=True)[0]
    assert torch.equal(attend(qh, k, v, mask), sdpa)
    for opts in (dict(window=20), dict(softcap=3.0), dict(scale=0.05), dict(window=70, softcap=20.0, scale=0.1)):
        m = mask & window_mask(pos, kp, opts.get("window", 0))
        got = attend(qh.double(), k.double(), v.double(), m, opts.get("scale", 0.0), opts.get("softcap", 0.0))
        ref = _reference(qkv, pos, kc, vc, start, vis, nh, nkv, d, **opts)
        assert _rel(got.transpose(0, 1).reshape(q, nh * d), ref) < 1e-12, opts
    # a row that sees nothing: zeros, not NaN
    none = torch.zeros(q, start + q, dtype=torch.bool)
    assert torch.equal(attend(qh, k, v, none, softcap=5.0), torch.zeros(nh, q, d))
    with pytest.raises(ValueError):
        attend(qh, k, v, mask, softcap=float("nan"))
    with pytest.raises(ValueError):
        window_mask(pos, kp, -1)


# ---------------------------------------------------------------------------------------------------------------
# The lean forward's per-layer fields
# ---------------------------------------------------------------------------------------------------------------


def _tiny_mistral(window):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "mistral", vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=256, sliding_window=window, bos_token_id=None,
        eos_token_id=None, pad_token_id=None)
    return AutoModelForCausalLM.from_config(config).float().eval()


def _lean_steps(lean, ids):
    """Logits of a prefill of 13 tokens, then a tree of 4 (a chain of 2 and a sibling, the chain kept), then the
    remaining tokens one at a time: every row's logits at its own position."""
    cache = lean.new_cache(64)
    rows = [lean.forward(ids[:13], torch.arange(13), cache).logits]
    cache.keep(list(range(13)))
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    tree_ids = torch.stack([ids[13], ids[14], ids[20]])
    out = lean.forward(tree_ids, torch.tensor([13, 14, 14]), cache, tree_mask=tree).logits
    rows.append(out[:2])
    cache.keep([0, 1])
    for p in range(15, ids.shape[0]):
        rows.append(lean.forward(ids[p : p + 1], torch.tensor([p]), cache).logits)
        cache.keep([0])
    return torch.cat(rows)


@pytest.mark.parametrize("path", ["native", "torch"])
def test_lean_window_field_gives_hf_mistral_logits(path):
    """LlamaLayer.window on a Mistral with a sliding window of 8: the lean forward's logits are HF's, well past the
    window, over a prefill, a tree and single steps -- on the native kernel and on the torch path."""
    from fastforward.model.lean import LeanLlama

    hf = _tiny_mistral(8)
    lean = LeanLlama.from_hf(hf)
    if path == "native" and lean.ops is None:
        pytest.skip("the native kernels are unavailable here")
    if path == "torch":
        lean.ops = None
    ids = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids.unsqueeze(0)).logits[0]
    assert [layer.window for layer in lean.layers] == [8, 8]  # from_hf reads the model's window
    for layer in lean.layers:
        layer.window = 0
    plain = _lean_steps(lean, ids)
    assert (plain - ref).abs().max() > 1e-3  # without the window the logits past it differ: the check can fail
    for layer in lean.layers:
        layer.window = 8
    got = _lean_steps(lean, ids)
    assert (got - ref).abs().max() < 1e-4


def test_lean_native_and_torch_paths_agree_with_every_option():
    from fastforward.model.lean import LeanLlama

    lean = LeanLlama.from_hf(_tiny_mistral(None))
    if lean.ops is None:
        pytest.skip("the native kernels are unavailable here")
    lean.layers[0].window, lean.layers[0].softcap, lean.layers[0].scale = 5, 2.0, 0.5
    lean.layers[1].softcap = 1.5  # layers differ, as Gemma 2's local and global layers do
    ids = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(1))
    native = _lean_steps(lean, ids)
    ops, lean.ops = lean.ops, None
    torch_path = _lean_steps(lean, ids)
    lean.ops = ops
    assert (native - torch_path).abs().max() < 1e-4
    for layer in lean.layers:
        layer.window, layer.softcap, layer.scale = 0, 0.0, 0.0
    assert (_lean_steps(lean, ids) - native).abs().max() > 1e-3
