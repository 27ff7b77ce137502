"""The arithmetic of a GGUF model's matrix products: what "the model" computes, which every method reproduces.

A GGUF file fixes the weights; the arithmetic fixes how they are multiplied. fastforward has two:

* ``exact`` -- every weight decoded to the fp32 value of the reference dequantisation (gguf-py's) and multiplied
  with fp32 activations: the dequantised model, at the file's size (``fastforward/kernels/quant_gemm.cpp``, or AMX
  bf16 tiles that are exact too). The default for Hugging Face folders, and one flag away for GGUF files.
* ``q8`` -- llama.cpp's arithmetic: each activation row is quantised to 8 bits per block exactly as llama.cpp does
  for the weight's format, the dot products are integer per block, and each block's integer is scaled in fp32
  (``fastforward/kernels/q8_gemm.cpp``). One VNNI instruction does 64 multiply-adds of it, and no weight is ever
  converted to float, which makes it several times cheaper per activation row on CPUs without AMX.

This module is the definition of ``q8`` -- the product, element by element, that the native kernel reproduces
bitwise on every instruction set -- written in plain PyTorch. It is the fallback where the native kernels are not
available and the reference the tests hold the kernel to.

**Activation rows** (``quantize_activations``), per row and per block, as llama.cpp's x86 code does:

* ``Q8_0`` (for Q4_0, Q5_0, Q8_0 weights; blocks of 32): ``amax = max |x|``, ``id = 127 / amax`` (0 when amax is 0),
  ``q = round_half_even(x * id)``, ``d = fp16(amax / 127)``.
* ``Q8_1`` (for Q4_1, Q5_1): the same ``q`` and ``d``, and ``s = fp16((amax / 127) * sum(q))``.
* ``Q8_K`` (for Q4_K, Q5_K, Q6_K; blocks of 256): ``max`` = the first element of largest magnitude,
  ``iscale = -127 / max``, ``q = min(127, round_half_even(iscale * x))``, ``d = 1 / iscale`` (all zero when max is
  0), and the sums of q over each 16 (``bsums``).

Quantising a row depends on that row alone, so a row's product never depends on the other rows of the call.

**The product** ``y[m, n]`` of activation row m and weight row n: for each block b of the weight row, in ascending
order, an exact integer ``I_b`` and a term ``t_b`` in fp32 (every operation rounded, no fused multiply-add):

* Q4_0, Q5_0, Q8_0: ``I = sum(q_w * q_a) - o * sum(q_a)`` with the quant's offset o (8, 16, 0);
  ``t = float(I) * (d_w * d_a)``.
* Q4_1, Q5_1: ``I = sum(q_w * q_a)``; ``t = float(I) * (d_w * d_a) + m_w * s_a``.
* Q4_K, Q5_K (a block is a 256-weight super-block of 8 sub-blocks j with 6-bit scale sc_j and min m_j):
  ``I = sum_j sc_j * sum_{k in j}(q_w * q_a)``, ``Imin = sum_j m_j * (bsums of j)``;
  ``t = float(I) * (d_w * d_a) - float(Imin) * (dmin_w * d_a)``.
* Q6_K (16 sub-blocks i of 16 with int8 scale sc_i): ``I = sum_i sc_i * (sum_{k in i}(q_w * q_a) - 32 * bsum_i)``;
  ``t = float(I) * (d_w * d_a)``.

and ``y = ((0 + t_0) + t_1) + ...`` in block order. Integer sums are exact whatever their order, so the only rounding
is in these few fp32 operations, which every path performs in the same order: the result does not depend on the
CPU, the instruction set, the number of threads or the number of rows in the call.
"""

from __future__ import annotations

import numpy as np
import torch

ARITHMETICS = ("exact", "q8")
DEFAULT_GGUF_ARITHMETIC = "q8"

# GGML type ids
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
Q8_FORMATS = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K",
              Q6_K: "Q6_K"}
#: the activation blocks each weight format is multiplied with
ACTIVATION_FORMAT = {Q4_0: "Q8_0", Q5_0: "Q8_0", Q8_0: "Q8_0", Q4_1: "Q8_1", Q5_1: "Q8_1", Q4_K: "Q8_K",
                     Q5_K: "Q8_K", Q6_K: "Q8_K"}
BLOCK = {Q4_0: 32, Q4_1: 32, Q5_0: 32, Q5_1: 32, Q8_0: 32, Q4_K: 256, Q5_K: 256, Q6_K: 256}
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34, Q4_K: 144, Q5_K: 176, Q6_K: 210}
OFFSET = {Q4_0: 8, Q5_0: 16, Q8_0: 0}


# ------------------------------------------------------------------------------------------------------------------
# Activation rows
# ------------------------------------------------------------------------------------------------------------------


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


