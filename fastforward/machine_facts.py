"""What this machine gets: the facts ``fastforward info`` prints and the server's ``/v1/models`` card carries.

* **cpu** -- its model name and the features the kernels and llama.cpp choose by (AVX2, AVX-512, AVX-512 VNNI,
  AVX-VNNI, AVX-512 BF16, AMX), the CPUs this process may use and torch's threads;
* **kernels** -- the native build for this CPU (:mod:`fastforward.kernels`): which ISA and integer dot product, and
  whether it is built (``not built yet``: the first model load compiles it);
* **model** -- for a loaded target: its backend, arithmetic and KV cache, and per weight format the kernel that
  multiplies it (what ``fastforward profile`` prints as ``matmul``); its cached cost curve
  (:func:`fastforward.costs.curve_path`: age, t(1), t(8)/t(1), whether it was measured under load); the shipped
  drafters trained for it;
* **llama_cpp** -- whether llama-cpp-python is there, its version and its own ``system_info``, and the one known way
  its build fails here: its AMX backend on a CPU with AMX (:func:`llama_cpp_amx_problem`, the line the benchmark's
  llama.cpp peer prints too);
* **caches** -- the cache folder (``$FASTFORWARD_CACHE``) and what each part of it holds.

Nothing here measures or compiles anything: a curve that is not cached is reported as such, kernels that are not
built as ``not built yet``, and llama-cpp-python is imported only when asked (``import_llama_cpp``; the server never
imports it: a second OpenMP runtime in the process changes its speed).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

import torch

from . import kernels
from .costs import LOADED_WAIT_SHARE, MIN_CPU_SHARE, CostCurve, curve_path, plausible_curve
from .drafters import SHIPPED_DIR, shipped_drafter
from .linear import DenseLinear, PackedLinear, amx_in_use, packed_kernel_name
from .machine import last_level_cache_bytes, usable_cpus
from .model import resolve_model
from .paths import cache_root, costs_dir, data_root, default_cache_root, kernels_dir
from .version import __version__

#: the CPU features that choose a kernel (ours or llama.cpp's): /proc/cpuinfo flag -> the name people know it by
CPU_FEATURES = {
    "avx2": "AVX2",
    "avx512f": "AVX-512",
    "avx512_vnni": "AVX-512 VNNI",
    "avx_vnni": "AVX-VNNI",
    "avx512_bf16": "AVX-512 BF16",
    "amx_tile": "AMX",
    "amx_int8": "AMX-INT8",
    "amx_bf16": "AMX-BF16",
}

#: the shipped drafters' kinds and the method that reads each
DRAFTER_METHODS = {"eagle3": "eagle", "fasteagle": "fasteagle", "falcon": "falcon", "draft-model": "sps"}

#: how to get llama-cpp-python (the ``llamacpp`` extra of pyproject.toml)
LLAMACPP_INSTALL = "pip install -e '.[llamacpp]' (builds llama.cpp from source, ~8 min)"

#: llama.cpp's CPU backends without its AMX one, for a CPU with AMX (which has every feature named here)
LLAMACPP_NO_AMX_CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON "
    "-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF "
    "-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
)


# ------------------------------------------------------------------------------------------------------------------
# The CPU
# ------------------------------------------------------------------------------------------------------------------


def cpu_model_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_facts(flags: set[str] | None = None) -> dict:
    flags = kernels.cpu_flags() if flags is None else flags
    llc = last_level_cache_bytes()
    return {
        "model": cpu_model_name(),
        "architecture": platform.machine(),
        "features": {flag: flag in flags for flag in CPU_FEATURES},
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "torch_threads": torch.get_num_threads(),
        "last_level_cache_bytes": llc,
    }


# ------------------------------------------------------------------------------------------------------------------
# The native kernels: found, never compiled
# ------------------------------------------------------------------------------------------------------------------


def kernel_facts() -> dict:
    """The native build for this CPU: its ISA, integer dot product and status -- ``built`` (then loaded, which only
    imports it), ``not built yet`` (the first model load compiles it, 20-60 s), ``being built``, ``failed`` (an
    earlier build failed; the forward uses torch), ``off`` ($FASTFORWARD_NO_KERNEL) or ``none`` (no AVX2 here)."""
    if os.environ.get("FASTFORWARD_NO_KERNEL", "") not in ("", "0"):
        return {"status": "off", "isa": None, "note": "FASTFORWARD_NO_KERNEL is set: torch matmuls"}
    isa = kernels.pick_isa()
    if isa is None:
        return {"status": "none", "isa": None, "note": "no AVX2 or AVX-512 on this CPU: torch matmuls"}
    flags = kernels.isa_flags(isa)
    vnni = "avx512-vnni" if "-DFF_VNNI_512" in flags else "avx-vnni" if "-DFF_VNNI_AVX" in flags else None
    name, digest = kernels._build_id(isa, flags)  # the digest load_native() looks the build up by
    own, default = kernels_dir() / digest, default_cache_root() / "kernels" / digest
    facts = {"status": "not built yet", "isa": isa, "vnni": vnni, "digest": digest, "folder": str(own)}
    built = next((d for d in (own, default) if d.is_dir() and any(d.glob(f"{name}*.so"))), None)
    if built is None:
        if (own / "FAILED").is_file():
            facts.update(status="failed", note=f"an earlier build failed (delete {own / 'FAILED'} to retry): "
                                               "torch matmuls")
        elif (own / "lock").is_file():
            facts.update(status="being built", note="another process is compiling it")
        else:
            facts["note"] = "the first command that loads a model compiles it (once, 20-60 s)"
        return facts
    native = kernels.load_native()  # built for this CPU and source: an import, no compile
    if native is None:
        facts.update(status="failed", note="built, but it does not load: torch matmuls")
        return facts
    facts.update(status="built", folder=str(built), amx=amx_in_use(native),
                 paths={"q8": packed_kernel_name(native, "q8"), "exact": f"quant-{packed_kernel_name(native)}",
                        "fp32": f"skinny-{native.isa}"})
    return facts


# ------------------------------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------------------------------


def _linear_kernel(linear) -> tuple[str, str, str]:
    """(storage format, arithmetic, kernel) of one weight the forward multiplies."""
    if isinstance(linear, PackedLinear):
        native = linear.native
        if linear.arithmetic == "q8":
            return linear.format_name, "q8", (f"q8-{native.q8_dot}" if native is not None else
                                              "q8-reference (torch, no native kernels)")
        if native is None or linear.data is None:
            return linear.format_name, "exact", "mkl (dequantised to fp32)"
        tiled = linear.kernel_fmt == getattr(native, "TILED_FORMAT_BASE", -1) + linear.fmt
        return linear.format_name, "exact", f"quant-{native.isa}{'+amx' if tiled else ''}"
    if isinstance(linear, DenseLinear):
        kernel = (f"skinny-{kernels.load_native().isa} up to {linear.kernel_max_q} rows, mkl beyond"
                  if linear.skinny is not None else "mkl")
        return str(linear.w_out_in.dtype).replace("torch.", ""), "exact", kernel
    return type(linear).__name__, "exact", "torch"


def weight_facts(target) -> list[dict]:
    """Per (format, arithmetic, kernel): how many of the weight matrices a forward multiplies (q|k|v and gate|up
    fused, the head once) are stored and multiplied so, and their bytes."""
    backend = target.backend
    if target.backend_name != "lean" or not hasattr(backend, "matmul_weights"):
        dtype = str(next(target.hf_model.parameters()).dtype).replace("torch.", "")
        return [{"format": dtype, "arithmetic": "exact", "kernel": "torch (the HF forward)", "matrices": None,
                 "bytes": None}]
    groups: dict[tuple, dict] = {}
    for linear in backend.matmul_weights():
        fmt, arithmetic, kernel = _linear_kernel(linear)
        row = groups.setdefault((fmt, arithmetic, kernel), {"format": fmt, "arithmetic": arithmetic,
                                                            "kernel": kernel, "matrices": 0, "bytes": 0})
        row["matrices"] += 1
        row["bytes"] += int(linear.nbytes)
    return sorted(groups.values(), key=lambda r: -r["bytes"])


def cost_curve_facts(target, now: float | None = None) -> dict:
    """The target's cached cost curve (never measured here): where, how old, t(1), t(8)/t(1), the cache length it
    was measured on, and whether other load shared the CPUs while it was (its stored load reading)."""
    path = curve_path(target)
    facts: dict = {"cached": False, "path": str(path), "threads": torch.get_num_threads()}
    try:
        text, mtime = path.read_text(), path.stat().st_mtime
        data = json.loads(text)
        ms = {int(q): float(v) for q, v in data["ms"].items()}
    except FileNotFoundError:
        facts["note"] = ("not measured yet: the first run of a method that sizes its drafts measures it (a few "
                         "seconds, once); 'fastforward profile' prints it")
        return facts
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        facts["note"] = "unreadable: the next run that needs it measures it again"
        return facts
    curve = CostCurve(ms)
    wait, cpu = data.get("wait_share"), data.get("cpu_share")
    loaded = (wait > LOADED_WAIT_SHARE if isinstance(wait, (int, float)) else
              cpu < MIN_CPU_SHARE if isinstance(cpu, (int, float)) else None)  # costs.LoadReading.loaded's rule
    facts.update(cached=True, measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(mtime)),
                 age_hours=round(max(0.0, (now or time.time()) - mtime) / 3600, 2), kv=data.get("kv"),
                 t1_ms=round(curve.t(1), 3), t8_over_t1=round(curve.ratio(8), 3),
                 ms={q: round(v, 3) for q, v in curve.ms.items()}, wait_share=wait, cpu_share=cpu,
                 under_load=loaded, plausible=plausible_curve(ms))
    return facts


def drafter_facts(target=None) -> list[dict]:
    """The shipped drafters: kind, the method that reads each, the model each was trained for, its size and (with a
    loaded ``target``) whether it is the one that method uses for it (:func:`fastforward.drafters.shipped_drafter`:
    the target's fingerprint)."""
    out = []
    if not SHIPPED_DIR.is_dir():
        return out
    for folder in sorted(p for p in SHIPPED_DIR.iterdir() if (p / "config.json").is_file()):
        try:
            cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        meta = cfg.get("fastforward") or cfg.get("fastforward_draft_model") or {}
        kind = meta.get("kind", "eagle3" if "fastforward" in cfg else "draft-model")
        row = {"name": folder.name, "kind": kind, "method": DRAFTER_METHODS.get(kind),
               "trained_for": meta.get("target"), "bytes": folder_size(folder)[0]}
        if target is not None:
            row["for_this_model"] = shipped_drafter(target, kind) == folder
        out.append(row)
    return out


def model_file_facts(name: str, why: str) -> dict:
    """A model's facts without loading it (``why`` says why not): what kind it is, where, and how large."""
    kind, path = resolve_model(name)
    size, _ = folder_size(path) if path.is_dir() else (path.stat().st_size, True)
    return {"name": name, "loaded": False, "kind": kind, "file": str(path), "bytes": size, "note": why,
            "drafters": drafter_facts()}


def model_facts(target, now: float | None = None) -> dict:
    """A loaded target's facts: backend, arithmetic, KV cache, the forward's weights by kernel, its cost curve and
    shipped drafters."""
    return {
        "name": target.name,
        "loaded": True,
        "backend": target.backend_name,
        "arithmetic": target.arithmetic,
        "kv_cache": target.kv_precision,
        "matmul": getattr(target.backend, "matmul_kernel", "hf"),
        "max_context": target.max_context,
        "row_exact_rows": target.batch_rows_limit(),
        "weights": weight_facts(target),
        "cost_curve": cost_curve_facts(target, now),
        "drafters": drafter_facts(target),
    }


# ------------------------------------------------------------------------------------------------------------------
# llama.cpp
# ------------------------------------------------------------------------------------------------------------------


def llama_cpp_amx_problem(system_info: str | None, flags: set[str] | None = None,
                          version: str | None = None) -> str | None:
    """One line when llama.cpp's build runs its AMX backend (``system_info`` says ``AMX_INT8 = 1``) on a CPU with
    AMX, where that build dies on prompts of a few hundred tokens (a segmentation fault in its AMX matmul, seen with
    llama-cpp-python 0.3.36): what happens, and the command that rebuilds it without; None otherwise. ``fastforward
    info`` says it, and the benchmark's llama.cpp peer prints it before it loads such a build."""
    if not system_info or not re.search(r"AMX_INT8\s*=\s*1", system_info):
        return None
    flags = kernels.cpu_flags() if flags is None else flags
    if not {"amx_int8", "amx_tile"} & flags:
        return None
    pin = f"llama-cpp-python=={version}" if version else "llama-cpp-python"
    return (f"llama.cpp{f' (llama-cpp-python {version})' if version else ''} runs its AMX backend on this AMX CPU, "
            "where that build dies on prompts of a few hundred tokens (a segmentation fault); rebuild it without: "
            f'CMAKE_ARGS="{LLAMACPP_NO_AMX_CMAKE_ARGS}" pip install --force-reinstall --no-deps --no-cache-dir {pin}')


def llama_cpp_version() -> str | None:
    """The installed llama-cpp-python's version (from its package metadata: nothing imported), or None."""
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return None


def llama_cpp_system_info(import_it: bool = True) -> str | None:
    """llama.cpp's ``llama_print_system_info`` (the CPU features its build uses), one line; None when
    llama-cpp-python is not imported (and ``import_it`` is false) or does not answer."""
    module = sys.modules.get("llama_cpp")
    if module is None and import_it:
        import llama_cpp as module  # noqa: PLC0415 - its shared library loads only when asked
    if module is None or not hasattr(module, "llama_print_system_info"):
        return None
    try:
        info = module.llama_print_system_info()
    except Exception:  # noqa: BLE001 - a broken build: no system info
        return None
    if isinstance(info, bytes):
        info = info.decode("utf-8", errors="replace")
    return " ".join(str(info).split()) or None


def llama_cpp_facts(import_it: bool = True, flags: set[str] | None = None) -> dict:
    """Whether llama-cpp-python is installed (found without importing it), its version, its ``system_info`` (with
    ``import_it``, or when something already imported it) and :func:`llama_cpp_amx_problem`."""
    if importlib.util.find_spec("llama_cpp") is None:
        return {"installed": False, "note": f"not installed: {LLAMACPP_INSTALL}"}
    version = llama_cpp_version()
    facts: dict = {"installed": True, "version": version}
    try:
        info = llama_cpp_system_info(import_it)
    except (ImportError, OSError, RuntimeError) as exc:  # installed, but its shared library does not load
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        facts.update(loads=False, note=f"installed but does not load ({first}); reinstall it: {LLAMACPP_INSTALL}")
        return facts
    facts["system_info"] = info
    if info is None and not import_it:
        facts["note"] = "not imported here: 'fastforward info' reads its system_info"
    problem = llama_cpp_amx_problem(info, flags, version)
    if problem:
        facts["problem"] = problem
    return facts


# ------------------------------------------------------------------------------------------------------------------
# Folders
# ------------------------------------------------------------------------------------------------------------------

MAX_FILES_COUNTED = 200_000  # a folder's size stops being summed after this many files (then marked "at least")


def folder_size(path: Path) -> tuple[int, bool]:
    """(bytes of the files under ``path``, whether every file was counted); links are not followed."""
    total, files, stack = 0, 0, [Path(path)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(Path(entry.path))
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
                    files += 1
            except OSError:
                continue
            if files >= MAX_FILES_COUNTED:
                return total, False
    return total, True


def cache_facts() -> dict:
    """The cache folder, its size and each top-level entry's (kernels, costs, trees, data, converted models and
    tokenizers, ...); the default cache too when ``$FASTFORWARD_CACHE`` points elsewhere (built kernels are read
    there as well); the shared data folder (not sized)."""
    root = cache_root()
    parts = {}
    if root.is_dir():
        for entry in sorted(root.iterdir()):
            size, complete = folder_size(entry) if entry.is_dir() else (entry.stat().st_size, True)
            parts[entry.name] = {"bytes": size, "complete": complete}
    facts = {"cache": str(root), "exists": root.is_dir(), "bytes": sum(p["bytes"] for p in parts.values()),
             "parts": parts, "costs": str(costs_dir()), "kernels": str(kernels_dir())}
    default = default_cache_root()
    if default != root and default.is_dir():
        size, complete = folder_size(default / "kernels")
        facts["default_cache_kernels"] = {"path": str(default / "kernels"), "bytes": size, "complete": complete}
    data = data_root()
    facts["data"] = {"path": str(data), "exists": data.is_dir()}
    return facts


# ------------------------------------------------------------------------------------------------------------------
# All of it
# ------------------------------------------------------------------------------------------------------------------


def machine_facts(*, import_llama_cpp: bool = True, folders: bool = True) -> dict:
    """The machine's facts (no model): versions, CPU, kernels, llama.cpp and (with ``folders``) the caches."""
    flags = kernels.cpu_flags()
    facts = {
        "fastforward": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu_facts(flags),
        "kernels": kernel_facts(),
        "llama_cpp": llama_cpp_facts(import_llama_cpp, flags),
    }
    if folders:
        facts["caches"] = cache_facts()
    return facts


def facts(target=None, *, import_llama_cpp: bool = True, folders: bool = True) -> dict:
    """:func:`machine_facts` and, for a loaded ``target``, ``model``: :func:`model_facts` -- the one account of
    what this machine gets, for ``fastforward info`` and the server's model card."""
    out = machine_facts(import_llama_cpp=import_llama_cpp, folders=folders)
    if target is not None:
        out["model"] = model_facts(target)
    return out
