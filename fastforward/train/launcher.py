"""Refuse a distributed launch whose processes did not join one process group.

``torchrun --nproc_per_node 2 -m fastforward.cli train ...`` on a CPU-only machine, without
``ACCELERATE_USE_CPU=1``, starts two processes that each build a single-process ``Accelerator`` (accelerate forms a
CPU group only when told to use the CPU): each would train alone, as the main process, into the same ``--out``.
:func:`check_launcher` compares what the launcher says (its environment variables) with the group the
``Accelerator`` formed, and stops every such process with a one-line :class:`~fastforward.errors.UsageError`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..errors import UsageError

# The number of processes a launcher started: torchrun / accelerate launch / torch.distributed.launch (WORLD_SIZE),
# Open MPI, MPICH / Intel MPI (PMI), MVAPICH -- the variables accelerate itself reads.
SIZE_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
# This process's rank in that launch.
RANK_VARS = ("RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")

HINT = ("on CPUs run `ACCELERATE_USE_CPU=1 torchrun ...` or `accelerate launch --cpu ...`; on GPUs check that "
        "every process sees its GPU")


def _int_vars(env: Mapping[str, str], names) -> dict[str, int]:
    found = {}
    for name in names:
        value = env.get(name)
        if value is not None and value.strip():
            try:
                found[name] = int(value)
            except ValueError:
                raise UsageError(f"the launcher variable {name}={value!r} is not an integer") from None
    return found


def launched_world(env: Mapping[str, str] | None = None) -> tuple[int, dict[str, int]]:
    """(the number of processes the environment says were launched -- 1 when no launcher is seen, the launcher's
    variables found, by name)."""
    env = os.environ if env is None else env
    sizes = _int_vars(env, SIZE_VARS)
    ranks = _int_vars(env, RANK_VARS)
    return max(sizes.values(), default=1), {**sizes, **ranks}


def check_launcher(num_processes: int, env: Mapping[str, str] | None = None) -> None:
    """Raise a one-line :class:`UsageError` when a distributed launcher started this process (``WORLD_SIZE`` > 1,
    or a rank above 0) but the process group it joined has ``num_processes`` != that size (typically 1: every
    process training alone into the same output). ``num_processes`` is ``Accelerator().num_processes`` (or
    ``torch.distributed.get_world_size()``). Accepts an object with a ``num_processes`` attribute too."""
    num_processes = getattr(num_processes, "num_processes", num_processes)
    world, found = launched_world(env)
    rank = max((v for k, v in found.items() if k in RANK_VARS), default=0)
    if world > 1 and num_processes != world:
        names = ", ".join(f"{k}={v}" for k, v in found.items() if k in SIZE_VARS)
        raise UsageError(f"a launcher started {world} processes ({names}) but accelerate did not make them one "
                         f"process group (this process sees {num_processes}), so each would train alone into the "
                         f"same --out; {HINT}")
    if world == 1 and rank > 0 and num_processes == 1:
        names = ", ".join(f"{k}={v}" for k, v in found.items() if k in RANK_VARS)
        raise UsageError(f"this process has rank {rank} ({names}) but no launcher world size and no process group, "
                         f"so it would train alone as the main process; {HINT}")
