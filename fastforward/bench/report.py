"""Aggregates of ``results.jsonl``: ``summary.json``, ``report.md`` and the plots.

Speedup over AR is a ratio of tokens per second, per question (so a method that emits a different number of
tokens is still compared fairly). Three averages over questions are reported, and named:

* ``speedup_geomean``   -- geometric mean of the per-question ratios (what PASTA argues for; the headline);
* ``speedup_arith``     -- arithmetic mean of the per-question ratios;
* ``speedup_total``     -- ratio of total throughputs: (sum of tokens / sum of time) of the method over AR's;
* ``speedup_specbench`` -- Spec-Bench's own number: mean per-question tokens/s of the method over AR's.

Timing per (question, method) is the median over repeats (``*_min`` fields use the fastest repeat instead).
``tau`` is tokens per target forward pooled over all steps (prefill included, AR = 1.00); ``acceptance_by_depth``
[d-1] is, over all decode steps whose draft reached depth d, the fraction that accepted a token at depth d.
``ttft`` is the time to the first token of a turn (prefill included), averaged over turns, then questions.

Against a reference peer (``hf-generate``, ``llama-cpp``), every method also gets the geometric-mean ratio of its
tokens/s to the peer's (``speedup_vs_hf_generate_geomean``, ``speedup_vs_llama_cpp_geomean``), computed like the
speedup over AR, and given twice: *end to end* (all tokens over all time, the prefill included: what a user waits
for) and *decode only* (``..._decode_geomean``: the tokens after each turn's first over the time after it, so a
long prompt's prefill does not hide or inflate the decoding speed). The time to first token is reported apart
(``ttft``, and ``ttft_speedup_vs_...``: the peer's mean TTFT over the method's). Peers that compute differently
(llama.cpp) get ``agreement`` with AR instead of mismatches.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections import Counter
from pathlib import Path

from ..stats import geomean, pool_draft_sources
from .plots import write_plots
from .results import write_atomic
from .spec import BASELINE, OVERALL

HF_GENERATE = "hf-generate"
LLAMA_CPP = "llama-cpp"

#: peers every method is also compared with when they ran: (label, summary.json key of the end-to-end ratio, report
#: title, explanation); the decode-only ratio is under :func:`decode_key`, the TTFT ratio under :func:`ttft_key`
REFERENCE_PEERS = (
    (HF_GENERATE, "speedup_vs_hf_generate_geomean", "Against Hugging Face transformers",
     "Geometric-mean speedup over `hf-generate` (transformers' greedy `generate` on the same prompts)."),
    (LLAMA_CPP, "speedup_vs_llama_cpp_geomean", "Against llama.cpp",
     "Geometric-mean ratio of tokens/s over `llama-cpp` (llama.cpp's autoregressive decoding, through "
     "llama-cpp-python, of the same GGUF file on the same prompt tokens, its weights quantised as in the file and "
     "its activations to 8 bits: our `--arithmetic q8`, up to the order of its sums, so its text can differ from "
     "ours -- see its agreement with AR)."),
)


def decode_key(key: str) -> str:
    """``speedup_vs_llama_cpp_geomean`` -> ``speedup_vs_llama_cpp_decode_geomean``: the decode-only twin."""
    return key.replace("_geomean", "_decode_geomean")


def ttft_key(key: str) -> str:
    """``speedup_vs_llama_cpp_geomean`` -> ``ttft_speedup_vs_llama_cpp``: the peer's TTFT over the method's."""
    return "ttft_" + key.replace("_geomean", "")


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def decode_part(row: dict) -> tuple[int, float] | None:
    """(tokens after each turn's first, seconds after each turn's first token) of a row: its decoding without the
    prefill. None when the row has no time to first token (``prefill_time`` 0: the runner does not measure it)."""
    prefill = row.get("prefill_time") or 0.0
    if prefill <= 0:
        return None
    turns = row.get("turns") or []
    if turns and all(isinstance(t, dict) and "new_tokens" in t for t in turns):
        tokens = sum(max(0, int(t["new_tokens"]) - 1) for t in turns)
    else:  # rows without per-turn counts: one first token per turn
        tokens = max(0, int(row["new_tokens"]) - max(1, len(turns)))
    seconds = float(row["wall_time"]) - prefill
    return (tokens, seconds) if seconds > 0 else None


def _per_question(rows: list[dict]) -> dict[tuple[str, str], dict]:
    """(label, question) -> tokens and median / min wall time over repeats."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["label"], str(row["question_id"])), []).append(row)
    out = {}
    for key, rs in groups.items():
        walls = [r["wall_time"] for r in rs]
        decode = [d for d in (decode_part(r) for r in rs) if d is not None]
        checked = [r.get("lossless") for r in rs if r.get("lossless") is not None]
        divs = [r["first_divergence"] for r in rs if r.get("lossless") is False and r.get("first_divergence")]
        out[key] = {
            "category": rs[0]["category"],
            "new_tokens": statistics.median(r["new_tokens"] for r in rs),
            "wall": statistics.median(walls),
            "wall_min": min(walls),
            # decode only (after each turn's first token); None when the time to first token was not measured
            "decode_tokens": statistics.median(d[0] for d in decode) if decode else None,
            "decode_wall": statistics.median(d[1] for d in decode) if decode else None,
            "decode_wall_min": min(d[1] for d in decode) if decode else None,
            "repeats": len(rs),
            "steps": sum(r["decoding_steps"] for r in rs),
            "tokens": sum(r["new_tokens"] for r in rs),
            "draft_time": sum(r.get("draft_time") or 0.0 for r in rs),
            "verify_time": sum(r.get("verify_time") or 0.0 for r in rs),
            "proposal_rows": sum(r.get("proposal_rows") or 0 for r in rs),
            "decode_steps": sum(r["decoding_steps"] - len(r.get("turns") or [None]) for r in rs),
            "attempts": [r.get("depth_attempts", []) for r in rs],
            "accepts": [r.get("depth_accepts", []) for r in rs],
            "checked": bool(checked),
            "mismatch": any(c is False for c in checked),
            "near_tie": bool(divs) and all(d.get("near_tie") for d in divs),
            "jacobi": _jacobi_counts(rs),
            "sources": [t.get("method_stats") for r in rs for t in (r.get("turns") or [])],
            "ttft": _ttft(rs),
            "agreement": [r["agreement"] for r in rs if r.get("agreement")],
        }
    return out


