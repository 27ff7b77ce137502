"""Reading a GGUF file directly: hyper-parameters, tensors (memory-mapped, quantised blocks kept packed), tokenizer.

The lean forward runs a Llama-family GGUF straight from this: no conversion to an HF model, one packed copy of the
weights (about the file's size in memory). Tensors in formats the native kernel multiplies packed
(:data:`fastforward.linear.PACKED_FORMATS`) stay packed; any other quantised type is dequantised to fp32 at load
with a one-line notice. Only the tokenizer goes through transformers, once per file: it is saved beside the
cache of converted models and read back from there.

llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` (interleaved RoPE pairs); :func:`unpermute_rows`
undoes it so that the HF (rotate-half) RoPE applies, as transformers' GGUF loader does for the fp32 weights.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .arithmetic import Q8_FORMATS
from .errors import UsageError
from .linear import PACKED_FORMATS, DenseLinear, PackedLinear, dequantize

#: GGUF architectures the lean forward reads (Llama's layout; Qwen2's QKV biases; Qwen3's q/k norms; Phi-3's fused
#: q|k|v and gate|up tensors; Gemma 2 / 3's four norms per layer, soft-caps and local / global layers)
SUPPORTED_ARCHITECTURES = {"llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"}


class UnsupportedGGUF(UsageError):
    """A readable GGUF file of an architecture the lean forward does not run (load() then converts it)."""


@dataclass
class GGUFTensor:
    name: str
    type_id: int  # GGML type
    shape: tuple[int, ...]  # torch order: (out, in) for a matrix
    offset: int  # of the data in the file
    nbytes: int
    path: Path

    def read(self) -> torch.Tensor:
        """The tensor's bytes, read from the file into fresh memory (``[out, row_bytes]`` uint8 for a matrix).

        Reading rather than memory-mapping keeps the file's pages out of the process's resident memory: the
        weights take their packed size once."""
        rows = self.shape[0] if len(self.shape) == 2 else 1
        return self.read_rows(0, rows)

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of the tensor's bytes (``[stop - start, row_bytes]`` uint8), read into fresh
        memory."""
        rows = self.shape[0] if len(self.shape) == 2 else 1
        row_bytes = self.nbytes // rows
        buf = torch.empty((stop - start) * row_bytes, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.offset + start * row_bytes)
            if f.readinto(memoryview(buf.numpy())) != buf.numel():
                raise UsageError(f"{self.path} is truncated (tensor {self.name})")
        return buf.view(stop - start, row_bytes)


@dataclass
class GGUFModel:
    path: Path
    architecture: str
    hparams: dict  # n_layers, hidden_size, intermediate_size, n_heads, n_kv_heads, head_dim, eps, rope_theta, ...
    tensors: dict[str, GGUFTensor] = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception:  # noqa: BLE001 - an unreadable field is treated as absent
        return default


INDEX_VERSION = 3


def read_gguf(path: Path, index_file: Path | None = None) -> GGUFModel:
    """Hyper-parameters and the tensor table of a Llama-family GGUF file (:class:`UnsupportedGGUF` for another
    architecture, UsageError for an unreadable file).

    Parsing a GGUF header means walking its whole tokenizer vocabulary (seconds in Python); with ``index_file``
    the result is saved there once and read back on later calls."""
    path = Path(path)
    if index_file is not None and index_file.is_file():
        try:
            index = json.loads(index_file.read_text())
            if index.get("version") == INDEX_VERSION:
                return _from_index(path, index)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged index is rebuilt
    index = _parse(path)
    if index_file is not None:
        index_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = index_file.with_name(index_file.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(index))
        tmp.replace(index_file)
    return _from_index(path, index)


def _from_index(path: Path, index: dict) -> GGUFModel:
    tensors = {name: GGUFTensor(name, t["type"], tuple(t["shape"]), t["offset"], t["nbytes"], path)
               for name, t in index["tensors"].items()}
    if index["architecture"] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedGGUF(f"GGUF architecture '{index['architecture']}' is not one the lean forward runs "
                              f"({sorted(SUPPORTED_ARCHITECTURES)})")
    return GGUFModel(path, index["architecture"], index["hparams"], tensors, index["metadata"])


