"""Native layer ops (fastforward/kernels/layer_ops.cpp): agreement with the torch ops they replace, the bitwise
tree-verification property of `attention`, thread-count independence, and argument errors -- the attention tests
over fp32 and fp16 KV caches alike (an fp16 cache: written rounded to nearest even, read back exactly)."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastforward import kernels
from fastforward.model import StaticKVCache

#: the KV cache dtypes attention takes
KV_DTYPES = [torch.float32, torch.float16]
kv_dtypes = pytest.mark.parametrize("kv", KV_DTYPES, ids=["fp32", "fp16"])


@pytest.fixture(scope="module")
def ops():
    module = kernels.load_native()
    if module is None or not hasattr(module, "attention"):
        pytest.skip("the native layer ops are unavailable here")
    return module


def _rope_tables(positions: int, d: int, base: float = 10000.0):
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float64), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float().contiguous(), emb.sin().float().contiguous()


COS, SIN = {}, {}


def _tables(d):
    if d not in COS:
        COS[d], SIN[d] = _rope_tables(2048, d)
    return COS[d], SIN[d]


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _split_rope(qkv, positions, nh, nkv, d):
    """LeanLlama.forward's head split and RoPE: q [nh, q, d], k and v [nkv, q, d]."""
    q = qkv.shape[0]
    cos, sin = _tables(d)
    c, s = cos[positions].unsqueeze(0), sin[positions].unsqueeze(0)
    qh = qkv[:, : nh * d].view(q, nh, d).transpose(0, 1)
    kh = qkv[:, nh * d : (nh + nkv) * d].view(q, nkv, d).transpose(0, 1)
    vh = qkv[:, (nh + nkv) * d :].view(q, nkv, d).transpose(0, 1)
    return qh * c + _rotate_half(qh) * s, kh * c + _rotate_half(kh) * s, vh


def _reference(qkv, positions, k_cache, v_cache, start, visible, nh, nkv, d, dtype=torch.float32):
    """(output [q, nh*d], k_cache, v_cache after the writes) by torch ops, attention in `dtype`; the writes in the
    caches' dtype (fp16: torch's rounding to nearest even)."""
    q = qkv.shape[0]
    qh, kh, vh = _split_rope(qkv, positions, nh, nkv, d)
    kc, vc = k_cache.clone(), v_cache.clone()
    kc[:, start : start + q] = kh.to(kc.dtype)
    vc[:, start : start + q] = vh.to(vc.dtype)
    local = torch.ones(q, q, dtype=torch.bool).tril() if visible is None else visible
    mask = torch.cat([torch.ones(q, start, dtype=torch.bool), local], dim=1)
    o = F.scaled_dot_product_attention(
        qh.unsqueeze(0).to(dtype),
        kc[:, : start + q].unsqueeze(0).to(dtype),
        vc[:, : start + q].unsqueeze(0).to(dtype),
        attn_mask=mask,
        enable_gqa=nh != nkv,
    )
    return o[0].transpose(0, 1).reshape(q, nh * d).float(), kc, vc


def _parents_to_visible(parents):
    """visible [q, q]: ancestors + self of each token; parents[i] < i or -1 (a root)."""
    q = len(parents)
    vis = torch.zeros(q, q, dtype=torch.bool)
    for i in range(q):
        j = i
        while j >= 0:
            vis[i, j] = True
            j = parents[j]
    return vis


def _random_parents(q, g, roots=False):
    lo = -1 if roots else 0
    return [-1] + [int(torch.randint(lo, i, (1,), generator=g)) for i in range(1, q)]


def _inputs(q, start, nh, nkv, d, seed, extra=3, kv=torch.float32):
    g = torch.Generator().manual_seed(seed)
    cap = start + q + extra
    k_cache = torch.randn(nkv, cap, d, generator=g).to(kv)
    v_cache = torch.randn(nkv, cap, d, generator=g).to(kv)
    qkv = torch.randn(q, (nh + 2 * nkv) * d, generator=g) * 1.5
    return qkv, k_cache, v_cache, g


