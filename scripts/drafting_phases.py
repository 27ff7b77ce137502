"""Where a drafting step's time goes, per method: real greedy decoding of a few benchmark questions, with the time of
every proposer call (what ``fastforward bench`` counts as drafting) split into the drafter's own calls, beside the
target's forward per step.

    python scripts/drafting_phases.py --questions DATA_DIR/spec_bench/question.jsonl --per-category 1 \\
        --methods ar,eagle,fasteagle,falcon,sps --max-new-tokens 128 --threads 2

Per method (ms per decoding step, calls per step, ms per call):

* ``drafting``: the proposer's ``start`` (committing the prompt), ``propose`` and ``observe`` (each also on its
  own) -- the benchmark's
  "drafting ms / step" (steps: the target's forwards, the prefill's one included) -- beside the verification
  forwards (the prefill's chunks excluded) and, from the ``ar`` spec when it is listed first, drafting as a share of
  ``ar``'s forward per step;
* the drafter's calls: ``commit`` (accepted rows into the drafter's cache: EAGLE's ``fuse`` + ``commit``, or
  ``commit_top``, which also gives the root's top-k in the same native call; FastEagle's ``commit``, or
  ``commit_top`` with every depth's head and top-k; Falcon's ``commit``;
  whatever they call inside), ``layer`` (draft rows through the drafter's layer: EAGLE's ``rows``, or
  ``rows_top`` with the rows' head and top-k in the same native call, or ``expand``, the whole expansion in one;
  Falcon's ``first_block`` / ``extend``),
  ``head`` (the draft vocabulary's logits: ``logits``, and ``log_probs`` / ``probs`` where a normalised row is
  wanted), ``top-k`` (what ``top`` adds to the head: the k best per row, natively from the logits where the
  kernels built; before the runners had ``top``, the proposers' ``topk`` counted in ``other``), and for ``sps``
  the draft model's forwards (``draft forward``);
* ``other``: drafting outside those calls (the proposer's own bookkeeping, tree assembly, taps, back-off).

Method specs are the benchmark's (``LABEL=METHOD:KEY=VALUE``): ``eagle:nodes=16`` drafts a tree of 16 every step, so
a step's cost is not averaged with the steps a method skips. With ``--cpu-time`` the clock is this process's CPU
time, which other load on the machine changes far less than wall time (use it with ``--threads 1``).
"""

from __future__ import annotations

import argparse
import collections
import functools
import time

import torch

PHASES = {  # runner class -> {method: phase}
    "Eagle3Runner": {"fuse": "commit", "commit": "commit", "commit_top": "commit", "rows": "layer",
                     "rows_top": "layer", "expand": "layer", "logits": "head", "log_probs": "head", "top": "top-k"},
    "FastEagleRunner": {"commit": "commit", "commit_top": "commit", "logits": "head", "probs": "head",
                        "top": "top-k"},
    "FalconRunner": {"commit": "commit", "first_block": "layer", "extend": "layer", "logits": "head", "probs": "head",
                     "top": "top-k"},
    "DraftModelProposer": {"_forward": "draft forward"},
}
PROPOSER_CALLS = ("start", "propose", "observe")


