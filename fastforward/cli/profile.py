"""``fastforward profile``: what one target forward costs per number of new tokens, on this machine.

The cost curve t(q) decides how large a draft tree may be: a proposer pays t(q)/t(1) for a verification over q
tokens and must win more than that in accepted tokens. The measuring is :mod:`fastforward.costs`' (ours and HF's
forward) and :mod:`fastforward.bench.peers`' (llama.cpp's).
"""

from __future__ import annotations

import json
import platform
import sys

import torch

import fastforward as ff

from ..bench.peers import gguf_path, llama_cpp_forward_costs, llama_cpp_system_info, require_llama_cpp
from ..costs import DEFAULT_QS, measure_forward_costs
from ..errors import UsageError
from ..kernels import load_native
from ..machine import achieved_bandwidth, forward_read_bytes, measure_read_bandwidth
from .options import add_model_arguments, max_new_tokens, model_load_kwargs, positive_int

DEFAULTS = {"q": ",".join(map(str, DEFAULT_QS)), "kv": 300, "repeats": 15}
STREAM_DEFAULTS = {"stop": "<<never-in-the-text>>", "method": "ar",
                   "prompt": "Count from 1 to 2000, separated by commas: 1, 2, 3,"}
CURVE_ONLY = {"--q": "q", "--kv": "kv", "--repeats": "repeats", "--no-hf": "no_hf", "--llama-cpp": "llama_cpp"}
MAX_CONTEXT_LIST = 8  # prompt lengths per --context run
MAX_CONTEXT_TOKENS = 131072  # the longest --context prompt (the longest context of the models users run)
STREAM_ONLY = {"--stop": "stop", "--method": "method", "--prompt": "prompt"}


def add_arguments(p, name: str) -> None:
    add_model_arguments(p)
    p.add_argument("--q", default=None, help=f"new-token counts (default: {DEFAULTS['q']})")
    p.add_argument("--kv", type=positive_int, default=None,
                   help=f"tokens already in the KV cache (default: {DEFAULTS['kv']})")
    p.add_argument("--repeats", type=positive_int, default=None,
                   help=f"timed forwards per q (default: {DEFAULTS['repeats']})")
    p.add_argument("--no-hf", action="store_true", help="skip HF's own forward (measured side by side by default)")
    p.add_argument("--llama-cpp", action="store_true",
                   help="also measure llama.cpp on the same GGUF file (needs llama-cpp-python)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--stream", type=max_new_tokens, default=None, metavar="N",
                   help="instead: stream N tokens with a stop string (--stop) and print the time per step at tokens "
                        "100 and N-100: the work per step must not grow with the generation")
    p.add_argument("--context", default=None, metavar="N[,N...]",
                   help="instead: read a prompt of N random tokens and decode 32 tokens after it, for each N: prefill "
                        "and decode tokens/s (with --llama-cpp, llama.cpp's on the same ids; --repeats runs each, "
                        "default 2)")
    p.add_argument("--stop", default=None, help="with --stream: the stop string watched for")
    p.add_argument("--method", default=None, help="with --stream: the decoding method (default: ar)")
    p.add_argument("--prompt", default=None, help="with --stream: the prompt, fed without the chat template")


def _given(args, flags: dict) -> list[str]:
    """Which of ``flags`` (``{flag: dest}``) the command line set (store_true flags: when true)."""
    return [flag for flag, dest in flags.items() if getattr(args, dest) not in (None, False)]


def _fill(args, defaults: dict) -> None:
    for dest, value in defaults.items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)


def parse_qs(text: str) -> list[int]:
    """``--q``: distinct comma-separated integers >= 1."""
    try:
        qs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--q takes comma-separated integers, got '{text}'") from None
    if not qs or min(qs) < 1:
        raise UsageError("--q values must be >= 1")
    if len(set(qs)) != len(qs):
        raise UsageError(f"--q lists a value twice: '{text}'")
    return qs


