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

import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .errors import UsageError

SUPPORTED_ARCHITECTURES = {"llama", "qwen2"}


class UnsupportedGGUF(UsageError):
    """A readable GGUF file of an architecture the lean forward does not run (load() then converts it)."""


@dataclass
class GGUFTensor:
    name: str
    type_id: int  # GGML type
    shape: tuple[int, ...]  # torch order: (out, in) for a matrix
    data: np.ndarray  # memory-mapped raw bytes ([out, row_bytes] for quantised matrices) or values (F32/F16)
    offset: int  # of the data in the file
    path: Path

    def read(self) -> torch.Tensor:
        """The tensor's bytes, read from the file into fresh memory (``[out, row_bytes]`` uint8 for a matrix).

        Reading rather than copying from the memory map keeps the file's pages out of the process's resident
        memory: the weights then take their packed size once."""
        rows = self.data.shape[0] if self.data.ndim == 2 else 1
        buf = torch.empty(self.data.nbytes, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            if f.readinto(memoryview(buf.numpy())) != buf.numel():
                raise UsageError(f"{self.path} is truncated (tensor {self.name})")
        return buf.view(rows, -1)


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


def read_gguf(path: Path) -> GGUFModel:
    """Hyper-parameters and memory-mapped tensors of a Llama-family GGUF file (UsageError if it is not one)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - truncated or not a GGUF file
        raise UsageError(f"cannot read {path} as a GGUF file ({type(exc).__name__}: {exc})") from None
    arch = str(_field(reader, "general.architecture", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedGGUF(f"GGUF architecture '{arch}' is not one the lean forward runs "
                              f"({sorted(SUPPORTED_ARCHITECTURES)})")

    def hp(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    n_heads = int(hp("attention.head_count"))
    hidden = int(hp("embedding_length"))
    hparams = {
        "n_layers": int(hp("block_count")),
        "hidden_size": hidden,
        "intermediate_size": int(hp("feed_forward_length")),
        "n_heads": n_heads,
        "n_kv_heads": int(hp("attention.head_count_kv", n_heads)),
        "head_dim": int(hp("attention.key_length", hidden // n_heads)),
        "eps": float(hp("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(hp("rope.freq_base", 10000.0)),
        "rope_dim": int(hp("rope.dimension_count", hidden // n_heads)),
        "rope_scaling": str(hp("rope.scaling.type", "none") or "none"),
        "max_positions": int(hp("context_length", 4096)),
        "sliding_window": hp("attention.sliding_window"),
    }
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(s) for s in reversed(list(t.shape)))  # GGUF lists dims innermost first
        tensors[t.name] = GGUFTensor(t.name, int(t.tensor_type), shape, t.data, int(t.data_offset), Path(path))
    metadata = {"bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
                "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id")}
    return GGUFModel(Path(path), arch, hparams, tensors, metadata)


def unpermute_rows(n_rows: int, n_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation: HF row ``h*2*half + t*half + i`` is GGUF row
    ``h*2*half + 2*i + t``."""
    half = n_rows // n_heads // 2
    h = torch.arange(n_heads).view(-1, 1, 1)
    t = torch.arange(2).view(1, -1, 1)
    i = torch.arange(half).view(1, 1, -1)
    return (h * 2 * half + 2 * i + t).reshape(-1)


def linear_from_tensor(t: GGUFTensor, *, native, permute_heads: int | None = None):
    """A :class:`~fastforward.linear.PackedLinear` (packed formats) or a dense fp32 one (anything else)."""
    from .linear import PACKED_FORMATS, DenseLinear, PackedLinear, dequantize

    out_features, in_features = t.shape
    order = None if permute_heads is None else unpermute_rows(out_features, permute_heads)
    if t.type_id in PACKED_FORMATS and native is not None and in_features % PACKED_FORMATS[t.type_id][1] == 0:
        data = t.read()
        data = data.index_select(0, order) if order is not None else data
        return PackedLinear(data, t.type_id, in_features, native=native)
    if t.type_id in (0, 1):  # F32, F16
        dense = torch.from_numpy(np.array(t.data, dtype=np.float32)).reshape(out_features, in_features)
    else:
        if t.type_id not in PACKED_FORMATS:
            _notice_dequantised(t)
        dense = dequantize(t.read(), t.type_id, in_features)
    if order is not None:
        dense = dense.index_select(0, order)
    return DenseLinear(dense, native=native)


_noticed: set[str] = set()


def _notice_dequantised(t: GGUFTensor) -> None:
    from gguf import GGMLQuantizationType

    name = GGMLQuantizationType(t.type_id).name
    if name not in _noticed:
        _noticed.add(name)
        print(f"fastforward: {name} weights have no packed kernel; dequantised to fp32 at load", file=sys.stderr)


def vector(t: GGUFTensor) -> torch.Tensor:
    """A 1-D F32/F16 tensor (norm weights, biases) as fp32."""
    return torch.from_numpy(np.array(t.data, dtype=np.float32)).reshape(-1)