class Clock:
    """Time per phase. The proposer's calls and the forwards are timed whole; the drafter's calls by what they do
    themselves: a call inside ``commit``, ``layer`` or ``draft forward`` belongs to that phase (EAGLE's commit runs
    its rows through ``rows``), while ``top-k`` counts only what ``top`` adds to the ``head`` it calls."""

    ABSORB = ("commit", "layer", "draft forward")

    def __init__(self, cpu: bool):
        self.now = time.process_time if cpu else time.perf_counter
        self.total = collections.defaultdict(float)
        self.calls = collections.Counter()
        self.stack: list[list] = []  # [phase, time spent in the phases called inside it]

    def wrap(self, owner, name: str, phase: str, drafter: bool = True) -> None:
        f = getattr(owner, name)

        @functools.wraps(f)
        def timed(*args, **kwargs):
            if not drafter:
                t0 = self.now()
                try:
                    return f(*args, **kwargs)
                finally:
                    self.total[phase] += self.now() - t0
                    self.calls[phase] += 1
            if any(frame[0] in self.ABSORB or frame[0] == phase for frame in self.stack):
                return f(*args, **kwargs)
            frame = [phase, 0.0]
            self.stack.append(frame)
            t0 = self.now()
            try:
                return f(*args, **kwargs)
            finally:
                spent = self.now() - t0
                self.stack.pop()
                self.total[phase] += spent - frame[1]
                self.calls[phase] += 1
                if self.stack:
                    self.stack[-1][1] += spent

        setattr(owner, name, timed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", required=True, help="a question file (as fastforward bench reads)")
    parser.add_argument("--per-category", type=int, default=1, help="questions per category (evenly spaced)")
    parser.add_argument("--categories", default=None, help="comma-separated categories (default: all)")
    parser.add_argument("--methods", default="ar,eagle,fasteagle,falcon,sps", help="the benchmark's method specs")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu-time", action="store_true", help="CPU time of this process instead of wall time")
    args = parser.parse_args(argv)
    if not 1 <= args.per_category <= 100 or not 1 <= args.max_new_tokens <= 4096 or not 1 <= args.threads <= 256:
        parser.error("--per-category in [1, 100], --max-new-tokens in [1, 4096], --threads in [1, 256]")
    torch.set_num_threads(args.threads)

    import fastforward as ff
    from fastforward.bench.methods import parse_specs
    from fastforward.bench.questions import load_questions, select_questions
    from fastforward.drafters.eagle import Eagle3Runner
    from fastforward.drafters.falcon import FalconRunner
    from fastforward.drafters.fasteagle import FastEagleRunner
    from fastforward.engine import Generation
    from fastforward.proposers import make_proposer
    from fastforward.proposers.sps import DraftModelProposer
    from fastforward.request import GenerationRequest
    from fastforward.verify import SamplingConfig

    specs = parse_specs([args.methods])
    categories = [c for c in args.categories.split(",") if c] if args.categories else None
    questions = select_questions(load_questions([args.questions]), categories, per_category=args.per_category)
    target = ff.load(args.model)
    clock = Clock(args.cpu_time)
    for cls in (Eagle3Runner, FastEagleRunner, FalconRunner, DraftModelProposer):
        for name, phase in PHASES[cls.__name__].items():
            if hasattr(cls, name):
                clock.wrap(cls, name, phase)
    clock.wrap(target, "forward_many", "forward", drafter=False)
    print(f"{args.model}: {len(questions)} questions, {args.max_new_tokens} new tokens, {args.threads} threads, "
          f"{'CPU' if args.cpu_time else 'wall'} ms")
    ar_forward = None
    for spec in specs:
        clock.total.clear()
        clock.calls.clear()
        steps = tokens = 0
        for q in questions:
            proposer = make_proposer(spec.method, target, **spec.options)
            for name in PROPOSER_CALLS:
                clock.wrap(proposer, name, name, drafter=False)
            prompt = GenerationRequest(q.turns[0], spec.method, max_new_tokens=args.max_new_tokens).prompt_ids(target)
            gen = Generation(target, prompt, proposer, max_new_tokens=args.max_new_tokens,
                             sampling=SamplingConfig(temperature=0.0), seed=0)
            result = gen.run()
            steps += result.stats.target_forwards  # the prefill's forward counts as a step, as the benchmark's
            tokens += len(result.token_ids)
        per_step = {k: 1e3 * v / steps for k, v in clock.total.items()}
        forward = per_step.get("forward", 0.0)
        if spec.label == "ar":
            ar_forward = forward
        drafting = sum(per_step.get(name, 0.0) for name in PROPOSER_CALLS)
        named = sum(per_step.get(p, 0.0) for p in ("commit", "layer", "head", "top-k", "draft forward"))
        line = (f"\n{spec.label}: {steps} steps, {tokens / steps:.2f} tokens/step; drafting {drafting:.3f} ms/step"
                f" (verification forward {forward:.3f} ms/step")
        if ar_forward:
            line += f"; drafting = {drafting / ar_forward:.1%} of ar's forward per step"
        print(line + ")")
        print("  " + ", ".join(f"{name} {per_step.get(name, 0.0):.3f}" for name in PROPOSER_CALLS) + " ms/step")
        for phase in ("commit", "layer", "head", "top-k", "draft forward"):
            if clock.calls[phase]:
                print(f"  {phase:<14}{per_step[phase]:8.3f} ms/step {clock.calls[phase] / steps:6.2f} calls/step "
                      f"{1e3 * clock.total[phase] / clock.calls[phase]:7.3f} ms/call")
        if spec.label != "ar":
            print(f"  {'other':<14}{drafting - named:8.3f} ms/step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
