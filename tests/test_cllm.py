"""CLLM: Jacobi-trajectory collection (fixed points = AR output, augmentation, repetition filter, resume) and
consistency training (global/local/AR losses, a 5-step run loadable by `fastforward generate`, resume), on a tiny
random float32 HF model, plus one-line usage errors."""

import json
import random

import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli

import fastforward as ff
from fastforward.testing import tiny_hf_folder
from fastforward.train import trajectories as traj_mod
from fastforward.train.cllm import (
    CLLM,
    CLLMRecord,
    ar_loss,
    consistency_kl,
    converged_prefix_mask,
    read_records,
)
from fastforward.train.trajectories import (
    augment_state,
    augment_trajectory,
    ngram_repeat_ratio,
    repetition_reason,
)

N_TOKEN = 4
MAX_NEW = 24
NO_FILTER = ["--max-ngram-repeat", "1", "--max-sentence-repeats", "1000"]  # a tiny random model loops a lot


# --------------------------------------------------------------------------------------------------------------
# Fixtures and helpers
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return str(tiny_hf_folder(tmp_path_factory.mktemp("tiny-hf"), max_positions=256))


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "gsm8k.jsonl"
    rows = [{"question": f"Tom has {i} apples and buys {i + 2} more. How many now?", "answer": f"#### {2 * i + 2}"}
            for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def collect_args(model, prompts, out, *extra):
    return ["collect-trajectories", "--model", model, "--prompts", prompts, "--out", out, "--n-token", N_TOKEN,
            "--max-new-tokens", MAX_NEW, "--threads", "1", "--quiet", *NO_FILTER, *extra]


def records_of(out):
    return [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def collected(tiny_folder, prompts_file, tmp_path_factory):
    """An uninterrupted collection of 4 prompts (the reference for the resume tests, the data for training)."""
    out = tmp_path_factory.mktemp("traj") / "straight"
    meta = traj_mod.collect(tiny_folder, prompts_file, str(out), n_token=N_TOKEN, max_new_tokens=MAX_NEW, limit=4,
                            max_ngram_repeat=1.0, max_sentence_repeats=1000, threads=1, quiet=True)
    assert meta["complete"] and meta["records"] > 0
    return out


def weights(folder):
    from safetensors.torch import load_file

    return load_file(f"{folder}/model.safetensors")


# --------------------------------------------------------------------------------------------------------------
# Collection
# --------------------------------------------------------------------------------------------------------------


def test_every_trajectory_ends_at_the_ar_continuation_of_its_prefix(tiny_folder, prompts_file, collected):
    questions = [json.loads(line)["question"] for line in open(prompts_file)]
    recs = records_of(collected)
    meta = json.loads((collected / "meta.json").read_text())
    assert meta["records"] == len(recs) and meta["n_token"] == N_TOKEN and meta["prompts_done"] == 4
    target = ff.load(tiny_folder)
    answers = {}
    for r in recs:
        assert len(r["states"]) >= 2 and r["states"][-1] == r["fixed_point"] and len(r["fixed_point"]) == N_TOKEN
        assert all(len(s) == N_TOKEN for s in r["states"])
        key = r["prompt_id"]
        if key not in answers:
            ar = ff.generate(target, r["prompt_ids"], "ar", max_new_tokens=MAX_NEW)
            answers[key] = ar.token_ids
        assert r["prompt_ids"] == target.encode(questions[int(key)])  # the chat-templated question
        assert r["answer_ids"] == answers[key]  # the greedy answer kept for the AR loss
        start = r["prefix_length"] - r["prompt_length"]
        assert r["fixed_point"] == answers[key][start : start + N_TOKEN]
        # ... which is the AR continuation of the block's own prefix
        prefix = (r["prompt_ids"] + r["answer_ids"])[: r["prefix_length"]]
        assert ff.generate(target, prefix, "ar", max_new_tokens=N_TOKEN).token_ids == r["fixed_point"]
    # blocks of one prompt are consecutive: block b starts where block b-1 ended
    by_prompt = {}
    for r in recs:
        by_prompt.setdefault(r["prompt_id"], []).append(r)
    for rs in by_prompt.values():
        assert [r["block"] for r in rs] == list(range(len(rs)))
        assert [r["prefix_length"] for r in rs] == [rs[0]["prefix_length"] + N_TOKEN * b for b in range(len(rs))]
        assert rs[0]["prefix_length"] == rs[0]["prompt_length"] + 1  # the prefill's token is the first root


def test_augmentation_only_replaces_wrong_tokens_with_correct_ones():
    rng = random.Random(0)
    corrected = 0
    for _ in range(300):
        n = rng.randint(1, 12)
        fixed = [rng.randrange(6) for _ in range(n)]
        state = [rng.randrange(6) for _ in range(n)]
        new = augment_state(state, fixed, rng, prob=0.5)
        wrong = [i for i in range(n) if state[i] != fixed[i]]
        for i in range(n):
            if state[i] == fixed[i]:
                assert new[i] == state[i]  # a correct token is never touched
            else:
                assert new[i] in (state[i], fixed[i])  # a wrong token stays or becomes the correct one
        if wrong:
            assert any(new[i] != fixed[i] for i in wrong)  # never collapses into the fixed point
        corrected += sum(new[i] != state[i] for i in wrong)
        assert augment_state(fixed, fixed, rng) == fixed
    assert corrected > 100
    states = [[1, 2, 3], [4, 2, 5], [4, 9, 6]]
    out = augment_trajectory(states, [4, 9, 6], random.Random(1), prob=1.0)
    assert out[-1] == [4, 9, 6] and len(out) == 3


def test_augmented_collection_corrects_the_same_trajectories(tiny_folder, prompts_file, collected, tmp_path):
    out = tmp_path / "aug"
    traj_mod.collect(tiny_folder, prompts_file, str(out), n_token=N_TOKEN, max_new_tokens=MAX_NEW, limit=4,
                     augment=True, max_ngram_repeat=1.0, max_sentence_repeats=1000, threads=1, quiet=True)
    raw, aug = records_of(collected), records_of(out)
    assert len(raw) == len(aug)
    changed = 0
    for r, a in zip(raw, aug, strict=True):
        assert a["augmented"] and not r["augmented"]
        assert (a["prompt_id"], a["block"], a["fixed_point"]) == (r["prompt_id"], r["block"], r["fixed_point"])
        assert len(a["states"]) == len(r["states"]) and a["states"][-1] == r["states"][-1]
        fp = r["fixed_point"]
        for s_raw, s_aug in zip(r["states"], a["states"], strict=True):
            for i, (x, y) in enumerate(zip(s_raw, s_aug, strict=True)):
                assert y == x or (x != fp[i] and y == fp[i])
                changed += y != x
    assert changed > 0


def test_repetition_filter_drops_a_planted_repetitive_sample_and_keeps_a_clean_one():
    clean_text = ("Tom starts with 3 apples. He buys 5 more apples at the shop. "
                  "So he has 3 + 5 = 8 apples.\n#### 8")
    clean_ids = list(clean_text.encode())
    assert repetition_reason(clean_ids, clean_text) is None
    loop_ids = [7, 8, 9, 10, 11] * 30
    assert ngram_repeat_ratio(loop_ids) > 0.9
    assert repetition_reason(loop_ids, "t7 t8 t9 t10 t11 " * 30) == "token"
    sentence_text = "Let me think about it. " + "He buys 5 more apples at the shop. " * 3 + "So 8."
    varied = list(range(200))  # no repeated token n-gram: only the sentence rule can fire
    assert repetition_reason(varied, sentence_text) == "sentence"
    assert repetition_reason(varied, sentence_text, max_sentence_repeats=3) is None


def test_collection_drops_a_repetitive_answer(tiny_folder, prompts_file, tmp_path, monkeypatch):
    real = traj_mod.collect_prompt
    planted = {}

    def plant(target, prompt_ids, **kw):
        answer, trajs, stats = real(target, prompt_ids, **kw)
        if not planted:  # the first prompt "answers" in a loop
            planted["ids"] = prompt_ids
            return [5, 6, 7, 8] * 10, trajs, stats
        return answer, trajs, stats

    monkeypatch.setattr(traj_mod, "collect_prompt", plant)
    out = tmp_path / "filtered"
    meta = traj_mod.collect(tiny_folder, prompts_file, str(out), n_token=N_TOKEN, max_new_tokens=MAX_NEW, limit=2,
                            max_sentence_repeats=1000, threads=1, quiet=True)
    done = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert done[0]["dropped"] == "token" and not done[0]["kept"] and done[0]["records"] == 0
    assert done[1]["kept"] and done[1]["records"] > 0  # the tiny model's real answer is not a 4-token loop
    assert {r["prompt_id"] for r in records_of(out)} == {done[1]["prompt_id"]}
    assert meta["dropped_token_repetition"] == 1 and meta["prompts_kept"] == 1


def test_collection_resumes_after_a_kill_without_loss_or_duplicates(tiny_folder, prompts_file, collected, tmp_path,
                                                                     monkeypatch, capsys):
    out = tmp_path / "killed"
    real = traj_mod.collect_prompt
    calls = []

    def killed_on_third(target, prompt_ids, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(target, prompt_ids, **kw)

    monkeypatch.setattr(traj_mod, "collect_prompt", killed_on_third)
    code, _, err = run_cli(capsys, *collect_args(tiny_folder, prompts_file, out, "--limit", 3))
    assert code == 130, err
    monkeypatch.setattr(traj_mod, "collect_prompt", real)
    first = (out / "trajectories.jsonl").read_text()
    assert len((out / "prompts.jsonl").read_text().splitlines()) == 2
    # a kill in the middle of writing the next prompt: a partial line and records of an unfinished prompt
    with open(out / "trajectories.jsonl", "a") as f:
        f.write(json.dumps({"prompt_id": "2", "block": 0, "states": []}) + "\n" + '{"prompt_id": "2", "blo')
    code, stdout, err = run_cli(capsys, *collect_args(tiny_folder, prompts_file, out, "--limit", 4))  # limit grows
    assert code == 0, err
    assert "4/4 prompts done" in stdout
    text = (out / "trajectories.jsonl").read_text()
    assert text.startswith(first)  # nothing already written is lost or rewritten
    assert text == (collected / "trajectories.jsonl").read_text()  # == an uninterrupted run: no duplicates
    keys = [(r["prompt_id"], r["block"]) for r in records_of(out)]
    assert len(keys) == len(set(keys))
    # a finished collection re-run does nothing; --limit may grow; other settings are refused
    code, stdout, err = run_cli(capsys, *collect_args(tiny_folder, prompts_file, out, "--limit", 4))
    assert code == 0 and (out / "trajectories.jsonl").read_text() == text, err
    assert_one_line_error(capsys, *collect_args(tiny_folder, prompts_file, out, "--limit", 4, "--seed", 1),
                          match="other settings (seed)")


# --------------------------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------------------------


def test_pure_losses_are_zero_at_the_fixed_point_and_positive_otherwise():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 11, generator=g)
    include = torch.ones(2, 4, dtype=torch.bool)
    assert consistency_kl(logits, logits.clone(), include).abs().max() < 1e-6
    other = torch.randn(2, 4, 11, generator=g)
    kl = consistency_kl(other, logits, include)
    assert (kl > 1e-3).all()
    assert consistency_kl(other, logits, torch.zeros(2, 4, dtype=torch.bool)).eq(0).all()  # all masked
    # gradients reach the student only (stop-gradient on the teacher)
    s, t = other.clone().requires_grad_(), logits.clone().requires_grad_()
    consistency_kl(s, t, include).sum().backward()
    assert s.grad.abs().sum() > 0 and t.grad is None
    # the converged-prefix mask: position i is trained iff the state differs from the teacher before i
    states = torch.tensor([[1, 2, 3, 4], [1, 9, 3, 9], [7, 2, 3, 4]])
    fixed = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    assert converged_prefix_mask(states, fixed).tolist() == [
        [False] * 4, [False, False, True, True], [False, True, True, True]]
    valid = torch.tensor([[True] * 4, [True, True, True, False], [True] * 4])
    assert converged_prefix_mask(states, fixed, valid)[1].tolist() == [False, False, True, False]
    # AR loss: per-record mean over labelled tokens
    labels = torch.tensor([[-100, 3, 4, -100], [-100, -100, 1, 2]])
    lg = torch.full((2, 4, 11), -20.0)
    for b in range(2):
        for j in range(3):
            if labels[b, j + 1] >= 0:
                lg[b, j, labels[b, j + 1]] = 20.0
    assert ar_loss(lg, labels).max() < 1e-6
    assert (ar_loss(lg, labels, label_smoothing=0.1) > 0).all()


@pytest.mark.parametrize("kind", ["global", "local"])
@pytest.mark.parametrize("mask", [True, False], ids=["masked", "unmasked"])
def test_model_consistency_loss_is_zero_at_the_fixed_point_and_positive_otherwise(tiny_folder, kind, mask):
    model = ff.load(tiny_folder, backend="hf").hf_model
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (40,), generator=g).tolist()
    fp = ids[14:18]
    wrong = [(t + 1) % 256 for t in fp]
    converged = CLLMRecord(ids, 10, 14, [fp, fp], fp)
    other = CLLMRecord(ids[:35], 8, 14, [wrong, [fp[0], wrong[1], fp[2], wrong[3]], fp], fp)
    method = CLLM(kind, ar_weight=0.0, mask=mask, seed=0)
    with torch.no_grad():
        zero = method.loss(model, method.collate([converged, converged], 0))
        assert abs(float(zero)) < 1e-5
        for key in range(4):  # whichever state is drawn, it differs from its teacher
            batch = method.collate([converged, other], key)
            assert batch["num_tokens"] == 2
            per = method.loss(model, batch)
            assert float(per) > 1e-4
            single = method.loss(model, method.collate([other], key))
            assert float(single) > 1e-4
    # with the AR loss, a batch of two equals the sum of the two records alone (padding is inert)
    method_ar = CLLM(kind, ar_weight=10.0, mask=mask, seed=0)
    with torch.no_grad():
        both = method_ar.loss(model, method_ar.collate([other, converged], 3))
        a = method_ar.loss(model, method_ar.collate([other], 3))
        b = method_ar.loss(model, method_ar.collate([converged], 3))
    # (row 0 draws its state first, so it gets the same state in both batches)
    assert method_ar.collate([other, converged], 3)["state_index"][0] == method_ar.collate([other], 3)["state_index"][0]
    torch.testing.assert_close(both, a + b, rtol=1e-4, atol=1e-4)
    assert float(b) > 0  # the AR term (label-smoothed) is never zero


# --------------------------------------------------------------------------------------------------------------
# Training runs
# --------------------------------------------------------------------------------------------------------------


def train_args(model, traj, out, *extra):
    return ["train", "cllm", "--model", model, "--trajectories", traj, "--out", out, "--batch-size", "2",
            "--grad-accum", "1", "--max-length", "128", "--threads", "1", "--quiet", *extra]


def test_records_load_and_batch_pads_properly(collected):
    recs, dropped = read_records(collected / "trajectories.jsonl", 128)
    assert dropped == 0 and len(recs) == len(records_of(collected))
    r = recs[0]
    assert r.input_ids[r.prefix_length : r.prefix_length + r.n] == r.fixed_point
    batch = CLLM("global").collate(recs[:3], 7)
    for row, e in enumerate(recs[:3]):
        end = e.prefix_length + e.n
        assert batch["student_ids"][row, : e.prefix_length].tolist() == e.input_ids[: e.prefix_length]
        assert batch["student_ids"][row, e.prefix_length : end].tolist() in e.states[:-1]
        assert batch["student_mask"][row].sum() == end
        assert batch["teacher_ids"][row, e.prefix_length : end].tolist() == e.fixed_point
    assert read_records(collected / "trajectories.jsonl", recs[0].prefix_length + 1)[1] > 0  # too long: dropped


@pytest.mark.parametrize("kind", [["--full"], ["--lora", "4", "--lr", "1e-2", "--loss", "local"]],
                         ids=["full-global", "lora-local"])
def test_five_steps_write_a_model_generate_loads(tiny_folder, collected, tmp_path, capsys, kind):
    out = tmp_path / "run"
    code, stdout, err = run_cli(capsys, *train_args(tiny_folder, collected, out, "--max-steps", 5, "--save-every", 5,
                                                   *kind))
    assert code == 0, err
    assert "step 5/5" in stdout
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5] and all(r["loss"] > 0 for r in log)
    summary = json.loads((out / "fastforward_train.json").read_text())
    stats = summary["method_stats"]
    assert stats["records_seen"] == 10 and stats["mean_ar"] > 0 and stats["mean_consistency"] >= 0
    assert summary["identity"]["loss"] == ("local" if "local" in kind else "global")
    for folder in (out, out / "checkpoints" / "step-000005"):
        code, stdout, err = run_cli(capsys, "generate", "--model", folder, "Add 1 and 2.", "--max-new-tokens", 6,
                                    "--json")
        assert code == 0, err
        assert len(json.loads(stdout)["token_ids"]) <= 6
    assert not torch.equal(weights(out)["model.layers.0.self_attn.q_proj.weight"],
                           weights(tiny_folder)["model.layers.0.self_attn.q_proj.weight"])


