// quant_mm: out[M, N] = x[M, K] @ W^T for a GGUF-quantised weight W [N, K] kept packed, with fp32 activations.
//
// W is stored as GGUF stores it: N rows of K/QK blocks (row_bytes each), in one of the block formats below.
// Each block of 32 weights is decoded in registers to exactly the fp32 values the reference dequantisation
// (gguf-py's `dequantize`) gives -- the same multiplies and adds in the same order, no fused multiply-add there
// (the build passes -ffp-contract=off) -- and multiplied with fp32 activations. So the product is the one of the
// dequantised fp32 model, up to the order of summation, while memory carries the file's 4.5-8.5 bits per weight.
//
// Numerics, the same for every M (row m of quant_mm(x) is bitwise equal to quant_mm(x[m:m+1])):
//   every output element is summed in chunks of kChunk = 128 weights (blocked summation, which keeps the rounding
//   error near a BLAS's): per chunk one vector accumulator of kLanes lanes starts at 0 and takes
//   fma(x[k + lane], w[k + lane], acc) for k = chunk start, + kLanes, ... in order; the chunk's vector is added to
//   the running total of the earlier chunks; at the end the total's lanes are reduced by a fixed tree (Isa::hsum,
//   or Isa::hsum_lanes for many totals at once: the same additions).
//   Tiling over rows and columns, threading and the choice between decoding in registers (up to seven rows) or
//   into an L1 scratch (more rows) never change that arithmetic.
//
// With 16 lanes, a Q4_0 / Q4_1 block's 16 possible weight values are computed that way once and its 32 nibbles
// looked up among them (vpermps), which gives the same values with a third of the vector work. Q4_0 / Q4_1 / Q8_0
// rows are kept with their fp16 block scales regrouped in front of the quants (`regroup_block_scales_`, same
// bytes), converted once per row (`prepare_row`), and every block prefetches the bytes 4 KB ahead.
//
// Formats (QK = weights per block, bytes per block): Q4_0 (32, 18), Q4_1 (32, 20), Q5_0 (32, 22), Q5_1 (32, 24),
// Q8_0 (32, 34), Q4_K (256, 144), Q5_K (256, 176), Q6_K (256, 210), and BF16 (32, 64). Any other GGUF type is
// dequantised at load by the Python side.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "isa.h"

// amx_gemm.cpp: weights in the AMX kernel's tiled layout (format codes TILED_FORMAT_BASE + type).
bool ff_is_tiled(int64_t fmt);
at::Tensor ff_amx_mm(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t K);
at::Tensor ff_amx_rows(const at::Tensor& w, int64_t fmt, int64_t K, const at::Tensor& ids);
// q8_gemm.cpp: weights in the integer kernel's panel layout (format codes Q8_FORMAT_BASE + type).
bool ff_is_q8(int64_t fmt);
at::Tensor ff_q8_mm(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t K);
at::Tensor ff_q8_rows(const at::Tensor& w, int64_t fmt, int64_t K, const at::Tensor& ids);

namespace {

using ff::Isa;
using ff::kLanes;
using ff::Reg;

constexpr int kSlots = 32 / kLanes;  // vectors per 32-weight block

// GGML type ids (gguf.GGMLQuantizationType).
enum Fmt : int { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
                 kBF16 = 30 };

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 32 unsigned bytes -> slot s of int32 lanes (element s*kLanes + lane).
#if defined(FF_ISA_AVX512)
using IReg = __m512i;
inline IReg widen_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline IReg widen_s8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline IReg iand(IReg a, int v) { return _mm512_and_si512(a, _mm512_set1_epi32(v)); }
inline IReg isrl(IReg a, int n) { return _mm512_srli_epi32(a, n); }
inline IReg isub(IReg a, int v) { return _mm512_sub_epi32(a, _mm512_set1_epi32(v)); }
inline IReg ior(IReg a, IReg b) { return _mm512_or_si512(a, b); }
inline IReg isll(IReg a, int n) { return _mm512_slli_epi32(a, n); }
inline Reg tofloat(IReg a) { return _mm512_cvtepi32_ps(a); }
// Lane l of the result: bit (first + l) of v, as 0 or 1.
inline IReg bits_of(uint32_t v, int first) {
  return _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(v)),
                                            _mm512_add_epi32(_mm512_set1_epi32(first),
                                                             _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                                               12, 13, 14, 15))),
                          _mm512_set1_epi32(1));
}
inline Reg bf16_to_float(const uint8_t* p) {
  const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}
