"""The packed linear stack of a model (every weight matmul of one forward) timed under several builds of the native
kernels, alternated round by round in one process, so that the machine's drift weighs on all of them alike.

    python scripts/compare_kernel_builds.py --model smollm2-135m --m 1,2,4,8,16 \\
        --build before=OLD_TREE/fastforward/kernels --build after=fastforward/kernels [--build wide=:-DFF_Q8_ZMM_ROWS=8]
        [--threads 1 --cpu-time]

A build is ``NAME=SOURCE_DIR[:EXTRA_FLAGS]`` (the directory holding the kernel sources, e.g. a worktree of an older
commit: ``git worktree add /tmp/old REV``; empty for this checkout's), compiled with this CPU's flags plus the extra
ones into a temporary folder. The weights are the model's as this checkout loads them (its arithmetic, ``q8`` for a
GGUF file). Builds whose weight layout differs from this checkout's compute other numbers from the same bytes: the
timing still compares them, and the script says so (it compares every build's outputs with the first's). Printed:
median ms per stack for each build and number of rows, and the 25th-75th percentiles.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
from pathlib import Path

import torch


def packed_linears(target) -> list:
    """Every packed weight on the native kernels that the target's forward multiplies (each once)."""
    from fastforward.linear import PackedLinear

    weights = getattr(target.backend, "matmul_weights", None)
    if weights is None:  # not the lean forward (an HF model): nothing of ours to time
        return []
    return [lin for lin in weights() if isinstance(lin, PackedLinear) and lin.data is not None
            and lin.native is not None]


def build(name: str, source: str, extra: str, root: Path):
    import torch.utils.cpp_extension as cpp

    from fastforward import kernels

    here = [Path(p) for p in kernels.SOURCES]
    sources = [Path(source) / p.name if source else p for p in here]
    headers = [Path(source) / p.name if source else p for p in kernels.HEADERS]
    flags = kernels.isa_flags(kernels.pick_isa()) + extra.split()
    if source:
        flags.append(f"-I{source}")
    digest = hashlib.sha256((" ".join(flags) + "".join(p.read_text() for p in sources + headers if p.is_file())
                             ).encode()).hexdigest()[:12]
    directory = root / digest
    directory.mkdir(parents=True, exist_ok=True)
    return cpp.load(f"ff_compare_{name}_{digest}", [str(p) for p in sources], extra_cflags=flags,
                    extra_ldflags=["-fopenmp"], build_directory=str(directory))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--build", action="append", required=True, help="NAME=SOURCE_DIR[:EXTRA_FLAGS]")
    parser.add_argument("--m", default="1,2,4,8,16", help="activation rows per call")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--build-dir", default=None,
                        help="where the builds go, kept and reused by source and flags (default: a new temporary "
                             "folder)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time in CPU seconds of this process instead of wall time (with --threads 1: what "
                             "other load on a shared machine leaves unchanged)")
    args = parser.parse_args(argv)
    if not 1 <= args.rounds <= 1000 or not 1 <= args.threads <= 256:
        parser.error("--rounds must be in [1, 1000] and --threads in [1, 256]")
    rows = [int(m) for m in args.m.split(",")]
    if not rows or min(rows) < 1 or max(rows) > 4096:
        parser.error("--m: rows per call in [1, 4096]")
    specs = {}
    for spec in args.build:
        name, _, rest = spec.partition("=")
        source, _, extra = rest.partition(":")
        if not name.isidentifier() or name in specs or (source and not (Path(source) / "q8_gemm.cpp").is_file()):
            parser.error(f"--build {spec}: NAME=SOURCE_DIR[:EXTRA_FLAGS], a new name and a folder of kernel sources")
        specs[name] = (source, extra)
    torch.set_num_threads(args.threads)

    import fastforward as ff

    target = ff.load(args.model)
    linears = packed_linears(target)
    if not linears:
        parser.error(f"{args.model} has no packed weights on the native kernels")
    root = Path(args.build_dir) if args.build_dir else Path(tempfile.mkdtemp(prefix="ff-kernel-builds-"))
    builds = {name: build(name, source, extra, root) for name, (source, extra) in specs.items()}
    print(f"{args.model}: {len(linears)} packed weights, {sum(lin.nbytes for lin in linears) / 1e6:.1f} MB; "
          f"{args.threads} threads")
    xs = {m: [torch.randn(m, lin.in_features) for lin in linears] for m in rows}

    def stack(module, m):
        return [module.quant_mm(x, lin.data, lin.kernel_fmt, lin.in_features) for lin, x in
                zip(linears, xs[m], strict=True)]

    def same(a, b):  # bitwise, NaN where the other has NaN (random weights can overflow fp16 scales)
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())

    first = next(iter(builds))
    reference = stack(builds[first], rows[0])
    for name, module in builds.items():
        if not all(same(a, b) for a, b in zip(reference, stack(module, rows[0]), strict=True)):
            print(f"note: {name}'s outputs differ from {first}'s (another weight layout, or another arithmetic)")
    times = {(name, m): [] for name in builds for m in rows}
    clock = time.process_time if args.cpu_time else time.perf_counter
    for _ in range(args.rounds):
        for m in rows:
            for name, module in builds.items():
                t0 = clock()
                stack(module, m)
                times[(name, m)].append((clock() - t0) * 1e3)
    what = "CPU ms" if args.cpu_time else "ms"
    print("rows | " + " | ".join(builds) + f" (median {what} per stack [25th-75th])")
    for m in rows:
        cells = []
        for name in builds:
            q = statistics.quantiles(times[(name, m)], n=4) if args.rounds > 1 else [times[(name, m)][0]] * 3
            cells.append(f"{statistics.median(times[(name, m)]):.2f} [{q[0]:.2f}-{q[2]:.2f}]")
        print(f"{m} | " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