def test_train_resumes_from_step_3(tiny_folder, collected, tmp_path, capsys):
    # a constant learning rate, so stopping at 3 of 3 steps and going on to 5 is the same schedule as 5 straight
    common = ["--full", "--save-every", 3, "--seed", 2, "--schedule", "constant", "--warmup", "0"]
    code, _, err = run_cli(capsys, *train_args(tiny_folder, collected, tmp_path / "straight", "--max-steps", 5,
                                               *common))
    assert code == 0, err
    out = tmp_path / "resumed"
    code, stdout, err = run_cli(capsys, *train_args(tiny_folder, collected, out, "--max-steps", 3, *common))
    assert code == 0 and "step 3/3" in stdout, err
    argv = [a for a in train_args(tiny_folder, collected, out, "--max-steps", 5, *common) if a != "--quiet"]
    code, stdout, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert "resuming from step 3" in err and "step 5/5" in stdout and "2 steps in" in stdout
    log = [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log == [1, 2, 3, 4, 5]
    a, b = weights(tmp_path / "straight"), weights(out)
    for name in a:  # the resumed run sees the same states, batches and schedule as the uninterrupted one
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)
    assert_one_line_error(capsys, *train_args(tiny_folder, collected, out, "--max-steps", 6, *common,
                                              "--ar-weight", "1"), match="different settings (ar_weight)")


