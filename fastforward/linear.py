"""Weight matrices as the lean forward uses them: ``y = x @ W^T`` for ``x [q, in]``, whatever the storage.

* :class:`DenseLinear` -- fp32 weights (HF folders): fastforward's skinny-GEMM kernel for up to ``kernel_max_q``
  rows, MKL beyond. Kept in the two layouts those want (``[in, out]`` and ``[out, in]``).
* :class:`PackedLinear` -- a GGUF block-quantised weight kept packed (``[out, row_bytes]`` uint8, the file's bytes;
  for Q4_0 / Q4_1 / Q8_0 each row's fp16 block scales regrouped in front of its quants, which the kernel converts
  eight at a time) and multiplied by the native ``quant_mm`` kernel with fp32 activations: the product of the
  dequantised model, reading 4.5-8.5 bits per weight. Without the native kernels it is dequantised once to fp32
  (the plain PyTorch path).

On a CPU with AMX (Intel Sapphire Rapids and later), Q4_0 / Q4_1 / Q8_0 weights with a multiple of 16 outputs are
regrouped at load into the AMX kernel's tiled layout (same bytes) and multiplied there: every product exact in bf16
tiles, the sums in fp32 (``kernels/amx_gemm.cpp``), so extra rows in a forward cost a fraction of what they cost
with fp32 multiply-adds. ``FASTFORWARD_NO_AMX=1`` keeps the multiply-add kernel.

With ``arithmetic="q8"`` a packed weight is multiplied in llama.cpp's integer arithmetic instead (8-bit activation
blocks, integer block dots, fp32 block scaling: :mod:`fastforward.arithmetic` defines it, ``kernels/q8_gemm.cpp``
runs it), its rows regrouped at load into the integer kernel's panels of 8 (same bytes, K-quants' scales unpacked).

All compute each output row independently of the other rows in the call (bitwise), which is what makes a tree
verification give exactly the logits of decoding its path token by token.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

from .arithmetic import ARITHMETICS, Q8_FORMATS
from .kernels import load_native

# GGML block formats the native kernel multiplies packed: type id -> (name, weights per block, bytes per block).
PACKED_FORMATS = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24),
                  8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
                  30: ("BF16", 32, 64)}
FORMAT_IDS = {name: fmt for fmt, (name, _, _) in PACKED_FORMATS.items()}
# GGML types the AMX kernel multiplies (in its tiled layout, format code TILED_FORMAT_BASE + type).
AMX_FORMATS = (2, 3, 8)
NO_AMX_ENV = "FASTFORWARD_NO_AMX"


def amx_in_use(native) -> bool:
    """Whether packed weights go to the AMX kernel: the native module has it, the CPU and OS allow it, and
    ``$FASTFORWARD_NO_AMX`` is unset."""
    return (native is not None and hasattr(native, "amx_ready") and os.environ.get(NO_AMX_ENV, "") in ("", "0")
            and bool(native.amx_ready()))


def packed_kernel_name(native, arithmetic: str = "exact") -> str:
    """The packed-weight kernel's name for reports and cost-curve keys: 'avx512+amx', 'avx512', 'avx2', and for the
    q8 arithmetic 'q8-avx2', 'q8-avx512-vnni'..."""
    if arithmetic == "q8":
        return f"q8-{native.q8_dot}"
    return f"{native.isa}+amx" if amx_in_use(native) else native.isa


def dequantize(data: torch.Tensor, fmt: int, n_in: int) -> torch.Tensor:
    """The reference fp32 values of a packed weight ``[out, row_bytes]`` (gguf-py's dequantisation)."""
    from gguf import GGMLQuantizationType, quants

    if fmt == FORMAT_IDS["BF16"]:
        return data.contiguous().view(torch.bfloat16).float().reshape(data.shape[0], n_in)
    out = quants.dequantize(data.numpy(), GGMLQuantizationType(fmt))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(data.shape[0], n_in)


class DenseLinear:
    """fp32 ``W [out, in]``."""

    def __init__(self, w_out_in: torch.Tensor, *, native=None, kernel_max_q: int = 128, small_q_max: int = 4):
        self.w_out_in = w_out_in.detach().contiguous()
        self._w_in_out = None  # made on first use: an embedding never needs it
        self.out_features, self.in_features = self.w_out_in.shape
        self.skinny = None if native is None else native.skinny_mm
        self.kernel_max_q = kernel_max_q
        self.small_q_max = small_q_max

    @property
    def w_in_out(self) -> torch.Tensor:
        if self._w_in_out is None:
            self._w_in_out = self.w_out_in.t().contiguous()
        return self._w_in_out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q = x.shape[0]
        if self.skinny is not None and q <= self.kernel_max_q:
            return self.skinny(x, self.w_in_out)
        return x @ self.w_in_out if q <= self.small_q_max else F.linear(x, self.w_out_in)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.w_out_in)

    def dense(self) -> torch.Tensor:
        return self.w_out_in

    @property
    def nbytes(self) -> int:
        return self.w_out_in.nbytes + (0 if self._w_in_out is None else self._w_in_out.nbytes)