#else
using IReg = __m256i;
inline IReg widen_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline IReg widen_s8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline IReg iand(IReg a, int v) { return _mm256_and_si256(a, _mm256_set1_epi32(v)); }
inline IReg isrl(IReg a, int n) { return _mm256_srli_epi32(a, n); }
inline IReg isub(IReg a, int v) { return _mm256_sub_epi32(a, _mm256_set1_epi32(v)); }
inline IReg ior(IReg a, IReg b) { return _mm256_or_si256(a, b); }
inline IReg isll(IReg a, int n) { return _mm256_slli_epi32(a, n); }
inline Reg tofloat(IReg a) { return _mm256_cvtepi32_ps(a); }
inline IReg bits_of(uint32_t v, int first) {
  return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(v)),
                                            _mm256_add_epi32(_mm256_set1_epi32(first),
                                                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))),
                          _mm256_set1_epi32(1));
}
inline Reg bf16_to_float(const uint8_t* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
#endif

#if !defined(FF_ISA_AVX512)
// The 4-bit values of 32 weights whose low nibbles are elements 0..15 of 16 bytes and high nibbles 16..31
// (Q4_0 / Q4_1 layout), slot by slot (8 lanes; with 16 lanes these blocks decode by `nibble_lookup`).
inline void nibbles_split16(const uint8_t* qs, IReg q[kSlots]) {
  const IReg b0 = widen_u8(qs), b1 = widen_u8(qs + 8);
  q[0] = iand(b0, 0xF);
  q[1] = iand(b1, 0xF);
  q[2] = isrl(b0, 4);
  q[3] = isrl(b1, 4);
}
#endif

#if defined(FF_ISA_AVX512)
// 0, 1, ..., 15: the values of a nibble.
inline IReg nibble_values() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
// Q4_0 / Q4_1 blocks with 16 lanes: the weight of nibble value v is table[v], so a block decodes by two lookups
// (vpermps reads only the low 4 bits of each index: the low nibbles need no mask) instead of converting and
// scaling every weight. table holds exactly the values the per-weight arithmetic gives, so w is unchanged.
inline void nibble_lookup(Reg table, const uint8_t* qs, Reg w[kSlots]) {
  const IReg b = widen_u8(qs);
  w[0] = _mm512_permutexvar_ps(b, table);
  w[1] = _mm512_permutexvar_ps(isrl(b, 4), table);
}
#endif

// The low (hi = false) or high nibbles of 32 consecutive bytes: elements 0..31 in order (Q4_K / Q6_K layout).
inline void nibbles32(const uint8_t* qs, bool hi, IReg q[kSlots]) {
  for (int s = 0; s < kSlots; ++s) {
    const IReg b = widen_u8(qs + s * kLanes);
    q[s] = hi ? isrl(b, 4) : iand(b, 0xF);
  }
}

// A weight row as the decoders read it: its quants (K-quants, BF16: all its bytes) and, for the formats with one
// or two fp16 scales per 32-weight block (Q4_0, Q8_0: d; Q4_1: d, m), those scales already converted to fp32
// (`prepare_row`), kScales per block. Converting them once per row instead of inside every block's decode takes
// the conversion and the broadcasts off the shuffle port, where the decode of a lone activation row is bound (the
// scales then broadcast from memory).
struct WRow {
  const uint8_t* q;
  const float* s;
};

// Decoders: Fmt -> block geometry, kScales, and decode(row, b, w) giving the fp32 weights of 32-weight block b.
template <int F>
struct Decoder;

template <>
struct Decoder<kQ4_0> {
  static constexpr int64_t kQK = 32, kBytes = 18, kQBytes = 16;
  static constexpr int kScales = 1;
  static inline void decode(const WRow& row, int64_t b, Reg w[kSlots]) {
    const uint8_t* blk = row.q + b * kQBytes;
    const Reg d = Isa::bcast(row.s + b);
#if defined(FF_ISA_AVX512)
    // The 16 values a nibble can stand for, computed as below, then looked up (the same fp32 values).
    nibble_lookup(Isa::mul(d, tofloat(isub(nibble_values(), 8))), blk, w);
#else
    IReg q[kSlots];
    nibbles_split16(blk, q);
    for (int s = 0; s < kSlots; ++s) w[s] = Isa::mul(d, tofloat(isub(q[s], 8)));
#endif
  }
};

template <>
struct Decoder<kQ4_1> {
  static constexpr int64_t kQK = 32, kBytes = 20, kQBytes = 16;
  static constexpr int kScales = 2;
  static inline void decode(const WRow& row, int64_t b, Reg w[kSlots]) {
    const uint8_t* blk = row.q + b * kQBytes;
    const Reg d = Isa::bcast(row.s + 2 * b), m = Isa::bcast(row.s + 2 * b + 1);
#if defined(FF_ISA_AVX512)
    // The 16 values a nibble can stand for, computed as below, then looked up (the same fp32 values).
    nibble_lookup(Isa::add(Isa::mul(d, tofloat(nibble_values())), m), blk, w);
#else
    IReg q[kSlots];
    nibbles_split16(blk, q);
    for (int s = 0; s < kSlots; ++s) w[s] = Isa::add(Isa::mul(d, tofloat(q[s])), m);
#endif
  }
};

template <>
struct Decoder<kQ8_0> {
  static constexpr int64_t kQK = 32, kBytes = 34, kQBytes = 32;
  static constexpr int kScales = 1;
  static inline void decode(const WRow& row, int64_t b, Reg w[kSlots]) {
    const uint8_t* blk = row.q + b * kQBytes;
    const Reg d = Isa::bcast(row.s + b);
    for (int s = 0; s < kSlots; ++s) w[s] = Isa::mul(d, tofloat(widen_s8(blk + s * kLanes)));
  }
};

// Q5_0 / Q5_1: 32 five-bit quants per block: the Q4 nibbles, and bit e of the 4-byte qh the high bit of element e.
// Kernel layout: the row's scales first (as Q4_0 / Q4_1), then per block qh (4 bytes) and the 16 bytes of nibbles.
inline void q5_values(const uint8_t* blk, IReg q[kSlots]) {
  uint32_t qh;
  std::memcpy(&qh, blk, 4);
  const uint8_t* qs = blk + 4;
#if defined(FF_ISA_AVX512)
  const IReg b = widen_u8(qs);
  q[0] = ior(iand(b, 0xF), isll(bits_of(qh, 0), 4));
  q[1] = ior(isrl(b, 4), isll(bits_of(qh, 16), 4));
#else
  nibbles_split16(qs, q);
  for (int s = 0; s < kSlots; ++s) q[s] = ior(q[s], isll(bits_of(qh, s * kLanes), 4));
#endif
}

template <>
struct Decoder<kQ5_0> {
  static constexpr int64_t kQK = 32, kBytes = 22, kQBytes = 20;
  static constexpr int kScales = 1;
  static inline void decode(const WRow& row, int64_t b, Reg w[kSlots]) {
    const Reg d = Isa::bcast(row.s + b);
    IReg q[kSlots];
    q5_values(row.q + b * kQBytes, q);
    for (int s = 0; s < kSlots; ++s) w[s] = Isa::mul(d, tofloat(isub(q[s], 16)));
  }
};

template <>
struct Decoder<kQ5_1> {
  static constexpr int64_t kQK = 32, kBytes = 24, kQBytes = 20;
  static constexpr int kScales = 2;
  static inline void decode(const WRow& row, int64_t b, Reg w[kSlots]) {
    const Reg d = Isa::bcast(row.s + 2 * b), m = Isa::bcast(row.s + 2 * b + 1);
    IReg q[kSlots];
    q5_values(row.q + b * kQBytes, q);
    for (int s = 0; s < kSlots; ++s) w[s] = Isa::add(Isa::mul(d, tofloat(q[s])), m);
  }
};

// Q4_K: super-blocks of 256 = 8 sub-blocks of 32: d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 bytes
// of nibbles (64-weight chunks: low nibbles first 32, high nibbles next 32). w = (d * sc) * q - (dmin * m).
template <>
struct Decoder<kQ4_K> {
  static constexpr int64_t kQK = 256, kBytes = 144, kQBytes = kBytes / 8;  // kQBytes: per 32 weights
  static constexpr int kScales = 0;
  static constexpr bool kPrepared = true;  // (d * sc, dmin * m) per sub-block, computed once per row
  static inline void decode(const WRow& wrow, int64_t b, Reg w[kSlots]) {
    const uint8_t* blk = wrow.q + (b >> 3) * kBytes;
    const int j = static_cast<int>(b & 7);
    const Reg vd = Isa::bcast(wrow.s + 2 * b), vm = Isa::bcast(wrow.s + 2 * b + 1);
    IReg q[kSlots];
    nibbles32(blk + 16 + (j >> 1) * 32, j & 1, q);
    for (int s = 0; s < kSlots; ++s) w[s] = Isa::sub(Isa::mul(vd, tofloat(q[s])), vm);
  }
};

// The six-bit scale and min of sub-block j of a Q4_K / Q5_K super-block (its 12 packed bytes at sc6).
inline void k_scale_min(const uint8_t* sc6, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = sc6[j] & 0x3F;
    mn = sc6[j + 4] & 0x3F;
  } else {
    sc = (sc6[j + 4] & 0x0F) | ((sc6[j - 4] >> 2) & 0x30);
    mn = (sc6[j + 4] >> 4) | ((sc6[j] >> 2) & 0x30);
  }
}

