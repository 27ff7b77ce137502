"""``fastforward info``: what this machine gets -- CPU features, the native kernels, the model's kernel path and
arithmetic per weight format, its cached cost curve, the shipped drafters, llama.cpp, the caches.

The facts are :mod:`fastforward.machine_facts`' (the server's ``/v1/models`` card carries the same); nothing is
measured or compiled. The model is loaded (a few seconds) only when that compiles nothing: with the native kernels
built, or an HF folder where they cannot be had; otherwise it is described from its file.
"""

from __future__ import annotations

import json
import textwrap
import time

import fastforward as ff

from ..errors import ModelNotFoundError, UsageError
from ..machine_facts import CPU_FEATURES, machine_facts, model_facts, model_file_facts
from ..model import DEFAULT_MODEL, resolve_model
from .options import add_model_arguments, model_load_kwargs


class _DefaultModel(str):
    """``--model``'s default, told apart from the same name given on the command line."""


def add_arguments(p, name: str) -> None:
    add_model_arguments(p, threads_help="torch threads, as the run you ask about will use them (default: torch's "
                                        "choice); the cost curve is cached per thread count")
    p.set_defaults(model=_DefaultModel(DEFAULT_MODEL))
    p.add_argument("--no-model", action="store_true", help="the machine's facts only: no model is looked at or "
                   "loaded (about a second instead of the model's load)")
    p.add_argument("--json", action="store_true", help="print the facts as one JSON object")


def run(args, name: str) -> int:
    given = not isinstance(args.model, _DefaultModel)
    if given and args.no_model:
        raise UsageError("--no-model and --model exclude each other")
    if given:
        resolve_model(args.model)  # an unknown model is a one-line error before anything else
    facts = machine_facts()
    if not args.no_model:
        facts["model"] = _model(args, facts["kernels"]["status"])
    if args.json:
        print(json.dumps(facts, indent=1, default=str))
    else:
        print(render(facts))
    return 0


def _model(args, kernel_status: str) -> dict:
    """The model's facts: loaded when loading it compiles and converts nothing, else from its file."""
    try:
        kind, _ = resolve_model(args.model)
    except ModelNotFoundError as exc:  # the default model, not installed (a given one was checked before)
        return {"name": str(args.model), "loaded": False, "note": str(exc)}
    if kernel_status in ("not built yet", "being built"):
        return model_file_facts(str(args.model), "not loaded: loading it would compile the native kernels first "
                                                 "(once, 20-60 s); run it once (fastforward generate \"hi\"), then "
                                                 "'fastforward info' again")
    if kernel_status != "built" and kind == "gguf":
        return model_file_facts(str(args.model), "not loaded: without the native kernels a GGUF file is dequantised "
                                                 "into a cached HF folder on its first load")
    t0 = time.perf_counter()
    target = ff.load(str(args.model), **model_load_kwargs(args))
    facts = model_facts(target)
    facts["load_seconds"] = round(time.perf_counter() - t0, 2)
    return facts


# ------------------------------------------------------------------------------------------------------------------
# The text
# ------------------------------------------------------------------------------------------------------------------

WIDTH = 120
VNNI_NAMES = {"avx512-vnni": "AVX-512 VNNI", "avx-vnni": "AVX-VNNI"}


def size_text(n: int | None, complete: bool = True) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{'at least ' if not complete else ''}{n / scale:.1f} {unit}"
    return f"{'at least ' if not complete else ''}{n} B"


def _age(hours: float) -> str:
    if hours < 1:
        return f"{hours * 60:.0f} min"
    return f"{hours:.1f} h" if hours < 48 else f"{hours / 24:.1f} days"