def _rows_per_step(per_question: list[dict]) -> float | None:
    rows = sum(m.get("proposal_rows") or 0 for m in per_question)
    steps = sum(max(0, m.get("decode_steps") or 0) for m in per_question)
    return rows / steps if rows and steps else None


def _ttft(rows: list[dict]) -> float | None:
    """Median over repeats of the mean time to first token per turn; None when the runner does not measure it."""
    values = [r["prefill_time"] / max(1, len(r.get("turns") or [None])) for r in rows if r.get("prefill_time")]
    return statistics.median(values) if values else None


def _jacobi_counts(rows: list[dict]) -> list[int] | None:
    """[iterations, tokens fixed by them, stationary tokens, blocks] pooled over the rows' turns, for methods that
    report Jacobi statistics (CLLM Table 3's fast-forwarded and stationary counts); None for the others."""
    acc = [0, 0, 0, 0]
    seen = False
    for r in rows:
        for t in r.get("turns") or []:
            st = t.get("method_stats") or {}
            if "fast_forward" not in st:
                continue
            seen = True
            acc[0] += len(st["fast_forward"])
            acc[1] += sum(st["fast_forward"])
            acc[2] += int(st.get("stationary_tokens", 0))
            acc[3] += int(st.get("blocks_started", 0))
    return acc if seen else None


def _stats(label: str, qids: list[str], pq: dict, ref_label: str | None = BASELINE) -> dict:
    mine = [pq[(label, q)] for q in qids]
    tokens = sum(m["new_tokens"] for m in mine)
    wall = sum(m["wall"] for m in mine)
    attempts: list[int] = []
    accepts: list[int] = []
    for m in mine:
        for lst_a, lst_c in zip(m["attempts"], m["accepts"], strict=False):
            for d, (a, c) in enumerate(zip(lst_a, lst_c, strict=False)):
                if d >= len(attempts):
                    attempts.append(0)
                    accepts.append(0)
                attempts[d] += a
                accepts[d] += c
    steps = sum(m["steps"] for m in mine)
    jac = [m["jacobi"] for m in mine if m.get("jacobi")]
    res = {
        "questions": len(mine),
        "new_tokens": tokens,
        "wall_time": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "tau": sum(m["tokens"] for m in mine) / steps if steps else 0.0,
        # per decoding step (one target forward), over every repeat: what drafting and verifying cost
        "draft_ms_per_step": 1e3 * sum(m["draft_time"] for m in mine) / steps if steps else None,
        "verify_ms_per_step": 1e3 * sum(m["verify_time"] for m in mine) / steps if steps else None,
        # rows a decoding step's target forward scored, on average (1 for AR; None where not recorded)
        "rows_per_step": _rows_per_step(mine),
        "acceptance_by_depth": [c / a if a else 0.0 for a, c in zip(attempts, accepts, strict=False)],
        "checked": sum(m["checked"] for m in mine),
        "mismatches": sum(m["mismatch"] for m in mine),
        "mismatches_near_tie": sum(m["mismatch"] and m["near_tie"] for m in mine),
    }
    ttft = [m["ttft"] for m in mine if m.get("ttft") is not None]
    res["ttft"] = mean(ttft) if ttft else None
    agreed = [m["agreement"] for m in mine if m.get("agreement")]
    if agreed:
        res["agreement"] = {
            "questions": len(agreed),
            "identical_prefix_fraction": mean([mean([a["fraction"] for a in rs]) for rs in agreed]),
            "identical_prefix_tokens": mean([mean([a["identical_prefix"] for a in rs]) for rs in agreed]),
            "identical_questions": sum(all(a["identical"] for a in rs) for rs in agreed),
            "identical_turns": sum(a["identical_turns"] for rs in agreed for a in rs),
            "turns": sum(a["turns"] for rs in agreed for a in rs),
        }
    sources = pool_draft_sources(st for m in mine for st in m.get("sources") or [])
    if sources:  # auto: which source drafted, pooled over the questions
        res["draft_sources"] = sources
    if jac:
        it, fixed, stat, blocks = (sum(j[i] for j in jac) for i in range(4))
        res["jacobi"] = {"iterations": it, "fast_forward_per_iteration": fixed / it if it else None,
                         "stationary_per_block": stat / blocks if blocks else None, "blocks": blocks}
    for suffix, wkey in (("", "wall"), ("_min", "wall_min")):
        for name, value in _ratios(label, qids, pq, ref_label, "new_tokens", wkey).items():
            res[f"speedup_{name}{suffix}"] = value
    decoded = [m for m in mine if m.get("decode_wall")]
    decode_wall = sum(m["decode_wall"] for m in decoded)
    res["decode_tokens_per_s"] = (sum(m["decode_tokens"] for m in decoded) / decode_wall if decode_wall > 0
                                  else None)
    res["speedup_decode_geomean"] = _ratios(label, qids, pq, ref_label, "decode_tokens", "decode_wall")["geomean"]
    ref_ttft = [(pq[(label, q)]["ttft"], pq[(ref_label, q)]["ttft"]) for q in qids if (ref_label, q) in pq
                and pq[(label, q)].get("ttft") and pq[(ref_label, q)].get("ttft")]
    res["ttft_ratio"] = (mean([r for _, r in ref_ttft]) / mean([m for m, _ in ref_ttft]) if ref_ttft
                         else None)
    return res