// Q5_K: Q4_K's layout with 32 bytes of high bits after the scales (bit j of qh[k]: element 32 j + k's fifth bit).
// w = (d * sc) * q - (dmin * m), q in 0..31.
template <>
struct Decoder<kQ5_K> {
  static constexpr int64_t kQK = 256, kBytes = 176, kQBytes = kBytes / 8;
  static constexpr int kScales = 0;
  static constexpr bool kPrepared = true;
  static inline void decode(const WRow& wrow, int64_t b, Reg w[kSlots]) {
    const uint8_t* blk = wrow.q + (b >> 3) * kBytes;
    const int j = static_cast<int>(b & 7);
    const Reg vd = Isa::bcast(wrow.s + 2 * b), vm = Isa::bcast(wrow.s + 2 * b + 1);
    IReg q[kSlots];
    nibbles32(blk + 48 + (j >> 1) * 32, j & 1, q);
    for (int s = 0; s < kSlots; ++s) {
      const IReg h = iand(isrl(widen_u8(blk + 16 + s * kLanes), j), 1);
      w[s] = Isa::sub(Isa::mul(vd, tofloat(ior(q[s], isll(h, 4)))), vm);
    }
  }
};

// Q6_K: super-blocks of 256: ql[128] (low 4 bits), qh[64] (high 2 bits), 16 int8 scales (one per 16 weights),
// d (fp16). Per 128-weight half: element e < 64 takes ql[e] & 15, else ql[e-64] >> 4; its high bits are
// (qh[e % 32] >> 2*(e / 32)) & 3. w = (d * scale) * (q - 32).
template <>
struct Decoder<kQ6_K> {
  static constexpr int64_t kQK = 256, kBytes = 210, kQBytes = kBytes / 8;  // kQBytes: about, per 32 weights
  static constexpr int kScales = 0;
  static constexpr bool kPrepared = true;  // d * scale of both 16-weight halves of each 32, once per row
  static inline void decode(const WRow& wrow, int64_t b, Reg w[kSlots]) {
    const uint8_t* blk = wrow.q + (b >> 3) * kBytes;
    const int j = static_cast<int>(b & 7);
    const int half = j >> 2, e0 = (j & 3) * 32;
    const uint8_t* ql = blk + half * 64 + (e0 & 63);
    const uint8_t* qh = blk + 128 + half * 32;
    const Reg d0 = Isa::bcast(wrow.s + 2 * b), d1 = Isa::bcast(wrow.s + 2 * b + 1);
    IReg lo[kSlots];
    nibbles32(ql, e0 >= 64, lo);
    const int shift = 2 * (e0 / 32);
    for (int s = 0; s < kSlots; ++s) {
      const IReg h = iand(isrl(widen_u8(qh + s * kLanes), shift), 3);
      const Reg q = tofloat(isub(ior(lo[s], isll(h, 4)), 32));
      w[s] = Isa::mul(s * kLanes < 16 ? d0 : d1, q);
    }
  }
};

// BF16: plain bfloat16 weights (the upper halves of fp32s), read 32 at a time.
template <>
struct Decoder<kBF16> {
  static constexpr int64_t kQK = 32, kBytes = 64, kQBytes = kBytes;
  static constexpr int kScales = 0;
  static inline void decode(const WRow& wrow, int64_t b, Reg w[kSlots]) {
    const uint8_t* row = wrow.q;
    const uint8_t* blk = row + b * kBytes;
    for (int s = 0; s < kSlots; ++s) w[s] = bf16_to_float(blk + s * kLanes * 2);
  }
};

// The kernel's layout of a row of a format with fp16 block scales (Q4_0, Q4_1, Q8_0): the row's scales first,
// kScales per block in block order (2 * kScales * K/32 bytes), then its blocks' quants (kQBytes each) -- the GGUF
// row's bytes regrouped, same size (`regroup_block_scales_`). The scales then convert to fp32 eight at a time and the
// quants load at a fixed stride. (Converting them from the GGUF layout, four bytes at a 20-byte stride, cost a
// fifth of a lone activation row's product, even gathered.) K-quants and BF16 rows are used as the file has them.
template <int F>
constexpr int64_t scale_bytes(int64_t K) { return K / 32 * 2 * Decoder<F>::kScales; }

