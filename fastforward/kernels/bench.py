"""Benchmark of the all-layers linear stack of the default model (SmolLM2-135M shapes, random fp32 weights).

    python -m fastforward.kernels.bench [--m 1,2,4,8,16,32] [--rounds 9] [--threads 2] [--quiet-only]

For each M, one "stack" is every weight matmul of one decoder forward (30 x qkv, o, gate|up, down, plus the LM head)
on M rows, timed as MKL ``x @ W`` ([in, out] weights), MKL ``F.linear`` ([out, in] weights) and ``skinny_mm``.
Variants and M values are interleaved round by round so drifts hit all of them alike; the table gives medians and,
as the noise, the 25th-75th percentile range. On a shared machine the CPU time other processes used during each
round is measured (from /proc/stat); ``--quiet-only`` keeps only rounds in which they used < 0.1 cores, waiting
for such rounds up to ``--max-wait`` seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

# (in, out) of one decoder layer's fused weights, layers, and the LM head.
LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
N_LAYERS = 30
HEAD = (576, 49152)


def make_weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = LAYER_SHAPES * N_LAYERS + [HEAD]
    in_out = [torch.randn(k, n, generator=g) * k**-0.5 for k, n in shapes]
    out_in = [w.t().contiguous() for w in in_out]
    return in_out, out_in


def stack_time(fn, xs, ws) -> float:
    t0 = time.perf_counter()
    for x, w in zip(xs, ws, strict=True):
        fn(x, w)
    return (time.perf_counter() - t0) * 1000


class OtherLoad:
    """CPU cores used by other processes between start() and stop() (None where /proc is missing)."""

    @staticmethod
    def _snap():
        try:
            with open("/proc/stat") as f:
                cpu = [int(v) for v in f.readline().split()[1:9]]
            with open("/proc/self/stat") as f:
                own = f.read().rsplit(")", 1)[1].split()
            return sum(cpu) - cpu[3] - cpu[4], int(own[11]) + int(own[12]), time.perf_counter()
        except (OSError, ValueError, IndexError):
            return None

    def start(self):
        self.a = self._snap()

    def stop(self) -> float | None:
        b = self._snap()
        if self.a is None or b is None:
            return None
        busy = (b[0] - self.a[0]) - (b[1] - self.a[1])
        return busy / os.sysconf("SC_CLK_TCK") / max(1e-6, b[2] - self.a[2])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", default="1,2,4,8,16,32")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quiet-only", action="store_true", help="keep only rounds other processes left alone")
    p.add_argument("--max-wait", type=float, default=900, help="seconds to wait for quiet rounds")
    p.add_argument("--no-mkl", action="store_true", help="time only the kernel")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from . import kernel_name, load_kernel

    kernel = load_kernel()
    ms = [int(v) for v in args.m.split(",")]
    in_out, out_in = make_weights()
    variants = {}
    if not args.no_mkl:
        variants["MKL x @ W"] = (lambda x, w: x @ w, in_out)
        variants["MKL F.linear"] = (F.linear, out_in)
    if kernel is not None:
        variants[kernel_name()] = (kernel, in_out)
    xs = {m: [torch.randn(m, w.shape[0]) for w in in_out] for m in ms}
    samples = {(v, m): [] for v in variants for m in ms}
    loads, dropped, meter, t_start = [], 0, OtherLoad(), time.perf_counter()
    with torch.inference_mode():
        for m in ms:  # warm-up
            for fn, ws in variants.values():
                stack_time(fn, xs[m], ws)
        r = 0
        while len(loads) < args.rounds:
            if args.quiet_only and time.perf_counter() - t_start > args.max_wait:
                break
            order = ms[r % len(ms):] + ms[: r % len(ms)]
            r += 1
            meter.start()
            got = {(v, m): stack_time(fn, xs[m], ws) for m in order for v, (fn, ws) in variants.items()}
            load = meter.stop()
            if args.quiet_only and load is not None and load >= 0.1:
                dropped += 1
                time.sleep(1)
                continue
            loads.append(load)
            for key, t in got.items():
                samples[key].append(t)
    n = len(loads)
    known = [v for v in loads if v is not None]
    load_txt = f"{statistics.mean(known):.2f} cores on average (max {max(known):.2f})" if known else "unknown"
    print(f"all-layer linear stack, ms (median [p25-p75] of {n} interleaved rounds), {torch.get_num_threads()} "
          f"threads; other processes used {load_txt}" + (f"; {dropped} busier rounds dropped" if dropped else ""))
    if n < 2:
        print("(too few rounds)")
        return
    print("| variant | " + " | ".join(f"M={m}" for m in ms) + " |")
    print("|---|" + "---|" * len(ms))
    for v in variants:
        cells = []
        for m in ms:
            q = statistics.quantiles(samples[(v, m)], n=4)
            cells.append(f"{statistics.median(samples[(v, m)]):.1f} [{q[0]:.1f}-{q[2]:.1f}]")
        print(f"| {v} | " + " | ".join(cells) + " |")
    if kernel is not None:
        v = kernel_name()
        base = statistics.median(samples[(v, ms[0])])
        print(f"| {v} t(M)/t({ms[0]}) | " + " | ".join(f"{statistics.median(samples[(v, m)]) / base:.2f}"
                                                   for m in ms) + " |")


if __name__ == "__main__":
    main()