def run(args, name: str) -> int:
    if args.stream is not None:
        wrong = _given(args, CURVE_ONLY | {"--context": "context"})
        if wrong:
            raise UsageError(f"{', '.join(wrong)} cannot be combined with --stream (it times streamed steps)")
        _fill(args, STREAM_DEFAULTS)
        return _run_stream(args)
    if args.context is not None:
        wrong = _given(args, {k: v for k, v in CURVE_ONLY.items() if k not in ("--llama-cpp", "--repeats")}
                       | STREAM_ONLY)
        if wrong:
            raise UsageError(f"{', '.join(wrong)} cannot be combined with --context")
        return _run_context(args)
    wrong = _given(args, STREAM_ONLY)
    if wrong:
        raise UsageError(f"{', '.join(wrong)} {'applies' if len(wrong) == 1 else 'apply'} to --stream only")
    _fill(args, DEFAULTS)
    qs = parse_qs(args.q)
    gguf = None
    if args.llama_cpp:
        gguf = gguf_path(args.model)
        require_llama_cpp()
    target = ff.load(args.model, **model_load_kwargs(args))
    try:
        lean = measure_forward_costs(target, qs, args.kv, args.repeats)
        hf = None if args.no_hf else measure_forward_costs(target, qs, args.kv, args.repeats, hf=True)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    llama = None if gguf is None else llama_cpp_forward_costs(gguf, qs, args.kv, args.repeats)
    info = {
        "model": args.model, "backend": target.backend_name, "kv": args.kv, "threads": torch.get_num_threads(),
        "matmul": getattr(target.backend, "matmul_kernel", "hf"), "kv_cache": target.kv_precision,
        "arithmetic": target.arithmetic, "torch": torch.__version__, "python": sys.version.split()[0],
        "cpu": platform.processor() or platform.machine(),
    }
    if gguf is not None:
        info["llama_cpp_system_info"] = llama_cpp_system_info()
    memory = memory_use(target, qs, args.kv, lean)
    rows = row_costs(target, qs, lean, llama, info["threads"])
    if args.json:
        print(json.dumps({"info": info, "ms": {"engine": lean, "hf": hf, "llama.cpp": llama}, "memory": memory,
                          "extra_rows": rows}))
        return 0
    print(f"forward cost, median ms, KV cache {args.kv} tokens ({target.kv_precision}), {info['threads']} threads, "
          f"backend {target.backend_name}, arithmetic {target.arithmetic}, matmul {info['matmul']}, "
          f"torch {torch.__version__}")
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
    print(describe_row_costs(rows, qs, llama is not None))
    if memory.get("weight_gb_per_s"):
        print("| fastforward weights read, GB/s (% of measured) | " + " | ".join(
            f"{memory['weight_gb_per_s'][q]:.1f} ({100 * memory['weight_fraction_of_bandwidth'][q]:.0f}%)"
            for q in qs) + " |")
    print(describe_memory(memory))
    if gguf is not None:
        print(f"llama.cpp system_info: {info['llama_cpp_system_info'] or '(not available)'}")
    return 0


def weight_macs(backend) -> int | None:
    """Multiply-adds of one row through the forward's weight products (every layer's and the head's), or None for a
    backend that does not list its weights."""
    weights = getattr(backend, "matmul_weights", None)
    if weights is None:
        return None
    return sum(int(w.out_features) * int(w.in_features) for w in weights())


def row_costs(target, qs: list[int], lean: dict, llama: dict | None, threads: int) -> dict:
    """What one more row of a forward costs, per q after the first: ``ms_per_row`` (t(q) - t(q_prev)) / (q - q_prev)
    (ours and llama.cpp's), the multiply-adds per cycle per core those rows' weight products reach
    (``macs_per_cycle``: the products' multiply-adds per row over the marginal time, this core's measured clock and
    the threads) beside ``peak_macs_per_cycle``, the kernel's dot instruction at full rate here (measured), and the
    kernel each q's products run on (``kernel``)."""
    qs = sorted(qs)
    native = load_native()
    arithmetic = getattr(target, "arithmetic", "exact")
    matmul = getattr(target.backend, "matmul_kernel", "hf")
    q8_path = getattr(native, "q8_kernel_path", None) if arithmetic == "q8" else None
    out = {"macs_per_row": weight_macs(target.backend), "kernel": {q: q8_path(q) if q8_path else matmul for q in qs}}
    peak = native.q8_dot_peak() if native is not None and hasattr(native, "q8_dot_peak") else None
    out["ghz"] = None if peak is None else peak["ghz"]
    out["peak_macs_per_cycle"] = None if peak is None or arithmetic != "q8" else peak["macs_per_cycle"]
    out["peak_instruction"] = None if peak is None or arithmetic != "q8" else peak["instruction"]
    for name, ms in (("fastforward", lean), ("llama.cpp", llama)):
        if ms is None:
            continue
        per_row = {q: (ms[q] - ms[p]) / (q - p) for p, q in zip(qs, qs[1:], strict=False)}
        rate = {}
        for q, t in per_row.items():
            if out["macs_per_row"] and out["ghz"] and t > 0:
                rate[q] = out["macs_per_row"] / (t * 1e-3) / (out["ghz"] * 1e9) / max(1, threads)
            else:
                rate[q] = None
        out[name] = {"ms_per_row": per_row, "macs_per_cycle": rate}
    return out


