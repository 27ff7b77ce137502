"""MSN noisy training: the noise collator, PPL-based noise location, the shared data pipeline and training loop
(tiny random model: 5-step run, checkpoints loadable by `fastforward generate`, resume), and usage errors."""

import json

import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli

import fastforward as ff
from fastforward.cli import main
from fastforward.errors import UsageError
from fastforward.testing import tiny_hf_folder
from fastforward.train import trainer as trainer_mod
from fastforward.train.data import (
    Encoded,
    Example,
    encode_example,
    encode_examples,
    read_examples,
    split_examples,
    subsample,
)
from fastforward.train.msn import (
    MSN,
    NoiseCollator,
    apply_ahead_noise,
    candidate_range,
    lowest_loss_starts,
    random_starts,
)
from fastforward.train.trainer import BatchSchedule, pad_batch, token_losses

# --------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------


def unique_examples():
    """Sequences whose tokens are all distinct, so a noise token never equals the clean token it replaces."""
    shapes = [(5, 20), (3, 12), (8, 30), (2, 7), (6, 6 + 5)]  # (prompt_len, length); the last: response = L + 1
    return [Encoded(list(range(100 + 40 * k, 100 + 40 * k + n)), p) for k, (p, n) in enumerate(shapes)]






@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return str(tiny_hf_folder(tmp_path_factory.mktemp("tiny-hf"), max_positions=256))


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.json"
    recs = [
        {"instruction": f"Add {i} and {i + 1}.", "input": "" if i % 3 else f"a = {i}",
         "output": f"{i} + {i + 1} = {2 * i + 1}"}
        for i in range(48)
    ]
    path.write_text(json.dumps(recs))
    return str(path)


def train_args(model, data, out, *extra):
    return ["train", "msn", "--model", model, "--data", data, "--out", out, "--batch-size", "2", "--grad-accum", "2",
            "--max-length", "64", "--threads", "1", "--quiet", *extra]


def weights(folder):
    from safetensors.torch import load_file

    return load_file(f"{folder}/model.safetensors")


# --------------------------------------------------------------------------------------------------------------
# The noise collator (pure)
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("noise_length", [1, 2, 4, 5])
def test_noise_replaces_one_segment_inside_the_response_with_earlier_tokens(noise_length):
    examples = unique_examples()
    collator = NoiseCollator(noise_length, "random", seed=123)
    for key in range(60):
        batch = collator(examples, key)
        clean, noisy, labels = batch["clean_input_ids"], batch["input_ids"], batch["labels"]
        for b, e in enumerate(examples):
            n, p = len(e.input_ids), e.prompt_len
            start = int(batch["noise_start"][b])
            # labels: the clean response tokens, -100 on the prompt and on padding; never touched by noise
            assert labels[b, :p].eq(-100).all() and labels[b, n:].eq(-100).all()
            assert labels[b, p:n].tolist() == e.input_ids[p:]
            assert clean[b, :n].tolist() == e.input_ids
            if n - p < noise_length + 1:  # no room for a whole segment before the last token
                assert start == -1 and torch.equal(noisy[b], clean[b])
                continue
            # exactly one segment of the requested length, inside the response, off the last token
            assert p <= start and start + noise_length <= n - 1
            changed = (noisy[b] != clean[b]).nonzero().flatten().tolist()
            assert changed == list(range(start, start + noise_length))
            # each noise token is a token from an earlier position of the clean sequence
            for j in changed:
                assert int(noisy[b, j]) in e.input_ids[:j]
            # prompt and padding untouched
            assert torch.equal(noisy[b, :p], clean[b, :p]) and torch.equal(noisy[b, n:], clean[b, n:])
        assert batch["num_tokens"] == sum(e.response_len for e in examples)