def _ratios(label: str, qids: list[str], pq: dict, ref_label: str | None, tokens_key: str, wall_key: str) -> dict:
    """The method's tokens/s over the reference's, per question (``tokens_key`` over ``wall_key``: end to end or
    decode only), averaged over the questions both ran: ``geomean``, ``arith``, ``total`` (ratio of total
    throughputs) and ``specbench`` (mean tokens/s over mean tokens/s); NaN when no question compares."""
    ratios, tps, tps_ref, tot, tot_ref = [], [], [], [0.0, 0.0], [0.0, 0.0]
    for q in qids:
        ref = pq.get((ref_label, q))
        m = pq[(label, q)]
        if ref is None or not m.get(wall_key) or not ref.get(wall_key) or not ref.get(tokens_key):
            continue
        if m[wall_key] <= 0 or ref[wall_key] <= 0 or ref[tokens_key] <= 0 or m[tokens_key] is None:
            continue
        t, t_ref = m[tokens_key] / m[wall_key], ref[tokens_key] / ref[wall_key]
        ratios.append(t / t_ref)
        tps.append(t)
        tps_ref.append(t_ref)
        tot[0] += m[tokens_key]
        tot[1] += m[wall_key]
        tot_ref[0] += ref[tokens_key]
        tot_ref[1] += ref[wall_key]
    return {
        "geomean": geomean(ratios),
        "arith": mean(ratios),
        "total": (tot[0] / tot[1]) / (tot_ref[0] / tot_ref[1]) if ratios and tot[1] > 0 and tot_ref[0] > 0
        else float("nan"),
        "specbench": mean(tps) / mean(tps_ref) if ratios else float("nan"),
    }


def _clean(x):
    """NaN -> None, so summary.json is strict JSON."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def _against_peers(entry: dict, label: str, qids: list[str], pq: dict, refs: list[tuple[str, str]]) -> None:
    """Each reference peer's three comparisons into ``entry``: end to end, decode only, time to first token."""
    for ref, key in refs:
        against = _stats(label, qids, pq, ref)
        entry[key] = against["speedup_geomean"]
        entry[decode_key(key)] = against["speedup_decode_geomean"]
        entry[ttft_key(key)] = against["ttft_ratio"]


def llama_cpp_system_info(rows: list[dict]) -> str | None:
    """The llama.cpp build's ``system_info`` the newest row that has one recorded (rows from before it was recorded:
    None)."""
    for row in sorted(rows, key=lambda r: r.get("timestamp", ""), reverse=True):
        info = (row.get("software") or {}).get("llama_cpp_system_info")
        if info:
            return info
    return None


