"""Where one lean forward's time goes, per number of new tokens: every phase of the forward timed on its own with
the model's real weights and shapes, beside the whole forward, all interleaved round by round in one process.

    python scripts/forward_phases.py --model smollm2-135m --q 1,8,16 --kv 300 --rounds 15 --threads 2

Phases (each summed over the forward's calls, median ms over the rounds):

* ``<weight>``: the native product of each weight kind (every layer's qkv, o, gate|up, down; the LM head) on q
  random rows: ``quant_mm`` as the forward calls it (one call per layer);
* ``attention``: RoPE, the KV write and attention of q rows over a ``--kv``-token cache, per layer;
* ``norms + silu``: the fused residual add + RMSNorm (twice a layer) and SiLU * up;
* ``call floor``: the same number of products on a weight of 16 rows x 32 inputs: what a call costs beside its
  work (Python and pybind, allocation, the parallel regions);
* ``quantise``: the activation rows' 8-bit blocks alone (``q8_quantize``, q8 arithmetic only; its copies out
  included, so an upper bound);
* ``forward``: ``target.forward`` over q tokens (the profile's forward), and ``sum`` the phases' sum.

The per-row cost of each phase is (t(q_max) - t(q_min)) / (q_max - q_min); with ``--clock GHZ`` the multiply-adds
per cycle per core the products reach on an extra row.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--q", default="1,8,16", help="new tokens per forward, comma-separated")
    parser.add_argument("--kv", type=int, default=300, help="tokens already in the cache")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", type=float, default=None, help="the cores' clock in GHz (for MAC/cycle)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time in CPU seconds of this process instead of wall time (with --threads 1: what "
                             "other load on the machine leaves unchanged)")
    args = parser.parse_args(argv)
    qs = sorted({int(v) for v in args.q.split(",") if v.strip()})
    if not qs or qs[0] < 1 or qs[-1] > 1024:
        parser.error("--q: new tokens in [1, 1024]")
    if not 1 <= args.rounds <= 1000 or not 1 <= args.threads <= 256 or not 1 <= args.kv <= 100_000:
        parser.error("--rounds in [1, 1000], --threads in [1, 256], --kv in [1, 100000]")
    torch.set_num_threads(args.threads)

    import fastforward as ff
    from fastforward.linear import PackedLinear

    target = ff.load(args.model)
    lean = target.backend
    ops = lean.ops
    if ops is None or not all(isinstance(w, PackedLinear) and w.native is not None for w in lean.matmul_weights()):
        parser.error(f"{args.model}: needs the lean forward on packed weights and the native layer ops")
    native = lean.head.native
    layers = lean.layers
    kinds = {"qkv": [layer.qkv for layer in layers], "o": [layer.o for layer in layers],
             "gate|up": [layer.gate_up for layer in layers], "down": [layer.down for layer in layers],
             "head": [lean.head]}
    cap = args.kv + qs[-1] + 1
    cache = target.new_cache(cap)
    with torch.inference_mode():
        target.forward(torch.randint(0, target.vocab_size, (args.kv,)), torch.arange(args.kv), cache, last_only=True)
    cache.keep(range(args.kv))
    floor_w = PackedLinear(torch.zeros(16, 34, dtype=torch.uint8) + 1, 8, 32, native=native,
                           arithmetic=lean.arithmetic)
    g = torch.Generator().manual_seed(0)
    xs = {q: {k: [torch.randn(q, w.in_features, generator=g) for w in ws] for k, ws in kinds.items()} for q in qs}
    nh, nkv, d = lean.n_heads, lean.n_kv_heads, lean.head_dim
    qkv_rows = {q: torch.randn(q, (nh + 2 * nkv) * d, generator=g) for q in qs}
    hidden = {q: torch.randn(q, lean.hidden_size, generator=g) for q in qs}
    gu_rows = {q: torch.randn(q, 2 * lean.intermediate_size, generator=g) for q in qs}

    clock = time.process_time if args.cpu_time else time.perf_counter

    def timed(fn) -> float:
        t0 = clock()
        fn()
        return (clock() - t0) * 1e3

    def phases(q):
        out = {}
        for k, ws in kinds.items():
            out[k] = timed(lambda k=k, ws=ws: [w(x) for w, x in zip(ws, xs[q][k], strict=True)])
        pos = torch.arange(args.kv, args.kv + q)

        def attend():
            for i in range(len(layers)):
                ops.attention(qkv_rows[q], lean.cos, lean.sin, pos, cache.k[i], cache.v[i], args.kv, None, nh, nkv)
        out["attention"] = timed(attend)
        x = hidden[q].clone()

        def norms():
            for layer in layers:
                ops.add_rms_norm(x, hidden[q], layer.post_norm, lean.eps)
                ops.silu_mul(gu_rows[q])
                ops.add_rms_norm(x, hidden[q], layer.in_norm, lean.eps)
        out["norms + silu"] = timed(norms)
        n_calls = sum(len(ws) for ws in kinds.values())
        x1 = torch.randn(q, 32, generator=g)
        out["call floor"] = timed(lambda: [floor_w(x1) for _ in range(n_calls)])
        if lean.arithmetic == "q8":
            # a stacked weight (mixed formats: Q4_K_M's attn_v in Q6_K beside a Q4_K attn_q) quantises per part
            out["quantise"] = timed(lambda: [native.q8_quantize(x, part.fmt) for k, ws in kinds.items()
                                             for w, x in zip(ws, xs[q][k], strict=True)
                                             for part in getattr(w, "parts", [w])])
        ids = torch.randint(0, target.vocab_size, (q,))
        with torch.inference_mode():
            out["forward"] = timed(lambda: target.forward(ids, pos, cache))
        return out

    samples = {}
    with torch.inference_mode():
        for q in qs:  # warm-up
            phases(q)
        for r in range(args.rounds):
            for q in qs[r % len(qs):] + qs[: r % len(qs)]:
                for k, v in phases(q).items():
                    samples.setdefault((k, q), []).append(v)
    names = list(dict.fromkeys(k for k, _ in samples))
    med = {key: statistics.median(v) for key, v in samples.items()}
    summed = [n for n in names if n not in ("forward", "quantise", "call floor")]
    macs = {k: sum(w.out_features * w.in_features for w in ws) for k, ws in kinds.items()}
    print(f"{args.model}: arithmetic {lean.arithmetic}, matmul {lean.matmul_kernel}, KV cache {args.kv} tokens "
          f"({target.kv_precision}), {args.threads} threads; median {'CPU ' if args.cpu_time else ''}ms of "
          f"{args.rounds} interleaved rounds")
    lo, hi = qs[0], qs[-1]
    print("| phase | " + " | ".join(f"q={q}" for q in qs) + f" | per extra row ({lo}->{hi}) |"
          + (" MAC/cycle/core |" if args.clock else ""))
    print("|---|" + "---:|" * (len(qs) + 1 + bool(args.clock)))
    for n in names + ["sum"]:
        vals = {q: sum(med[(k, q)] for k in summed) if n == "sum" else med[(n, q)] for q in qs}
        row = (vals[hi] - vals[lo]) / (hi - lo) if hi > lo else float("nan")
        cells = [f"{vals[q]:.2f}" for q in qs] + [f"{row:.3f}"]
        if args.clock:
            m = sum(macs.values()) if n in ("sum", "forward") else macs.get(n)
            rate = m / (row * 1e-3) / (args.clock * 1e9) / args.threads if m and row > 0 else None
            cells.append("" if rate is None else f"{rate:.1f}")
        print(f"| {n} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
