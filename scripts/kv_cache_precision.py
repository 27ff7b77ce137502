"""Time one decoding forward with an fp32 and an fp16 KV cache, side by side in one process.

For each cache length: one sequence's one-token forward, and a batch step of several sequences (one new token each,
each over its own cache), the two precisions' calls alternated so that both see the same machine state. Prints the
median milliseconds and the fp16 / fp32 ratio.

    python scripts/kv_cache_precision.py --model FILE.gguf --threads 2 --kv 300,1000,2000 --batch 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fastforward as ff
from fastforward.model.forward import ForwardRequest


def filled_cache(lean, length: int, generator: torch.Generator):
    """A cache whose first ``length`` slots hold random keys and values (their values do not change the cost)."""
    cache = lean.new_cache(length + 8)
    cache.k[:, :, :length] = torch.randn(cache.k[:, :, :length].shape, generator=generator).to(cache.k.dtype)
    cache.v[:, :, :length] = torch.randn(cache.v[:, :, :length].shape, generator=generator).to(cache.v.dtype)
    cache.length = length
    return cache


def step(lean, caches, token: int):
    """One new token per cache, all in one forward; nothing is committed, so the caches stay as they were."""
    requests = [ForwardRequest(torch.tensor([token]), torch.tensor([c.length]), c) for c in caches]
    if len(requests) == 1:
        r = requests[0]
        return lean.forward(r.ids, r.positions, r.cache, last_only=True)
    return lean.forward_many(requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--arithmetic", default="auto", choices=["auto", "exact", "q8"])
    parser.add_argument("--kv", default="300,1000,2000", help="cache lengths")
    parser.add_argument("--batch", type=int, default=8, help="sequences in the batch step")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    lengths = [int(x) for x in args.kv.split(",")]
    precisions = ("fp32", "fp16")
    leans = {p: ff.load(args.model, threads=args.threads, arithmetic=args.arithmetic, kv_cache=p).backend
             for p in precisions}
    gen = torch.Generator().manual_seed(0)
    print(f"model {args.model}, {args.threads} threads, arithmetic {args.arithmetic}; median ms of {args.repeats}")
    print(f"{'cache':>6} {'sequences':>9} {'fp32 ms':>8} {'fp16 ms':>8} {'fp16/fp32':>9}")
    for length in lengths:
        for n in (1, args.batch):
            caches = {p: [filled_cache(leans[p], length, gen) for _ in range(n)] for p in precisions}
            times = {p: [] for p in precisions}
            for p in precisions:  # warm-up
                step(leans[p], caches[p], 5)
            for _ in range(args.repeats):
                for p in precisions:
                    t0 = time.perf_counter()
                    step(leans[p], caches[p], 5)
                    times[p].append(time.perf_counter() - t0)
            ms = {p: 1000 * statistics.median(times[p]) for p in precisions}
            print(f"{length:>6} {n:>9} {ms['fp32']:>8.2f} {ms['fp16']:>8.2f} {ms['fp16'] / ms['fp32']:>9.3f}")


if __name__ == "__main__":
    main()
