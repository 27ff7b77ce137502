"""Native kernels, compiled on first use for the CPU at hand.

``load_kernel()`` returns ``skinny_mm(x, w)`` -- ``x [M, K] @ w [K, N]`` in fp32 for a few rows ``M``, ``w``
row-major ``[in, out]`` -- or ``None`` when it cannot be had (no AVX2/AVX-512, no compiler or ``ninja``, a failed
build, or ``FASTFORWARD_NO_KERNEL=1``). Everything works without it; a failure is reported once on stderr.

The kernel reads every weight once whatever ``M`` is, and accumulates every output element alone, in ascending
``k``, with fused multiply-adds: row ``m`` of ``skinny_mm(x, w)`` is bitwise equal to ``skinny_mm(x[m:m+1], w)``.
The build (``torch.utils.cpp_extension``, 10-40 s, once) lands in ``$FASTFORWARD_CACHE/kernels/<hash>``, the
hash covering the source, the compiler flags, the CPU's flags and the torch/Python versions, so a binary is never
reused on a machine it was not built for.

The module also holds ``quant_mm`` (GGUF blocks multiplied packed: ``quant_gemm.cpp``, and on CPUs with AMX the
tiled bf16 path of ``amx_gemm.cpp``, switched on per weight at load by :mod:`fastforward.linear`) and the layer ops
(``layer_ops.cpp``).

The build is for the best ISA the CPU has; ``FASTFORWARD_KERNEL_ISA=avx2`` picks the AVX2 build on an AVX-512 CPU
(to compare), and ``FASTFORWARD_KERNEL_ISA=avx512-emulated`` builds the AVX-512 source against SIMDe's portable
intrinsics so that its code path runs, slowly, on an AVX2 CPU (testing only: ``tests/test_kernels.py``).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent
SOURCES = [HERE / name for name in ("native.cpp", "skinny_gemm.cpp", "quant_gemm.cpp", "layer_ops.cpp", "amx_gemm.cpp",
                                     "q8_gemm.cpp")]
HEADERS = [HERE / "isa.h", HERE / "tiles.h"]
ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx2", "-mfma", "-mf16c", "-DFF_ISA_AVX512"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DFF_ISA_AVX2"],
    # Testing only: the AVX-512 source on an AVX2 CPU, its intrinsics from SIMDe's portable headers (slow).
    "avx512-emulated": ["-mavx2", "-mfma", "-mf16c", "-DFF_ISA_AVX512", "-DFF_ISA_EMULATED"],
}
# FASTFORWARD_KERNEL_ISA: build for this ISA instead of the best the CPU has ("avx2" on an AVX-512 machine, to
# compare; "avx512-emulated" to run the AVX-512 code path on a CPU without it).
ISA_ENV = "FASTFORWARD_KERNEL_ISA"
# Without OpenMP, at::parallel_for runs on one thread; no contraction of a*b+c into fma beyond the explicit ones,
# so that weights decode to exactly the values the reference dequantisation gives.
BASE_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
# The integer kernel's one multiply-accumulate instruction (vpdpbusd), where the CPU has it: AVX-512 VNNI (with the
# 256-bit forms of AVX512VL), or AVX-VNNI on CPUs without AVX-512. Without either, AVX2's vpmaddubsw + vpmaddwd
# compute the same integers. The emulated AVX-512 build takes the VNNI path too (SIMDe), so that it is tested here.
VNNI_FLAGS = {
    "avx512": ({"avx512_vnni", "avx512vl", "avx512bw"}, ["-mavx512vnni", "-mavx512vl", "-mavx512bw", "-DFF_VNNI_512"]),
    "avx2": ({"avx_vnni"}, ["-mavxvnni", "-DFF_VNNI_AVX"]),
    "avx512-emulated": (set(), ["-DFF_VNNI_512"]),
}
# FASTFORWARD_NO_VNNI=1 builds the AVX2 integer path on a CPU with VNNI (to compare the two).
NO_VNNI_ENV = "FASTFORWARD_NO_VNNI"


def isa_flags(isa: str, flags: set[str] | None = None) -> list[str]:
    """The compiler flags of a build for ``isa`` on a CPU with ``flags`` (default: this CPU's)."""
    flags = cpu_flags() if flags is None else flags
    extra = []
    needs, vnni = VNNI_FLAGS.get(isa, (None, []))
    if needs is not None and needs <= flags and os.environ.get(NO_VNNI_ENV, "") in ("", "0"):
        extra = vnni
    return BASE_FLAGS + ISA_FLAGS[isa] + extra

_lock = threading.Lock()
_state: dict = {}  # "module": the native module, or None once tried and unavailable


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def pick_isa(flags: set[str] | None = None, requested: str | None = None) -> str | None:
    """'avx512', 'avx2', 'avx512-emulated' (only when requested) or None (no build for this CPU). ``requested``
    (default: ``$FASTFORWARD_KERNEL_ISA``) is honoured when the CPU can run it, else reported and ignored."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    flags = cpu_flags() if flags is None else flags
    requested = os.environ.get(ISA_ENV, "") if requested is None else requested
    if requested:
        needs = {"avx512": {"avx512f", "avx2", "fma"}, "avx2": {"avx2", "fma"},
                 "avx512-emulated": {"avx2", "fma"}}.get(requested)
        if needs is None:
            print(f"fastforward: {ISA_ENV}={requested} is not one of {', '.join(ISA_FLAGS)}; ignored",
                  file=sys.stderr)
        elif flags and not needs <= flags:
            print(f"fastforward: {ISA_ENV}={requested} needs {', '.join(sorted(needs - flags))}, which this CPU "
                  "lacks; ignored", file=sys.stderr)
        else:
            return requested
    if not flags:  # no /proc/cpuinfo: trust what torch dispatches to
        cap = torch.backends.cpu.get_cpu_capability()
        return {"AVX512": "avx512", "AVX2": "avx2"}.get(cap)
    if {"avx512f", "avx2", "fma"} <= flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return None


def _build_id(isa: str, flags: list[str]) -> tuple[str, str]:
    """(extension name, digest) for this source, these flags, this CPU and this torch/Python."""
    h = hashlib.sha256()
    for path in SOURCES + HEADERS:
        h.update(path.read_bytes())
    h.update(" ".join(flags).encode())
    h.update(" ".join(sorted(cpu_flags())).encode())
    h.update(f"{torch.__version__}|{sys.version_info[:2]}|{platform.machine()}".encode())
    digest = h.hexdigest()[:16]
    return f"ff_native_{isa.replace('-', '_')}_{digest}", digest


def _import_built(name: str, directory: Path):
    lock = directory / "lock"  # cpp_extension's: a build is under way, or one was killed (then it stays forever)
    try:
        if time.time() - lock.stat().st_mtime < 600:
            return None  # let cpp_extension wait for that build
        lock.unlink()
    except OSError:
        pass
    for path in sorted(directory.glob(f"{name}*.so")):
        loader = importlib.machinery.ExtensionFileLoader(name, str(path))
        spec = importlib.util.spec_from_file_location(name, path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module
    return None


def _compile(name: str, directory: Path, flags: list[str]):
    import torch.utils.cpp_extension as cpp

    directory.mkdir(parents=True, exist_ok=True)
    print("fastforward: compiling the native kernels for this CPU (once, 20-60 s)", file=sys.stderr)
    return cpp.load(name, [str(s) for s in SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                    build_directory=str(directory), verbose=False)


def load_native():
    """The compiled native module (``skinny_mm``, ``quant_mm``, ``quant_rows``, ``isa``), or None when it cannot
    be had (warned about once on stderr)."""
    with _lock:
        if "module" in _state:
            return _state["module"]
        _state["module"] = None
        if os.environ.get("FASTFORWARD_NO_KERNEL", "") not in ("", "0"):
            return None
        isa = pick_isa()
        if isa is None:
            print("fastforward: no AVX2/AVX-512 on this CPU; using torch matmuls", file=sys.stderr)
            return None
        flags = isa_flags(isa)
        try:
            from ..paths import default_cache_root, kernels_dir

            name, digest = _build_id(isa, flags)
            directory = kernels_dir() / digest
            # A build in the default cache serves too (the digest pins it to this CPU, source and torch).
            default = default_cache_root() / "kernels" / digest
            failed = directory / "FAILED"
            module = _import_built(name, directory) or _import_built(name, default)
            if module is None and failed.is_file():
                print(f"fastforward: the native kernels failed to build earlier (delete {failed} to retry); "
                      "using torch matmuls", file=sys.stderr)
                return None
            if module is None:
                try:
                    module = _compile(name, directory, flags)
                except Exception as exc:
                    failed.write_text(f"{type(exc).__name__}: {exc}\n")
                    raise
        except Exception as exc:  # a missing compiler/ninja or a failed build: run without the kernels
            msg = " ".join(str(exc).split())[:200]
            print(f"fastforward: native kernels unavailable ({type(exc).__name__}: {msg}); "
                  "using torch matmuls", file=sys.stderr)
            return None
        _state["module"] = module
        _state["digest"] = digest
        return module


def build_digest() -> str | None:
    """The loaded native build's digest (source, flags, CPU, torch/Python), or None without one: what a cached
    measurement of the kernels' speed must be keyed by."""
    return _state.get("digest") if load_native() is not None else None


def load_kernel():
    """The compiled ``skinny_mm(x, w)`` (fp32 weights ``[in, out]``), or None when unavailable."""
    module = load_native()
    return None if module is None else module.skinny_mm


def kernel_name() -> str | None:
    """'skinny-avx512' / 'skinny-avx2' (or 'skinny-avx512-emulated') once the native module loads, else None."""
    module = load_native()
    return None if module is None else f"skinny-{module.isa}"