def test_noise_start_covers_every_candidate_and_is_seeded():
    e = Encoded(list(range(50, 70)), 6)  # response positions 6..19; L=4 -> starts 6..15
    lo, hi = candidate_range(6, 20, 4)
    assert (lo, hi) == (6, 16)
    collator = NoiseCollator(4, "random", seed=7)
    starts = {int(collator([e], k)["noise_start"][0]) for k in range(400)}
    assert starts == set(range(lo, hi))
    a, b = collator([e], 5), collator([e], 5)
    assert torch.equal(a["input_ids"], b["input_ids"])  # same (seed, key) -> same noise
    c = NoiseCollator(4, "random", seed=8)([e], 5)
    d = collator([e], 6)
    assert not (torch.equal(a["input_ids"], c["input_ids"]) and torch.equal(a["input_ids"], d["input_ids"]))


def test_no_noise_leaves_inputs_clean():
    examples = unique_examples()
    batch = NoiseCollator(4, "none", seed=0)(examples, 3)
    assert torch.equal(batch["input_ids"], batch["clean_input_ids"])
    assert batch["noise_start"].eq(-1).all()
    assert torch.equal(batch["labels"], pad_batch(examples, 0)["labels"])


def test_apply_ahead_noise_is_pure():
    ids = torch.arange(10, 30).view(1, 20)
    before = ids.clone()
    out = apply_ahead_noise(ids, torch.tensor([8]), 3, torch.Generator().manual_seed(0))
    assert torch.equal(ids, before)
    assert (out != ids).nonzero()[:, 1].tolist() == [8, 9, 10]
    starts = random_starts(torch.tensor([3, 3]), torch.tensor([5, 20]), 4, torch.Generator().manual_seed(0))
    assert starts[0] == -1 and 3 <= starts[1] <= 15


def test_bad_noise_settings_raise():
    with pytest.raises(UsageError):
        NoiseCollator(0)
    with pytest.raises(UsageError):
        NoiseCollator(4, "middle")


# --------------------------------------------------------------------------------------------------------------
# PPL-based location (Appendix A)
# --------------------------------------------------------------------------------------------------------------


def test_lowest_loss_window_is_chosen():
    losses = torch.full((1, 20), 5.0)
    losses[0, 0:4] = 0.0  # lowest of all, but in the prompt
    losses[0, 16:20] = 0.0  # low, but touches the last token (never a candidate)
    losses[0, 9:13] = 0.5  # the lowest admissible window: start 9
    start = lowest_loss_starts(losses, torch.tensor([5]), torch.tensor([20]), 4)
    assert start.tolist() == [9]
    # windows are scored by their sum: one very low token does not beat a uniformly low window
    losses2 = torch.full((1, 20), 3.0)
    losses2[0, 6] = 0.0  # window 6..9 sums to 9
    losses2[0, 10:14] = 1.0  # window 10..13 sums to 4
    assert lowest_loss_starts(losses2, torch.tensor([5]), torch.tensor([20]), 4).tolist() == [10]
    # ties go to the earliest; too-short responses get -1
    flat = torch.ones(2, 12)
    assert lowest_loss_starts(flat, torch.tensor([3, 8]), torch.tensor([12, 12]), 4).tolist() == [3, -1]


def test_ppl_location_picks_the_lowest_loss_window_of_the_model(tiny_folder):
    target = ff.load(tiny_folder, backend="hf")
    model = target.hf_model
    examples = [Encoded(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist(), p)
                for p, n in [(4, 30), (6, 25), (3, 18)]]
    method = MSN(4, "ppl", seed=1)
    batch = method.collate(examples, 0)
    assert batch["noise_start"].eq(-1).all()  # chosen later, from the model
    method.loss(model, batch)
    starts = batch["noise_start"]
    with torch.no_grad():
        for b, e in enumerate(examples):
            ids = torch.tensor([e.input_ids])
            logits = model(input_ids=ids).logits[0]
            tok = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="none")  # token j at j-1
            lo, hi = candidate_range(e.prompt_len, len(e.input_ids), 4)
            sums = [float(tok[s - 1 : s + 3].sum()) for s in range(lo, hi)]
            assert int(starts[b]) == lo + min(range(len(sums)), key=sums.__getitem__)
    assert method.stats()["sequences_noised"] == 3


