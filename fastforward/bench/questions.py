"""Benchmark questions: reading the common question-file formats and selecting a subset.

Every record becomes a :class:`Question` with an id, a category and one or more user turns. Supported files
(the format is recognised per record, by its fields):

=====================================  ==========================================  ==========================
file                                   fields used                                 category
=====================================  ==========================================  ==========================
Spec-Bench / MT-Bench ``.jsonl``       ``turns`` (list of user turns), ``category``  the record's (see below)
HumanEval ``.jsonl`` / ``.jsonl.gz``   ``prompt`` (+ ``task_id``), see below         ``humaneval``
GSM8K ``.jsonl``                       ``question`` (+ ``answer``)                   ``gsm8k``
plain ``.jsonl``                       ``prompt`` (+ optional ``id``, ``category``)  the record's, or the folder
Alpaca ``.json`` / ``.jsonl``          ``instruction`` + optional ``input``          ``alpaca``
ShareGPT ``.json``                     ``conversations`` (the human turns)           ``sharegpt``
=====================================  ==========================================  ==========================

Spec-Bench files mix the 8 MT-Bench categories (writing, roleplay, ...) with its own 5 (translation, ...).
Spec-Bench reports the MT-Bench part as one category, "multi-turn conversation", so by default those 8 are folded
into the category ``mt_bench`` (the original name is kept as ``subcategory``; ``--categories`` accepts either).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
MT_BENCH = "mt_bench"


@dataclass
class Question:
    question_id: str  # unique within a run (prefixed by the file's stem when two files share ids)
    category: str
    turns: list[str]
    subcategory: str = ""
    source: str = ""  # the file it came from
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"question_id": self.question_id, "category": self.category, "subcategory": self.subcategory,
                "source": self.source, "turns": list(self.turns)}


def read_question_records(path: Path) -> list[tuple[int, object]]:
    """(line number or index, parsed record) pairs from a .jsonl, .jsonl.gz or .json file (a missing or unreadable
    file, or a line that is not JSON, is a one-line :class:`UsageError`)."""
    if not path.exists():
        raise UsageError(f"questions file {path} does not exist")
    if not path.is_file():
        raise UsageError(f"questions file {path} is not a file")
    name = path.name.lower()
    opener = gzip.open if name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise UsageError(f"questions file {path} cannot be read: {exc}") from None
    stripped = text.lstrip()
    is_jsonl = name.endswith((".jsonl", ".jsonl.gz"))
    if name.endswith((".json", ".json.gz")) or (stripped.startswith("[") and not is_jsonl):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if isinstance(data, dict):  # {"questions": [...]} or {"data": [...]}
            data = next((v for v in data.values() if isinstance(v, list)), None)
        if not isinstance(data, list):
            raise UsageError(f"{path}: expected a JSON array of question records")
        return [(i + 1, rec) for i, rec in enumerate(data)]
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append((lineno, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path} line {lineno}: not valid JSON ({exc.msg})") from None
    return records


def humaneval_prompt(problem: dict) -> str:
    """The user turn for a HumanEval problem: the same instruction ``fastforward eval --task humaneval`` scores, so
    a benchmark on HumanEval times exactly the generations whose pass@1 the evaluation reports."""
    return (
        "Complete the following Python function. Reply with the complete function in one ```python code block."
        f"\n\n```python\n{problem['prompt'].rstrip()}\n```"
    )


def _text(value, where: str, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise UsageError(f"{where}: '{name}' must be a non-empty string")
    return value


def parse_question_record(rec, where: str, default_category: str,
                          fold_mt_bench: bool) -> tuple[object, str, str, list[str]]:
    """(id or None, category, subcategory, turns) of one question record (MT-Bench / Spec-Bench ``turns``, ShareGPT
    ``conversations``, HumanEval or plain ``prompt``, GSM8K ``question``, alpaca ``instruction``); ``where`` names it
    in the one-line :class:`UsageError` a malformed record raises."""
    if not isinstance(rec, dict):
        raise UsageError(f"{where}: a question record must be a JSON object")
    qid = next((rec[k] for k in ("question_id", "task_id", "id") if rec.get(k) not in (None, "")), None)
    category = rec.get("category") if isinstance(rec.get("category"), str) else ""
    if "turns" in rec:
        turns = rec["turns"]
        if not isinstance(turns, list) or not turns:
            raise UsageError(f"{where}: 'turns' must be a non-empty list of strings")
        turns = [_text(t, where, "turns") for t in turns]
    elif "conversations" in rec:
        conv = rec["conversations"]
        if not isinstance(conv, list):
            raise UsageError(f"{where}: 'conversations' must be a list")
        turns = [_text(m.get("value"), where, "conversations.value") for m in conv
                 if isinstance(m, dict) and m.get("from") in ("human", "user")]
        if not turns:
            raise UsageError(f"{where}: the conversation has no human turn")
        category = category or "sharegpt"
    elif "prompt" in rec:
        turns = [_text(rec["prompt"], where, "prompt")]
        if isinstance(rec.get("task_id"), str) and rec["task_id"].startswith("HumanEval"):
            category = category or "humaneval"
            turns = [humaneval_prompt(rec)]
    elif "question" in rec:
        turns = [_text(rec["question"], where, "question")]
        category = category or "gsm8k"
    elif "instruction" in rec:
        prompt = _text(rec["instruction"], where, "instruction")
        extra = rec.get("input")
        if isinstance(extra, str) and extra.strip():
            prompt = f"{prompt}\n\n{extra}"
        turns = [prompt]
        category = category or "alpaca"
    else:
        raise UsageError(
            f"{where}: no question field (expected 'turns', 'prompt', 'question', 'instruction' or 'conversations')"
        )
    category = category or default_category
    subcategory = ""
    if fold_mt_bench and category in MT_BENCH_CATEGORIES:
        category, subcategory = MT_BENCH, category
    return qid, category, subcategory, turns


def load_question_file(path, fold_mt_bench: bool = True) -> list[Question]:
    path = Path(path).expanduser()
    default_category = path.parent.name or path.stem.split(".")[0]
    questions = []
    seen = set()
    for n, rec in read_question_records(path):
        where = f"{path} record {n}" if path.suffix == ".json" else f"{path} line {n}"
        qid, category, subcategory, turns = parse_question_record(rec, where, default_category, fold_mt_bench)
        qid = str(qid) if qid is not None else str(len(questions))
        if qid in seen:
            raise UsageError(f"{where}: duplicate question id '{qid}'")
        seen.add(qid)
        questions.append(Question(qid, category, turns, subcategory, str(path)))
    if not questions:
        raise UsageError(f"questions file {path} holds no questions")
    return questions


def load_questions(paths, fold_mt_bench: bool = True) -> list[Question]:
    """All questions of several files; ids are prefixed with the file's stem where two files share an id."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    per_file = [load_question_file(p, fold_mt_bench) for p in paths]
    if len(per_file) > 1:
        counts: dict[str, int] = {}
        for qs in per_file:
            for q in qs:
                counts[q.question_id] = counts.get(q.question_id, 0) + 1
        stems: dict[str, str] = {}
        for qs in per_file:
            stem = Path(qs[0].source).name.split(".")[0]
            parent = Path(qs[0].source).parent.name
            key = stem if stem not in stems.values() else f"{parent}/{stem}"
            stems[qs[0].source] = key
            for q in qs:
                if counts[q.question_id] > 1:
                    q.question_id = f"{key}:{q.question_id}"
    out = [q for qs in per_file for q in qs]
    ids = [q.question_id for q in out]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise UsageError(f"question id '{dup}' appears twice; give the files different names")
    return out