def _rel(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------------------------
# rms_norm, add_rms_norm, silu_mul
# ---------------------------------------------------------------------------------------------------------------


def _rms_ref(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("D", [1, 7, 8, 17, 64, 576, 1000, 2048])
@pytest.mark.parametrize("q", [1, 3, 16])
def test_rms_norm(ops, q, D):
    g = torch.Generator().manual_seed(q * 1000 + D)
    x = torch.randn(q, D, generator=g) * 3
    w = torch.randn(D, generator=g)
    for eps in (1e-5, 1e-6):
        out = ops.rms_norm(x, w, eps)
        assert out.shape == (q, D) and out.dtype == torch.float32
        torch.testing.assert_close(out, _rms_ref(x, w, eps), rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(
        ops.rms_norm(x.t().contiguous().t(), w, 1e-5), _rms_ref(x, w, 1e-5), rtol=2e-6, atol=1e-7
    )  # non-contiguous x


@pytest.mark.parametrize("D", [5, 576, 1000])
def test_add_rms_norm(ops, D):
    g = torch.Generator().manual_seed(D)
    x = torch.randn(4, D, generator=g)
    delta = torch.randn(4, D, generator=g)
    w = torch.randn(D, generator=g)
    want_x = x + delta
    out = ops.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(x, want_x)  # updated in place, exactly the torch sum
    torch.testing.assert_close(out, _rms_ref(want_x, w, 1e-5), rtol=2e-6, atol=1e-7)
    assert torch.equal(out, ops.rms_norm(want_x, w, 1e-5))


@pytest.mark.parametrize("inter", [1, 3, 8, 13, 1536])
def test_silu_mul(ops, inter):
    g = torch.Generator().manual_seed(inter)
    gu = torch.randn(5, 2 * inter, generator=g) * 4
    gu[0, :inter] = torch.linspace(-110, 110, inter)  # saturation on both sides
    out = ops.silu_mul(gu)
    assert out.shape == (5, inter)
    gate, up = gu.double()[:, :inter], gu.double()[:, inter:]
    exact = gate * torch.sigmoid(gate) * up
    # within a few float32 ulp of the exact value (underflowing products aside)
    err = (out.double() - exact).abs()
    assert (err <= 4e-7 * exact.abs() + 1e-30).all(), err.max()
    torch.testing.assert_close(out, F.silu(gu[:, :inter]) * gu[:, inter:], rtol=1e-6, atol=1e-30)


def test_silu_exp_accuracy(ops):
    """The vector exp, seen through silu on g in [-87, -17] where 1 + exp(-g) rounds to exp(-g): the result is
    g / exp8(-g), so its error in ulp is exp8's plus the division's half ulp."""
    g = torch.linspace(-87.0, -17.0, 200_001)
    gu = torch.cat([g, torch.ones_like(g)]).reshape(1, -1)
    out = ops.silu_mul(gu)[0]
    exact = g.double() * torch.exp(g.double())
    ulp = (torch.nextafter(out.abs(), torch.tensor(math.inf)) - out.abs()).double()
    err = ((out.double() - exact).abs() / ulp).max().item()
    assert err < 2.5, err
    rel = ((out.double() - exact).abs() / exact.abs()).max().item()
    assert rel < 3e-7, rel


# ---------------------------------------------------------------------------------------------------------------
# attention vs torch
# ---------------------------------------------------------------------------------------------------------------

SHAPES = [(9, 3, 64), (4, 2, 16), (8, 8, 32), (6, 1, 40), (4, 4, 20), (2, 1, 128)]


@kv_dtypes
@pytest.mark.parametrize("nh,nkv,d", SHAPES)
@pytest.mark.parametrize("start", [0, 1, 63, 64, 65, 300, 1000])
def test_attention_matches_sdpa(ops, nh, nkv, d, start, kv):
    cos, sin = _tables(d)
    for q in (1, 2, 5, 16):
        for kind in ("causal", "tree", "forest"):
            qkv, kc, vc, g = _inputs(q, start, nh, nkv, d, seed=start * 31 + q, kv=kv)
            if kind == "causal":
                vis = None
            else:
                vis = _parents_to_visible(_random_parents(q, g, roots=kind == "forest"))
            positions = torch.arange(start, start + q) if kind == "causal" else start + vis.sum(1) - 1
            ref, ref_k, ref_v = _reference(qkv, positions, kc, vc, start, vis, nh, nkv, d)
            ref64, _, _ = _reference(qkv, positions, kc, vc, start, vis, nh, nkv, d, torch.float64)
            out = ops.attention(qkv, cos, sin, positions, kc, vc, start, vis, nh, nkv)
            assert out.shape == (q, nh * d) and out.dtype == torch.float32
            assert _rel(out, ref64) < 2e-6, (q, kind)
            assert _rel(out, ref) < 1e-5, (q, kind)
            # the cache writes are exactly LeanLlama's (same products and sums, torch's rounding to fp16), nothing
            # else touched
            assert kc.dtype == kv and torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


def test_attention_masks_and_edges(ops):
    nh, nkv, d = 9, 3, 64
    cos, sin = _tables(d)
    qkv, kc, vc, g = _inputs(6, 100, nh, nkv, d, seed=5)
    pos = torch.arange(100, 106)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    a = ops.attention(qkv, cos, sin, pos, kc.clone(), vc.clone(), 100, None, nh, nkv)
    b = ops.attention(qkv, cos, sin, pos, kc.clone(), vc.clone(), 100, causal, nh, nkv)
    assert torch.equal(a, b)
    # an arbitrary (non-tree, even non-causal) visibility pattern is honoured too
    vis = torch.rand(6, 6, generator=g) < 0.5
    vis[:, 0] = True
    ref, _, _ = _reference(qkv, pos, kc, vc, 100, vis, nh, nkv, d, torch.float64)
    assert _rel(ops.attention(qkv, cos, sin, pos, kc.clone(), vc.clone(), 100, vis, nh, nkv), ref) < 2e-6
    # a row that sees nothing at all (no prefix) gives zeros
    vis = torch.eye(3, dtype=torch.bool)
    vis[1, 1] = False
    out = ops.attention(qkv[:3], cos, sin, pos[:3], kc, vc, 0, vis, nh, nkv)
    assert torch.equal(out[1], torch.zeros(nh * d)) and out[0].abs().sum() > 0
    # no new tokens
    assert ops.attention(qkv[:0], cos, sin, pos[:0], kc, vc, 5, None, nh, nkv).shape == (0, nh * d)
    # a row sharply peaked on one key (large logits): softmax stays finite and exact-ish
    big = qkv.clone() * 40
    ref, _, _ = _reference(big, pos, kc, vc, 100, None, nh, nkv, d, torch.float64)
    out = ops.attention(big, cos, sin, pos, kc.clone(), vc.clone(), 100, None, nh, nkv)
    assert torch.isfinite(out).all() and _rel(out, ref) < 1e-5


# ---------------------------------------------------------------------------------------------------------------
# The bitwise property: row i among q tree tokens == token i alone over exactly its visible keys
# ---------------------------------------------------------------------------------------------------------------


def _ancestors(parents, i):
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def _check_alone(ops, parents, prefix, nh, nkv, d, seed, kv=torch.float32):
    q = len(parents)
    cos, sin = _tables(d)
    qkv, kc, vc, _ = _inputs(q, prefix, nh, nkv, d, seed, kv=kv)
    vis = _parents_to_visible(parents)
    positions = prefix + vis.sum(1) - 1  # prefix + depth
    out = ops.attention(qkv, cos, sin, positions, kc, vc, prefix, vis, nh, nkv)
    for i in range(q):
        path = _ancestors(parents, i)
        start = prefix + len(path) - 1
        k2 = torch.randn(nkv, start + 2, d).to(kv)  # junk beyond the visible slots must not matter
        v2 = torch.randn(nkv, start + 2, d).to(kv)
        k2[:, :prefix], v2[:, :prefix] = kc[:, :prefix], vc[:, :prefix]
        for n, j in enumerate(path[:-1]):  # the accepted path compacted into place
            k2[:, prefix + n], v2[:, prefix + n] = kc[:, prefix + j], vc[:, prefix + j]
        alone = ops.attention(qkv[i : i + 1], cos, sin, positions[i : i + 1], k2, v2, start, None, nh, nkv)
        assert torch.equal(alone[0], out[i]), (i, path, prefix)
        assert torch.equal(k2[:, start], kc[:, prefix + i]) and torch.equal(v2[:, start], vc[:, prefix + i])
    return out


@st.composite
def trees(draw, max_q=16):
    q = draw(st.integers(1, max_q))
    forest = draw(st.booleans())
    lo = -1 if forest else 0
    parents = [-1] + [draw(st.integers(lo, i - 1)) for i in range(1, q)]
    return parents


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    parents=trees(),
    prefix=st.one_of(st.sampled_from([0, 1, 63, 64, 127, 300, 1000]), st.integers(0, 200)),
    shape=st.sampled_from(SHAPES),
    seed=st.integers(0, 2**31 - 1),
    kv=st.sampled_from(KV_DTYPES),
)
def test_tree_rows_equal_alone(ops, parents, prefix, shape, seed, kv):
    _check_alone(ops, parents, prefix, *shape, seed, kv=kv)


@kv_dtypes
@pytest.mark.parametrize("prefix", [0, 62, 64, 1000])
def test_tree_rows_equal_alone_deep_and_wide(ops, prefix, kv):
    # a chain (every row's new keys straddle chunk boundaries as the prefix grows) and a star
    _check_alone(ops, list(range(-1, 15)), prefix, 9, 3, 64, seed=prefix, kv=kv)
    _check_alone(ops, [-1] + [0] * 15, prefix, 9, 3, 64, seed=prefix + 1, kv=kv)


@kv_dtypes
def test_compaction_by_static_cache_keep(ops, kv):
    """The real flow: verify a tree, keep the accepted path with StaticKVCache.keep, then decode the next token
    alone: its output equals the tree call's row for the same token and key set."""
    nh, nkv, d, prefix = 9, 3, 64, 500
    cos, sin = _tables(d)
    g = torch.Generator().manual_seed(7)
    parents = _random_parents(12, g)
    vis = _parents_to_visible(parents)
    positions = prefix + vis.sum(1) - 1
    cache = StaticKVCache(1, nkv, d, prefix + 40, dtype=kv)
    cache.k[0, :, :prefix] = torch.randn(nkv, prefix, d, generator=g)
    cache.v[0, :, :prefix] = torch.randn(nkv, prefix, d, generator=g)
    cache.length = prefix
    qkv = torch.randn(12, (nh + 2 * nkv) * d, generator=g)
    out = ops.attention(qkv, cos, sin, positions, cache.k[0], cache.v[0], prefix, vis, nh, nkv)
    leaf = max(range(12), key=lambda i: (int(vis[i].sum()), i))
    path = _ancestors(parents, leaf)
    cache.keep(path[:-1])  # accept all but the leaf; the leaf becomes the next token
    alone = ops.attention(
        qkv[leaf : leaf + 1], cos, sin, positions[leaf : leaf + 1], cache.k[0], cache.v[0], cache.length, None, nh, nkv
    )
    assert torch.equal(alone[0], out[leaf])


@kv_dtypes
@pytest.mark.parametrize("q,prefix", [(1, 1000), (4, 300), (16, 1000), (16, 0), (9, 77)])
def test_thread_count_independence(ops, q, prefix, kv):
    nh, nkv, d = 9, 3, 64
    cos, sin = _tables(d)
    g = torch.Generator().manual_seed(q + prefix)
    vis = _parents_to_visible(_random_parents(q, g))
    positions = prefix + vis.sum(1) - 1
    qkv, kc, vc, _ = _inputs(q, prefix, nh, nkv, d, seed=q, kv=kv)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(ops.attention(qkv, cos, sin, positions, kc.clone(), vc.clone(), prefix, vis, nh, nkv))
            x = torch.randn(q, 576, generator=torch.Generator().manual_seed(1))
            results.append(ops.rms_norm(x, torch.ones(576), 1e-5))
            results.append(ops.silu_mul(torch.randn(q, 3072, generator=torch.Generator().manual_seed(2))))
    finally:
        torch.set_num_threads(threads)
    for k in range(3):
        assert torch.equal(results[k], results[3 + k]) and torch.equal(results[k], results[6 + k])


@kv_dtypes
def test_rows_independent_of_batch(ops, kv):
    """Causal prefill in pieces: rows computed in one call equal rows computed in calls of other sizes (more than
    64 rows take several passes inside one call)."""
    nh, nkv, d, prefix, q = 9, 3, 64, 200, 150
    cos, sin = _tables(d)
    qkv, kc, vc, _ = _inputs(q, prefix, nh, nkv, d, seed=11, kv=kv)
    positions = torch.arange(prefix, prefix + q)
    whole = ops.attention(qkv, cos, sin, positions, kc.clone(), vc.clone(), prefix, None, nh, nkv)
    ref, _, _ = _reference(qkv, positions, kc, vc, prefix, None, nh, nkv, d, torch.float64)
    assert _rel(whole, ref) < 2e-6
    parts, s = [], prefix
    k2, v2 = kc.clone(), vc.clone()
    for n in (1, 3, 12, 70, 64):
        lo = s - prefix
        parts.append(ops.attention(qkv[lo : lo + n], cos, sin, positions[lo : lo + n], k2, v2, s, None, nh, nkv))
        s += n
    assert torch.equal(torch.cat(parts), whole)


# ---------------------------------------------------------------------------------------------------------------
# Argument errors
# ---------------------------------------------------------------------------------------------------------------


def test_errors(ops):
    nh, nkv, d = 4, 2, 16
    cos, sin = _tables(d)
    qkv, kc, vc, _ = _inputs(3, 10, nh, nkv, d, seed=0)
    pos = torch.arange(10, 13)

    def call(**kw):
        args = dict(
            qkv=qkv,
            cos=cos,
            sin=sin,
            positions=pos,
            k_cache=kc,
            v_cache=vc,
            start=10,
            visible=None,
            n_heads=nh,
            n_kv_heads=nkv,
        )
        args.update(kw)
        return ops.attention(**args)

    call()
    cases = [
        (dict(qkv=qkv.double()), "qkv must be float32"),
        (dict(qkv=qkv[:, :-1].contiguous()), "qkv has"),
        (dict(qkv=qkv.t().contiguous().t()), "qkv must be contiguous"),
        (dict(qkv=qkv[0]), "qkv must be 2-D"),
        (dict(k_cache=kc.transpose(0, 1).contiguous().transpose(0, 1)), "contiguous"),
        (dict(v_cache=vc[:, :-1].contiguous()), "differ in shape"),
        (dict(k_cache=kc[:1].contiguous(), v_cache=vc[:1].contiguous()), "n_kv_heads"),
        (dict(v_cache=kc), "same tensor"),
        (dict(positions=pos.int()), "positions must be"),
        (dict(positions=pos[:2]), "positions must be"),
        (dict(positions=pos + 5000), "outside the RoPE tables"),
        (dict(positions=pos - 20), "outside the RoPE tables"),
        (dict(start=14), "do not fit"),
        (dict(start=-1), "do not fit"),
        (dict(visible=torch.ones(3, 3)), "visible must be a bool"),
        (dict(visible=torch.ones(4, 3, dtype=torch.bool)), "visible must be a bool"),
        (dict(visible=torch.ones(3, 11, dtype=torch.bool)), "visible must be a bool"),  # past the capacity (16)
        (dict(write_slots=torch.tensor([11, 12, 13])), "give visible"),
        (dict(visible=torch.ones(3, 3, dtype=torch.bool), write_slots=torch.tensor([10, 10, 12])), "twice"),
        (dict(visible=torch.ones(3, 3, dtype=torch.bool), write_slots=torch.tensor([9, 11, 12])), "outside"),
        (dict(visible=torch.ones(3, 3, dtype=torch.bool), write_slots=torch.tensor([10, 11])), "write_slots must"),
        (dict(n_heads=3), "multiple of n_kv_heads"),
        (dict(n_kv_heads=0), "multiple of n_kv_heads"),
        (dict(cos=cos[:, :8].contiguous()), "cos"),
        (dict(sin=sin.double()), "sin must be float32"),
    ]
    odd = torch.zeros(nkv, 20, 15)
    cases.append((dict(k_cache=odd, v_cache=odd.clone()), "must be even"))
    cases.append((dict(k_cache=kc.bfloat16(), v_cache=vc.bfloat16()), "k_cache must be float32 or float16"))
    cases.append((dict(k_cache=kc.half()), "differ in dtype"))
    for kw, msg in cases:
        with pytest.raises(RuntimeError, match=msg):
            call(**kw)
            pytest.fail(f"no error for {sorted(kw)} ({msg})")
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="w has 7 elements"):
        ops.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        ops.rms_norm(x.double(), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="must be 2-D"):
        ops.rms_norm(x[0], torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="in place and must be contiguous"):
        ops.add_rms_norm(torch.randn(8, 2).t(), x, torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="delta has shape"):
        ops.add_rms_norm(x.clone(), x[:1], torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="even number of columns"):
        ops.silu_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="float32"):
        ops.silu_mul(torch.randn(2, 8).half())


