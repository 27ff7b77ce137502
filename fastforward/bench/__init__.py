"""A Spec-Bench-style harness: every method side by side, losslessness checked, plotted.

The library behind ``fastforward bench`` (``fastforward/cli/bench.py``). Python use (the command does the same)::

    from fastforward.bench import load_questions, select_questions, parse_specs, resolve_specs, run_bench
    questions = select_questions(load_questions("question.jsonl"), per_category=2)
    specs = resolve_specs(parse_specs(["pld,jacobi"]), parse_specs(["hf-generate"], kind="peer"))
    rows = run_bench(ff.load(), questions, specs, "bench-out", max_new_tokens=128)
"""

from .methods import EngineRunner, parse_spec, parse_specs, resolve_specs
from .questions import Question, load_question_file, load_questions, select_questions
from .report import aggregate, geomean, write_report
from .runner import agreement, first_divergence, logit_gap, run_bench
from .spec import MethodSpec, TurnOutcome

__all__ = [
    "EngineRunner",
    "MethodSpec",
    "Question",
    "TurnOutcome",
    "aggregate",
    "agreement",
    "first_divergence",
    "geomean",
    "load_question_file",
    "load_questions",
    "logit_gap",
    "parse_spec",
    "parse_specs",
    "resolve_specs",
    "run_bench",
    "select_questions",
    "write_report",
]