def parse_per_category(text: str) -> tuple[int | None, dict[str, int]]:
    """``--per-category`` value: ``N`` (every category), ``CAT=M,...`` (only those, M each) or both
    (``4,gsm8k=40``: 40 GSM8K questions, 4 of every other category)."""
    default, overrides = None, {}
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        name, sep, value = part.rpartition("=")
        try:
            n = int(value)
        except ValueError:
            raise UsageError(f"--per-category: '{part}' is not N or CATEGORY=N") from None
        if n <= 0:
            raise UsageError(f"--per-category must be a positive integer, got {n}")
        if sep:
            if not name.strip():
                raise UsageError(f"--per-category: '{part}' has no category name")
            overrides[name.strip()] = n
        else:
            default = n
    if default is None and not overrides:
        raise UsageError("--per-category: give N or CATEGORY=N")
    return default, overrides


def select_questions(
    questions: list[Question],
    categories: list[str] | None = None,
    per_category: int | str | None = None,
    limit: int | None = None,
    spread: bool = True,
) -> list[Question]:
    """Filter by category (a category or an MT-Bench subcategory), then take ``per_category`` from each category
    or ``limit`` overall (``per_category`` may be ``"4,gsm8k=40"``: see :func:`parse_per_category`; a category
    with no count and no default is left out). ``spread`` picks evenly spaced questions (so 8 of Spec-Bench's 80
    MT-Bench questions cover all 8 subcategories) instead of the first ones. The order of the files is kept."""
    default, overrides = (None, {}) if per_category is None else parse_per_category(per_category)
    if limit is not None and limit <= 0:
        raise UsageError(f"--limit must be a positive integer, got {limit}")
    if categories:
        names = [q.category for q in questions] + [q.subcategory for q in questions if q.subcategory]
        known = list(dict.fromkeys(names))
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise UsageError(f"unknown category '{unknown[0]}'; the questions have: {', '.join(known)}")
        wanted = set(categories)
        questions = [q for q in questions if q.category in wanted or q.subcategory in wanted]

    def take(items: list[Question], n: int) -> list[Question]:
        if n >= len(items):
            return list(items)
        if not spread:
            return items[:n]
        return [items[(i * len(items)) // n] for i in range(n)]

    if per_category is not None:
        groups: dict[str, list[Question]] = {}
        for q in questions:
            groups.setdefault(q.category, []).append(q)
        unknown = [c for c in overrides if c not in groups]
        if unknown:
            raise UsageError(f"--per-category: unknown category '{unknown[0]}'; the questions have: "
                             f"{', '.join(groups)}")
        chosen = {id(q) for cat, items in groups.items() if overrides.get(cat, default)
                  for q in take(items, overrides.get(cat, default))}
        questions = [q for q in questions if id(q) in chosen]
    elif limit is not None:
        questions = take(questions, limit)
    if not questions:
        raise UsageError("no questions selected (check --categories, --per-category and --limit)")
    return questions