def test_token_losses_are_aligned_with_tokens(tiny_folder):
    model = ff.load(tiny_folder, backend="hf").hf_model
    batch = pad_batch([Encoded(list(range(40, 52)), 5), Encoded(list(range(60, 68)), 2)], 0)
    with torch.no_grad():
        tl = token_losses(model, batch["input_ids"], batch["attention_mask"], batch["labels"])
        logits = model(input_ids=torch.tensor([list(range(60, 68))])).logits[0]
    assert tl[0, :5].eq(0).all() and tl[1, :2].eq(0).all() and tl[1, 8:].eq(0).all()
    expect = torch.nn.functional.cross_entropy(logits[1:7], torch.arange(62, 68), reduction="none")
    torch.testing.assert_close(tl[1, 2:8], expect, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------------------


def test_read_formats_and_split(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([
        {"instruction": "Say hi", "input": "", "output": "hi"},
        {"instruction": "Sum", "input": "1, 2", "output": "3"},
        {"instruction": "Empty", "input": "", "output": "  "},
    ]))
    (tmp_path / "g.jsonl").write_text(
        json.dumps({"question": "2+2?", "answer": "It is 2+2=<<2+2=4>>4.\n#### 4"}) + "\n"
    )
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "Q", "response": "R"}) + "\n")
    ex = read_examples(f"{tmp_path}/a.json,{tmp_path}/g.jsonl,{tmp_path}/p.jsonl")
    assert [(e.prompt, e.response) for e in ex] == [
        ("Say hi", "hi"), ("Sum\n\n1, 2", "3"), ("2+2?", "It is 2+2=4.\n#### 4"), ("Q", "R"),
    ]
    many = [Example(f"q{i}", f"a{i}") for i in range(2000)]
    train, held = split_examples(many, 0.05)
    assert 50 < len(held) < 150 and len(train) + len(held) == 2000
    assert not {e.key for e in train} & {e.key for e in held}
    # the split depends on each record only: order, mixing and subsetting do not move a record across it
    train_r, held_r = split_examples(many[::-1][:700], 0.05)
    assert {e.key for e in held_r} <= {e.key for e in held}
    assert {e.key for e in train_r} <= {e.key for e in train}
    sub = subsample(train, 10, seed=3)
    assert sub == subsample(train, 10, seed=3) and sub != subsample(train, 10, seed=4) and len(sub) == 10