#: summary.json's ``definitions``: what each number means
DEFINITIONS = {
    "speedup_geomean": "geometric mean over questions of (method tokens/s) / (AR tokens/s)",
    "speedup_arith": "arithmetic mean over questions of (method tokens/s) / (AR tokens/s)",
    "speedup_total": "(total method tokens / total method time) / (total AR tokens / total AR time)",
    "speedup_specbench": "Spec-Bench: mean per-question method tokens/s / mean per-question AR tokens/s",
    "tau": "new tokens per target forward, pooled over all forwards (prefill included; AR = 1)",
    "acceptance_by_depth": "[d-1]: of the decode steps whose draft reached depth d, the fraction that "
                           "accepted a token at depth d",
    "rows_per_step": "rows a decoding step's target forward scored, on average over the steps after each "
                     "turn's prefill (1 for AR): what a step costs on another model's cost curve",
    "mismatches": "questions whose output differs from AR's in at least one repeat (temperature 0 only)",
    "mismatches_near_tie": "mismatches whose first divergence is a floating-point near-tie",
    "speedup_vs_hf_generate_geomean": "geometric mean over questions of (method tokens/s) / (hf-generate "
                                      "tokens/s), when hf-generate ran",
    "speedup_vs_llama_cpp_geomean": "geometric mean over questions of (method tokens/s) / (llama-cpp "
                                    "tokens/s), when llama-cpp ran; end to end (prefill included)",
    "speedup_decode_geomean": "decode only: as speedup_geomean, with the tokens after each turn's first over "
                              "the time after the first token",
    "decode_tokens_per_s": "tokens after each turn's first / time after the first token, over the method's "
                           "questions (null when the time to first token was not measured)",
    "speedup_vs_llama_cpp_decode_geomean": "decode only: geometric mean over questions of (method decode "
                                           "tokens/s) / (llama-cpp decode tokens/s)",
    "speedup_vs_hf_generate_decode_geomean": "decode only, against hf-generate",
    "ttft_speedup_vs_llama_cpp": "llama-cpp's mean time to first token / the method's, over the questions "
                                 "both ran (> 1: the method's first token comes sooner)",
    "ttft_speedup_vs_hf_generate": "the same against hf-generate",
    "ttft_ratio": "AR's mean time to first token / the method's, over the questions both ran",
    "ttft": "seconds to the first token of a turn (prefill included), mean over turns and questions "
            "(median over repeats); null when the runner does not measure it",
    "agreement": "peers with other arithmetic (llama.cpp), temperature 0: identical_prefix_fraction = mean "
                 "over questions of (tokens identical to AR's before the first difference) / (AR's tokens); "
                 "identical_turns of turns: turns identical to AR's (in an identical conversation); "
                 "identical_questions: questions whose every turn is identical",
    "jacobi.fast_forward_per_iteration": "Jacobi methods: tokens fixed per iteration (CLLM Table 3's "
                                         "fast-forwarded count; 1 = plain AR)",
    "jacobi.stationary_per_block": "Jacobi methods: tokens that were already in place before their "
                                   "prefix converged, per n-token block (CLLM Table 3)",
}


def _labels(all_rows: list[dict]) -> list[str]:
    """The methods' labels in the order they first appear, AR first."""
    labels = list(dict.fromkeys(r["label"] for r in all_rows))
    if BASELINE in labels:
        labels.remove(BASELINE)
        labels.insert(0, BASELINE)
    return labels


def _method_entry(label: str, r0: dict, pq: dict, failed: list[dict], categories: list[str],
                  refs: list[tuple[str, str]]) -> dict:
    """One method's summary: what it is (from its first row ``r0``), its numbers overall and per category."""
    qids = [q for (lab, q) in pq if lab == label]
    entry = {"method": r0.get("method", label), "kind": r0.get("kind", "method"),
             "options": r0.get("options", {}), "lossless_claimed": r0.get("lossless_claimed", True)}
    entry.update(_stats(label, qids, pq))
    entry["errors"] = sum(r["label"] == label for r in failed)
    _against_peers(entry, label, qids, pq, refs)
    entry["categories"] = {}
    for cat in categories:
        cq = [q for q in qids if pq[(label, q)]["category"] == cat]
        if cq:
            c = _stats(label, cq, pq)
            _against_peers(c, label, cq, pq, refs)
            entry["categories"][cat] = c
    return entry


def _mismatch_details(rows: list[dict]) -> list[dict]:
    """Each row that differs from AR's: which question, method and repeat, and its first divergence."""
    mismatches = []
    for r in rows:
        if r.get("lossless") is False:
            d = dict(r.get("first_divergence") or {})
            mismatches.append({"question_id": r["question_id"], "category": r["category"], "label": r["label"],
                               "repeat": r["repeat"], **d})
    return mismatches