class PackedLinear:
    """A GGUF block-quantised ``W [out, in]`` kept packed: ``data [out, row_bytes]`` uint8 of GGML type ``fmt``, in
    the kernel's layout (see the module docstring). ``data`` comes in the file's layout and is regrouped into a
    copy, or in place when ``owned`` (the caller hands it over: no second copy of a large weight at load);
    ``kernel_layout=True`` says it already is in the kernel's (a concatenation of such weights)."""

    def __init__(self, data: torch.Tensor, fmt: int, in_features: int, *, native=None, kernel_layout: bool = False,
                 owned: bool = False, kernel_fmt: int | None = None, allow_amx: bool = True,
                 arithmetic: str = "exact", out_features: int | None = None):
        name, qk, nb = PACKED_FORMATS[fmt]
        if arithmetic not in ARITHMETICS:
            raise ValueError(f"unknown arithmetic {arithmetic!r} (use {', '.join(ARITHMETICS)})")
        if arithmetic == "q8" and fmt not in Q8_FORMATS:
            raise ValueError(f"{name} weights have no q8 arithmetic")
        row_bytes = in_features // qk * nb
        if not kernel_layout and (data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != row_bytes):
            raise ValueError(f"a {name} weight with {in_features} inputs needs [out, {in_features // qk * nb}] uint8")
        self.fmt, self.format_name, self.arithmetic = fmt, name, arithmetic
        # The format code the native kernels are given: the GGML type, TILED_FORMAT_BASE + type for the AMX layout,
        # or Q8_FORMAT_BASE + type for the integer kernel's panels.
        self.kernel_fmt = fmt if kernel_fmt is None else kernel_fmt
        self.out_features = data.shape[0] if out_features is None else out_features
        self.in_features = in_features
        self.native = native
        if native is not None:
            if kernel_layout:
                self.data = data.contiguous()
            elif arithmetic == "q8":  # panels of 8 rows; rows past out_features are zeros
                self.data = native.q8_pack(data.contiguous(), fmt, in_features)
                self.kernel_fmt = native.Q8_FORMAT_BASE + fmt
            elif allow_amx and fmt in AMX_FORMATS and data.shape[0] % 16 == 0 and amx_in_use(native):
                self.data = data.contiguous() if owned else data.clone(memory_format=torch.contiguous_format)
                native.amx_tile_(self.data, fmt, in_features)
                self.kernel_fmt = native.TILED_FORMAT_BASE + fmt
            else:
                self.data = data.contiguous() if owned else data.clone(memory_format=torch.contiguous_format)
                native.regroup_block_scales_(self.data, fmt, in_features, True)
            self._dense = None
        elif arithmetic == "q8":  # the plain PyTorch path of the integer arithmetic (its reference definition)
            self.data = data.contiguous() if owned else data.clone(memory_format=torch.contiguous_format)
            self._dense = None
        else:  # the plain PyTorch path: dequantise once
            self.data = None
            self._dense = DenseLinear(dequantize(data, fmt, in_features))

    @property
    def padded(self) -> bool:
        """Whether the kernel's output has columns past ``out_features`` (panels of 8 rows, cut after the call)."""
        return self.data is not None and self.data.shape[0] != self.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._dense is not None:
            return self._dense(x)
        if self.native is None:  # q8 without the native kernels
            from .arithmetic import q8_matmul

            return q8_matmul(x, self.data, self.fmt, self.in_features)
        out = self.native.quant_mm(x, self.data, self.kernel_fmt, self.in_features)
        return out[:, : self.out_features].contiguous() if self.padded else out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of W as fp32 (an embedding lookup)."""
        if self._dense is not None:
            return self._dense.rows(ids)
        if self.native is None:
            return dequantize(self.data[ids], self.fmt, self.in_features)
        return self.native.quant_rows(self.data, self.kernel_fmt, self.in_features, ids)

    def dense(self) -> torch.Tensor:
        """All of W as fp32 (for tests and conversions; not used by the forward)."""
        if self._dense is not None:
            return self._dense.dense()
        return dequantize(self.file_layout(), self.fmt, self.in_features)

    def file_layout(self) -> torch.Tensor:
        """A copy of ``data`` with the file's (GGUF) layout."""
        if self.native is None:
            return self.data.clone()
        if self.arithmetic == "q8":
            return self.native.q8_unpack(self.data, self.fmt, self.in_features, self.out_features)
        if self.kernel_fmt != self.fmt:
            return self.native.amx_untile(self.data, self.fmt, self.in_features)
        return self.native.regroup_block_scales_(self.data.clone(), self.fmt, self.in_features, False)

    @property
    def nbytes(self) -> int:
        return self._dense.nbytes if self._dense is not None else self.data.numel()

    @staticmethod
    def concat(parts: list[PackedLinear]) -> PackedLinear | None:
        """One weight whose outputs are the parts' outputs in order (q|k|v, gate|up), or None when the parts
        differ in format or inputs."""
        first = parts[0]
        if first.data is None or first.native is None or any(
                p.kernel_fmt != first.kernel_fmt or p.in_features != first.in_features or p.data is None or p.padded
                for p in parts):
            return None
        if first.fmt in getattr(first.native, "q8_panel_pairs", ()) and first.kernel_fmt != first.fmt and any(
                p.data.shape[0] % 16 for p in parts[:-1]):
            return None  # panels laid out in pairs: a part with an odd panel count would split a pair
        return PackedLinear(torch.cat([p.data for p in parts]), first.fmt, first.in_features, native=first.native,
                            kernel_layout=True, kernel_fmt=first.kernel_fmt, arithmetic=first.arithmetic)