def test_bad_data_raises(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        read_examples(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text(json.dumps([{"foo": 1}]))
    with pytest.raises(UsageError, match="unsupported record"):
        read_examples(str(tmp_path / "bad.json"))
    (tmp_path / "broken.json").write_text("[{")
    with pytest.raises(UsageError, match="cannot read"):
        read_examples(str(tmp_path / "broken.json"))


def test_encoding_matches_inference_prompt_and_ends_with_eos(tiny_folder):
    target = ff.load(tiny_folder)
    tok = target.tokenizer
    ex = Example("Write a loop.", "for i in range(3): print(i)")
    enc = encode_example(tok, ex, 512)
    assert enc.input_ids[: enc.prompt_len] == target.encode(ex.prompt)  # exactly what generation feeds the model
    assert enc.input_ids[-1] == tok.eos_token_id
    assert tok.decode(enc.input_ids[enc.prompt_len : -1]) == ex.response
    short = encode_example(tok, ex, enc.prompt_len + 3)
    assert len(short.input_ids) == enc.prompt_len + 3 and short.prompt_len == enc.prompt_len
    assert encode_example(tok, ex, enc.prompt_len) is None
    kept, dropped = encode_examples(tok, [ex, Example("x" * 600, "y")], 512)
    assert len(kept) == 1 and dropped == 1


def test_batch_schedule_is_deterministic_and_covers_each_epoch():
    s = BatchSchedule(10, 4, seed=0)
    assert s.per_epoch == 3
    epoch0 = [s.batch(m) for m in range(3)]
    assert all(len(b) == 4 for b in epoch0)
    assert set(sum(epoch0, [])) == set(range(10))
    assert [BatchSchedule(10, 4, seed=0).batch(m) for m in range(3)] == epoch0
    assert [s.batch(m) for m in range(3, 6)] != epoch0  # a new permutation each epoch
    assert BatchSchedule(10, 4, seed=1).batch(0) != epoch0[0] or BatchSchedule(10, 4, seed=1).batch(1) != epoch0[1]


def test_length_grouping_cuts_padding_and_keeps_coverage():
    lengths = [(7 * i) % 97 + 3 for i in range(200)]
    grouped = BatchSchedule(200, 4, seed=0, lengths=lengths, group=8)
    plain = BatchSchedule(200, 4, seed=0)
    batches = [grouped.batch(m) for m in range(grouped.per_epoch)]
    assert sorted(sum(batches, [])) == list(range(200))

    def padding(bs):
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in bs)

    assert padding(batches) < 0.25 * padding([plain.batch(m) for m in range(plain.per_epoch)])
    assert batches == [BatchSchedule(200, 4, seed=0, lengths=lengths, group=8).batch(m) for m in range(50)]
    firsts = [lengths[b[0]] for b in batches[:8]]
    assert firsts != sorted(firsts)  # micro-batch order within a chunk is shuffled
    assert BatchSchedule(10, 1, seed=0, lengths=range(10)).batch(0) == BatchSchedule(10, 1, seed=0).batch(0)


# --------------------------------------------------------------------------------------------------------------
# Training runs on a tiny random model
# --------------------------------------------------------------------------------------------------------------


def test_five_steps_write_a_model_generate_loads(tiny_folder, data_file, tmp_path, capsys):
    out = tmp_path / "run"
    code, stdout, err = run_cli(capsys, *train_args(tiny_folder, data_file, out, "--max-steps", 5, "--save-every", 2,
                                                   "--full"))
    assert code == 0, err
    assert "step 5/5" in stdout
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5] and all(r["loss"] > 0 for r in log)
    state = json.loads((out / "checkpoints" / "step-000005" / "trainer_state.json").read_text())
    assert state["step"] == 5 and state["identity"]["noise_location"] == "random"
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000005"]  # --keep-checkpoints 1
    summary = json.loads((out / "fastforward_train.json").read_text())
    assert summary["method_stats"]["sequences_noised"] > 0
    # the final model and the checkpoint are plain HF folders that `fastforward generate` runs
    for folder in (out, out / "checkpoints" / "step-000005"):
        code, stdout, err = run_cli(capsys, "generate", "--model", folder, "Add 1 and 2.", "--max-new-tokens", 6,
                                    "--json")
        assert code == 0, err
        assert len(json.loads(stdout)["token_ids"]) <= 6
    target = ff.load(str(out))
    assert target.tokenizer.chat_template and target.eos_token_ids == {258}
    assert not torch.equal(weights(out)["lm_head.weight"], weights(tiny_folder)["lm_head.weight"])