// Row p (K weights, kernel layout) ready to decode: its scales converted into buf (room for scale_room(K) floats;
// the last group of eight reads up to 14 bytes into the row's quants and fills the padding with values nobody
// uses -- a conversion, which cannot fault).
inline int64_t scale_room(int64_t K) { return (K / 32 * 2 + 7) / 8 * 8; }
// K-quants (kPrepared): each 32 weights' two scale factors, computed as the decoder used to compute them per block
// (the same fp32 products, so the same weights), once per row into buf: Q4_K / Q5_K (d * sc, dmin * m) of the
// sub-block, Q6_K d * scale of its two 16-weight halves. Measured single-threaded (2048 x 2048, L3-resident, one
// row): Q4_K 0.158 -> 0.140 ns a weight, Q5_K 0.240 -> 0.212 (Q4_0: 0.083).
template <int F>
inline void prepare_k_scales(const uint8_t* p, int64_t K, float* buf) {
  using D = Decoder<F>;
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const uint8_t* blk = p + sb * D::kBytes;
    float* o = buf + 16 * sb;
    if constexpr (F == kQ6_K) {
      const float d = fp16(blk + 208);
      const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
      for (int i = 0; i < 16; ++i) o[i] = d * static_cast<float>(scales[i]);
    } else {
      const float d = fp16(blk), dmin = fp16(blk + 2);
      for (int j = 0; j < 8; ++j) {
        int sc, mn;
        k_scale_min(blk + 4, j, sc, mn);
        o[2 * j] = d * static_cast<float>(sc);
        o[2 * j + 1] = dmin * static_cast<float>(mn);
      }
    }
  }
}

template <int F>
inline WRow prepare_row(const uint8_t* p, int64_t K, float* buf) {
  constexpr int kS = Decoder<F>::kScales;
  if constexpr (kS > 0) {
    const int64_t n = K / 32 * kS;
    for (int64_t i = 0; i < n; i += 8)
      _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i))));
  } else if constexpr (requires { Decoder<F>::kPrepared; }) {
    prepare_k_scales<F>(p, K, buf);
  }
  return WRow{p + scale_bytes<F>(K), buf};
}

// A thread's scratch for the converted scales of `rows` weight rows of K weights.
inline float* scale_scratch(int64_t rows, int64_t K) {
  thread_local std::vector<float> buf;
  const size_t need = static_cast<size_t>(rows) * static_cast<size_t>(scale_room(K));
  if (buf.size() < need) buf.resize(need);
  return buf.data();
}

// Weights stream from memory once per forward; the hardware prefetcher alone leaves the decode waiting on them
// (a weight matrix here is 0.2-2 MB, each thread's share a few hundred rows). Every block asks for the bytes
// kPrefetchAhead further on. Measured on an AVX-512 Xeon (default model, q = 1, 2 threads, one forward over a
// 300-token cache): 9.2 -> 7.5 ms; 1 KB ahead 7.9, 2 KB 7.6, 8 KB 7.9, 16 KB 8.0.
constexpr int64_t kPrefetchAhead = 4096;
inline void prefetch_ahead(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchAhead), _MM_HINT_T0);
}

constexpr int64_t kChunk = 128;  // weights per partial sum (blocked summation), a multiple of 32

// A tile's outputs from its totals: each total's lanes reduced by Isa::hsum's tree; a tile of at least kLanes / 2
// totals does it kLanes at a time (Isa::hsum_lanes: the same additions, a fifth of the vector work).
template <int MR, int NR>
inline void store_tile(const Reg (&tot)[MR][NR], float* out, int64_t N, int64_t n) {
  constexpr int kTotals = MR * NR;
  if constexpr (kTotals < kLanes / 2) {
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < NR; ++r) out[i * N + n + r] = Isa::hsum(tot[i][r]);
  } else {
    constexpr int kGroups = (kTotals + kLanes - 1) / kLanes;
    float sums[kGroups * kLanes];
    for (int g = 0; g < kGroups; ++g) {
      Reg v[kLanes];
      for (int j = 0; j < kLanes; ++j) {
        const int c = g * kLanes + j;
        v[j] = c < kTotals ? tot[c / NR][c % NR] : Isa::zero();
      }
      Isa::hsum_lanes(v, sums + g * kLanes);
    }
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < NR; ++r) out[i * N + n + r] = sums[i * NR + r];
  }
}

// Rows [0, MR) of x times weight rows [0, NR) (row r at wrows[r]), decoded in registers block by block. NC chunks
// are summed side by side (their accumulators are independent, so NR x NC x MR multiply-add chains are in flight
// instead of one per output element: a lone activation row is otherwise bound by the fma latency). Each chunk
// still starts from zero and takes its blocks in order, and the chunks are added to the total in order: the
// arithmetic of every output element is the one described at the top, whatever NC is.
// Block b of weight rows [0, NR), decoded in registers, times rows [0, MR) of x, added into one chunk's acc.
template <int F, int MR, int NR>
inline void add_block(const float* x, int64_t K, const WRow* wrows, int64_t b, Reg (&acc)[MR][NR]) {
  Reg w[NR][kSlots];
  for (int r = 0; r < NR; ++r) prefetch_ahead(wrows[r].q + b * Decoder<F>::kQBytes);
  for (int r = 0; r < NR; ++r) Decoder<F>::decode(wrows[r], b, w[r]);
  for (int s = 0; s < kSlots; ++s)
    for (int i = 0; i < MR; ++i) {
      const Reg xv = Isa::load(x + i * K + b * 32 + s * kLanes);
      for (int r = 0; r < NR; ++r) acc[i][r] = Isa::fma(xv, w[r][s], acc[i][r]);
    }
}

