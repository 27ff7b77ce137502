"""A distributed launcher whose processes did not join one process group is refused in one line
(``fastforward.train.launcher.check_launcher``), instead of every process training alone into the same --out."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from fastforward.errors import UsageError
from fastforward.train.launcher import RANK_VARS, SIZE_VARS, check_launcher, launched_world

REPO = Path(__file__).resolve().parents[1]
LAUNCHER_VARS = SIZE_VARS + RANK_VARS


@pytest.fixture
def env(monkeypatch):
    """A clean launcher environment; returns a setter."""
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)

    def set_env(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))

    return set_env


def accelerator(n: int):
    return SimpleNamespace(num_processes=n)


def test_no_launcher_passes(env):
    check_launcher(accelerator(1))
    assert launched_world() == (1, {})


@pytest.mark.parametrize("n", [1, 2, 4])
def test_a_launch_that_formed_its_group_passes(env, n):
    env(WORLD_SIZE=n, RANK=n - 1, LOCAL_RANK=n - 1)
    check_launcher(accelerator(n))
    check_launcher(n)  # the number itself is accepted too


def test_a_single_process_launch_passes(env):
    env(WORLD_SIZE=1, RANK=0, LOCAL_RANK=0)  # torchrun --nproc_per_node 1
    check_launcher(accelerator(1))


@pytest.mark.parametrize("values", [
    {"WORLD_SIZE": 2, "RANK": 0, "LOCAL_RANK": 0},  # plain torchrun on CPUs, main process
    {"WORLD_SIZE": 2, "RANK": 1, "LOCAL_RANK": 1},  # ... and the other one
    {"WORLD_SIZE": 2},
    {"OMPI_COMM_WORLD_SIZE": 3, "OMPI_COMM_WORLD_RANK": 0},  # mpirun (Open MPI)
    {"PMI_SIZE": 2, "PMI_RANK": 1},  # mpirun (MPICH / Intel MPI)
    {"MV2_COMM_WORLD_SIZE": 2},  # MVAPICH
], ids=lambda v: ",".join(v))
def test_processes_outside_one_group_are_refused(env, values):
    env(**values)
    with pytest.raises(UsageError) as exc:
        check_launcher(accelerator(1))
    msg = str(exc.value)
    assert "\n" not in msg
    assert "did not make them one process group" in msg and "ACCELERATE_USE_CPU=1" in msg and "--cpu" in msg
    assert f"started {max(values[k] for k in values if k in SIZE_VARS)} processes" in msg


def test_a_group_of_the_wrong_size_is_refused(env):
    env(WORLD_SIZE=4, RANK=0)
    with pytest.raises(UsageError, match="started 4 processes"):
        check_launcher(accelerator(2))


def test_a_rank_without_world_size_is_refused_only_above_0(env):
    env(LOCAL_RANK=0)
    check_launcher(accelerator(1))  # rank 0 alone: the main process, as without a launcher
    env(RANK=1)
    with pytest.raises(UsageError, match="rank 1"):
        check_launcher(accelerator(1))


def test_a_garbled_launcher_variable_is_one_line(env):
    env(WORLD_SIZE="two")
    with pytest.raises(UsageError, match="WORLD_SIZE='two'"):
        check_launcher(accelerator(1))


def test_explicit_env_mapping(env):
    with pytest.raises(UsageError):
        check_launcher(1, env={"WORLD_SIZE": "2"})
    check_launcher(1, env={})


@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None,
                    reason="torchrun not installed")
def test_plain_torchrun_on_cpus_refuses_train_before_any_work(tmp_path):
    """The case this guards against, for real: ``torchrun --nproc_per_node 2 -m fastforward.cli train msn`` on CPUs
    without ``ACCELERATE_USE_CPU=1``. Both processes stop with the one-line error (exit 2) before writing --out."""
    from fastforward.testing import tiny_hf_folder

    model = tiny_hf_folder(tmp_path / "tiny", max_positions=64)
    data = tmp_path / "train.json"
    data.write_text(json.dumps([{"instruction": f"Add {i} and 1.", "input": "", "output": f"{i + 1}"}
                                for i in range(8)]))
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and k != "ACCELERATE_USE_CPU"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    proc = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", "-m", "fastforward.cli", "train", "msn",
                           "--model", str(model), "--data", str(data), "--out", str(out), "--full", "--max-steps", "1",
                           "--quiet"], env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode != 0, proc.stderr[-3000:]
    # one error from each process (their stderr lines may interleave), each exiting with the usage-error code 2
    assert proc.stderr.count("fastforward: error: a launcher started 2 processes (WORLD_SIZE=2)") == 2, proc.stderr
    assert proc.stderr.count("ACCELERATE_USE_CPU=1 torchrun") == 2
    # torchrun's report of the children: the first to exit with the usage-error code 2; the other either the same or,
    # when torchrun stopped it after the first failure (it had printed its error already), terminated (-15)
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)]
    assert 2 in codes and set(codes) <= {2, -15}, codes
    assert "fastforward/train/" not in proc.stderr and "internal error" not in proc.stderr  # no child traceback
    assert not out.exists()
