"""``fastforward make-data``: the target's own greedy responses to training prompts (fastforward.train.make_data).

A tiny random target (its tokenizer maps the word ``t12`` to id 12) and hand-written prompt files in the three
formats (ShareGPT ``conversations``, Alpaca ``instruction``/``input``, GSM8K ``question``): records equal what
``fastforward.generate`` gives each prompt; a run killed midway (plus a torn last line) resumes to exactly the
records of an uninterrupted run; duplicates collapse; benchmark files and changed settings are refused; the
held-out split depends on the prompt text only; bad command lines fail in one line before the model loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cli_helpers import fill, run_cli

import fastforward as ff
import fastforward.api
import fastforward.model
import fastforward.train.make_data as make_data_module
from fastforward.costs import CostCurve, CostModel, set_cost_model
from fastforward.errors import UsageError
from fastforward.paths import RUN_MARKER
from fastforward.testing import tiny_hf_folder, tiny_target
from fastforward.train.make_data import (
    BENCHMARK_FILES,
    MANIFEST,
    RESPONSES,
    SUMMARY_REQUEST,
    Prompt,
    category_of,
    make_data,
    read_prompts,
    read_records,
)

MAX_NEW = 6
HELDOUT = 0.3  # large enough that a dozen prompts give both splits
HUGE = "99999999999999999999"


# --------------------------------------------------------------------------------------------------------------
# Prompt files and the target
# --------------------------------------------------------------------------------------------------------------

SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "t3 t4 t5"}, {"from": "gpt", "value": "t9"}]},
    {"id": "b", "conversations": [{"from": "system", "value": "t1"}, {"from": "human", "value": " t7 t8 "},
                                  {"from": "gpt", "value": "t2"}, {"from": "human", "value": "t50"}]},
    {"id": "c", "conversations": [{"from": "gpt", "value": "t6"}]},  # no human turn: skipped
    {"id": "d", "conversations": [{"from": "human", "value": "t30 t31 t32 t33"}]},
    {"id": "e", "conversations": [{"from": "human", "value": "t3 t4 t5"}]},  # the same first turn again
]
ALPACA = [
    {"instruction": "t10 t11", "input": "t12", "output": "t0"},
    {"instruction": "t14 t15 t16", "input": "", "output": "t0"},
    {"instruction": "t3 t4 t5", "input": "", "output": "t0"},  # ShareGPT's first prompt: one record only
    {"instruction": "t40", "input": "t41 t42", "output": "t0"},
    {"instruction": "t60 t61", "input": "", "output": "t0"},
]
GSM8K = [
    {"question": "t20 t21 t22", "answer": "#### 3"},
    {"question": "t23 t24", "answer": "#### 4"},
    {"question": "t70 t71 t72 t73", "answer": "#### 5"},
    {"question": "t80", "answer": "#### 6"},
    {"question": "t10 t11\n\nt12", "answer": "#### 7"},  # Alpaca's instruction + input, word for word: one record
]
# The distinct prompt texts the three files hold.
EXPECTED = {"t3 t4 t5", "t7 t8", "t30 t31 t32 t33", "t10 t11\n\nt12", "t14 t15 t16", "t40\n\nt41 t42", "t60 t61",
            "t20 t21 t22", "t23 t24", "t70 t71 t72 t73", "t80"}


def write_sources(folder: Path) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sharegpt.json").write_text(json.dumps(SHAREGPT))
    (folder / "alpaca.json").write_text(json.dumps(ALPACA))
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    return ",".join(str(folder / n) for n in ("sharegpt.json", "alpaca.json", "train.jsonl"))


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTFORWARD_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def target():
    t = tiny_target(eos_token_id=66)  # EOS ends 3 of the 11 greedy responses early
    # a fixed cost curve: generate_batch sizes its forwards from it, and nothing is measured or cached on disk
    set_cost_model(t, CostModel(CostCurve({1: 1.0, 2: 1.1, 4: 1.3, 8: 1.8, 16: 3.0, 32: 5.5}), learn=False))
    return t


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return write_sources(tmp_path_factory.mktemp("prompts"))


def run(target, out, sources, **kw):
    kw = {"max_new_tokens": MAX_NEW, "heldout": HELDOUT, "max_active": 3, "log": lambda msg: None, **kw}
    return make_data(target, out, sources=sources, **kw)


@pytest.fixture(scope="module")
def reference(target, sources, tmp_path_factory):
    """An uninterrupted run: its folder and its records."""
    out = tmp_path_factory.mktemp("reference") / "data"
    summary = run(target, out, sources)
    records = read_records(out)
    assert summary["records"] == len(records)
    return out, records


def by_key(records) -> dict:
    keys = [r["key"] for r in records]
    assert len(keys) == len(set(keys)), "a prompt appears twice"
    return {r["key"]: r for r in records}


# --------------------------------------------------------------------------------------------------------------
# (1) Records are the target's own greedy responses
# --------------------------------------------------------------------------------------------------------------


def test_records_are_the_targets_greedy_responses(target, reference):
    out, records = reference
    assert {r["prompt"] for r in records} == EXPECTED
    assert {r["source"] for r in records} == {"sharegpt.json", "alpaca.json", "train.jsonl"}
    for r in records:
        assert set(r) == {"key", "source", "split", "prompt", "prompt_ids", "response_ids", "finish_reason"}
        assert r["prompt_ids"] == target.encode(r["prompt"])
        alone = ff.generate(target, r["prompt"], "ar", max_new_tokens=MAX_NEW)
        assert r["response_ids"] == alone.token_ids, r["prompt"]
        assert r["finish_reason"] == alone.finish_reason
        assert r["key"] == Prompt(r["prompt"], "any").key
    # both ways a response ends are covered: EOS (id 66) and the budget
    assert {r["finish_reason"] for r in records} == {"eos", "length"}, [r["response_ids"] for r in records]
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["max_new_tokens"] == MAX_NEW and manifest["model"] == target.name
    assert [Path(s).name for s in manifest["sources"]] == ["sharegpt.json", "alpaca.json", "train.jsonl"]
    assert json.loads((out / RUN_MARKER).read_text())["command"] == "make-data"


def test_sampled_responses_sit_beside_the_greedy_ones_and_resume_to_the_same_samples(target, reference, sources,
                                                                                     tmp_path):
    """--temperature adds one sampled response per prompt under its own key (the greedy records stay); each is
    what generate() samples for that prompt alone with the record's seed, and the seed depends on the prompt, not on
    the batch: a run cut short and resumed draws the same responses."""
    out = tmp_path / "data"
    shutil.copytree(reference[0], out)
    greedy = by_key(reference[1])
    run(target, out, sources, temperature=0.8, max_active=2)
    records = by_key(read_records(out))
    sampled = {k: r for k, r in records.items() if k not in greedy}
    assert {k: r for k, r in records.items() if k in greedy} == greedy
    assert len(sampled) == len(greedy)
    for key, r in sampled.items():
        assert key == f"{Prompt(r['prompt'], 'any').key}-t0.8-s0" and r["temperature"] == 0.8
        assert r["split"] == greedy[Prompt(r["prompt"], "any").key]["split"]  # the prompt's split
        alone = ff.generate(target, r["prompt"], "ar", max_new_tokens=MAX_NEW, temperature=0.8, seed=r["seed"])
        assert r["response_ids"] == alone.token_ids
    assert sum(r["response_ids"] != greedy[k.split("-t")[0]]["response_ids"] for k, r in sampled.items()) >= 3
    # cut short, then resumed with another batch size: the same samples
    again = tmp_path / "again"
    shutil.copytree(reference[0], again)
    run(target, again, sources, temperature=0.8, limit=4)
    run(target, again, sources, temperature=0.8, max_active=5)
    assert by_key(read_records(again)) == records
    assert run(target, again, sources, temperature=0.8)["new_tokens"] == 0  # nothing left to do


def test_plain_ar_steps_make_the_same_records(target, reference, sources, tmp_path):
    """--method ar (one token per step, for many sequences per forward) writes what prompt lookup writes."""
    out = tmp_path / "data"
    run(target, out, sources, method="ar", max_active=5)
    assert by_key(read_records(out)) == by_key(reference[1])


def test_a_finished_run_resumes_to_a_no_op(target, reference, sources):
    out, records = reference
    before = (out / RESPONSES).read_bytes()
    summary = run(target, out, sources)
    assert summary["new_tokens"] == 0 and summary["records"] == len(records)
    assert (out / RESPONSES).read_bytes() == before


# --------------------------------------------------------------------------------------------------------------
# (2) Killed midway: resumed, nothing lost or duplicated
# --------------------------------------------------------------------------------------------------------------


def dying_after(monkeypatch, n: int):
    """Make the next make_data stop (KeyboardInterrupt, as Ctrl-C or a kill would) after ``n`` more records were
    saved: the record writer (``on_result``) raises instead of saving the next one."""
    real = fastforward.api.generate_batch
    saved = [0]

    def generate_batch(*args, on_result=None, **kwargs):
        def save(i, result):
            if saved[0] == n:
                raise KeyboardInterrupt
            on_result(i, result)
            saved[0] += 1

        return real(*args, on_result=save, **kwargs)

    monkeypatch.setattr(fastforward.api, "generate_batch", generate_batch)
    if hasattr(make_data_module, "generate_batch"):  # imported at module level rather than at the call
        monkeypatch.setattr(make_data_module, "generate_batch", generate_batch)


@pytest.mark.parametrize("first, second", [(0, 4), (3, 5), (4, 0)])
def test_killed_midway_resumes_with_nothing_lost_or_duplicated(target, reference, sources, tmp_path, monkeypatch,
                                                               first, second):
    _, expected = reference
    out = tmp_path / "data"
    done = 0
    for n in (first, second):  # killed twice
        with monkeypatch.context() as m:
            dying_after(m, n)
            with pytest.raises(KeyboardInterrupt) as exc:
                run(target, out, sources)
        done += n
        assert f"{done} records kept in {out / RESPONSES}" in str(exc.value)
        records = read_records(out)
        assert len(records) == done
        kept = by_key(records)
        assert all(kept[k] == by_key(expected)[k] for k in kept)  # finished records are final
    # the kill also tore the record being written: half of a line the resumed run must write in full
    missing = next(r for r in expected if r["key"] not in kept)
    line = json.dumps(missing)
    with open(out / RESPONSES, "a") as f:
        f.write(line[: len(line) // 2])
    summary = run(target, out, sources)
    records = read_records(out)
    assert summary["records"] == len(records) == len(expected)
    assert by_key(records) == by_key(expected)
    assert sorted(records, key=lambda r: r["key"]) == sorted(expected, key=lambda r: r["key"])
    text = (out / RESPONSES).read_text()
    assert text.endswith("\n") and all(json.loads(x) for x in text.splitlines())


def test_a_torn_line_alone_is_dropped_on_read(tmp_path):
    (tmp_path / RESPONSES).write_text('{"key": "a"}\n{"key": "b", "sou')
    assert read_records(tmp_path) == [{"key": "a"}]
    assert (tmp_path / RESPONSES).read_text().endswith('"sou')  # reading alone repairs nothing
    assert read_records(tmp_path, repair=True) == [{"key": "a"}]
    assert (tmp_path / RESPONSES).read_text() == '{"key": "a"}\n'


def test_a_broken_line_inside_the_file_is_one_line(tmp_path):
    (tmp_path / RESPONSES).write_text('{"key": "a"}\nnot json\n{"key": "b"}\n')
    with pytest.raises(UsageError, match=f"{RESPONSES}:2 is not a JSON record"):
        read_records(tmp_path)


# --------------------------------------------------------------------------------------------------------------
# (3) Deduplication
# --------------------------------------------------------------------------------------------------------------


def test_the_same_prompt_in_two_files_gives_one_record(reference):
    _, records = reference
    texts = [r["prompt"] for r in records]
    assert texts.count("t3 t4 t5") == 1  # ShareGPT twice + Alpaca once
    assert texts.count("t10 t11\n\nt12") == 1  # Alpaca instruction + input == a GSM8K question
    assert texts.count("t7 t8") == 1  # stripped like every prompt
    assert len(texts) == len(set(texts)) == len(EXPECTED)


def test_read_prompts_dedups_and_mixes_every_source(sources, tmp_path):
    prompts = read_prompts(sources)
    assert [p.text for p in prompts].count("t3 t4 t5") == 1
    assert {p.text for p in prompts} == EXPECTED
    assert {p.source for p in prompts[:3]} == {"sharegpt.json", "alpaca.json", "train.jsonl"}  # round-robin
    again = write_sources(tmp_path / "copy")  # the same files once more: nothing new
    assert [p.text for p in read_prompts(sources + "," + again)] == [p.text for p in prompts]


def test_summaries_and_sql_questions_become_prompts(tmp_path):
    """XSum's articles ask for a one-sentence summary; Spider's questions carry their database's tables (from the
    tables.json beside them) and are categorised as 'summary' and 'sql'."""
    xsum = tmp_path / "XSum-test.jsonl"
    xsum.write_text(json.dumps({"id": "1", "document": " An article. ", "summary": "s"}) + "\n")
    spider = tmp_path / "spider"
    spider.mkdir()
    (spider / "dev.json").write_text(json.dumps([{"db_id": "music", "question": "How many singers?", "query": "q"},
                                                 {"db_id": "unknown", "question": "Which one?", "query": "q"}]))
    (spider / "tables.json").write_text(json.dumps([{
        "db_id": "music", "table_names_original": ["singer", "concert"],
        "column_names_original": [[-1, "*"], [0, "id"], [0, "name"], [1, "year"]]}]))
    prompts = {p.text: p.source for p in read_prompts(f"{xsum},{spider / 'dev.json'}")}
    assert prompts == {
        SUMMARY_REQUEST + "An article.": "XSum-test.jsonl",
        "Write an SQL query for this question.\nTables: singer(id, name); concert(year)\nQuestion: How many singers?":
            "dev.json",
        "Write an SQL query for this question.\nDatabase: unknown\nQuestion: Which one?": "dev.json"}
    assert {category_of(s) for s in prompts.values()} == {"summary", "sql"}


# --------------------------------------------------------------------------------------------------------------
# (4) Refusals
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BENCHMARK_FILES)
def test_a_benchmark_file_is_refused_in_one_line(target, sources, tmp_path, name):
    bench = tmp_path / name
    bench.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["t5 t6"]}) + "\n")
    out = tmp_path / "data"
    with pytest.raises(UsageError) as exc:
        run(target, out, f"{sources},{bench}")
    assert "\n" not in str(exc.value) and "benchmark" in str(exc.value) and name in str(exc.value)
    assert not out.exists()  # refused before anything is written


def test_a_resume_with_other_settings_is_refused(target, sources, tmp_path):
    out = tmp_path / "data"
    run(target, out, sources, limit=2)
    before = (out / RESPONSES).read_bytes()
    with pytest.raises(UsageError, match="max_new_tokens=6, not 7") as exc:
        run(target, out, sources, max_new_tokens=MAX_NEW + 1)
    assert "\n" not in str(exc.value)
    with pytest.raises(UsageError, match="heldout"):
        run(target, out, sources, heldout=0.1)
    assert (out / RESPONSES).read_bytes() == before
    run(target, out, sources, limit=4)  # the same settings: resumed, 2 more prompts
    assert len(read_records(out)) == 4


@pytest.mark.parametrize("kwargs, match", [
    ({"heldout": 1.0}, "--heldout"),
    ({"heldout": float("nan")}, "--heldout"),
    ({"limit": 0}, "--limit"),
    ({"limit": -1}, "--limit"),
])
def test_bad_arguments_are_refused_before_any_work(target, sources, tmp_path, kwargs, match):
    out = tmp_path / "data"
    with pytest.raises(UsageError, match=match):
        run(target, out, sources, **kwargs)
    assert not out.exists()


def test_a_folder_of_another_command_is_refused(target, sources, tmp_path):
    out = tmp_path / "data"
    out.mkdir()
    (out / RUN_MARKER).write_text(json.dumps({"command": "train"}))
    with pytest.raises(UsageError, match="'fastforward train'"):
        run(target, out, sources)
    assert [p.name for p in out.iterdir()] == [RUN_MARKER]


def test_out_with_a_tilde_is_the_home_folder(target, sources, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    run(target, "~/data", sources, limit=1)
    assert len(read_records(tmp_path / "home" / "data")) == 1
    assert not (tmp_path / "~").exists()


# --------------------------------------------------------------------------------------------------------------
# (5) The held-out split is a function of the prompt text only
# --------------------------------------------------------------------------------------------------------------


def test_the_split_depends_on_the_prompt_text_only(target, reference, sources, tmp_path):
    _, records = reference
    assert {r["split"] for r in records} == {"train", "heldout"}
    for r in records:
        assert r["split"] == ("heldout" if Prompt(r["prompt"], "elsewhere").heldout(HELDOUT) else "train")
    # another seed (another order), other file names, another mix, a prefix: every prompt keeps its split
    other = tmp_path / "other"
    other.mkdir()
    (other / "chat.json").write_text(json.dumps(list(reversed(SHAREGPT))))
    (other / "more.jsonl").write_text("".join(json.dumps({"prompt": f"t{i} t{i + 1}"}) + "\n" for i in range(81, 90)))
    out = tmp_path / "data"
    run(target, out, f"{other / 'more.jsonl'},{other / 'chat.json'},{sources.split(',')[2]}", seed=7, limit=10)
    split = {r["key"]: r["split"] for r in records}
    mixed = read_records(out)
    assert len(mixed) == 10
    shared = [r for r in mixed if r["key"] in split]
    assert shared, "the two runs share no prompt"
    for r in mixed:
        assert r["split"] == ("heldout" if Prompt(r["prompt"], "x").heldout(HELDOUT) else "train")
        if r["key"] in split:
            assert r["split"] == split[r["key"]]


def test_a_larger_heldout_fraction_only_adds_prompts():
    prompts = [Prompt(f"t{i} t{i * 7 % 96}", "s") for i in range(200)]
    small = {p.key for p in prompts if p.heldout(0.05)}
    large = {p.key for p in prompts if p.heldout(0.3)}
    assert small < large and 0 < len(small) < 30 and 30 < len(large) < 90
    assert not any(p.heldout(0.0) for p in prompts)


# --------------------------------------------------------------------------------------------------------------
# The command line: bad input in one line before the model loads; a run; Ctrl-C
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory, sources):
    root = tmp_path_factory.mktemp("cli")
    tiny = tiny_hf_folder(root / "tiny", max_positions=64)
    hfonly = root / "hfonly"  # config.json only: no tokenizer, no weights
    hfonly.mkdir()
    (hfonly / "config.json").write_text(json.dumps({"model_type": "llama"}))
    q = root / "question.jsonl"  # a benchmark's questions
    q.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["t5 t6"]}) + "\n")
    (root / "broken.jsonl").write_text('{"prompt": "t1"}\n{"prompt": \n')
    (root / "odd.json").write_text(json.dumps([{"text": "t1 t2"}]))
    (root / "empty.json").write_text(json.dumps([{"conversations": [{"from": "gpt", "value": "t1"}]}]))
    foreign = root / "foreign"
    foreign.mkdir()
    (foreign / "notes.md").write_text("# mine\n")
    other = root / "other-command"
    other.mkdir()
    (other / RUN_MARKER).write_text(json.dumps({"command": "train"}))
    (root / "a-file.txt").write_text("x\n")
    return {"{tiny}": str(tiny), "{hfonly}": str(hfonly), "{data}": sources, "{q}": str(q), "{dir}": str(root),
            "{foreign}": str(foreign), "{other}": str(other), "{file}": str(root / "a-file.txt")}


OUT = "{dir}/never-written"
MD = ["make-data", "--model", "{tiny}", "--data", "{data}", "--out", OUT, "--max-new-tokens", "4"]

CASES = [
    (MD + ["--limit", "0"], "--limit"),
    (MD + ["--limit", "-3"], "--limit"),
    (MD + ["--limit", "2.5"], "--limit"),
    (MD + ["--max-new-tokens", "0"], "--max-new-tokens"),
    (MD + ["--max-new-tokens", "1e3"], "--max-new-tokens"),
    (MD + ["--max-active", "0"], "--max-active"),
    (MD + ["--max-active", "1025"], "--max-active"),
    (MD + ["--max-batch-tokens", "0"], "--max-batch-tokens"),
    (MD + ["--max-batch-tokens", "4097"], "--max-batch-tokens"),
    (MD + ["--seed", HUGE], "--seed"),
    (MD + ["--seed", "-1"], "--seed"),
    (MD + ["--temperature", "-1"], "--temperature"),
    (MD + ["--method", "eagle"], "--method"),
    (MD + ["--temperature", "nan"], "--temperature"),
    (MD + ["--heldout", "nan"], "--heldout"),
    (MD + ["--heldout", "1"], "--heldout"),
    (MD + ["--heldout", "-0.1"], "--heldout"),
    (MD + ["--data", "{dir}/no-such-file.json"], "data file not found"),
    (MD + ["--data", ""], "no data file given"),
    (MD + ["--data", "{data},{q}"], "benchmark"),
    (MD + ["--data", "{dir}/broken.jsonl"], "cannot read"),
    (MD + ["--data", "{dir}/odd.json"], "unsupported record"),
    (MD + ["--data", "{dir}/empty.json"], "no usable prompts"),
    (MD + ["--out", "{foreign}"], "did not write"),
    (MD + ["--out", "{other}"], "'fastforward train'"),
    (MD + ["--out", "{file}"], "not a folder"),
    (MD + ["--model", "{hfonly}"], "has no tokenizer"),
    (MD + ["--bogus"], "unrecognized arguments"),
]


@pytest.mark.parametrize("argv, match", CASES, ids=[" ".join(a[-2:]) for a, _ in CASES])
def test_bad_input_is_one_line_exit_2_before_any_work(files, no_load, capsys, argv, match):
    before = {p: sorted(Path(files[p]).iterdir()) for p in ("{foreign}", "{other}")}
    code, out, err = run_cli(capsys, *fill(files, argv))
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("fastforward") and "Traceback" not in err + out, err
    assert match in lines[0], lines[0]
    assert not Path(fill(files, [OUT])[0]).exists()
    assert {p: sorted(Path(files[p]).iterdir()) for p in before} == before


def test_the_command_writes_resumes_and_says_so_when_interrupted(files, target, reference, tmp_path, monkeypatch,
                                                                 capsys):
    monkeypatch.setattr(ff, "load", lambda *a, **k: target)
    out = tmp_path / "data"
    argv = ["make-data", "--model", "tiny", "--data", files["{data}"], "--out", out, "--max-new-tokens", MAX_NEW,
            "--heldout", HELDOUT, "--max-active", 2, "--limit", 5]
    with monkeypatch.context() as m:
        dying_after(m, 2)
        code, _, err = run_cli(capsys, *argv)
    assert code == 130, err
    lines = [line for line in err.splitlines() if line.startswith("fastforward")]
    assert len(lines) == 1 and lines[0].startswith("fastforward: interrupted: 2 records kept") and "resume" in lines[0]
    code, stdout, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert f"saved {out}/{RESPONSES}: 5 records" in stdout
    assert "2 records already" in stdout and "3 prompts to go" in stdout
    records = by_key(read_records(out))
    assert set(records) == {p.key for p in read_prompts(files["{data}"])[:5]}  # --limit: the first 5 of the mix
    assert all(records[k] == by_key(reference[1])[k] for k in records)


def test_a_second_writer_on_the_same_folder_is_refused(target, sources, tmp_path):
    import fcntl

    out = tmp_path / "data"
    run(target, out, sources, limit=1)
    with open(out / ".make_data.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another make-data at work
        with pytest.raises(UsageError, match="another 'fastforward make-data' is writing"):
            run(target, out, sources, limit=2)
    assert len(read_records(out)) == 1


@pytest.mark.parametrize("temperature, method", [(0.0, "pld"), (0.9, "pld"), (0.0, "ar")])
def test_features_recorded_while_generating_match_a_separate_pass(target, sources, tmp_path, temperature, method):
    """--features stores, per record, the taps and final states the generation's own forwards computed: the same
    as computing them afterwards over prompt + response (up to bf16 storage), for sampled responses too."""
    from fastforward.drafters.features import FeatureStore, compute_features

    out = tmp_path / "data"
    run(target, out, sources, limit=3, features=True, temperature=temperature, method=method)
    store = FeatureStore(out)
    assert len(read_records(out)) == 3
    for rec in read_records(out):
        ids = rec["prompt_ids"] + rec["response_ids"]
        stored = store.get(rec)
        fresh = compute_features(target, ids)
        n = len(ids) - 1  # the last token is never read by a forward: zeros
        assert stored["taps"].shape == (len(ids), 3, target.config.hidden_size)
        scale = fresh["taps"][:n].abs().max()
        assert (stored["taps"][:n] - fresh["taps"][:n]).abs().max() <= 0.01 * scale
        assert (stored["final"][:n] - fresh["final"][:n]).abs().max() <= 0.01 * fresh["final"][:n].abs().max()