# --------------------------------------------------------------------------------------------------------------
# Usage errors
# --------------------------------------------------------------------------------------------------------------


def test_bad_input_gives_one_line_errors(tiny_folder, prompts_file, collected, tmp_path, capsys):
    out = tmp_path / "x"
    assert_one_line_error(capsys, *train_args(tiny_folder, tmp_path / "missing", out), match="no trajectories at")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "trajectories.jsonl").write_text("")
    assert_one_line_error(capsys, *train_args(tiny_folder, tmp_path / "empty", out), match="no trajectory records")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "trajectories.jsonl").write_text('{"prompt_ids": [1]}\n')
    assert_one_line_error(capsys, *train_args(tiny_folder, tmp_path / "bad", out), match="not a trajectory record")
    assert_one_line_error(capsys, *train_args(tiny_folder, collected, out, "--ar-weight", "-1"), match="--ar-weight")
    assert_one_line_error(capsys, *train_args(tiny_folder, collected, out, "--label-smoothing", "1"),
                          match="--label-smoothing")
    assert_one_line_error(capsys, *train_args(tiny_folder, collected, out, "--loss", "mid"))
    assert_one_line_error(capsys, *train_args(tiny_folder, collected, out, "--max-length", "3"),
                          match="fits --max-length")
    assert_one_line_error(capsys, "train", "cllm", "--model", tiny_folder, "--out", out)  # --trajectories missing
    for flags, match in [(["--n-token", "0"], "--n-token"), (["--n-token", "1"], "--n-token"),
                         (["--max-new-tokens", "4"], "--max-new-tokens"), (["--limit", "0"], "--limit"),
                         (["--augment-prob", "0"], "--augment-prob")]:
        assert_one_line_error(capsys, *collect_args(tiny_folder, prompts_file, out, *flags), match=match)
    assert_one_line_error(capsys, *collect_args(tiny_folder, tmp_path / "nope.jsonl", out), match="does not exist")
    assert_one_line_error(capsys, *collect_args(str(tmp_path / "no-model"), prompts_file, out))
    assert not (out / "trajectories.jsonl").exists()