template <int F, int MR, int NR, int NC>
inline void direct_totals(const float* x, int64_t K, const WRow* wrows, Reg (&tot)[MR][NR]) {
  constexpr int64_t kBlocks = kChunk / 32;  // blocks per chunk
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) tot[i][r] = Isa::zero();
  int64_t k0 = 0;
  for (; k0 + NC * kChunk <= K; k0 += NC * kChunk) {  // NC whole chunks side by side
    Reg acc[NC][MR][NR];
    for (int c = 0; c < NC; ++c)
      for (int i = 0; i < MR; ++i)
        for (int r = 0; r < NR; ++r) acc[c][i][r] = Isa::zero();
    for (int64_t j = 0; j < kBlocks; ++j)
      for (int c = 0; c < NC; ++c) add_block<F, MR, NR>(x, K, wrows, k0 / 32 + c * kBlocks + j, acc[c]);
    for (int c = 0; c < NC; ++c)
      for (int i = 0; i < MR; ++i)
        for (int r = 0; r < NR; ++r) tot[i][r] = Isa::add(tot[i][r], acc[c][i][r]);
  }
  for (; k0 < K; k0 += kChunk) {  // the rest, a chunk at a time (the last may be short)
    Reg acc[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < NR; ++r) acc[i][r] = Isa::zero();
    const int64_t b1 = std::min(K, k0 + kChunk) / 32;
    for (int64_t b = k0 / 32; b < b1; ++b) add_block<F, MR, NR>(x, K, wrows, b, acc);
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < NR; ++r) tot[i][r] = Isa::add(tot[i][r], acc[i][r]);
  }
}

template <int F, int MR, int NR, int NC>
inline void direct_tile(const float* x, int64_t K, const WRow* wrows, float* out, int64_t N, int64_t n) {
  Reg tot[MR][NR];
  direct_totals<F, MR, NR, NC>(x, K, wrows, tot);
  store_tile<MR, NR>(tot, out, N, n);
}

// G passes of direct_totals over weight rows n, n + NR, ... (`row(n', t)` readies weight row n' in scale slot t),
// their G * NR * MR totals reduced together by store_tile: a pass has too few totals to fill Isa::hsum_lanes.
template <int F, int MR, int NR, int NC, int G, typename RowFn>
inline void direct_group(const float* x, int64_t K, RowFn&& row, float* out, int64_t N, int64_t n) {
  Reg tot[MR][G * NR];
  for (int g = 0; g < G; ++g) {
    WRow r[NR];
    for (int t = 0; t < NR; ++t) r[t] = row(n + g * NR + t, t);
    Reg t[MR][NR];
    direct_totals<F, MR, NR, NC>(x, K, r, t);
    for (int i = 0; i < MR; ++i)
      for (int c = 0; c < NR; ++c) tot[i][g * NR + c] = t[i][c];
  }
  store_tile<MR, G * NR>(tot, out, N, n);
}

// Weight rows per direct_group for MR activation rows and NR weight rows per pass: enough passes to fill one
// Isa::hsum_lanes (at least two).
constexpr int group_passes(int MR, int NR) { return std::max(2, kLanes / (MR * NR)); }

// Rows [0, MR) of x times NR weight rows already decoded into `wf` (NR x K floats, row r at wf + r * K).
template <int MR, int NR>
inline void scratch_tile(const float* x, int64_t K, const float* wf, float* out, int64_t N, int64_t n) {
  Reg tot[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) tot[i][r] = Isa::zero();
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    Reg acc[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < NR; ++r) acc[i][r] = Isa::zero();
    const int64_t k1 = std::min(K, k0 + kChunk);
    for (int64_t k = k0; k < k1; k += kLanes) {
      Reg w[NR];
      for (int r = 0; r < NR; ++r) w[r] = Isa::load(wf + r * K + k);
      for (int i = 0; i < MR; ++i) {
        const Reg xv = Isa::load(x + i * K + k);
        for (int r = 0; r < NR; ++r) acc[i][r] = Isa::fma(xv, w[r], acc[i][r]);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < NR; ++r) tot[i][r] = Isa::add(tot[i][r], acc[i][r]);
  }
  store_tile<MR, NR>(tot, out, N, n);
}

// One activation row: one weight row at a time, two chunks side by side. Measured on the AVX2 EPYC (default model,
// 2 threads, three alternating runs) against two weight rows x one chunk: the Q8_0 head 2.1 -> 1.3 ms (its cheap
// decode left the lone fma chain as the limit), the Q4_1 layers unchanged at ~6.4 ms; 2 x 2 and 1 x 3 no better.
// Two activation rows already give four chains with two weight rows x one chunk, which measured best there; three
// to seven rows take one weight row at a time, all rows in registers, instead of the scratch path's decoded rows
// written to L1 and read back (the 30 layers' matmuls, three alternating runs each: 3 rows 11.5-13.3 -> 9.0-9.2
// ms, 4 rows 11.4-16.7 -> 9.8-9.9, 5 rows 14.7-17.6 -> 12.8-13.4, 6 rows 15.6-17.5 -> 13.8-15.3, 7 rows
// 18.8-20.1 -> 13.9-16.4; at 8 rows 17.4-18.8 -> 19.0-20.0: from there the scratch path, which decodes each
// weight row once for all rows, is faster).
#if defined(FF_ISA_AVX512)
// With 16 lanes a block is two multiply-adds per activation row, and the table decode leaves the chains' latency
// as the limit: four chunks side by side for one row, two for three or four rows. Measured on an AVX-512 Xeon
// (the 30 layers' and the head's matmuls in a q-token forward, 2 threads; profile medians, two runs each): q = 1
// 8.4-8.5 -> 8.2-8.3 ms, q = 3 11.4-13.3 -> 10.7, q = 4 13.0-15.3 -> 12.3; two chunks for two rows no better.
constexpr int kOneRowChunks = 4;
constexpr int kTwoRowChunks = 1;
constexpr int kFewRowChunks = 2;
constexpr int kDirectRows = 7;  // up to this many activation rows: decode in registers
constexpr int kTileRows = 6;    // scratch path: 6 activation rows x 4 weight rows = 24 accumulators
constexpr int kTileCols = 4;
#else
constexpr int kOneRowChunks = 2;
constexpr int kTwoRowChunks = 1;
constexpr int kFewRowChunks = 1;
constexpr int kDirectRows = 7;
constexpr int kTileRows = 4;  // 4 x 3 accumulators + 3 weights + 1 activation = 16 ymm
constexpr int kTileCols = 3;
#endif

