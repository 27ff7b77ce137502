"""What this machine's memory can deliver, and how much of it a forward uses.

A one-token forward of a quantised model reads every weight once and does little arithmetic per byte, so its time
is bounded below by (bytes read) / (memory read bandwidth). :func:`measure_read_bandwidth` measures that bandwidth
the way STREAM does (a pass over a buffer far larger than the last-level cache, best of several repeats, with the
run's threads); :func:`forward_read_bytes` counts what a forward of the lean backend reads, so ``fastforward profile``
and the benchmarks can say how close t(1) is to the machine's limit.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .errors import UsageError

#: the default buffer: 1 GiB, far beyond any last-level cache this runs on
DEFAULT_BUFFER_BYTES = 1 << 30
#: bounds of the buffer (below 64 MiB a server's L3 would hold much of it) and of the repeats
MIN_BUFFER_BYTES, MAX_BUFFER_BYTES = 64 << 20, 16 << 30
MAX_REPEATS = 100


@dataclass(frozen=True)
class Bandwidth:
    """A measured read bandwidth: ``gb_per_s`` (10^9 bytes per second) of the fastest of ``repeats`` passes over
    ``buffer_bytes`` with ``threads`` threads, by ``method``."""

    gb_per_s: float
    buffer_bytes: int
    threads: int
    repeats: int
    method: str
    last_level_cache_bytes: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache's size from sysfs (Linux), or None where it cannot be read."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) if sizes else None


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm: pages touched, the thread pool up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _time_sum(buffer_bytes: int, repeats: int) -> tuple[float, int]:
    """(fastest seconds of ``torch.sum`` over a fresh float32 buffer of ``buffer_bytes``, its bytes)."""
    buf = torch.empty(buffer_bytes // 4, dtype=torch.float32)
    buf.fill_(1.0)
    return _best_seconds(buf.sum, repeats), buf.nbytes


def measure_read_bandwidth(buffer_bytes: int = DEFAULT_BUFFER_BYTES, repeats: int = 5,
                           threads: int | None = None) -> Bandwidth:
    """The machine's memory read bandwidth: ``torch.sum`` over a float32 buffer of ``buffer_bytes`` (filled first,
    so its pages are real), split across ``threads`` torch threads (default: the current count), fastest of
    ``repeats`` passes. A sum does one add per 4 bytes read, vectorised, so it runs at the speed memory delivers
    (one thread on a 2-core VM already reaches it); the value is what a weight-streaming forward could hope for."""
    if not MIN_BUFFER_BYTES <= buffer_bytes <= MAX_BUFFER_BYTES:
        raise UsageError(f"the bandwidth buffer must be {MIN_BUFFER_BYTES >> 20} MiB to {MAX_BUFFER_BYTES >> 30} "
                         f"GiB, got {buffer_bytes} bytes")
    if not 1 <= repeats <= MAX_REPEATS:
        raise UsageError(f"bandwidth repeats must be 1..{MAX_REPEATS}, got {repeats}")
    before = torch.get_num_threads()
    threads = threads or before
    torch.set_num_threads(threads)
    try:
        seconds, nbytes = _time_sum(buffer_bytes, repeats)  # the buffer is freed when this returns
    finally:
        torch.set_num_threads(before)
    return Bandwidth(gb_per_s=nbytes / seconds / 1e9, buffer_bytes=nbytes, threads=threads, repeats=repeats,
                     method="torch.sum over float32", last_level_cache_bytes=last_level_cache_bytes())


def _one_layout_bytes(linear) -> int:
    """Bytes a forward reads from one weight: a dense weight kept in two layouts reads only one of them; a stack of
    differently stored parts reads each part; a packed weight its packed bytes."""
    parts = getattr(linear, "parts", None)
    if parts is not None:
        return sum(_one_layout_bytes(p) for p in parts)
    dense = getattr(linear, "_dense", None)
    if dense is not None:
        return _one_layout_bytes(dense)
    w = getattr(linear, "w_out_in", None)
    if isinstance(w, torch.Tensor):
        return w.nbytes
    return int(linear.nbytes)


def forward_read_bytes(backend, q: int = 1, kv: int = 0) -> dict | None:
    """What one forward of ``q`` new tokens on a ``kv``-token cache reads from memory, for the lean backend (None
    for others): ``weights`` -- every layer's weights once and the output head in full, but of the embedding table
    only the q rows looked up, unless it is also the (tied) output head, which reads it all anyway; ``kv_cache`` --
    the keys and values attention reads (the cache's dtype, every layer); ``total`` -- both. Norms and activations
    (kilobytes) are left out."""
    embed, head, layers = (getattr(backend, a, None) for a in ("embed", "head", "layers"))
    if embed is None or head is None or layers is None:
        return None
    linears = {id(head): head}
    for layer in layers:
        for name in ("qkv", "o", "gate_up", "down"):
            lin = getattr(layer, name, None)
            if lin is not None:
                linears.setdefault(id(lin), lin)
    weights = sum(_one_layout_bytes(lin) for lin in linears.values())
    if embed is not head:  # an untied embedding: only the looked-up rows
        weights += q * _one_layout_bytes(embed) // max(1, embed.out_features)
    kv_dtype = getattr(backend, "kv_dtype", getattr(backend, "dtype", torch.float32))  # fp16 with --kv-cache fp16
    itemsize = torch.empty((), dtype=kv_dtype).element_size()
    kv_bytes = 2 * backend.n_layers * backend.n_kv_heads * backend.head_dim * itemsize * (kv + q)
    return {"weights": int(weights), "kv_cache": int(kv_bytes), "total": int(weights + kv_bytes)}


def achieved_bandwidth(read_bytes: int, ms: float) -> float:
    """GB/s that reading ``read_bytes`` in ``ms`` milliseconds amounts to."""
    return read_bytes / (ms / 1e3) / 1e9


_libc_trim = None


def release_freed_memory() -> None:
    """Give the memory the C allocator holds free back to the system (glibc's ``malloc_trim``; nothing elsewhere).
    Loading a model reads each weight into a buffer that is freed once packed; glibc keeps such freed heap memory
    resident, so without this a load's peak and resident memory grow by the fragments (~15% of a 1.7 B file)."""
    global _libc_trim
    if _libc_trim is None:
        _libc_trim = False
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                _libc_trim = ctypes.CDLL("libc.so.6").malloc_trim
            except (OSError, AttributeError):
                pass
    if _libc_trim:
        _libc_trim(0)