def test_the_trainer_hook_leaves_instruction_data_training_alone(tiny_folder, tmp_path, capsys):
    """The trainer's optional ``load_records`` hook (used by cllm) must not change methods that read --data."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"t{i} t{i + 1}", "response": f"t{i + 2} t{i + 3}"}) + "\n"
                            for i in range(12)))
    out = tmp_path / "msn"
    code, stdout, err = run_cli(capsys, "train", "msn", "--model", tiny_folder, "--data", data, "--out", out,
                                "--max-steps", 2, "--batch-size", 2, "--grad-accum", 1, "--full", "--threads", 1,
                                "--quiet", "--heldout", "0")
    assert code == 0 and "step 2/2" in stdout, err
    assert json.loads((out / "fastforward_train.json").read_text())["method_stats"]["sequences_seen"] == 4


def test_training_on_an_unfinished_collection_says_so(tiny_folder, collected, tmp_path, capsys):
    import shutil

    part = tmp_path / "partial"
    shutil.copytree(collected, part)
    meta = json.loads((part / "meta.json").read_text())
    meta.update(complete=False, prompts_total=6)
    (part / "meta.json").write_text(json.dumps(meta))
    argv = [a for a in train_args(tiny_folder, part, tmp_path / "o", "--max-steps", 1, "--lora", 2) if a != "--quiet"]
    code, stdout, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert "is not complete (4/6 prompts)" in err and "step 1/1" in stdout