// All activation rows x NR decoded weight rows, in ceil(M / kTileRows) tiles of as equal a height as can be (16
// rows: 6 + 5 + 5, 8 rows: 4 + 4): a short tile is load-bound (two rows x four weight rows: six loads per eight
// multiply-adds), and 16 rows as 6 + 6 + 2 + 2 spent a third of the tile time in the two short tiles. A tile's
// height changes no output element's arithmetic.
template <int MR, int NR>
inline void scratch_tile_rows(int rows, const float* x, int64_t K, const float* wf, float* out, int64_t N, int64_t n) {
  if constexpr (MR > 1) {
    if (rows < MR) return scratch_tile_rows<MR - 1, NR>(rows, x, K, wf, out, N, n);
  }
  scratch_tile<MR, NR>(x, K, wf, out, N, n);
}

template <int NR>
inline void scratch_rows(const float* x, int64_t M, int64_t K, const float* wf, float* out, int64_t N, int64_t n) {
  const int64_t tiles = (M + kTileRows - 1) / kTileRows;
  int64_t m0 = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int rows = static_cast<int>(M / tiles + (t < M % tiles ? 1 : 0));
    scratch_tile_rows<kTileRows, NR>(rows, x + m0 * K, K, wf, out + m0 * N, N, n);
    m0 += rows;
  }
}

// Weight row `wrow` (K weights, scales converted) decoded into wf[0..K).
template <int F>
void decode_row(const WRow& wrow, int64_t K, float* wf) {
  using D = Decoder<F>;
  const int64_t blocks = K / 32;
  for (int64_t b = 0; b < blocks; ++b) {
    Reg w[kSlots];
    prefetch_ahead(wrow.q + b * D::kQBytes);
    D::decode(wrow, b, w);
    for (int s = 0; s < kSlots; ++s) Isa::store(wf + b * 32 + s * kLanes, w[s]);
  }
}

// Weight rows [n, n1) times MR activation rows, NR weight rows per pass: whole groups of passes through
// direct_group, the rest one pass at a time (`row` as for direct_group); n ends where the passes stopped.
template <int F, int MR, int NR, int NC, typename RowFn>
inline void direct_rows(const float* x, int64_t K, RowFn&& row, float* out, int64_t N, int64_t& n, int64_t n1) {
  constexpr int G = group_passes(MR, NR);
  for (; n + G * NR <= n1; n += G * NR) direct_group<F, MR, NR, NC, G>(x, K, row, out, N, n);
  for (; n + NR <= n1; n += NR) {
    WRow r[NR];
    for (int t = 0; t < NR; ++t) r[t] = row(n + t, t);
    direct_tile<F, MR, NR, NC>(x, K, r, out, N, n);
  }
}

template <int F>
void run_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t N, float* out) {
  // Equal runs of weight rows per thread (multiples of 4, so that tiles stay whole); a share should be worth
  // a fork.
  const int64_t groups = (N + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, K * M));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    const int64_t n0 = g0 * 4, n1 = std::min(N, g1 * 4);
    float* scales = scale_scratch(kTileCols, K);
    // Weight row n ready to decode, its scales in slot t of the scratch.
    auto row = [&](int64_t n, int t) { return prepare_row<F>(w + n * row_bytes, K, scales + t * scale_room(K)); };
    int64_t n = n0;
    if (M <= kDirectRows) {  // decoded in registers
      switch (M) {
        case 1: direct_rows<F, 1, 1, kOneRowChunks>(x, K, row, out, N, n, n1); break;
        case 2:
          direct_rows<F, 2, 2, kTwoRowChunks>(x, K, row, out, N, n, n1);
          direct_rows<F, 2, 1, kTwoRowChunks>(x, K, row, out, N, n, n1);
          break;
        case 3: direct_rows<F, 3, 1, kFewRowChunks>(x, K, row, out, N, n, n1); break;
        case 4: direct_rows<F, 4, 1, kFewRowChunks>(x, K, row, out, N, n, n1); break;
        case 5: direct_rows<F, 5, 1, 1>(x, K, row, out, N, n, n1); break;
        case 6: direct_rows<F, 6, 1, 1>(x, K, row, out, N, n, n1); break;
        default: direct_rows<F, 7, 1, 1>(x, K, row, out, N, n, n1); break;
      }
    } else {
      // Decoded weight rows, from a cache-line boundary: a vector's malloc'd data sits 16 bytes past one, so every
      // 64-byte store and load of the scratch split two lines. One thread, the 30 layers' and the head's products
      // at 8 rows, CPU time (min of four): 28.2 -> 25.6 ms; with store_tile's batched reduction too, 23.5 ms.
      thread_local std::vector<float> buf;
      if (static_cast<int64_t>(buf.size()) < kTileCols * K + 16) buf.resize(kTileCols * K + 16);
      float* wf = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64 / sizeof(float);
      for (; n + kTileCols <= n1; n += kTileCols) {
        for (int t = 0; t < kTileCols; ++t) decode_row<F>(row(n + t, t), K, wf + t * K);
        scratch_rows<kTileCols>(x, M, K, wf, out, N, n);
      }
      for (; n < n1; ++n) {
        decode_row<F>(row(n, 0), K, wf);
        scratch_rows<1>(x, M, K, wf, out, N, n);
      }
    }
  });
}

// Long inputs (prefill) in chunks of activation rows that stay in L2 while every weight row passes by; each
// chunk decodes the weights again, which costs little next to its multiply-adds.
constexpr int64_t kRowChunk = 48;

template <int F>
void run(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t N, float* out) {
  for (int64_t m0 = 0; m0 < M; m0 += kRowChunk)
    run_rows<F>(x + m0 * K, std::min(kRowChunk, M - m0), K, w, row_bytes, N, out + m0 * N);
}

int64_t block_size(int fmt) {
  switch (fmt) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: case kBF16: return 32;
    case kQ4_K: case kQ5_K: case kQ6_K: return 256;
    default: return 0;
  }
}