def describe_row_costs(rows: dict, qs: list[int], with_llama: bool) -> str:
    """Table rows (the marginal ms of a row, the multiply-adds per cycle per core it reaches, the kernel per q) and
    one line on the peak they compare with."""
    qs = sorted(qs)
    lines = []
    names = ["fastforward"] + (["llama.cpp"] if with_llama else [])
    for name in names:
        got = rows.get(name)
        if got is None:
            continue
        lines.append(f"| {name} ms per extra row (from the previous q) | " + " | ".join(
            "–" if q not in got["ms_per_row"] else f"{got['ms_per_row'][q]:.3f}" for q in qs) + " |")
        if rows["macs_per_row"] and rows["ghz"]:
            lines.append(f"| {name} multiply-adds per cycle per core, extra rows | " + " | ".join(
                "–" if got["macs_per_cycle"].get(q) is None else f"{got['macs_per_cycle'][q]:.1f}" for q in qs) + " |")
    lines.append("| fastforward kernel | " + " | ".join(str(rows["kernel"][q]) for q in qs) + " |")
    if rows["macs_per_row"]:
        line = f"weight products: {rows['macs_per_row'] / 1e6:.1f} M multiply-adds a row"
        if rows["ghz"]:
            line += f"; this core's clock {rows['ghz']:.2f} GHz (measured)"
        if rows["peak_macs_per_cycle"]:
            line += (f"; the kernel's dot instruction ({rows['peak_instruction']}) peaks at "
                     f"{rows['peak_macs_per_cycle']:.1f} multiply-adds per cycle per core here (measured)")
        lines.append(line)
    return "\n".join(lines)


def parse_context(text: str) -> list[int]:
    """``--context``: distinct comma-separated prompt lengths >= 1 (at most :data:`MAX_CONTEXT_LIST`)."""
    try:
        ns = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--context takes comma-separated integers, got '{text}'") from None
    if not ns or min(ns) < 1 or max(ns) > MAX_CONTEXT_TOKENS:
        raise UsageError(f"--context values must be in [1, {MAX_CONTEXT_TOKENS}]")
    if len(ns) > MAX_CONTEXT_LIST or len(set(ns)) != len(ns):
        raise UsageError(f"--context takes at most {MAX_CONTEXT_LIST} distinct lengths, got '{text}'")
    return ns


