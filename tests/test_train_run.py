"""The training run every ``fastforward train METHOD`` shares (``fastforward.train.run``), on a toy model: the log,
checkpoints and their pruning, resume, the refusals of another run's folder, the time budget and Ctrl-C."""

from __future__ import annotations

import json

import pytest
import torch

from fastforward.errors import UsageError
from fastforward.train.run import LOG_FILE, STATE_FILE, TrainingRun, check_settings, checkpoint_dirs, trim_log

IDENTITY = {"seed": 0, "lr": 0.1}


def toy_run(out, total: int, identity=IDENTITY, save_every: int = 2, max_minutes=None, interrupt_at=None):
    """A linear model trained ``total`` steps through :class:`TrainingRun`; its steps and the folder it wrote."""
    run = TrainingRun(out, "train toy", identity, quiet=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model = run.prepare(model, optimizer, scheduler, params, max_grad_norm=1.0)
    x = torch.ones(4, 3)

    def step_fn(step):
        if step == interrupt_at:
            raise KeyboardInterrupt
        loss = model(x).pow(2).mean()
        run.accelerator.backward(loss)
        return float(loss.detach()), {"acc": 0.5}, 4

    def save(step, loss):
        state = run.state_at(step, total, loss, identity=identity)
        run.checkpoint(step, state, lambda folder: torch.save(model.state_dict(), folder / "toy.pt"))

    return run, run.train(total, step_fn, save, save_every=save_every, max_minutes=max_minutes, progress="lines")


def log_steps(out) -> list[int]:
    return [json.loads(line)["step"] for line in (out / LOG_FILE).read_text().splitlines()]


def test_steps_are_logged_checkpointed_and_resumed(tmp_path):
    out = tmp_path / "out"
    run, done = toy_run(out, 3)
    assert (done.step, run.start_step, done.stopped_by_budget) == (3, 0, False)
    rows = [json.loads(line) for line in (out / LOG_FILE).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert list(rows[0]) == ["step", "loss", "acc", "lr", "tokens", "seconds"] and rows[0]["tokens"] == 4
    assert [step for step, _ in checkpoint_dirs(out)] == [3]  # step 2's pruned: one kept
    state = json.loads((out / "checkpoints" / "step-000003" / STATE_FILE).read_text())
    assert state["step"] == 3 and state["world_size"] == 1 and state["identity"] == IDENTITY
    assert (out / "checkpoints" / "step-000003" / "toy.pt").is_file()
    assert not list((out / "checkpoints").glob(".step-*"))
    run, done = toy_run(out, 5)
    assert (run.start_step, done.step) == (3, 5)
    assert log_steps(out) == [1, 2, 3, 4, 5]


def test_another_runs_folder_is_refused_in_one_line(tmp_path):
    out = tmp_path / "out"
    toy_run(out, 2)
    with pytest.raises(UsageError, match=r"different settings \(lr\); use another --out"):
        TrainingRun(out, "train toy", {**IDENTITY, "lr": 0.2})
    state_file = out / "checkpoints" / "step-000002" / STATE_FILE
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "world_size": 2}))
    with pytest.raises(UsageError, match="written by 2 processes, this run has 1"):
        TrainingRun(out, "train toy", IDENTITY)
    state_file.write_text(json.dumps(state))
    run = TrainingRun(out, "train toy", IDENTITY, quiet=True)
    assert (run.resume, run.start_step) == (state_file.parent, 2)
    run.check_total(2)
    with pytest.raises(UsageError, match="at step 2, past the 1 steps asked for"):
        run.check_total(1)


def test_the_time_budget_stops_after_a_step_with_a_checkpoint(tmp_path):
    out = tmp_path / "out"
    _, done = toy_run(out, 10, save_every=100, max_minutes=1e-9)
    assert (done.step, done.stopped_by_budget) == (1, True)
    assert [step for step, _ in checkpoint_dirs(out)] == [1]


def test_ctrl_c_checkpoints_the_steps_done_and_says_how_to_resume(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt, match=r"checkpoint at step 3 in .*; re-run the same command to resume"):
        toy_run(out, 10, save_every=100, interrupt_at=3)
    assert [step for step, _ in checkpoint_dirs(out)] == [3]
    with pytest.raises(KeyboardInterrupt, match="^no step finished; re-run"):
        toy_run(tmp_path / "early", 10, interrupt_at=0)
    _, done = toy_run(out, 4)
    assert done.step == 4 and log_steps(out) == [1, 2, 3, 4]


def test_trim_log_drops_steps_past_the_checkpoint_and_garbled_lines(tmp_path):
    log = tmp_path / LOG_FILE
    log.write_text('{"step": 1}\n{"step": 2}\nnot json\n{"step": 3}\n')
    trim_log(log, 2)
    assert log.read_text() == '{"step": 1}\n{"step": 2}\n'
    trim_log(tmp_path / "absent.jsonl", 1)  # nothing to trim


@pytest.mark.parametrize("change, match", [
    ({"save_every": 0}, "--save-every must be a positive integer"),
    ({"save_every": True}, "--save-every must be a positive integer"),
    ({"warmup": 1.0}, "--warmup is a fraction"),
    ({"schedule": "step"}, "--schedule must be linear, cosine or constant"),
    ({"weight_decay": -1.0}, "--weight-decay and --max-grad-norm must be >= 0"),
    ({"mixed_precision": "fp8"}, "--mixed-precision must be one of no, bf16"),
])
def test_check_settings_names_the_flag(change, match):
    from types import SimpleNamespace

    good = dict(save_every=1, max_steps=None, warmup=0.0, schedule="cosine", weight_decay=0.0, max_grad_norm=1.0,
                mixed_precision="no")
    check_settings(SimpleNamespace(**good), ("save_every", "max_steps"))
    with pytest.raises(UsageError, match=match):
        check_settings(SimpleNamespace(**{**good, **change}), ("save_every", "max_steps"))