@kv_dtypes
@pytest.mark.parametrize("shared", [False, True])
def test_attention_many_is_bitwise_each_sequence_alone(ops, shared, kv):
    """Several sequences' attention in one call (each its own rows, cache, prefix and mask) gives
    bitwise the per-sequence calls' outputs and cache writes -- also when two sequences share one cache tensor
    (then they run one after another)."""
    nh, nkv, d = 9, 3, 64
    cos, sin = _tables(d)
    layers, cap, layer = 2, 1200, 1
    specs = [(1, 300, None), (5, 70, "tree"), (3, 0, "causal"), (1, 1000, None), (8, 64, "tree")]
    qkvs, positions, starts, visible, slots, k_all, v_all = [], [], [], [], [], [], []
    g = torch.Generator().manual_seed(7)
    for q, start, kind in specs:
        qkvs.append(torch.randn(q, (nh + 2 * nkv) * d, generator=g))
        vis = None if kind is None else (torch.ones(q, q, dtype=torch.bool).tril() if kind == "causal" else
                                         _parents_to_visible(_random_parents(q, g)))
        positions.append(torch.arange(start, start + q) if vis is None else start + vis.sum(1) - 1)
        starts.append(start)
        visible.append(vis)
        slots.append(None)
        k_all.append(torch.randn(layers, nkv, cap, d, generator=g).to(kv))
        v_all.append(torch.randn(layers, nkv, cap, d, generator=g).to(kv))
    if shared:  # sequences 0 and 1 in one cache: 1's prefix and new slots sit past 0's writes
        k_all[1], v_all[1] = k_all[0], v_all[0]
        starts[1] = 400
        positions[1] = positions[1] - 70 + 400
    ref_k = [k.clone() for k in k_all]
    ref_v = [v.clone() for v in v_all]
    if shared:
        ref_k[1], ref_v[1] = ref_k[0], ref_v[0]
    alone = [ops.attention(qkvs[j], cos, sin, positions[j], ref_k[j][layer], ref_v[j][layer], starts[j], visible[j],
                           nh, nkv, slots[j]) for j in range(len(specs))]
    bounds = [0]
    for q in qkvs:
        bounds.append(bounds[-1] + q.shape[0])
    out = ops.attention_many(torch.cat(qkvs), bounds, cos, sin, positions, k_all, v_all, layer, starts, visible, nh,
                             nkv, slots)
    assert torch.equal(out, torch.cat(alone))
    for j in range(len(specs)):
        assert torch.equal(k_all[j], ref_k[j]) and torch.equal(v_all[j], ref_v[j])
    with pytest.raises(RuntimeError, match="one entry per sequence"):
        ops.attention_many(torch.cat(qkvs), bounds[:-1], cos, sin, positions, k_all, v_all, layer, starts, visible,
                           nh, nkv, slots)