def render(facts: dict) -> str:
    """The facts as the terminal shows them: one block per subject, a label column, at most 120 columns wide."""
    lines = [f"fastforward {facts['fastforward']} (torch {facts['torch']}, Python {facts['python']})"]

    def row(label: str, text: str) -> None:
        indent = " " * (len(text) - len(text.lstrip()) + 2)
        for i, part in enumerate(textwrap.wrap(text, WIDTH - 13, subsequent_indent=indent, break_on_hyphens=False,
                                               break_long_words=False,
                                               drop_whitespace=True) or [""]):
            lines.append(f"{label if i == 0 else '':<13}{part}")

    cpu = facts["cpu"]
    llc = f", last-level cache {size_text(cpu['last_level_cache_bytes'])}" if cpu["last_level_cache_bytes"] else ""
    row("cpu", f"{cpu['model']} ({cpu['architecture']}){llc}")
    has = [CPU_FEATURES[k] for k, v in cpu["features"].items() if v]
    lacks = [CPU_FEATURES[k] for k, v in cpu["features"].items() if not v]
    row("", f"features: {', '.join(has) or 'none of those below'}" + (f"; not: {', '.join(lacks)}" if lacks else ""))
    row("threads", f"{cpu['torch_threads']} torch threads; {cpu['usable_cpus']} of {cpu['logical_cpus']} CPUs "
                   "usable by this process")
    k = facts["kernels"]
    if k["status"] == "built":
        row("kernels", f"{k['isa']} build{' with ' + VNNI_NAMES[k['vnni']] if k.get('vnni') else ''}, built "
                       f"({k['folder']}); AMX tiles {'in use' if k.get('amx') else 'not in use'}")
        paths = k["paths"]
        row("", f"q8 arithmetic: {paths['q8']}; exact on packed weights: {paths['exact']}; fp32 weights: "
                f"{paths['fp32']}")
    else:
        build = f"{k['isa']} build{' with ' + VNNI_NAMES[k['vnni']] if k.get('vnni') else ''}: " if k.get("isa") else ""
        row("kernels", f"{build}{k['status']} -- {k.get('note', '')}")
    if "model" in facts:
        _render_model(facts["model"], row)
    _render_llama_cpp(facts["llama_cpp"], row)
    if "caches" in facts:
        c = facts["caches"]
        row("cache", f"{c['cache']}: {size_text(c['bytes'], all(p['complete'] for p in c['parts'].values()))}"
                     + ("" if c["exists"] else " (not created yet)"))
        for part, size in c["parts"].items():
            row("", f"  {part}: {size_text(size['bytes'], size['complete'])}")
        if "default_cache_kernels" in c:
            d = c["default_cache_kernels"]
            row("", f"built kernels are read from {d['path']} too: {size_text(d['bytes'], d['complete'])}")
        row("data", f"{c['data']['path']}{'' if c['data']['exists'] else ' (absent)'}")
    return "\n".join(lines)


def _render_model(m: dict, row) -> None:
    if not m.get("loaded"):
        where = f" ({m['kind']}: {m['file']}, {size_text(m['bytes'])})" if "file" in m else ""
        row("model", f"{m['name']}{where}")
        row("", m.get("note", ""))
        _render_drafters(m.get("drafters", []), row)
        return
    row("model", f"{m['name']}: backend {m['backend']}, arithmetic {m['arithmetic']}, KV cache {m['kv_cache']}, "
                 f"context {m['max_context']} (loaded in {m.get('load_seconds', 0):.1f} s)")
    row("", f"matmul {m['matmul']}")
    for w in m["weights"]:
        n = w["matrices"]
        count = f"{n} {'matrix' if n == 1 else 'matrices'}, {size_text(w['bytes'])}: " if n is not None else ""
        row("", f"  {w['format']}: {count}{w['arithmetic']} arithmetic, kernel {w['kernel']}")
    c = m["cost_curve"]
    if c["cached"]:
        load = {True: "UNDER LOAD", False: "quiet", None: "load unknown"}[c["under_load"]]
        share = (f", its threads waited for a CPU {c['wait_share']:.0%} of the time" if c["wait_share"] is not None
                 else f", it got {c['cpu_share']:.0%} of its threads' CPU time" if c["cpu_share"] is not None else "")
        row("cost curve", f"t(1) {c['t1_ms']:.2f} ms, t(8)/t(1) {c['t8_over_t1']:.2f} ({c['threads']} threads, "
                          f"{c['kv']}-token cache); measured {_age(c['age_hours'])} ago, {load}{share}")
        if not c["plausible"]:
            row("", "implausible (grows faster than linearly): the next run that needs it measures it again")
        row("", c["path"])
    else:
        row("cost curve", f"{c['note']} ({c['threads']} threads)")
        row("", c["path"])
    _render_drafters(m["drafters"], row)


def _render_drafters(drafters: list[dict], row) -> None:
    if not drafters:
        row("drafters", "none shipped")
        return
    mine = [d for d in drafters if d.get("for_this_model")]
    others = [d for d in drafters if not d.get("for_this_model")]
    if mine:
        row("drafters", "for this model: " + ", ".join(f"{d['method']} ({d['kind']}, {size_text(d['bytes'])})"
                                                      for d in mine))
    if others:
        label = "" if mine else "drafters"
        what = "shipped for other models" if any("for_this_model" in d for d in others) else "shipped"
        row(label, f"{what}: " + ", ".join(f"{d['method']} ({d['kind']}, for {d['trained_for']})" for d in others))


def _render_llama_cpp(ll: dict, row) -> None:
    if not ll["installed"]:
        row("llama.cpp", ll["note"])
        return
    if ll.get("loads") is False:
        row("llama.cpp", ll["note"])
        return
    row("llama.cpp", f"llama-cpp-python {ll.get('version') or '(version unknown)'}")
    if ll.get("system_info"):
        row("", ll["system_info"])
    if ll.get("problem"):
        row("", "PROBLEM: " + ll["problem"])
