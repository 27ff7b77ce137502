"""``fastforward profile``: what one target forward costs per number of new tokens, on this machine.

The cost curve t(q) decides how large a draft tree may be: a proposer pays t(q)/t(1) for a verification over q
tokens and must win more than that in accepted tokens.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time

import torch

DEFAULT_QS = (1, 2, 4, 8, 16, 32, 64)


def _time_forward(target, cache, q: int, kv: int, repeats: int, hf: bool) -> float:
    ids = torch.randint(0, target.vocab_size, (q,))
    pos = torch.arange(kv, kv + q)
    times = []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        if hf:
            _hf_forward(target, cache, ids, pos)
        else:
            target.forward(ids, pos, cache)
        if i >= 2:  # warm-up excluded
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def _hf_forward(target, cache, ids, pos):
    """HF's own forward as users call it (``model(...)`` with a DynamicCache), cropping back after each call."""
    from .model import _full_mask

    q, kv = ids.numel(), pos[0].item()
    allowed = _full_mask(q, kv, None)
    mask = torch.zeros(1, 1, q, kv + q).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    with torch.inference_mode():
        target.hf_model(input_ids=ids[None], position_ids=pos[None], attention_mask=mask, past_key_values=cache,
                        use_cache=True)
    cache.crop(-q)  # transformers 5.x: a negative count of tokens to remove


def _prefilled_cache(target, kv: int, capacity: int, hf: bool):
    ids = torch.randint(0, target.vocab_size, (kv,))
    if hf:
        from transformers import DynamicCache

        cache = DynamicCache()
        with torch.inference_mode():
            target.hf_model(input_ids=ids[None], past_key_values=cache, use_cache=True)
        return cache
    cache = target.new_cache(capacity)
    target.forward(ids, torch.arange(kv), cache, last_only=True)
    cache.keep(range(kv))
    return cache


def measure_forward_costs(target, qs=DEFAULT_QS, kv: int = 300, repeats: int = 7, hf: bool = False) -> dict:
    """Median milliseconds of one forward over q new tokens on a kv-token cache, for each q (interleaved sweeps)."""
    qs = sorted(set(int(q) for q in qs))
    if not qs or qs[0] < 1:
        raise ValueError("q values must be >= 1")
    if kv + qs[-1] > target.max_context:
        raise ValueError(f"kv + q = {kv + qs[-1]} exceeds the model's context {target.max_context}")
    cache = _prefilled_cache(target, kv, kv + qs[-1] + 1, hf)
    samples = {q: [] for q in qs}
    rounds = 3  # interleave q values so slow drifts (thermal, other processes) hit all of them alike
    for _ in range(rounds):
        for q in qs:
            samples[q].append(_time_forward(target, cache, q, kv, max(1, repeats // rounds + 1), hf))
    return {q: statistics.median(v) for q, v in samples.items()}


def llama_cpp_forward_costs(gguf, qs, kv: int = 300, repeats: int = 7, threads: int | None = None) -> dict:
    """Median milliseconds of one ``Llama.eval`` (llama.cpp's ``llama_decode``) of q tokens on a kv-token cache of
    the same GGUF file, for each q: llama.cpp's own cost curve, measured the same way as ours."""
    from .bench.peers import require_llama_cpp

    require_llama_cpp()
    from llama_cpp import Llama

    threads = threads or torch.get_num_threads()
    llm = Llama(model_path=str(gguf), n_ctx=kv + max(qs) + 16, n_batch=max(512, max(qs)), n_threads=threads,
                n_threads_batch=threads, verbose=False, logits_all=False)
    g = torch.Generator().manual_seed(0)
    vocab = llm.n_vocab()
    llm.eval(torch.randint(0, vocab, (kv,), generator=g).tolist())
    samples = {q: [] for q in qs}
    for _ in range(3):
        for q in qs:
            tokens = torch.randint(0, vocab, (q,), generator=g).tolist()
            for i in range(max(1, repeats // 3 + 1) + 1):
                llm.n_tokens = kv  # eval() drops cache entries from n_tokens on: back to the kv-token prefix
                t0 = time.perf_counter()
                llm.eval(tokens)
                if i:
                    samples[q].append((time.perf_counter() - t0) * 1000)
    llm.close()
    return {q: statistics.median(v) for q, v in samples.items()}


def add_arguments(p, name: str) -> None:
    from .cli_generate import add_model_arguments

    add_model_arguments(p)
    p.add_argument("--q", default=",".join(map(str, DEFAULT_QS)), help="new-token counts (default: %(default)s)")
    p.add_argument("--kv", type=int, default=300, help="tokens already in the KV cache (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=15, help="timed forwards per q (default: %(default)s)")
    p.add_argument("--no-hf", action="store_true", help="skip HF's own forward (measured side by side by default)")
    p.add_argument("--llama-cpp", action="store_true",
                   help="also measure llama.cpp on the same GGUF file (needs llama-cpp-python)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args, name: str) -> int:
    import fastforward as ff

    from .errors import UsageError

    try:
        qs = [int(x) for x in args.q.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--q takes comma-separated integers, got '{args.q}'") from None
    if not qs or min(qs) < 1:
        raise UsageError("--q values must be >= 1")
    if args.kv < 1 or args.repeats < 1:
        raise UsageError("--kv and --repeats must be >= 1")
    gguf = None
    if args.llama_cpp:
        from .bench.peers import gguf_path, require_llama_cpp

        gguf = gguf_path(args.model)
        require_llama_cpp()
    target = ff.load(args.model, backend=args.backend, threads=args.threads,
                     weights=getattr(args, "weights", "auto"))
    try:
        lean = measure_forward_costs(target, qs, args.kv, args.repeats)
        hf = None if args.no_hf else measure_forward_costs(target, qs, args.kv, args.repeats, hf=True)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    llama = None if gguf is None else llama_cpp_forward_costs(gguf, qs, args.kv, args.repeats)
    info = {
        "model": args.model, "backend": target.backend_name, "kv": args.kv, "threads": torch.get_num_threads(),
        "matmul": getattr(target.backend, "matmul_kernel", "hf"),
        "torch": torch.__version__, "python": sys.version.split()[0], "cpu": platform.processor() or platform.machine(),
    }
    if args.json:
        print(json.dumps({"info": info, "ms": {"engine": lean, "hf": hf, "llama.cpp": llama}}))
        return 0
    print(f"forward cost, median ms, KV cache {args.kv} tokens, {info['threads']} threads, "
          f"backend {target.backend_name}, matmul {info['matmul']}, torch {torch.__version__}")
    print("| q new tokens | " + " | ".join(str(q) for q in qs) + " |")
    print("|---|" + "---|" * len(qs))
    print(f"| fastforward ({target.backend_name}) | " + " | ".join(f"{lean[q]:.1f}" for q in qs) + " |")
    if hf:
        print("| HF `model(...)` | " + " | ".join(f"{hf[q]:.1f}" for q in qs) + " |")
    if llama:
        print("| llama.cpp `Llama.eval` (same GGUF) | " + " | ".join(f"{llama[q]:.1f}" for q in qs) + " |")
    base = lean[qs[0]]
    print(f"| fastforward t(q)/t({qs[0]}) | " + " | ".join(f"{lean[q] / base:.2f}" for q in qs) + " |")
    if llama:
        print(f"| llama.cpp t(q)/t({qs[0]}) | " + " | ".join(f"{llama[q] / llama[qs[0]]:.2f}" for q in qs) + " |")
    return 0