def aggregate(rows: list[dict]) -> dict:
    """The machine-readable summary (see the module docstring for each number's definition)."""
    failed = [r for r in rows if r.get("error")]
    all_rows, rows = rows, [r for r in rows if not r.get("error")]
    pq = _per_question(rows)
    labels = _labels(all_rows)
    categories = list(dict.fromkeys(r["category"] for r in all_rows))
    first = {}
    for r in rows + failed:
        first.setdefault(r["label"], r)
    refs = [(ref, key) for ref, key, _, _ in REFERENCE_PEERS if ref in labels]
    methods = {label: _method_entry(label, first[label], pq, failed, categories, refs) for label in labels}
    mismatches = _mismatch_details(rows)
    param_sets = Counter(json.dumps(r.get("parameters", {}), sort_keys=True) for r in all_rows)
    last = max(all_rows, key=lambda r: r.get("timestamp", ""))
    return _clean({
        "baseline": BASELINE,
        "timing": "median wall time over repeats (fields ending in _min: the fastest repeat)",
        "definitions": DEFINITIONS,
        "parameters": last.get("parameters", {}),
        "parameter_sets": len(param_sets),
        "command": last.get("command", ""),
        "environment": {"machine": last.get("machine"), "software": last.get("software"),
                        "commit": last.get("commit"), "threads": last.get("threads"),
                        "commits": sorted({str(r.get("commit")) for r in rows}),
                        "llama_cpp_system_info": llama_cpp_system_info(all_rows)},
        "questions": len({str(r["question_id"]) for r in all_rows}),
        "categories": categories,
        "methods": methods,
        "mismatch_details": mismatches,
        "errors": [{"question_id": r["question_id"], "label": r["label"], "repeat": r["repeat"],
                    "error": r["error"]} for r in failed],
    })


# ----------------------------------------------------------------------------------------------------------------
# Markdown
# ----------------------------------------------------------------------------------------------------------------


def _f(x, nd=2, suffix="") -> str:
    return "–" if x is None else f"{x:.{nd}f}{suffix}"


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _ms(x) -> str:
    return "–" if x is None else f"{1000 * x:.0f}"


def _step_ms(m: dict, key: str) -> str:
    return "–" if m["kind"] == "peer" or m.get(key) is None else _f(m[key], 2)


def _opts(entry: dict) -> str:
    opts = entry.get("options") or {}
    return ", ".join(f"{k}={v}" for k, v in opts.items()) or "–"


def _table(header: list[str], rows: list[list[str]], left: int = 1) -> str:
    """A markdown table; the first ``left`` columns are text (left-aligned), the rest numbers."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i < left else "---:" for i in
                                                              range(len(header))) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _md_intro(summary: dict) -> list[str]:
    """The title and the paragraph of parameters (with a warning when the rows mix parameter sets)."""
    p = summary.get("parameters", {})
    env = summary.get("environment", {})
    out = ["# fastforward bench report", ""]
    out.append(
        f"Model `{p.get('model')}` ({p.get('backend')} backend, {p.get('dtype')}"
        + (f", arithmetic {p['arithmetic']}, KV cache {p.get('kv_cache')}" if p.get("arithmetic") else "")
        + f"), {summary['questions']} questions "
        f"in {len(summary['categories'])} categories, up to {p.get('max_new_tokens')} new tokens, temperature "
        f"{p.get('temperature')}, seed {p.get('seed')}, {p.get('repeats')} repeat(s) per question (timing: median), "
        f"{env.get('threads')} thread(s). Baseline: our engine's autoregressive decoding (`ar`)."
    )
    if summary.get("parameter_sets", 1) > 1:
        out.append("")
        out.append(f"**Warning:** the results mix {summary['parameter_sets']} parameter sets.")
    return out


def _md_overall_row(label: str, m: dict, depth_n: int) -> list[str]:
    """One method's row of the overall table."""
    alpha = [_f(m["acceptance_by_depth"][d]) if d < len(m["acceptance_by_depth"]) else "–" for d in range(depth_n)]
    mism = "n/a" if not m["checked"] else str(m["mismatches"]) + (
        f" ({m['mismatches_near_tie']} near-tie)" if m["mismatches"] else "")
    if not m["checked"] and m.get("agreement"):
        mism = f"n/a ({_pct(m['agreement']['identical_prefix_fraction'])} agreement)"
    name = f"`{label}`" + (" (peer)" if m["kind"] == "peer" else "")
    return [name, _opts(m), str(m["questions"]), _f(m["tokens_per_s"], 1),
            _f(m.get("decode_tokens_per_s"), 1), _ms(m.get("ttft")), _f(m["speedup_geomean"], 2, "×"),
            _f(m["speedup_arith"], 2, "×"), _f(m["speedup_total"], 2, "×"), _f(m["tau"])] + alpha + [
        _step_ms(m, "draft_ms_per_step"), _step_ms(m, "verify_ms_per_step"), mism]