class DraftLinear:
    """A packed weight kept in both kernel layouts, each call taking the faster for its number of rows: the
    multiply-add kernel up to ``few_rows`` rows (one row costs it about half what the AMX tile round trip does on
    a drafter's small matrices), the AMX kernel above. Rows of calls of different sizes are then **not** bitwise
    equal, so this is only for weights whose outputs need not be: a drafter's (it proposes; the target's
    verification decides). Without AMX it is one :class:`PackedLinear`."""

    def __init__(self, data: torch.Tensor, fmt: int, in_features: int, *, native, few_rows: int = 3):
        self.few = PackedLinear(data.clone(), fmt, in_features, native=native, owned=True, allow_amx=False)
        many = PackedLinear(data, fmt, in_features, native=native, owned=True)
        self.many = many if many.kernel_fmt != self.few.kernel_fmt else None
        self.few_rows = few_rows
        self.out_features, self.in_features = self.few.out_features, in_features
        self.format_name = self.few.format_name

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.many is None or x.shape[0] <= self.few_rows:
            return self.few(x)
        return self.many(x)

    def dense(self) -> torch.Tensor:
        return self.few.dense()

    @property
    def nbytes(self) -> int:
        return self.few.nbytes + (0 if self.many is None else self.many.nbytes)


def quantize(w: torch.Tensor, format_name: str) -> torch.Tensor:
    """Pack an fp32 ``W [out, in]`` into ``format_name`` blocks (``BF16``: rounded to bfloat16; ``Q8_0``: int8 with
    one fp16 scale per 32 weights, gguf-py's quantisation), as ``[out, row_bytes]`` uint8."""
    w = w.detach().float().contiguous()
    if format_name == "BF16":
        return w.to(torch.bfloat16).view(torch.uint8).reshape(w.shape[0], -1)
    from gguf import GGMLQuantizationType, quants

    return torch.from_numpy(quants.quantize(w.numpy(), GGMLQuantizationType[format_name]))


class StackedLinear:
    """Weights sharing an input but stored differently (a mixed-format GGUF such as Q4_K_M keeps attn_v in Q6_K
    beside a Q4_K attn_q): each part multiplied on its own, the outputs concatenated in order."""

    def __init__(self, parts: list):
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def dense(self) -> torch.Tensor:
        return torch.cat([p.dense() for p in self.parts])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def format_names(linear) -> set[str]:
    """The storage formats a linear multiplies ('Q4_1', 'F32', ...)."""
    if isinstance(linear, StackedLinear):
        return set().union(*(format_names(p) for p in linear.parts))
    return {getattr(linear, "format_name", "F32")}


def concat_linears(parts: list) -> object:
    """One linear for weights sharing an input (q|k|v, gate|up), outputs in order: packed rows concatenated when the
    parts share a format, else a :class:`StackedLinear` of the parts."""
    if all(isinstance(p, PackedLinear) for p in parts):
        fused = PackedLinear.concat(parts)
        if fused is not None:
            return fused
    if all(isinstance(p, DenseLinear) for p in parts):
        first = parts[0]
        native = None if first.skinny is None else _native()
        return DenseLinear(torch.cat([p.dense() for p in parts]), native=native, kernel_max_q=first.kernel_max_q,
                           small_q_max=first.small_q_max)
    return StackedLinear(parts)


def _native():
    return load_native()