# ---------------------------------------------------------------------------------------------------------------
# fp16 caches: rounded to nearest even when written, read back exactly
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nh,nkv,d", SHAPES)
@pytest.mark.parametrize("start", [0, 5, 64, 300])
def test_fp16_cache_is_the_fp32_arithmetic_of_its_rounded_values(ops, nh, nkv, d, start):
    """An fp16 cache computes, bit for bit, what an fp32 cache holding the same values computes: the fp16 call
    writes the new tokens' keys and values rounded; an fp32 call over the same values (its own, unrounded writes
    sent to slots no row sees, every row seeing the fp16 call's slots instead) gives the same rows. Its unrounded
    writes, rounded by torch, are the fp16 call's."""
    cos, sin = _tables(d)
    q = 7
    qkv, kc16, vc16, g = _inputs(q, start, nh, nkv, d, seed=start + d, extra=q, kv=torch.float16)
    vis = _parents_to_visible(_random_parents(q, g, roots=True))
    positions = start + vis.sum(1) - 1
    out16 = ops.attention(qkv, cos, sin, positions, kc16, vc16, start, vis, nh, nkv)
    kc32, vc32 = kc16.float(), vc16.float()  # the prefix and the fp16 call's writes, as fp32
    unseen = torch.arange(start + q, start + 2 * q)
    out32 = ops.attention(qkv, cos, sin, positions, kc32, vc32, start, vis, nh, nkv, unseen)
    assert torch.equal(out16, out32)
    new, unrounded_k, unrounded_v = slice(start, start + q), kc32[:, start + q :], vc32[:, start + q :]
    assert torch.equal(unrounded_k.half(), kc16[:, new]) and torch.equal(unrounded_v.half(), vc16[:, new])
    assert not torch.equal(unrounded_k, kc16[:, new].float())  # (the fp32 call's writes were not rounded)