def _md_overall(methods: dict) -> list[str]:
    """The overall table, one row per method, and what its columns mean."""
    out = ["", "## Overall", ""]
    depth_n = min(4, max((len(m["acceptance_by_depth"]) for m in methods.values()), default=0))
    header = ["method", "options", "questions", "tokens/s", "decode tokens/s", "TTFT ms", "speedup geomean",
              "speedup arith. mean", "speedup total", "τ"] + [f"α{d + 1}" for d in range(depth_n)] + [
                  "drafting ms / step", "verify ms / step", "mismatches"]
    rows = [_md_overall_row(label, m, depth_n) for label, m in methods.items()]
    out.append(_table(header, rows, left=2))
    out += [
        "",
        "Tokens/s: all tokens over all time, the prefill included (end to end); decode tokens/s: the tokens after "
        "each turn's first over the time after it (decode only); TTFT: mean time to a turn's first token. "
        "Speedup is over `ar`, computed per question as a ratio of tokens/s. *geomean*: geometric mean of the "
        "per-question ratios (the headline number); *arith. mean*: their arithmetic mean; *total*: ratio of total "
        "throughputs (all tokens / all time). Spec-Bench's own figure (mean tokens/s ÷ mean AR tokens/s) is "
        "`speedup_specbench` in summary.json. τ: tokens per target forward (AR = 1.00). αd: acceptance rate at "
        "draft depth d. Drafting / verify ms per step: the method's drafting and target-forward time over its "
        "decoding steps (peers: –). Mismatches: questions whose output differs from AR's (near-tie: the target's "
        "logit gap at the first divergence is within 0.01, i.e. floating-point rounding rather than a bug).",
    ]
    return out


def _depths(m: dict, n: int = 3) -> str:
    """A method's acceptance at the first ``n`` depths, 'a1 / a2 / a3' ('–' where it never drafted)."""
    alpha = (m.get("acceptance_by_depth") or [])[:n]
    return " / ".join(f"{a:.2f}" for a in alpha) if alpha else "–"


def _md_per_category(methods: dict, cats: list[str]) -> list[str]:
    """Speedup, τ, tokens/s, drafting ms per step and acceptance by depth per category, a table each (the last two
    for the methods that draft)."""
    out = []
    for title, key, nd, suffix in (("Speedup per category (geometric mean)", "speedup_geomean", 2, "×"),
                                   ("τ per category", "tau", 2, ""),
                                   ("Tokens/s per category", "tokens_per_s", 1, "")):
        out += ["", f"## {title}", ""]
        rows = []
        for label, m in methods.items():
            cells = [_f(m["categories"][c][key], nd, suffix) if c in m["categories"] else "–" for c in cats]
            rows.append([f"`{label}`"] + cells + [_f(m[key], nd, suffix)])
        out.append(_table(["method"] + cats + [OVERALL], rows))
    drafting = {label: m for label, m in methods.items() if m.get("acceptance_by_depth")}
    if drafting:
        out += ["", "## Drafting ms per step per category", ""]
        rows = [[f"`{label}`"] + [_f(m["categories"][c].get("draft_ms_per_step")) if c in m["categories"] else "–"
                                  for c in cats] + [_f(m.get("draft_ms_per_step"))] for label, m in drafting.items()]
        out.append(_table(["method"] + cats + [OVERALL], rows))
        out += ["", "## Acceptance at depths 1 / 2 / 3 per category", ""]
        rows = [[f"`{label}`"] + [_depths(m["categories"][c]) if c in m["categories"] else "–" for c in cats]
                + [_depths(m)] for label, m in drafting.items()]
        out.append(_table(["method"] + cats + [OVERALL], rows))
    return out


def _md_reference_peers(methods: dict, cats: list[str]) -> list[str]:
    """Each reference peer that ran: the methods' end-to-end, decode-only and time-to-first-token ratios to it."""
    out = []
    for peer, key, title, text in REFERENCE_PEERS:
        if not any(key in m for m in methods.values()):
            continue
        out += ["", f"## {title}", "", text]
        for subtitle, k, explain in (
                ("End to end", key, "tokens/s over all the time of each turn, the prefill included."),
                ("Decode only", decode_key(key), "the tokens after each turn's first over the time after it: the "
                 "decoding speed without the prefill."),
                ("Time to first token", ttft_key(key), f"`{peer}`'s mean time to first token over the method's "
                 "(above 1: the method's first token comes sooner).")):
            if not any(m.get(k) is not None for m in methods.values()):
                continue
            out += ["", f"**{subtitle}**: {explain}", ""]
            rows = []
            for label, m in methods.items():
                cells = [_f(m["categories"][c].get(k), 2, "×") if c in m["categories"] else "–" for c in cats]
                rows.append([f"`{label}`"] + cells + [_f(m.get(k), 2, "×")])
            out.append(_table(["method"] + cats + [OVERALL], rows))
    return out


def _md_ttft(methods: dict, cats: list[str]) -> list[str]:
    """Time to first token per category, for the methods that measured it."""
    timed = {label: m for label, m in methods.items() if m.get("ttft") is not None}
    if not timed:
        return []
    out = ["", "## Time to first token per category (ms)", "",
           "Mean over turns and questions of the time from the start of a turn to its first token (the "
           "prefill and the first token's choice).", ""]
    rows = []
    for label, m in timed.items():
        cells = [_ms(m["categories"][c].get("ttft")) if c in m["categories"] else "–" for c in cats]
        rows.append([f"`{label}`"] + cells + [_ms(m["ttft"])])
    out.append(_table(["method"] + cats + [OVERALL], rows))
    return out


