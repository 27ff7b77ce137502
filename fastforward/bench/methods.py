"""What the benchmark runs: method specs (``[label=]method[:key=value...]``) and the runners that time them.

A *runner* generates one turn and reports what happened (:class:`TurnOutcome`). :class:`EngineRunner` runs a
registered fastforward method through the engine; the peers (HF, llama.cpp) live in :mod:`.peers`. Anything with the
same interface can be benchmarked (the tests use this to inject a deliberately broken method). A runner whose
``exact`` attribute is False (llama.cpp: other arithmetic) is not checked token by token against AR; its agreement
with AR is recorded instead.
"""

from __future__ import annotations

import json
import re
import time

from ..engine import Generation
from ..errors import FastForwardError, UsageError
from ..proposers import available_methods, check_method_options, make_proposer
from ..proposers._options import parse_options
from ..verify import SamplingConfig
from .peers import PEERS, make_peer_runner
from .spec import BASELINE, MethodSpec, TurnOutcome

__all__ = [
    "BASELINE",
    "EngineRunner",
    "MethodSpec",
    "TurnOutcome",
    "apply_option_flags",
    "check_spec_on",
    "effective_options",
    "make_runner",
    "parse_spec",
    "parse_specs",
    "resolve_specs",
    "split_top_level",
]

LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


def split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split on ``sep`` outside brackets and quotes (so ``k=[1,2]`` stays whole)."""
    parts, depth, quote, cur = [], 0, "", []
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def parse_spec(text: str, kind: str = "method") -> MethodSpec:
    """``pld`` | ``pld:k=5`` | ``pld-k5=pld:k=5:max_ngram=3`` -> :class:`MethodSpec`."""
    head, _, opts = text.partition(":")
    label, eq, method = head.partition("=")
    if not eq:
        label = method = head
    label, method = label.strip(), method.strip()
    if not method:
        raise UsageError(f"'{text}' names no method")
    if not LABEL_RE.match(label):
        raise UsageError(f"'{label}' is not a valid label (letters, digits and _ . + - only)")
    pairs = split_top_level(opts, ":") if opts else []
    try:
        options = parse_options(pairs)
    except Exception as exc:  # UsageError (not KEY=VALUE) or whatever literal_eval raised
        raise UsageError(f"in '{text}': {exc}") from None
    return MethodSpec(label, method, options, kind)


def parse_specs(values: list[str] | None, kind: str = "method") -> list[MethodSpec]:
    specs = []
    for value in values or []:
        specs.extend(parse_spec(part, kind) for part in split_top_level(value))
    return specs


def apply_option_flags(specs: list[MethodSpec], flags: list[str] | None) -> None:
    """``LABEL.KEY=VALUE`` flags (``--method-option``) set options of the spec with that label."""
    by_label = {s.label: s for s in specs}
    for flag in flags or []:
        target, dot, pair = flag.partition(".")
        if not dot or "=" not in pair:
            raise UsageError(f"method option '{flag}' is not LABEL.KEY=VALUE")
        if target not in by_label:
            raise UsageError(f"method option '{flag}': no method labelled '{target}' (labels: {', '.join(by_label)})")
        by_label[target].options.update(parse_options([pair]))


def resolve_specs(methods: list[MethodSpec], peers: list[MethodSpec]) -> list[MethodSpec]:
    """Validate names, labels and options (no model needed); the baseline ``ar`` is always run, first."""
    for spec in methods:
        if spec.method in PEERS and spec.method not in available_methods():
            raise UsageError(f"unknown method '{spec.method}' (it is a peer: use --peers); available: "
                             f"{', '.join(available_methods())}")
        if spec.method not in available_methods():
            check_method_options(spec.method, spec.options)  # the unknown method's one-line error
        try:  # the option names and values, against the method's schema
            check_method_options(spec.method, spec.options)
        except UsageError as exc:
            raise UsageError(f"--methods {spec.label}: {exc}") from None
    for spec in peers:
        if spec.method not in PEERS:
            raise UsageError(f"unknown peer '{spec.method}'; available: {', '.join(PEERS)}")
        known = PEERS[spec.method].options
        unknown = sorted(set(spec.options) - set(known))
        if unknown:
            raise UsageError(f"peer '{spec.method}' has no option {', '.join(unknown)} "
                             f"(its options: {', '.join(known) or 'none'})")
    for spec in methods:
        if spec.label == BASELINE and (spec.method != BASELINE or spec.options):
            raise UsageError(f"the label '{BASELINE}' is reserved for the autoregressive baseline")
    specs = [s for s in methods if s.label != BASELINE]
    specs = [MethodSpec(BASELINE, BASELINE)] + specs + list(peers)
    labels = [s.label for s in specs]
    dup = next((x for x in labels if labels.count(x) > 1), None)
    if dup:
        raise UsageError(f"the label '{dup}' is used twice; name one of them, e.g. {dup}-2={dup}:...")
    return specs


def check_spec_on(spec: MethodSpec, target) -> None:
    """A method spec's option values checked on the loaded ``target`` the way ``fastforward generate -o`` checks
    them, by building its proposer once (:func:`~fastforward.proposers.make_proposer`): a drafter path that is not
    there, a forward's rows beyond the model's context ... are a one-line :class:`UsageError` naming the spec, before
    any question runs (types and ranges, such as ``topk=0`` or ``max_ngram=abc``, were refused by
    :func:`resolve_specs` before the model loaded). Peers are checked by their runners."""
    if spec.kind != "method":
        return
    try:
        proposer = make_proposer(spec.method, target, **spec.options)
    except FastForwardError as exc:
        raise UsageError(f"--methods {spec.label}: {exc}") from None
    if proposer.learns_across_requests:
        raise UsageError(f"--methods {spec.label}: it learns from earlier requests, so the run's answers (the "
                         "warm-up's and other methods' answers to the same question) would draft for one another; "
                         "benchmark it without learning")


def effective_options(spec: MethodSpec) -> dict:
    """The options a spec runs with: the method's defaults updated by the given ones (as JSON would store them)."""
    if spec.kind == "peer":
        defaults = dict(PEERS[spec.method].options) if spec.method in PEERS else {}
    else:
        info = available_methods().get(spec.method)
        defaults = info.options() if info is not None else {}
    return json.loads(json.dumps({**defaults, **spec.options}, default=str))


class EngineRunner:
    """Runs a registered fastforward method through the decode engine."""

    def __init__(self, spec: MethodSpec):
        self.spec = spec
        self.lossless = available_methods()[spec.method].lossless

    def generate(self, target, prompt_ids, *, max_new_tokens: int, temperature: float, seed) -> TurnOutcome:
        proposer = make_proposer(self.spec.method, target, **self.spec.options)  # built outside the timing
        gen = Generation(target, prompt_ids, proposer, max_new_tokens=max_new_tokens,
                         sampling=SamplingConfig(temperature=temperature), seed=seed)
        t0 = time.perf_counter()
        result = gen.run()
        wall = time.perf_counter() - t0
        s = result.stats
        return TurnOutcome(
            token_ids=list(result.token_ids), wall_time=wall, decoding_steps=s.target_forwards,
            accept_lengths=list(s.accept_lengths), depth_attempts=list(s.depth_attempts),
            depth_accepts=list(s.depth_accepts), prefill_time=s.prefill_time, draft_time=s.draft_time,
            verify_time=s.verify_time, finish_reason=s.finish_reason, method_stats=dict(s.method_stats),
            proposal_rows=s.proposal_tokens,
        )


def make_runner(spec: MethodSpec):
    if spec.kind == "peer":
        return make_peer_runner(spec)
    return EngineRunner(spec)