@pytest.mark.parametrize("d", [16, 20, 64])
def test_fp16_writes_round_to_nearest_even_as_torch_does(ops, d):
    """Values are written as torch's ``.half()`` rounds them: ties to even, subnormals, overflow to inf, signed
    zeros, in full vectors and in the head_dim tail (d = 20: 8 + 8 + 4 on AVX2). v is written unrotated, so its
    cache row holds exactly the rounded input."""
    nh, nkv = 2, 1
    edge = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 2049.0, 2051.0, 65504.0, 65519.0, 65520.0,
                         -65520.0, 2**-24, 2**-25, 3 * 2**-26, 2**-14 - 2**-25, -0.0, 1e-9, 1.0 / 3.0])
    qkv = torch.randn(2, (nh + 2 * nkv) * d, generator=torch.Generator().manual_seed(d))
    qkv[0, (nh + nkv) * d :] = edge.repeat(d // 16 + 1)[:d]
    qkv[1, (nh + nkv) * d :] = edge.flip(0).repeat(d // 16 + 1)[:d]
    cos, sin = _tables(d)
    kc = torch.zeros(nkv, 4, d, dtype=torch.float16)
    vc = torch.zeros(nkv, 4, d, dtype=torch.float16)
    ops.attention(qkv, cos, sin, torch.tensor([0, 1]), kc, vc, 0, None, nh, nkv)
    _, kh, vh = _split_rope(qkv, torch.tensor([0, 1]), nh, nkv, d)
    want_v = vh.half()
    assert torch.equal(vc[:, :2].view(torch.int16), want_v.view(torch.int16))  # bit patterns: -0.0 and inf too
    assert torch.equal(kc[:, :2], kh.half())
    assert vc[0, 0, 7].item() == float("inf") and vc[0, 0, 0].item() == 1.0  # 65520 overflows, 1 + 2^-11 ties to 1


def test_fp16_and_fp32_caches_are_close_but_not_equal(ops):
    """The same attention over an fp32 cache and over that cache rounded to fp16: another model's outputs, within
    fp16's precision of each other."""
    nh, nkv, d, start, q = 9, 3, 64, 300, 5
    cos, sin = _tables(d)
    qkv, kc, vc, g = _inputs(q, start, nh, nkv, d, seed=3)
    vis = _parents_to_visible(_random_parents(q, g))
    positions = start + vis.sum(1) - 1
    out32 = ops.attention(qkv, cos, sin, positions, kc.clone(), vc.clone(), start, vis, nh, nkv)
    out16 = ops.attention(qkv, cos, sin, positions, kc.half(), vc.half(), start, vis, nh, nkv)
    assert 0 < _rel(out16, out32) < 2e-3