def _md_agreement(methods: dict, cats: list[str]) -> list[str]:
    """The agreement with AR of the peers with other arithmetic (instead of a losslessness check)."""
    agreeing = {label: m for label, m in methods.items() if m.get("agreement")}
    if not agreeing:
        return []
    out = ["", "## Agreement with AR (peers with other arithmetic)", "",
           "llama.cpp quantises activations to 8 bits (and keeps the GGUF file's weights), so its greedy text "
           "is not expected to be token-identical to ours; instead of a losslessness check, its agreement with "
           "`ar` is measured: the identical prefix (tokens before the first difference, as a fraction of AR's "
           "tokens, mean over questions) and the turns identical to AR's.", ""]
    rows = []
    for label, m in agreeing.items():
        a = m["agreement"]
        cells = [_pct((m["categories"][c].get("agreement") or {}).get("identical_prefix_fraction"))
                 if c in m["categories"] else "–" for c in cats]
        rows.append([f"`{label}`"] + cells + [_pct(a["identical_prefix_fraction"]),
                                              _f(a["identical_prefix_tokens"], 1),
                                              f"{a['identical_turns']}/{a['turns']}",
                                              f"{a['identical_questions']}/{a['questions']}"])
    out.append(_table(["method"] + cats + [OVERALL, "identical prefix (tokens)", "identical turns",
                                           "identical questions"], rows))
    return out


def _md_repeats(methods: dict, p: dict) -> list[str]:
    """With several repeats: the speedups from the median repeat beside those from the fastest."""
    if not (p.get("repeats", 1) and p.get("repeats", 1) > 1):
        return []
    out = ["", "## Repeats: median vs fastest", ""]
    rows = [[f"`{label}`", _f(m["speedup_geomean"], 2, "×"), _f(m["speedup_geomean_min"], 2, "×"),
             _f(m["speedup_total"], 2, "×"), _f(m["speedup_total_min"], 2, "×")] for label, m in methods.items()]
    out.append(_table(["method", "geomean (median)", "geomean (min)", "total (median)", "total (min)"], rows))
    return out


def _md_jacobi(methods: dict, cats: list[str]) -> list[str]:
    """The Jacobi methods' iteration counts per category (CLLM Table 3)."""
    jac = {label: m for label, m in methods.items() if m.get("jacobi")}
    if not jac:
        return []
    out = ["", "## Jacobi iterations (CLLM Table 3)", "",
           "Fast-forwarded: tokens fixed per Jacobi iteration (one target forward; 1.00 = AR). Stationary: "
           "tokens already correct in the window before every token ahead of them was, per n-token block.", ""]
    rows = []
    for label, m in jac.items():
        for key, name in (("fast_forward_per_iteration", "fast-forwarded / iteration"),
                          ("stationary_per_block", "stationary / block")):
            cells = [_f((m["categories"][c].get("jacobi") or {}).get(key)) if c in m["categories"] else "–"
                     for c in cats]
            rows.append([f"`{label}` {name}"] + cells + [_f(m["jacobi"].get(key))])
    out.append(_table(["method"] + cats + [OVERALL], rows))
    return out


def _md_acceptance(methods: dict) -> list[str]:
    """The acceptance rate by draft depth (up to depth 10) of the methods that draft."""
    max_depth = max((len(m["acceptance_by_depth"]) for m in methods.values()), default=0)
    if not max_depth:
        return []
    out = ["", "## Acceptance rate by draft depth", ""]
    shown = min(max_depth, 10)
    rows = []
    for label, m in methods.items():
        a = m["acceptance_by_depth"]
        if a:
            rows.append([f"`{label}`"] + [_f(a[d]) if d < len(a) else "–" for d in range(shown)])
    out.append(_table(["method"] + [f"d={d + 1}" for d in range(shown)], rows))
    return out


def _md_draft_sources(methods: dict, cats: list[str]) -> list[str]:
    """Per method that reports draft sources (``auto``): each source's share of the decoding steps it drafted, its
    tau on those steps, its acceptance by depth and its drafting ms per step, overall and per category."""
    out = []
    for label, m in methods.items():
        pooled = m.get("draft_sources")
        if not pooled:
            continue
        out += ["", f"## Draft sources of `{label}`", "",
                "Share of decoding steps a source's nodes were verified in, its tau on those steps (tokens per step, "
                "the bonus included), acceptance by depth of its nodes, and its drafting ms per step (every step "
                "it was asked).", ""]
        rows = []
        for scope in ["overall", *cats]:
            part = m if scope == "overall" else m["categories"].get(scope, {})
            p = part.get("draft_sources")
            if not p:
                continue
            for name, s in p["sources"].items():
                rows.append([scope, name, _pct(s["share_of_steps"]), _f(s["tau"]),
                             " / ".join(_f(a) for a in s["acceptance_by_depth"][:3]) or "–", _f(s["ms_per_step"])])
        out.append(_table(["scope", "source", "share of steps", "tau", "acceptance d=1/2/3", "ms / step"], rows,
                          left=2))
    return out