def _run_context(args) -> int:
    """``--context``: prefill and decode speed at each prompt length, ours and (``--llama-cpp``) llama.cpp's."""
    from ..bench.long_context import DECODE_TOKENS, llama_cpp_long_context, measure_long_context

    ns = parse_context(args.context)
    repeats = args.repeats or 2
    gguf = None
    if args.llama_cpp:
        gguf = gguf_path(args.model)
        require_llama_cpp()
    target = ff.load(args.model, **model_load_kwargs(args))
    too_long = [n for n in ns if n + DECODE_TOKENS + 1 > target.max_context]
    if too_long:
        raise UsageError(f"--context {too_long[0]}: with {DECODE_TOKENS} new tokens it exceeds the model's context "
                         f"{target.max_context}")
    rows = []
    for n in ns:
        ours = measure_long_context(target, n, repeats)
        theirs = None if gguf is None else llama_cpp_long_context(gguf, n, repeats)
        rows.append({"prompt_tokens": n, "fastforward": ours, "llama.cpp": theirs})
    info = {"model": args.model, "backend": target.backend_name, "threads": torch.get_num_threads(),
            "kv_cache": target.kv_precision, "arithmetic": target.arithmetic,
            "llama_cpp_system_info": llama_cpp_system_info() if gguf is not None else None}
    if args.json:
        print(json.dumps({"info": info, "context": rows}))
        return 0
    print(f"long prompts: prefill of N random tokens, then {DECODE_TOKENS} greedy one-token forwards; median of "
          f"{repeats} runs, {info['threads']} threads, arithmetic {target.arithmetic}, KV cache {target.kv_precision}")
    print("| N | fastforward prefill tok/s | decode tok/s | llama.cpp prefill tok/s | decode tok/s | "
          "prefill ratio | decode ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        ours, theirs = row["fastforward"], row["llama.cpp"]
        cells = [str(row["prompt_tokens"]), f"{ours['prefill_tokens_per_s']:.0f}", f"{ours['decode_tokens_per_s']:.1f}"]
        if theirs is None:
            cells += ["–"] * 4
        else:
            cells += [f"{theirs['prefill_tokens_per_s']:.0f}", f"{theirs['decode_tokens_per_s']:.1f}",
                      f"{ours['prefill_tokens_per_s'] / theirs['prefill_tokens_per_s']:.2f}×",
                      f"{ours['decode_tokens_per_s'] / theirs['decode_tokens_per_s']:.2f}×"]
        print("| " + " | ".join(cells) + " |")
    if gguf is not None:
        print(f"llama.cpp system_info: {info['llama_cpp_system_info'] or '(not available)'}")
    return 0


def memory_use(target, qs: list[int], kv: int, lean: dict) -> dict:
    """The machine's measured read bandwidth, what one forward reads (lean backend only) and the bandwidth each
    t(q) achieves on its weights, as a fraction of the measured one. Measured after the forwards, with the run's
    threads, so the 1 GiB buffer never shares memory with them."""
    bandwidth = measure_read_bandwidth()
    out = {"read_bandwidth": bandwidth.as_dict()}
    reads = {q: forward_read_bytes(target.backend, q=q, kv=kv) for q in qs}
    if any(r is None for r in reads.values()):
        return out
    out["forward_read_bytes"] = reads
    out["weight_gb_per_s"] = {q: achieved_bandwidth(reads[q]["weights"], lean[q]) for q in qs}
    out["total_gb_per_s"] = {q: achieved_bandwidth(reads[q]["total"], lean[q]) for q in qs}
    out["weight_fraction_of_bandwidth"] = {q: out["weight_gb_per_s"][q] / bandwidth.gb_per_s for q in qs}
    return out


def describe_memory(memory: dict) -> str:
    """One line: the measured read bandwidth and what the first q's forward reads of it."""
    bw = memory["read_bandwidth"]
    line = (f"memory read bandwidth {bw['gb_per_s']:.1f} GB/s ({bw['method']}, {bw['buffer_bytes'] / 2**30:.1f} GiB, "
            f"{bw['threads']} threads, best of {bw['repeats']})")
    reads = memory.get("forward_read_bytes")
    if not reads:
        return line + "; bytes per forward: not counted for this backend"
    q = next(iter(reads))
    r = reads[q]
    return (line + f"; t({q}) reads {r['weights'] / 1e6:.1f} MB of weights (the embedding: its rows only, unless "
            f"tied to the head) and {r['kv_cache'] / 1e6:.1f} MB of KV cache: {memory['weight_gb_per_s'][q]:.1f} "
            f"GB/s of weights ({100 * memory['weight_fraction_of_bandwidth'][q]:.0f}% of the measured bandwidth), "
            f"{memory['total_gb_per_s'][q]:.1f} GB/s in all")


def _run_stream(args) -> int:
    """``--stream N``: median ms per streamed step around token 100 and token N-100."""
    from ..bench.streaming import stream_step_times
    from ..request import GenerationRequest

    if args.stream < 300:
        raise UsageError("--stream needs at least 300 tokens (steps are timed around 100 and N-100)")
    GenerationRequest(args.prompt, args.method, max_new_tokens=args.stream, stop=args.stop, chat=False)  # checks
    target = ff.load(args.model, **model_load_kwargs(args))
    marks = (100, args.stream - 100)
    times = stream_step_times(target, args.prompt, args.stream, args.stop, args.method, marks=marks)
    if args.json:
        print(json.dumps({"tokens": times.tokens, "finish_reason": times.finish_reason, "step_ms": times.at,
                          "outside_forward_ms": times.text_ms_at}))
        return 0
    print(f"streamed {times.tokens} tokens ({args.method}, stop string {args.stop!r}, finish: "
          f"{times.finish_reason}); median ms per step over the 50 steps around each mark")
    print("| around token | ms per step | of which outside the target forward |")
    print("|---|---|---|")
    for mark in marks:
        if mark in times.at:
            print(f"| {mark} | {times.at[mark]:.2f} | {times.text_ms_at[mark]:.2f} |")
    if len(times.at) < len(marks):
        print(f"(the generation ended after {times.tokens} tokens, before the last mark)")
    return 0