def test_lora_run_saves_merged_plain_model(tiny_folder, data_file, tmp_path, capsys):
    out = tmp_path / "lora"
    code, stdout, err = run_cli(capsys, *train_args(tiny_folder, data_file, out, "--max-steps", 3, "--lora", 4,
                                                   "--lr", "1e-2"))
    assert code == 0, err
    w, base = weights(out), weights(tiny_folder)
    assert set(w) == set(base)  # no adapter tensors: merged into a plain HF model
    assert not torch.equal(w["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(w["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert (out / "checkpoints" / "step-000003" / "adapter" / "adapter_model.safetensors").is_file()
    code, _, err = run_cli(capsys, "generate", "--model", out, "hi", "--max-new-tokens", 3)
    assert code == 0, err


def test_rerun_resumes_from_the_saved_step(tiny_folder, data_file, tmp_path, capsys):
    out = tmp_path / "resume"
    code, stdout, err = run_cli(capsys, *train_args(tiny_folder, data_file, out, "--max-steps", 3, "--save-every", 3,
                                                   "--full", "--no-noise"))
    assert code == 0 and "step 3/3" in stdout, err
    argv = [a for a in train_args(tiny_folder, data_file, out, "--max-steps", 5, "--save-every", 3, "--full",
                                  "--no-noise") if a != "--quiet"]
    code, stdout, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert "resuming from step 3" in err
    assert "step 5/5" in stdout and "2 steps in" in stdout
    log = [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log == [1, 2, 3, 4, 5]
    assert json.loads((out / "fastforward_train.json").read_text())["step"] == 5
    # nothing left to do: a third run is a no-op that keeps the model
    code, stdout, err = run_cli(capsys, *train_args(tiny_folder, data_file, out, "--max-steps", 5, "--full",
                                                   "--no-noise"))
    assert code == 0 and "0 steps in" in stdout, err
    # different settings in the same --out: refused, in one line
    assert_one_line_error(capsys, *train_args(tiny_folder, data_file, out, "--max-steps", 6, "--full"),
                          match="different settings (noise_location)")


@pytest.mark.parametrize("kind", [["--full"], ["--lora", "4", "--lr", "1e-2"]], ids=["full", "lora"])
def test_crash_and_resume_equals_an_uninterrupted_run(tiny_folder, data_file, tmp_path, capsys, monkeypatch, kind):
    common = ["--max-steps", 5, "--save-every", 2, "--seed", 3, *kind]
    code, _, err = run_cli(capsys, *train_args(tiny_folder, data_file, tmp_path / "straight", *common))
    assert code == 0, err

    real_save = trainer_mod.save_checkpoint

    def crash_after_step_2(accelerator, model, tokenizer, out, step, state, cfg):
        path = real_save(accelerator, model, tokenizer, out, step, state, cfg)
        if step == 2:
            raise RuntimeError("simulated crash")
        return path

    monkeypatch.setattr(trainer_mod, "save_checkpoint", crash_after_step_2)
    monkeypatch.setenv("FASTFORWARD_DEBUG", "1")
    with pytest.raises(RuntimeError, match="simulated crash"):
        main([str(a) for a in train_args(tiny_folder, data_file, tmp_path / "crashed", *common)])
    monkeypatch.setattr(trainer_mod, "save_checkpoint", real_save)
    assert not (tmp_path / "crashed" / "config.json").exists()  # no final model yet
    code, stdout, err = run_cli(capsys, *train_args(tiny_folder, data_file, tmp_path / "crashed", *common))
    assert code == 0 and "3 steps in" in stdout, err
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "crashed")
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name  # same data order, noise, optimizer and schedule


def test_ctrl_c_saves_a_checkpoint_and_the_rerun_resumes(tiny_folder, data_file, tmp_path, capsys, monkeypatch):
    out = tmp_path / "interrupted"
    real_loss = MSN.loss
    calls = []

    def interrupt_in_step_4(self, model, batch):
        calls.append(1)
        if len(calls) == 7:  # 2 micro-batches per step: the first micro-batch of step 4
            raise KeyboardInterrupt
        return real_loss(self, model, batch)

    monkeypatch.setattr(MSN, "loss", interrupt_in_step_4)
    argv = train_args(tiny_folder, data_file, out, "--max-steps", 5, "--save-every", 10, "--full")
    code, _, err = run_cli(capsys, *argv)
    assert code == 130 and "interrupted" in err
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000003"]
    monkeypatch.setattr(MSN, "loss", real_loss)
    code, stdout, err = run_cli(capsys, *[a for a in argv if a != "--quiet"])
    assert code == 0 and "resuming from step 3" in err and "step 5/5" in stdout, err


def test_grad_accumulation_equals_one_big_batch(tiny_folder, data_file, tmp_path, capsys, monkeypatch):
    """2 micro-batches of 1 and 1 micro-batch of 2 take the same step: the loss is a mean over all loss tokens.
    (Plain SGD stands in for AdamW here: Adam's first step is ~lr * sign(gradient), blind to how it is scaled.)"""
    monkeypatch.setattr(torch.optim, "AdamW", lambda params, lr, weight_decay: torch.optim.SGD(params, lr=lr))
    outs = []
    for bs, ga in [(2, 1), (1, 2)]:
        out = tmp_path / f"bs{bs}"
        argv = ["train", "msn", "--model", tiny_folder, "--data", data_file, "--out", out, "--batch-size", bs,
                "--grad-accum", ga, "--max-steps", 1, "--full", "--no-noise", "--lr", "1e-3", "--max-grad-norm", 0,
                "--no-group-by-length",
                "--threads", 1, "--quiet", "--max-length", 64]
        code, _, err = run_cli(capsys, *argv)
        assert code == 0, err
        outs.append(weights(out))
    base = weights(tiny_folder)
    for name in base:
        # atol: float32 sums in another order differ by ~1e-8 on updates of ~1e-5 (seen at 3e-8 on one element)
        torch.testing.assert_close(outs[0][name] - base[name], outs[1][name] - base[name], rtol=1e-3, atol=1e-7)
    assert any(not torch.equal(outs[0][n], base[n]) for n in base)


# --------------------------------------------------------------------------------------------------------------
# Usage errors: one line, exit code 2
# --------------------------------------------------------------------------------------------------------------


def test_usage_errors(tiny_folder, data_file, tmp_path, capsys):
    out = str(tmp_path / "x")
    assert_one_line_error(capsys, "train", match="training method")
    assert_one_line_error(capsys, *train_args(tiny_folder, data_file, out, "--noise-length", 0),
                          match="--noise-length")
    assert_one_line_error(capsys, *train_args(tiny_folder, str(tmp_path / "nope.json"), out), match="not found")
    assert_one_line_error(capsys, *train_args(tiny_folder, data_file, out, "--max-steps", 0), match="--max-steps")
    assert_one_line_error(capsys, *train_args(tiny_folder, data_file, out, "--lora", 0), match="--lora")
    assert_one_line_error(capsys, *train_args(tiny_folder, data_file, out, "--lora", 4, "--full"))
    assert_one_line_error(capsys, *train_args(str(tmp_path / "no-model"), data_file, out), match="unknown model")
    assert_one_line_error(capsys, *train_args(tiny_folder, data_file, out, "--heldout", 1.5), match="--heldout")
    assert_one_line_error(capsys, "train", "msn", "--data", data_file, match="--out")
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_data_parallel_run_with_two_cpu_processes(tiny_folder, data_file, tmp_path):
    """`torchrun` (what `accelerate launch` does) with 2 CPU processes: trains, checkpoints, resumes."""
    import os
    import shutil
    import subprocess
    import sys

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun not installed")
    out = tmp_path / "ddp"
    env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1")

    def launch(steps):
        cmd = [torchrun, "--standalone", "--nproc_per_node", "2", "-m", "fastforward.cli",
               *[str(a) for a in train_args(tiny_folder, data_file, out, "--max-steps", steps, "--save-every", 2)]]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)

    proc = launch(4)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("step 4/4") == 1  # reported once, by the main process
    assert {p.name for p in (out / "checkpoints" / "step-000004" / "accelerate").iterdir()} >= {
        "optimizer.bin", "random_states_0.pkl", "random_states_1.pkl"}
    state = json.loads((out / "fastforward_train.json").read_text())
    assert state["world_size"] == 2
    proc = launch(6)
    assert proc.returncode == 0 and "step 6/6" in proc.stdout and "2 steps in" in proc.stdout, proc.stderr[-2000:]