def _md_losslessness(summary: dict, methods: dict) -> list[str]:
    """The losslessness verdict: not checked, every output identical, or the first 50 mismatches."""
    out = ["", "## Losslessness", ""]
    details = summary.get("mismatch_details", [])
    if not any(m["checked"] for m in methods.values()):
        out.append("Not checked (sampling: temperature > 0).")
    elif not details:
        out.append("Every output is token-identical to AR's.")
    else:
        rows = []
        for d in details[:50]:
            rows.append([str(d["question_id"]), f"`{d['label']}`", str(d["repeat"]), str(d.get("turn", "–")),
                         str(d.get("index", "–")), f"{d.get('ar_token')} {d.get('ar_text', '')!r}",
                         f"{d.get('token')} {d.get('text', '')!r}", _f(d.get("logit_gap"), 4),
                         {True: "yes", False: "no"}.get(d.get("near_tie"), "–")])
        out.append(_table(["question", "method", "repeat", "turn", "index", "AR token", "method token",
                           "logit gap", "near-tie"], rows, left=2))
        if len(details) > 50:
            out.append(f"\n… and {len(details) - 50} more (summary.json has all of them).")
    unchecked = [label for label, m in methods.items() if m.get("agreement")]
    if unchecked and any(m["checked"] for m in methods.values()):
        out += ["", "Not checked (other arithmetic; see their agreement with AR above): "
                + ", ".join(f"`{label}`" for label in unchecked) + "."]
    return out


def _md_errors(summary: dict) -> list[str]:
    """The runs that failed (the first 50), left out of every number."""
    errors = summary.get("errors", [])
    if not errors:
        return []
    out = ["", "## Failed runs", "", "Excluded from every number above; rerunning the command retries them.", ""]
    out.append(_table(["question", "method", "repeat", "error"],
                      [[str(e["question_id"]), f"`{e['label']}`", str(e["repeat"]), e["error"].replace("|", "/")]
                       for e in errors[:50]], left=4))
    return out


def _md_environment(summary: dict) -> list[str]:
    """The command that ran and the machine, software, commit and threads it ran with."""
    env = summary.get("environment", {})
    out = ["", "## Command and environment", "", "```", summary.get("command") or "(not recorded)", "```", ""]
    mach, soft = env.get("machine") or {}, env.get("software") or {}
    out.append(f"- machine: {mach.get('cpu')}, {mach.get('cpu_count')} CPUs, {mach.get('arch')}, {mach.get('os')}")
    out.append("- software: " + ", ".join(f"{k} {v}" for k, v in soft.items() if k != "llama_cpp_system_info"))
    out.append(f"- commit: {', '.join(env.get('commits') or [str(env.get('commit'))])}")
    out.append(f"- threads: {env.get('threads')}")
    if env.get("llama_cpp_system_info"):
        out.append(f"- llama.cpp system_info: `{env['llama_cpp_system_info']}`")
    return out


def render_markdown(summary: dict, plots: list[str]) -> str:
    """report.md: the parameters, then a section each (the tables that apply), then the command and environment."""
    methods = summary["methods"]
    cats = summary["categories"]
    out = _md_intro(summary)
    out += _md_overall(methods)
    out += _md_per_category(methods, cats)
    out += _md_reference_peers(methods, cats)
    out += _md_ttft(methods, cats)
    out += _md_agreement(methods, cats)
    out += _md_repeats(methods, summary.get("parameters", {}))
    out += _md_jacobi(methods, cats)
    out += _md_acceptance(methods)
    out += _md_draft_sources(methods, cats)
    out += _md_losslessness(summary, methods)
    out += _md_errors(summary)
    if plots:
        out += ["", "## Plots", ""] + [f"![{Path(pl).stem}]({Path(pl).name})" for pl in plots]
    out += _md_environment(summary)
    return "\n".join(out) + "\n"


def write_report(out_dir, rows: list[dict], plots: bool = True) -> dict:
    """Write summary.json, report.md and the PNG plots into ``out_dir``; returns the summary. Without matplotlib
    (the ``bench`` extra) the plots are skipped with a one-line note; the report is written all the same."""
    out_dir = Path(out_dir)
    summary = aggregate(rows)
    files = []
    if plots:
        try:
            files = write_plots(summary, out_dir)
        except ImportError as exc:
            print(f"fastforward bench: no plots ({exc.name or 'matplotlib'} is not installed: "
                  "pip install -e '.[bench]'); report.md and summary.json are written without them", file=sys.stderr)
    write_atomic(out_dir / "summary.json", json.dumps(summary, indent=1) + "\n")
    write_atomic(out_dir / "report.md", render_markdown(summary, files))
    return summary