def _parse(path: Path) -> dict:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - truncated or not a GGUF file
        raise UsageError(f"cannot read {path} as a GGUF file: it is truncated or corrupt "
                         f"({type(exc).__name__} while reading its header)") from None
    arch = str(_field(reader, "general.architecture", ""))
    index = {"version": INDEX_VERSION, "architecture": arch, "hparams": {}, "tensors": {}, "metadata": {}}
    if arch not in SUPPORTED_ARCHITECTURES:
        return index

    def hp(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    try:
        n_heads = int(hp("attention.head_count"))
        hidden = int(hp("embedding_length"))
        head_dim = int(hp("attention.key_length", hidden // n_heads))  # Gemma's and Qwen3's differ from hidden / heads
        index["hparams"] = {
            "n_layers": int(hp("block_count")),
            "hidden_size": hidden,
            "intermediate_size": int(hp("feed_forward_length")),
            "n_heads": n_heads,
            "n_kv_heads": int(hp("attention.head_count_kv", n_heads)),
            "head_dim": head_dim,
            "eps": float(hp("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(hp("rope.freq_base", 10000.0)),
            "rope_dim": int(hp("rope.dimension_count", head_dim)),
            "rope_scaling": str(hp("rope.scaling.type", "none") or "none"),
            "rope_scale_factor": float(hp("rope.scaling.factor", 1.0) or 1.0),
            "max_positions": int(hp("context_length", 4096)),
            "sliding_window": hp("attention.sliding_window"),
            "sliding_window_pattern": _plain(hp("attention.sliding_window_pattern")),
            "rope_theta_swa": hp("rope.freq_base_swa"),
            "attn_softcap": hp("attn_logit_softcapping"),
            "final_softcap": hp("final_logit_softcapping"),
        }
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{path}: missing or malformed {arch} hyper-parameters ({exc})") from None
    for t in reader.tensors:
        shape = [int(s) for s in reversed(list(t.shape))]  # GGUF lists dims innermost first
        index["tensors"][t.name] = {"type": int(t.tensor_type), "shape": shape, "offset": int(t.data_offset),
                                    "nbytes": int(t.n_bytes)}
    for key in ("bos_token_id", "eos_token_id"):
        value = _field(reader, f"tokenizer.ggml.{key}")
        index["metadata"][key] = None if value is None else int(value)
    end = max((t["offset"] + t["nbytes"] for t in index["tensors"].values()), default=0)
    if end > path.stat().st_size:
        raise UsageError(f"{path} is truncated: its tensors end at byte {end}, the file has {path.stat().st_size}")
    return index


def _plain(value):
    """A metadata value as JSON (a GGUF array as a list of plain values)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return [v.item() if hasattr(v, "item") else v for v in value]


def unpermute_rows(n_rows: int, n_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation: HF row ``h*2*half + t*half + i`` is GGUF row
    ``h*2*half + 2*i + t``."""
    half = n_rows // n_heads // 2
    h = torch.arange(n_heads).view(-1, 1, 1)
    t = torch.arange(2).view(1, -1, 1)
    i = torch.arange(half).view(1, 1, -1)
    return (h * 2 * half + 2 * i + t).reshape(-1)


def linear_from_tensor(t: GGUFTensor, *, native, permute_heads: int | None = None, arithmetic: str = "exact"):
    """A :class:`~fastforward.linear.PackedLinear` (packed formats, multiplied in ``arithmetic``: 'exact' or 'q8')
    or a dense fp32 one (anything else: F32 / F16 tensors, and quantised types without a kernel, dequantised)."""
    out_features, in_features = t.shape
    order = None if permute_heads is None else unpermute_rows(out_features, permute_heads)
    q8 = arithmetic == "q8" and t.type_id in Q8_FORMATS
    if (t.type_id in PACKED_FORMATS and (native is not None or q8)
            and in_features % PACKED_FORMATS[t.type_id][1] == 0):
        if q8 and native is not None and order is None and out_features > Q8_PACK_ROWS:
            return PackedLinear(_q8_packed_in_slices(t, native, in_features), t.type_id, in_features, native=native,
                                kernel_layout=True, kernel_fmt=native.Q8_FORMAT_BASE + t.type_id, arithmetic="q8",
                                out_features=out_features)
        data = t.read()
        data = data.index_select(0, order) if order is not None else data
        return PackedLinear(data, t.type_id, in_features, native=native, owned=True,
                            arithmetic="q8" if q8 else "exact")
    if t.type_id in (0, 1):  # F32, F16
        dense = _values(t).reshape(out_features, in_features)
    else:
        if t.type_id not in PACKED_FORMATS:
            _notice_dequantised(t)
        dense = dequantize(t.read(), t.type_id, in_features)
    if order is not None:
        dense = dense.index_select(0, order)
    return DenseLinear(dense, native=native)


#: rows of a weight read and packed for the integer kernel at a time (a multiple of 16: its 8-row panels, in pairs on
#: AVX-512 VNNI): a large weight (an embedding of 150 K rows) is never held in the file's layout and the kernel's at
#: once while loading
Q8_PACK_ROWS = 4096


def _q8_packed_in_slices(t: GGUFTensor, native, in_features: int) -> torch.Tensor:
    """``native.q8_pack`` of the whole tensor, read and packed :data:`Q8_PACK_ROWS` rows at a time into one buffer
    (the panels of 8 rows, and their pairs, are independent, so the slices' packings laid end to end are the
    whole's)."""
    assert Q8_PACK_ROWS % 16 == 0, "slices must keep the kernel's pairs of panels whole"
    rows = t.shape[0]
    out = None
    for start in range(0, rows, Q8_PACK_ROWS):
        stop = min(rows, start + Q8_PACK_ROWS)
        packed = native.q8_pack(t.read_rows(start, stop).contiguous(), t.type_id, in_features)
        if out is None:
            out = torch.empty((rows + 7) // 8 * 8, packed.shape[1], dtype=torch.uint8)
        out[start : start + packed.shape[0]] = packed
    return out


_noticed: set[str] = set()


def _notice_dequantised(t: GGUFTensor) -> None:
    from gguf import GGMLQuantizationType

    name = GGMLQuantizationType(t.type_id).name
    if name not in _noticed:
        _noticed.add(name)
        print(f"fastforward: {name} weights have no packed kernel; dequantised to fp32 at load", file=sys.stderr)


def _values(t: GGUFTensor) -> torch.Tensor:
    if t.type_id not in (0, 1):
        raise UsageError(f"{t.path}: tensor {t.name} should be F32 or F16")
    return t.read().view(torch.float32 if t.type_id == 0 else torch.float16).reshape(-1).float()


def vector(t: GGUFTensor) -> torch.Tensor:
    """A 1-D F32/F16 tensor (norm weights, biases) as fp32."""
    return _values(t)