def quantize_activations(x: torch.Tensor, act_format: str) -> dict:
    """The 8-bit blocks of activation rows ``x [M, K]`` (fp32) in ``act_format`` ('Q8_0', 'Q8_1', 'Q8_K'):
    ``q`` int64 [M, nb, QK], ``d`` fp32 [M, nb], and ``sum`` (Q8_0, Q8_1), ``s`` (Q8_1) or ``bsums`` [M, nb, 16]
    (Q8_K)."""
    x = x.detach().to(torch.float32)
    M, K = x.shape
    qk = 256 if act_format == "Q8_K" else 32
    if K % qk:
        raise ValueError(f"{act_format} rows need a multiple of {qk} values, got {K}")
    xb = x.reshape(M, K // qk, qk)
    if act_format == "Q8_K":
        idx = xb.abs().argmax(dim=-1, keepdim=True)  # the first element of largest magnitude
        mx = torch.gather(xb, -1, idx).squeeze(-1)
        zero = mx == 0
        iscale = torch.where(zero, torch.ones_like(mx), torch.tensor(-127.0) / torch.where(zero, 1.0, mx))
        q = torch.round(iscale.unsqueeze(-1) * xb).clamp_max(127)
        q = torch.where(zero.unsqueeze(-1), torch.zeros_like(q), q).to(torch.int64)
        d = torch.where(zero, torch.zeros_like(mx), torch.tensor(1.0) / iscale)
        return {"q": q, "d": d, "bsums": q.reshape(M, K // qk, 16, 16).sum(-1)}
    amax = xb.abs().amax(dim=-1)
    d32 = amax / torch.tensor(127.0)
    inv = torch.where(amax != 0, torch.tensor(127.0) / torch.where(amax != 0, amax, 1.0), torch.zeros_like(amax))
    q = torch.round(xb * inv.unsqueeze(-1)).to(torch.int64)
    out = {"q": q, "d": _fp16(d32), "sum": q.sum(-1)}
    if act_format == "Q8_1":
        out["s"] = _fp16(d32 * out["sum"].to(torch.float32))
    return out


# ------------------------------------------------------------------------------------------------------------------
# Weight blocks as integers
# ------------------------------------------------------------------------------------------------------------------


def _half(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """Q4_0/Q4_1/Q5 layout: 16 bytes -> 32 quants (low nibbles first)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int64)


def _bits32(qh: np.ndarray) -> np.ndarray:
    word = np.ascontiguousarray(qh).view(np.uint32)  # [..., 1]
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int64)


def k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of Q4_K / Q5_K super-blocks from their 12 packed bytes."""
    s = scales.reshape(*scales.shape[:-1], 3, 4).astype(np.int64)
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def weight_blocks(data: np.ndarray, fmt: int, K: int) -> dict:
    """GGUF rows ``[N, row_bytes]`` as integer quants and fp32 scales: ``q`` [N, nb, QK] (before any offset),
    ``d`` [N, nb], and per format ``m`` (Q4_1, Q5_1), ``dmin``/``sc``/``mn`` (Q4_K, Q5_K), ``sc`` (Q6_K)."""
    N = data.shape[0]
    nb = K // BLOCK[fmt]
    blk = np.ascontiguousarray(data).reshape(N, nb, BLOCK_BYTES[fmt])
    if fmt == Q4_0:
        return {"q": _nibbles32(blk[..., 2:]), "d": _half(blk[..., 0:2])}
    if fmt == Q4_1:
        return {"q": _nibbles32(blk[..., 4:]), "d": _half(blk[..., 0:2]), "m": _half(blk[..., 2:4])}
    if fmt == Q5_0:
        return {"q": _nibbles32(blk[..., 6:]) | (_bits32(blk[..., 2:6]) << 4), "d": _half(blk[..., 0:2])}
    if fmt == Q5_1:
        return {"q": _nibbles32(blk[..., 8:]) | (_bits32(blk[..., 4:8]) << 4), "d": _half(blk[..., 0:2]),
                "m": _half(blk[..., 2:4])}
    if fmt == Q8_0:
        return {"q": blk[..., 2:].view(np.int8).astype(np.int64), "d": _half(blk[..., 0:2])}
    if fmt in (Q4_K, Q5_K):
        sc, mn = k_scales(blk[..., 4:16])
        qs_at = 16 if fmt == Q4_K else 48
        qs = blk[..., qs_at:qs_at + 128].reshape(N, nb, 4, 1, 32)
        q = ((qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F).reshape(N, nb, 256)
        q = q.astype(np.int64)
        if fmt == Q5_K:
            qh = blk[..., 16:48].reshape(N, nb, 1, 32)
            bits = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1  # bit j: sub-block j
            q = q | (bits.reshape(N, nb, 256).astype(np.int64) << 4)
        return {"q": q, "d": _half(blk[..., 0:2]), "dmin": _half(blk[..., 2:4]), "sc": sc, "mn": mn}
    if fmt == Q6_K:
        ql = blk[..., 0:128].reshape(N, nb, 2, 1, 64)
        ql = ((ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F).reshape(N, nb, 2, 128)
        qh = blk[..., 128:192].reshape(N, nb, 2, 1, 32)
        qh = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3).reshape(N, nb, 2, 128)
        q = (ql.astype(np.int64) | (qh.astype(np.int64) << 4)).reshape(N, nb, 256)
        return {"q": q, "d": _half(blk[..., 208:210]), "sc": blk[..., 192:208].view(np.int8).astype(np.int64)}
    raise ValueError(f"GGML type {fmt} has no q8 arithmetic")


# ------------------------------------------------------------------------------------------------------------------
# The product
# ------------------------------------------------------------------------------------------------------------------


def _block_dots(qa: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    """Exact integer dot products per block: qa [M, nb, G, L] x qw [N, nb, G, L] -> [M, nb, G, N] (float64 holds
    every partial sum exactly: all are integers far below 2^53)."""
    return torch.einsum("mbgl,nbgl->mbgn", qa.to(torch.float64), qw.to(torch.float64))


def q8_matmul(x: torch.Tensor, data, fmt: int, K: int) -> torch.Tensor:
    """``y [M, N]`` = activation rows ``x [M, K]`` times the GGUF weight rows ``data [N, row_bytes]`` (uint8, the
    file's layout) in the q8 arithmetic (the module docstring gives it element by element)."""
    if fmt not in Q8_FORMATS:
        raise ValueError(f"GGML type {fmt} has no q8 arithmetic")
    w = weight_blocks(data.numpy() if isinstance(data, torch.Tensor) else data, fmt, K)
    a = quantize_activations(x, ACTIVATION_FORMAT[fmt])
    qw = torch.from_numpy(w["q"])
    N, nb = qw.shape[0], qw.shape[1]
    M = x.shape[0]
    da = a["d"]  # [M, nb]
    dw = torch.from_numpy(w["d"])  # [N, nb]

    def scale(ws: torch.Tensor) -> torch.Tensor:  # [M, nb, N] = ws[n, b] * da[m, b], rounded
        return ws.t().unsqueeze(0) * da.unsqueeze(-1)

    def as_float(i: torch.Tensor) -> torch.Tensor:  # an exact integer (float64) -> int -> fp32, rounded to nearest
        return i.to(torch.int64).to(torch.float32)

    if fmt in (Q4_0, Q5_0, Q8_0, Q4_1, Q5_1):
        dots = _block_dots(a["q"].unsqueeze(2), qw.unsqueeze(2))[:, :, 0, :]  # [M, nb, N]
        if fmt in OFFSET:
            dots = dots - float(OFFSET[fmt]) * a["sum"].to(torch.float64).unsqueeze(-1)
        terms = as_float(dots) * scale(dw)
        if fmt in (Q4_1, Q5_1):
            terms = terms + torch.from_numpy(w["m"]).t().unsqueeze(0) * a["s"].unsqueeze(-1)
    elif fmt in (Q4_K, Q5_K):
        dots = _block_dots(a["q"].reshape(M, nb, 8, 32), qw.reshape(N, nb, 8, 32))  # [M, nb, 8, N]
        sc = torch.from_numpy(w["sc"]).to(torch.float64).permute(1, 2, 0).unsqueeze(0)  # [1, nb, 8, N]
        i_sum = (dots * sc).sum(2)
        bs32 = a["bsums"].reshape(M, nb, 8, 2).sum(-1).to(torch.float64)  # [M, nb, 8]
        mn = torch.from_numpy(w["mn"]).to(torch.float64)  # [N, nb, 8]
        i_min = torch.einsum("mbj,nbj->mbn", bs32, mn)
        terms = as_float(i_sum) * scale(dw) - as_float(i_min) * scale(torch.from_numpy(w["dmin"]))
    else:  # Q6_K
        dots = _block_dots(a["q"].reshape(M, nb, 16, 16), qw.reshape(N, nb, 16, 16))  # [M, nb, 16, N]
        dots = dots - 32.0 * a["bsums"].to(torch.float64).unsqueeze(-1)
        sc = torch.from_numpy(w["sc"]).to(torch.float64).permute(1, 2, 0).unsqueeze(0)
        terms = as_float((dots * sc).sum(2)) * scale(dw)
    out = torch.zeros(M, N, dtype=torch.float32)
    for b in range(nb):  # block order: the one rounding order of the sum
        out = out + terms[:, b, :]
    return out