int64_t block_bytes(int fmt) {
  switch (fmt) {
    case kQ4_0: return Decoder<kQ4_0>::kBytes;
    case kQ4_1: return Decoder<kQ4_1>::kBytes;
    case kQ8_0: return Decoder<kQ8_0>::kBytes;
    case kQ4_K: return Decoder<kQ4_K>::kBytes;
    case kQ5_0: return Decoder<kQ5_0>::kBytes;
    case kQ5_1: return Decoder<kQ5_1>::kBytes;
    case kQ5_K: return Decoder<kQ5_K>::kBytes;
    case kQ6_K: return Decoder<kQ6_K>::kBytes;
    case kBF16: return Decoder<kBF16>::kBytes;
    default: return 0;
  }
}

void check_weight(const at::Tensor& w, int fmt, int64_t K) {
  TORCH_CHECK(block_size(fmt) > 0, "quant_mm: unsupported GGML type ", fmt);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.device().is_cpu(),
              "quant_mm: the weight must be a contiguous CPU uint8 tensor [N, row_bytes]");
  TORCH_CHECK(K > 0 && K % block_size(fmt) == 0, "quant_mm: K=", K, " is not a multiple of the block size ",
              block_size(fmt));
  TORCH_CHECK(w.size(1) == K / block_size(fmt) * block_bytes(fmt), "quant_mm: a row of ", K, " weights takes ",
              K / block_size(fmt) * block_bytes(fmt), " bytes, the tensor has ", w.size(1));
}

template <typename Fn>
void dispatch(int fmt, Fn&& fn) {
  switch (fmt) {
    case kQ4_0: fn(std::integral_constant<int, kQ4_0>{}); break;
    case kQ4_1: fn(std::integral_constant<int, kQ4_1>{}); break;
    case kQ8_0: fn(std::integral_constant<int, kQ8_0>{}); break;
    case kQ4_K: fn(std::integral_constant<int, kQ4_K>{}); break;
    case kQ5_0: fn(std::integral_constant<int, kQ5_0>{}); break;
    case kQ5_1: fn(std::integral_constant<int, kQ5_1>{}); break;
    case kQ5_K: fn(std::integral_constant<int, kQ5_K>{}); break;
    case kQ6_K: fn(std::integral_constant<int, kQ6_K>{}); break;
    case kBF16: fn(std::integral_constant<int, kBF16>{}); break;
    default: TORCH_CHECK(false, "unsupported GGML type ", fmt);
  }
}

// out[M, N] = x[M, K] @ dequantize(w)^T
at::Tensor quant_mm(const at::Tensor& x_in, const at::Tensor& w, int64_t fmt, int64_t K) {
  if (ff_is_tiled(fmt)) return ff_amx_mm(x_in, w, fmt, K);
  if (ff_is_q8(fmt)) return ff_q8_mm(x_in, w, fmt, K);
  check_weight(w, static_cast<int>(fmt), K);
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "quant_mm: x must be a 2-D fp32 CPU tensor");
  TORCH_CHECK(x_in.size(1) == K, "quant_mm: x has ", x_in.size(1), " columns, the weight ", K);
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), N = w.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  dispatch(static_cast<int>(fmt), [&](auto f) {
    run<decltype(f)::value>(x.data_ptr<float>(), M, K, w.data_ptr<uint8_t>(), w.size(1), N, out.data_ptr<float>());
  });
  return out;
}

// The fp32 values of the given rows of w (an embedding lookup), decoded exactly as quant_mm uses them.
at::Tensor quant_rows(const at::Tensor& w, int64_t fmt, int64_t K, const at::Tensor& ids_in) {
  if (ff_is_tiled(fmt)) return ff_amx_rows(w, fmt, K, ids_in);
  if (ff_is_q8(fmt)) return ff_q8_rows(w, fmt, K, ids_in);
  check_weight(w, static_cast<int>(fmt), K);
  TORCH_CHECK(ids_in.dim() == 1 && ids_in.scalar_type() == at::kLong, "quant_rows: ids must be 1-D int64");
  const at::Tensor ids = ids_in.contiguous();
  const int64_t R = ids.size(0), N = w.size(0);
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(idp[r] >= 0 && idp[r] < N, "quant_rows: row ", idp[r], " out of range");
  at::Tensor out = at::empty({R, K}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t rb = w.size(1);
  dispatch(static_cast<int>(fmt), [&](auto f) {
    constexpr int F = decltype(f)::value;
    float* scales = scale_scratch(1, K);
    for (int64_t r = 0; r < R; ++r) decode_row<F>(prepare_row<F>(wp + idp[r] * rb, K, scales), K, op + r * K);
  });
  return out;
}

// In place: GGUF rows of a format with fp16 block scales <-> the kernel's layout (`scale_bytes`): split = true
// moves every row's block scales to its front, false puts them back. Other formats are left as they are.
at::Tensor regroup_block_scales_(at::Tensor& w, int64_t fmt, int64_t K, bool split) {
  check_weight(w, static_cast<int>(fmt), K);
  dispatch(static_cast<int>(fmt), [&](auto f) {
    using D = Decoder<decltype(f)::value>;
    if constexpr (D::kScales > 0) {
      const int64_t blocks = K / 32, sb = 2 * D::kScales, rb = w.size(1);
      uint8_t* base = w.data_ptr<uint8_t>();
      at::parallel_for(0, w.size(0), 64, [&](int64_t r0, int64_t r1) {
        std::vector<uint8_t> tmp(rb);
        for (int64_t r = r0; r < r1; ++r) {
          uint8_t* row = base + r * rb;
          std::memcpy(tmp.data(), row, rb);
          for (int64_t b = 0; b < blocks; ++b) {
            uint8_t* gguf = (split ? tmp.data() : row) + b * D::kBytes;  // the block in the GGUF layout
            uint8_t* scale = (split ? row : tmp.data()) + b * sb;        // its scales in the kernel layout
            uint8_t* quant = (split ? row : tmp.data()) + blocks * sb + b * D::kQBytes;
            if (split) {
              std::memcpy(scale, gguf, sb);
              std::memcpy(quant, gguf + sb, D::kQBytes);
            } else {
              std::memcpy(gguf, scale, sb);
              std::memcpy(gguf + sb, quant, D::kQBytes);
            }
          }
        }
      });
    }
  });
  return w;
}

}  // namespace

// The fp32 values of GGUF-layout rows, element by element as the reference dequantisation (gguf-py) computes them
// -- one rounding per product or sum, in its order -- for every packed format: the embedding rows of a weight kept
// in another layout (q8_gemm.cpp's panels). Plain C++: a lookup decodes a few rows.
void ff_decode_gguf_rows(const uint8_t* rows, int64_t n_rows, int64_t row_bytes, int fmt, int64_t K, float* out) {
  auto half = [](const uint8_t* p) { return fp16(p); };
  for (int64_t r = 0; r < n_rows; ++r) {
    const uint8_t* row = rows + r * row_bytes;
    float* o = out + r * K;
    switch (fmt) {
      case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: {
        const int bb = fmt == kQ4_0 ? 18 : fmt == kQ4_1 ? 20 : fmt == kQ5_0 ? 22 : fmt == kQ5_1 ? 24 : 34;
        for (int64_t b = 0; b < K / 32; ++b) {
          const uint8_t* blk = row + b * bb;
          const float d = half(blk);
          if (fmt == kQ8_0) {
            for (int k = 0; k < 32; ++k) o[32 * b + k] = static_cast<float>(static_cast<int8_t>(blk[2 + k])) * d;
            continue;
          }
          const bool with_min = fmt == kQ4_1 || fmt == kQ5_1, q5 = fmt == kQ5_0 || fmt == kQ5_1;
          const float m = with_min ? half(blk + 2) : 0.0f;
          uint32_t qh = 0;
          if (q5) std::memcpy(&qh, blk + (with_min ? 4 : 2), 4);
          const uint8_t* qs = blk + 2 + (with_min ? 2 : 0) + (q5 ? 4 : 0);
          for (int k = 0; k < 32; ++k) {
            int q = k < 16 ? (qs[k] & 0x0F) : (qs[k - 16] >> 4);
            if (q5) q |= static_cast<int>((qh >> k) & 1u) << 4;
            const float v = with_min ? d * static_cast<float>(q) + m
                                     : d * static_cast<float>(q - (q5 ? 16 : 8));
            o[32 * b + k] = v;
          }
        }
        break;
      }
      case kQ4_K: case kQ5_K: {
        const int bb = fmt == kQ4_K ? 144 : 176;
        for (int64_t b = 0; b < K / 256; ++b) {
          const uint8_t* blk = row + b * bb;
          const uint8_t* sc6 = blk + 4;
          const uint8_t* qh = blk + 16;
          const uint8_t* qs = blk + (fmt == kQ4_K ? 16 : 48);
          for (int j = 0; j < 8; ++j) {
            int sc, mn;
            if (j < 4) {
              sc = sc6[j] & 0x3F;
              mn = sc6[j + 4] & 0x3F;
            } else {
              sc = (sc6[j + 4] & 0x0F) | ((sc6[j - 4] >> 2) & 0x30);
              mn = (sc6[j + 4] >> 4) | ((sc6[j] >> 2) & 0x30);
            }
            const float dsc = half(blk) * static_cast<float>(sc), dmn = half(blk + 2) * static_cast<float>(mn);
            for (int k = 0; k < 32; ++k) {
              int q = (qs[32 * (j >> 1) + k] >> (4 * (j & 1))) & 0x0F;
              if (fmt == kQ5_K) q |= ((qh[k] >> j) & 1) << 4;
              o[256 * b + 32 * j + k] = dsc * static_cast<float>(q) - dmn;
            }
          }
        }
        break;
      }
      case kQ6_K: {
        for (int64_t b = 0; b < K / 256; ++b) {
          const uint8_t* blk = row + b * 210;
          const float d = half(blk + 208);
          for (int e = 0; e < 256; ++e) {
            const int h = e / 128, i = e % 128;
            const int lo = i < 64 ? (blk[64 * h + i] & 0x0F) : (blk[64 * h + i - 64] >> 4);
            const int hi = (blk[128 + 32 * h + i % 32] >> (2 * (i / 32))) & 3;
            const float ds = d * static_cast<float>(static_cast<int8_t>(blk[192 + e / 16]));
            o[256 * b + e] = ds * static_cast<float>((lo | (hi << 4)) - 32);
          }
        }
        break;
      }
      case kBF16: {
        for (int64_t k = 0; k < K; ++k) {
          const uint32_t bits = static_cast<uint32_t>(row[2 * k] | (row[2 * k + 1] << 8)) << 16;
          std::memcpy(o + k, &bits, 4);
        }
        break;
      }
      default: TORCH_CHECK(false, "decode: unsupported GGML type ", fmt);
    }
  }
}

// For the other sources of the module (layer_ops.cpp's fused layer): the same product.
at::Tensor ff_quant_mm(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t K) { return quant_mm(x, w, fmt, K); }
at::Tensor ff_quant_rows(const at::Tensor& w, int64_t fmt, int64_t K, const at::Tensor& ids) {
  return quant_rows(w, fmt, K, ids);
}

void register_quant_gemm(pybind11::module& m) {
  m.def("regroup_block_scales_", &regroup_block_scales_,
        "in place: GGUF rows [N, row_bytes] <-> the kernel's layout (each row's fp16 block scales first, then its "
        "quants) for Q4_0 / Q4_1 / Q8_0; split=True to the kernel's layout, False back; other formats unchanged",
        pybind11::arg("w"), pybind11::arg("fmt"), pybind11::arg("K"), pybind11::arg("split"));
  m.def("quant_mm", &quant_mm,
        "out[M, N] = x[M, K] @ dequantize(w)^T for a packed GGUF weight w [N, row_bytes] in the kernel's layout",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("fmt"), pybind11::arg("k"));
  m.def("quant_rows", &quant_rows, "fp32 rows of a packed GGUF weight in the kernel's layout (embedding lookup)",
        pybind11::arg("w"),
        pybind11::arg("fmt"), pybind11::arg("k"), pybind11::arg("ids"));
}
