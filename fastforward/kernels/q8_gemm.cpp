// q8_mm: out[M, N] = x[M, K] @ W^T in llama.cpp's integer arithmetic for GGUF weights (fastforward/arithmetic.py
// defines it element by element and is the reference these kernels match bitwise).
//
// Activation rows are quantised per row and per block as llama.cpp's x86 code does for the weight's format (Q8_0
// for Q4_0 / Q5_0 / Q8_0, Q8_1 for Q4_1 / Q5_1, Q8_K for the K-quants); each block's dot product is an exact
// integer (u8 x s8 products summed in int16 / int32 -- never overflowing, see the bounds at each kernel); each
// block's integer is scaled in fp32 and added to the output in block order. Only those few fp32 operations round,
// in one fixed order, so a row's result depends on nothing but that row and the weights: not on the other rows of
// the call, the tile a row falls in, the threads, or the instruction set (AVX2 maddubs, AVX-VNNI or AVX-512 VNNI
// vpdpbusd give the same integers).
//
// Weight layout ("panels"): the weight's rows are regrouped at load (q8_pack) into panels of 8 rows. For each
// block, a panel holds the 8 rows' fp16 scales side by side (one vcvtph2ps gives all 8) and then the quants as
// "slices": 32 bytes holding 4 consecutive quant bytes of each of the 8 rows. A slice is multiplied by 4 bytes of
// the activation row broadcast to all 8 lanes, so each 32-bit lane accumulates one weight row's dot product and
// no horizontal reduction is ever needed: lane r of the block's integer vector is row r's integer. Per format
// (per block of 8 rows; the GGUF bytes of the same 8 rows, regrouped; K-quants with their 6-bit scales unpacked):
//   Q4_0 (32): d[8] | 4 slices                                  144 B (= 8 x 18)
//   Q4_1 (32): d[8] | m[8] | 4 slices                           160 B
//   Q5_0 (32): d[8] | qh'[8] (u32) | 4 slices                   176 B
//   Q5_1 (32): d[8] | m[8] | qh'[8] | 4 slices                  192 B
//   Q8_0 (32): d[8] | 8 slices                                  272 B
//   Q4_K (256): d[8] | dmin[8] | sc[8 j][8 r] | mn[4][8 r][2] | 4 chunks x 8 slices        1184 B (8 x 144 + 32)
//   Q5_K (256): as Q4_K, then 8 qh slices before the quants                                1440 B (8 x 176 + 32)
//   Q6_K (256): d[8] | sc[16 i][8 r] (int8) | 2 halves x 8 x (ql slice A, ql slice B, qh slice H)   1680 B
// A Q4 slice's low nibbles are elements 4s..4s+3 of the block, its high nibbles 16+4s..19+4s (the GGUF order).
// Q5_0 / Q5_1's high bits are rearranged so that one shift and one mask put each slice's bits in place: bit
// 8i + p of qh' is the high bit of element (p & 1) * 16 + 4 (p >> 1) + i. Q5_K's qh bytes need no rearranging:
// bit p = 2c + h of qh byte k is the high bit of element 64c + 32h + k.
//
// Builds with 512-bit VNNI (FF_Q8_ZMM) lay the formats of blocks of 32 out in pairs of panels (in_pairs) and
// multiply 16 weight rows at once;
// builds with AMX-INT8 also run the same products on integer tiles ("integer tiles" below). The layout is the
// build's: packed and unpacked by the same build, and every build computes the same bits from it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "isa.h"
#include "tiles.h"

// quant_gemm.cpp: fp32 values of GGUF-layout rows (the reference dequantisation), for embedding lookups.
void ff_decode_gguf_rows(const uint8_t* rows, int64_t n_rows, int64_t row_bytes, int fmt, int64_t K, float* out);
// amx_gemm.cpp: whether this CPU and process have AMX-INT8 (checked, and the tile state requested, once).
bool ff_amx_int8_ready();

// The one u8 x s8 -> int32 multiply-accumulate of four byte pairs per lane, where the CPU has it.
#if defined(FF_VNNI_512)
#define FF_Q8_VNNI 1
#define FF_DPBUSD(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#elif defined(FF_VNNI_AVX)
#define FF_Q8_VNNI 1
#define FF_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#endif

// The vector kernel's name in reports.
#if defined(FF_VNNI_512)
#define Q8_DOT_NAME "avx512-vnni"
#elif defined(FF_VNNI_AVX)
#define Q8_DOT_NAME "avx-vnni"
#else
#define Q8_DOT_NAME "avx2"
#endif

// AVX-512 VNNI builds multiply two panels at once in 512-bit registers (tile2), from weights laid out in pairs
// (-DFF_Q8_NO_ZMM builds without them, to measure one against the other: scripts/compare_kernel_builds.py).
#if defined(FF_VNNI_512) && !defined(FF_ISA_EMULATED) && !defined(FF_Q8_NO_ZMM)
#define FF_Q8_ZMM 1
#endif

namespace {

constexpr int64_t kQ8Base = 2048;  // format code of a panel-layout weight: kQ8Base + its GGML type
constexpr int kRows = 8;           // weight rows per panel
enum : int { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

// ---- formats ---------------------------------------------------------------------------------------------------

struct Layout {
  int qk;           // weights per block
  int gguf_bytes;   // bytes of one GGUF block
  int panel_bytes;  // bytes of one block of a panel (8 rows)
};

constexpr bool q8_format(int f) {
  switch (f) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: case kQ4_K: case kQ5_K: case kQ6_K: return true;
    default: return false;
  }
}

constexpr Layout layout_of(int f) {
  switch (f) {
    case kQ4_0: return {32, 18, 144};
    case kQ4_1: return {32, 20, 160};
    case kQ5_0: return {32, 22, 176};
    case kQ5_1: return {32, 24, 192};
    case kQ8_0: return {32, 34, 272};
    case kQ4_K: return {256, 144, 1184};
    case kQ5_K: return {256, 176, 1440};
    case kQ6_K: return {256, 210, 1680};
    default: return {0, 0, 0};
  }
}

constexpr bool has_min(int f) { return f == kQ4_1 || f == kQ5_1; }
constexpr bool is_q5(int f) { return f == kQ5_0 || f == kQ5_1; }
constexpr bool is_k(int f) { return f == kQ4_K || f == kQ5_K || f == kQ6_K; }
constexpr int offset_of(int f) { return f == kQ4_0 ? 8 : f == kQ5_0 ? 16 : 0; }  // q - offset is the signed quant
// What the kernel's integer for a block of F exceeds the signed dot product by, per unit of the activation block's
// sum: the offset of Q4_0 / Q5_0's unsigned quants; with VNNI also Q8_0's, whose signed weights enter vpdpbusd
// made unsigned (w + 128: one xor per slice, shared by the tile's rows, instead of a sign flip per row). Either
// way the integer is exact, so the result is the same bit for bit.
constexpr int act_offset_of(int f) {
#if defined(FF_Q8_VNNI)
  if (f == kQ8_0) return 128;
#endif
  return offset_of(f);
}
// Byte offsets inside a legacy panel block: the mins, the rearranged high bits, the quant slices.
constexpr int min_at(int f) { return 16; }
constexpr int qh_at(int f) { return has_min(f) ? 32 : 16; }
constexpr int qs_at(int f) { return 16 + (has_min(f) ? 16 : 0) + (is_q5(f) ? 32 : 0); }
// K-quant panel offsets.
constexpr int kScAt = 32, kMnAt = 96, kQ5KQhAt = 160;
constexpr int k_qs_at(int f) { return f == kQ5_K ? 416 : 160; }
constexpr int kQ6ScAt = 16, kQ6HalfAt = 144, kQ6HalfBytes = 768;

int64_t panel_row_bytes(int f, int64_t K) { return K / layout_of(f).qk * layout_of(f).panel_bytes; }

// Whether a weight of format f is laid out in pairs of panels: with FF_Q8_ZMM, the formats of blocks of 32. Then
// panels 2q and 2q + 1 interleave block by block (block b of the first, block b of the second, block b + 1 of the
// first...), so that tile2 reads one stream; an odd last panel stands alone. Else panel p is its blocks in order.
// K-quant pair tiles were built twice and measured on the AMD EPYC (Zen 4), 1B Q4_K_M, the weight products: blocks
// of 2.4-3.4 KB interleaved like these, 1.1-1.3x faster at 8 and 16 rows but 1.7-2.8x slower at one and two; the two
// blocks interleaved 32 bytes at a time (one 512-bit load per slice of 16 rows: 46-48 multiply-adds per cycle in L1
// against 29 for the 256-bit tiles), 1.08-1.23x faster at 8-16 rows but 1.5x slower at one and two, reading from
// memory at two thirds of the rate. A third try kept single panels and read two neighbouring ones as two streams in
// 512-bit tiles for calls of 2+ rows: 1.2x on a weight in L3, but the 1B file's products from memory at 2 / 4 / 8
// rows took 38.7 / 44.8 / 59.9 ms against 23.3 / 31.1 / 53.3. A decoding step is one row: the K-quants keep single
// panels.
constexpr bool in_pairs(int f) {
#if defined(FF_Q8_ZMM)
  return q8_format(f) && !is_k(f);
#else
  return false;
#endif
}

// Where block b of panel p of a weight of n_panels panels begins.
inline int64_t block_at(int f, int64_t K, int64_t n_panels, int64_t p, int64_t b) {
  const int64_t pb = panel_row_bytes(f, K), bytes = layout_of(f).panel_bytes;
  if (in_pairs(f) && !(p == n_panels - 1 && n_panels % 2 == 1))
    return (p & ~int64_t{1}) * pb + b * 2 * bytes + (p & 1) * bytes;
  return p * pb + b * bytes;
}

// ---- packing (at load; plain C++) -------------------------------------------------------------------------------

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline void store_u32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

// Q5_0 / Q5_1: GGUF qh (bit e = element e's high bit) <-> qh' (bit 8i + p = element (p&1)*16 + 4(p>>1) + i's).
uint32_t q5_rearrange(uint32_t qh) {
  uint32_t out = 0;
  for (int p = 0; p < 8; ++p)
    for (int i = 0; i < 4; ++i) out |= ((qh >> ((p & 1) * 16 + 4 * (p >> 1) + i)) & 1u) << (8 * i + p);
  return out;
}
uint32_t q5_restore(uint32_t qh2) {
  uint32_t out = 0;
  for (int p = 0; p < 8; ++p)
    for (int i = 0; i < 4; ++i) out |= ((qh2 >> (8 * i + p)) & 1u) << ((p & 1) * 16 + 4 * (p >> 1) + i);
  return out;
}

// Q4_K / Q5_K 12-byte scales <-> 8 six-bit scales and mins.
void k_unpack_scales(const uint8_t* q, uint8_t sc[8], uint8_t mn[8]) {
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      sc[j] = q[j] & 63;
      mn[j] = q[j + 4] & 63;
    } else {
      sc[j] = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
      mn[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
  }
}
void k_pack_scales(const uint8_t sc[8], const uint8_t mn[8], uint8_t q[12]) {
  for (int j = 0; j < 4; ++j) {
    q[j] = static_cast<uint8_t>((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
    q[j + 4] = static_cast<uint8_t>((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
    q[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0x0F) | ((mn[j + 4] & 0x0F) << 4));
  }
}

// One block of one row between the GGUF layout (g) and its place in a panel block (P, row r); to_panel picks the
// direction. Every byte of the GGUF block has exactly one place in the panel, so the two directions are inverse.
template <bool to_panel>
void move_block(int f, uint8_t* g, uint8_t* P, int r) {
  auto mv = [&](uint8_t* gp, uint8_t* pp, int n) {
    if (to_panel) std::memcpy(pp, gp, n); else std::memcpy(gp, pp, n);
  };
  if (!is_k(f)) {
    mv(g, P + 2 * r, 2);  // d
    int at = 2;
    if (has_min(f)) {
      mv(g + 2, P + min_at(f) + 2 * r, 2);
      at = 4;
    }
    if (is_q5(f)) {
      uint8_t* pq = P + qh_at(f) + 4 * r;
      if (to_panel) store_u32(pq, q5_rearrange(load_u32(g + at))); else store_u32(g + at, q5_restore(load_u32(pq)));
      at += 4;
    }
    const int slices = f == kQ8_0 ? 8 : 4;
    for (int s = 0; s < slices; ++s) mv(g + at + 4 * s, P + qs_at(f) + 32 * s + 4 * r, 4);
    return;
  }
  if (f == kQ6_K) {
    mv(g + 208, P + 2 * r, 2);  // d
    for (int i = 0; i < 16; ++i) mv(g + 192 + i, P + kQ6ScAt + 8 * i + r, 1);
    for (int h = 0; h < 2; ++h)
      for (int t = 0; t < 8; ++t) {
        uint8_t* base = P + kQ6HalfAt + kQ6HalfBytes * h + 96 * t + 4 * r;
        mv(g + 64 * h + 4 * t, base, 4);            // A: ql bytes 4t.. of the half
        mv(g + 64 * h + 32 + 4 * t, base + 32, 4);  // B: ql bytes 32+4t..
        mv(g + 128 + 32 * h + 4 * t, base + 64, 4); // H: qh bytes 4t..
      }
    return;
  }
  // Q4_K, Q5_K
  mv(g, P + 2 * r, 2);
  mv(g + 2, P + 16 + 2 * r, 2);
  uint8_t sc[8], mn[8];
  if (to_panel) k_unpack_scales(g + 4, sc, mn);
  for (int j = 0; j < 8; ++j) {
    mv(sc + j, P + kScAt + 8 * j + r, 1);
    mv(mn + j, P + kMnAt + 16 * (j >> 1) + 2 * r + (j & 1), 1);
  }
  if (!to_panel) k_pack_scales(sc, mn, g + 4);
  int at = 16;
  if (f == kQ5_K) {
    for (int t = 0; t < 8; ++t) mv(g + 16 + 4 * t, P + kQ5KQhAt + 32 * t + 4 * r, 4);
    at = 48;
  }
  for (int c = 0; c < 4; ++c)
    for (int t = 0; t < 8; ++t) mv(g + at + 32 * c + 4 * t, P + k_qs_at(f) + 256 * c + 32 * t + 4 * r, 4);
}

void check_q8_weight(const at::Tensor& w, int f, int64_t K, bool panels) {
  TORCH_CHECK(q8_format(f), "q8: GGML type ", f, " has no integer kernel");
  const Layout L = layout_of(f);
  TORCH_CHECK(K > 0 && K % L.qk == 0, "q8: K=", K, " is not a multiple of the block size ", L.qk);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.device().is_cpu(),
              "q8: the weight must be a contiguous CPU uint8 tensor");
  const int64_t rb = panels ? panel_row_bytes(f, K) / kRows : K / L.qk * L.gguf_bytes;
  if (panels) {
    TORCH_CHECK(w.size(0) % kRows == 0, "q8: a panel weight has a multiple of ", kRows, " rows");
    TORCH_CHECK(w.size(1) * kRows == panel_row_bytes(f, K), "q8: a panel weight of ", K, " inputs takes ",
                panel_row_bytes(f, K) / kRows, " bytes a row, the tensor has ", w.size(1));
  } else {
    TORCH_CHECK(w.size(1) == rb, "q8: a GGUF row of ", K, " weights takes ", rb, " bytes, the tensor has ",
                w.size(1));
  }
}

// GGUF rows [N, row_bytes] -> panels [ceil(N/8)*8, panel_row_bytes/8] (rows past N are zero: zero scales and
// quants, whose products are 0 and whose outputs nobody reads).
at::Tensor q8_pack(const at::Tensor& w, int64_t fmt, int64_t K) {
  const int f = static_cast<int>(fmt);
  check_q8_weight(w, f, K, false);
  const Layout L = layout_of(f);
  const int64_t N = w.size(0), nb = K / L.qk, gb = w.size(1);
  const int64_t panels = (N + kRows - 1) / kRows, pb = panel_row_bytes(f, K);
  at::Tensor out = at::zeros({panels * kRows, pb / kRows}, w.options());
  uint8_t* op = out.data_ptr<uint8_t>();
  uint8_t* wp = w.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int r = 0; r < kRows && p * kRows + r < N; ++r)
        for (int64_t b = 0; b < nb; ++b)
          move_block<true>(f, wp + (p * kRows + r) * gb + b * L.gguf_bytes, op + block_at(f, K, panels, p, b), r);
  });
  return out;
}

// Rows `ids` of a panel weight back in the GGUF layout [len(ids), row_bytes].
at::Tensor q8_unpack_rows(const at::Tensor& w, int64_t fmt, int64_t K, const at::Tensor& ids_in) {
  const int f = static_cast<int>(fmt);
  check_q8_weight(w, f, K, true);
  TORCH_CHECK(ids_in.dim() == 1 && ids_in.scalar_type() == at::kLong, "q8: ids must be 1-D int64");
  const at::Tensor ids = ids_in.contiguous();
  const Layout L = layout_of(f);
  const int64_t nb = K / L.qk, gb = nb * L.gguf_bytes, pb = panel_row_bytes(f, K), R = ids.size(0);
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i) TORCH_CHECK(idp[i] >= 0 && idp[i] < w.size(0), "q8: row ", idp[i], " out of range");
  at::Tensor out = at::empty({R, gb}, w.options());
  uint8_t* op = out.data_ptr<uint8_t>();
  uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t panels = w.size(0) / kRows;
  for (int64_t i = 0; i < R; ++i) {
    const int64_t p = idp[i] / kRows;
    const int r = static_cast<int>(idp[i] % kRows);
    for (int64_t b = 0; b < nb; ++b)
      move_block<false>(f, op + i * gb + b * L.gguf_bytes, wp + block_at(f, K, panels, p, b), r);
  }
  return out;
}

at::Tensor q8_unpack(const at::Tensor& w, int64_t fmt, int64_t K, int64_t N) {
  TORCH_CHECK(N >= 0 && N <= w.size(0), "q8: N out of range");
  return q8_unpack_rows(w, fmt, K, at::arange(N, at::TensorOptions().dtype(at::kLong)));
}

// ---- activation rows ----------------------------------------------------------------------------------------------

// Fewest rows of a tile for which the K-quants take the 512-bit tiles k4_tile_z / q6k_tile_z (512-bit VNNI builds).
#ifndef FF_Q8_KZ_MIN_ROWS
#define FF_Q8_KZ_MIN_ROWS 2
#endif

// One call's quantised activation rows. Legacy formats (blocks of 32): q, d, and per block `off` = offset * sum(q)
// (Q4_0: 8, Q5_0: 16) or `s` (Q8_1). K-quants (blocks of 256): q, d, bsums of 16 (bs16) and of 32 (bs32), int16.
struct Acts {
  int64_t K = 0, nb = 0;
  const int8_t* q = nullptr;
  const float* d = nullptr;
  const int32_t* off = nullptr;
  const float* s = nullptr;
  const int16_t* bs16 = nullptr;
  const int16_t* bs32 = nullptr;
  // K-quants in 512-bit builds: q again with the sub-blocks a 512-bit tile multiplies side by side interleaved 4
  // bytes at a time, for its 8-byte broadcasts: Q4_K / Q5_K (k4_tile_z) per chunk of 64, bytes 4t..4t+3 then
  // 32+4t..32+4t+3 (t = 0..7); Q6_K (q6k_tile_z) per half of 128, for g = 0, 1: bytes 32g+4t.. then 64+32g+4t...
  const int8_t* qp = nullptr;
};

inline float fp16_round(float v) { return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// 32 floats times id, rounded half to even, as int8 (values within +-127) into q; returns their int32 lanes' sum.
inline __m256i quantize32(const float* x, __m256 id, int8_t* q) {
  __m256i i[4];
  for (int k = 0; k < 4; ++k)
    i[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), id),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
  __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p);
  return sum;
}

inline float amax32(const float* x) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(x));
  for (int k = 1; k < 4; ++k) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * k)));
  return hmax8(m);
}

// Q8_0 / Q8_1 (blocks of 32): llama.cpp's quantize_row_q8_0 / q8_1 (x86), plus the offset term or s.
void quantize_row_32(const float* x, int64_t K, int offset, bool q8_1, int8_t* q, float* d, int32_t* off, float* s) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float amax = amax32(x + 32 * b);
    const float dd = amax / 127.f;
    const float id = amax != 0.0f ? 127.f / amax : 0.0f;
    const int32_t sum = hsum_i32(quantize32(x + 32 * b, _mm256_set1_ps(id), q + 32 * b));
    d[b] = fp16_round(dd);
    off[b] = offset * sum;
    if (q8_1) s[b] = fp16_round(dd * static_cast<float>(sum));
  }
}

// Q8_K (blocks of 256): llama.cpp's quantize_row_q8_K_ref: the first element of largest magnitude sets the scale.
void quantize_row_k(const float* x, int64_t K, int8_t* q, float* d, int16_t* bs16, int16_t* bs32) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < K / 256; ++b) {
    const float* xb = x + 256 * b;
    __m256 m = _mm256_setzero_ps();
    for (int k = 0; k < 256; k += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + k)));
    const float amax = hmax8(m);
    int8_t* qb = q + 256 * b;
    if (!(amax > 0.0f)) {  // all zero (or NaN): llama.cpp's `if (!amax)`
      d[b] = 0.0f;
      std::memset(qb, 0, 256);
      for (int j = 0; j < 16; ++j) bs16[16 * b + j] = 0;
      for (int j = 0; j < 8; ++j) bs32[8 * b + j] = 0;
      continue;
    }
    float mx = 0.0f;
    for (int k = 0; k < 256; ++k)
      if (std::fabs(xb[k]) == amax) {
        mx = xb[k];
        break;
      }
    const float iscale = -127.f / mx;
    const __m256 vs = _mm256_set1_ps(iscale);
    const __m256i cap = _mm256_set1_epi32(127);
    for (int k = 0; k < 256; k += 32) {
      __m256i i[4];
      for (int u = 0; u < 4; ++u)
        i[u] = _mm256_min_epi32(cap, _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(vs, _mm256_loadu_ps(xb + k + 8 * u)),
                                                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
      __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
      p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + k), p);
    }
    for (int j = 0; j < 16; ++j) {
      int sum = 0;
      for (int k = 0; k < 16; ++k) sum += qb[16 * j + k];
      bs16[16 * b + j] = static_cast<int16_t>(sum);
    }
    for (int j = 0; j < 8; ++j) bs32[8 * b + j] = static_cast<int16_t>(bs16[16 * b + 2 * j] + bs16[16 * b + 2 * j + 1]);
    d[b] = 1.0f / iscale;
  }
}

// The activation rows of one call, in a per-thread buffer reused across calls.
Acts quantize_rows(const float* x, int64_t M, int64_t K, int f) {
  thread_local std::vector<uint8_t> buf;
  const bool k = is_k(f);
  const int64_t nb = K / (k ? 256 : 32);
  const int64_t q_bytes = (M * K + 63) / 64 * 64, f_bytes = (M * nb * 4 + 63) / 64 * 64;
  const int64_t bs_bytes = k ? (M * nb * 24 * 2 + 63) / 64 * 64 : 0;
#if defined(FF_Q8_ZMM)
  const bool pairs = is_k(f) && M >= FF_Q8_KZ_MIN_ROWS;  // one row: k4_tile / q6k_tile read q
#else
  const bool pairs = false;
#endif
  const int64_t qp_bytes = pairs ? q_bytes : 0;
  const size_t need = static_cast<size_t>(q_bytes + 3 * f_bytes + bs_bytes + qp_bytes + 64);
  if (buf.size() < need) buf.resize(need);
  uint8_t* base = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
  Acts a;
  a.K = K;
  a.nb = nb;
  int8_t* q = reinterpret_cast<int8_t*>(base);
  float* d = reinterpret_cast<float*>(base + q_bytes);
  int32_t* off = reinterpret_cast<int32_t*>(base + q_bytes + f_bytes);
  float* s = reinterpret_cast<float*>(base + q_bytes + 2 * f_bytes);
  int16_t* bs16 = reinterpret_cast<int16_t*>(base + q_bytes + 3 * f_bytes);
  int16_t* bs32 = bs16 + M * nb * 16;
  a.q = q, a.d = d, a.off = off, a.s = s, a.bs16 = bs16, a.bs32 = bs32;
  int8_t* qp = pairs ? reinterpret_cast<int8_t*>(base + q_bytes + 3 * f_bytes + bs_bytes) : nullptr;
  a.qp = qp;
  const int offset = act_offset_of(f);
  const bool q8_1 = has_min(f);
  at::parallel_for(0, M, std::max<int64_t>(1, 8192 / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      if (k) {
        quantize_row_k(x + m * K, K, q + m * K, d + m * nb, bs16 + m * nb * 16, bs32 + m * nb * 8);
        if (qp && f == kQ6_K)
          for (int64_t c = 0; c < K; c += 128)
            for (int g = 0; g < 2; ++g)
              for (int t = 0; t < 8; ++t) {
                std::memcpy(qp + m * K + c + 64 * g + 8 * t, q + m * K + c + 32 * g + 4 * t, 4);
                std::memcpy(qp + m * K + c + 64 * g + 8 * t + 4, q + m * K + c + 64 + 32 * g + 4 * t, 4);
              }
        else if (qp)
          for (int64_t c = 0; c < K; c += 64)
            for (int t = 0; t < 8; ++t) {
              std::memcpy(qp + m * K + c + 8 * t, q + m * K + c + 4 * t, 4);
              std::memcpy(qp + m * K + c + 8 * t + 4, q + m * K + c + 32 + 4 * t, 4);
            }
      } else
        quantize_row_32(x + m * K, K, offset, q8_1, q + m * K, d + m * nb, off + m * nb, s + m * nb);
    }
  });
  return a;
}

// ---- kernels --------------------------------------------------------------------------------------------------

using V = __m256i;

inline V vload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline V bcast4(const int8_t* p) {  // 4 activation bytes to every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline V bcast4(const int16_t* p) { return bcast4(reinterpret_cast<const int8_t*>(p)); }
inline V nib_lo(V w) { return _mm256_and_si256(w, _mm256_set1_epi8(0x0F)); }
inline V nib_hi(V w) { return _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(0x0F)); }
// Bit p of every byte of w moved to bit 4 (then masked): a Q5 high bit into place.
template <int P>
inline V bit_to_4(V w) {
  V v;
  if constexpr (P < 4) v = _mm256_slli_epi32(w, 4 - P);
  else if constexpr (P > 4) v = _mm256_srli_epi32(w, P - 4);
  else v = w;
  return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}
inline V madd_ones(V p16) { return _mm256_madd_epi16(p16, _mm256_set1_epi16(1)); }
inline __m256 cvt(V i) { return _mm256_cvtepi32_ps(i); }
// int16 pairs [s_r, s_r] for r = 0..7 from 8 bytes (unsigned / signed)
inline V pairs_u8(const uint8_t* p) {
  const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(x, x));
}
inline V pairs_s8(const uint8_t* p) {
  const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(x, x));
}
inline __m256 halfs8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }
#ifndef FF_Q8_AHEAD
#define FF_Q8_AHEAD 2048
#endif
constexpr int64_t kAhead = FF_Q8_AHEAD;  // bytes of the weight stream asked for ahead of use
// Every cache line of the block kAhead bytes on (a panel's blocks are read in order, so this covers the stream).
// Prefetching one or two lines a block instead left some lines to the hardware prefetcher; for Q6_K, whose block is
// read in two passes over strided slices, it missed half of them: 8.3 GB/s on one core from memory against 17.9 from
// L3.
template <int kBytes>
inline void prefetch_block(const uint8_t* P) {
#pragma GCC unroll 32
  for (int off = 0; off < kBytes; off += 64) prefetch(P + kAhead + off);
}
// Static analysis (llvm-mca) of a kernel's loop body: built with -DFF_MCA, the markers bracket one iteration.
#if defined(FF_MCA)
#define FF_MCA_BEGIN() asm volatile("# LLVM-MCA-BEGIN")
#define FF_MCA_END() asm volatile("# LLVM-MCA-END")
#else
#define FF_MCA_BEGIN()
#define FF_MCA_END()
#endif

// Independent vpdpbusd chains per row in a block: with few rows, one chain of 8 (latency 4 cycles each) per row
// and block leaves the multiplier idle (measured: one row ran at the chain's latency, 37 cycles a block), so the
// slices go round-robin into `chains` partial integers, added at the end (exact: the same integer).
template <int R>
constexpr int chains() { return R >= 4 ? 1 : R == 1 ? 4 : 2; }

// acc[i] = acc[i] + (float(I[i]) * (dw * d_a)) [+ mw * s_a]: the fp32 part of a legacy block, in its fixed order.
template <int F, int R>
inline void legacy_scale(__m256 (&acc)[R], V (&I)[R], const Acts& a, int64_t m0, int64_t b, __m256 dw, __m256 mw) {
  for (int i = 0; i < R; ++i) {
    const int64_t ab = (m0 + i) * a.nb + b;
    V t = I[i];
    if constexpr (act_offset_of(F) != 0) t = _mm256_sub_epi32(t, _mm256_set1_epi32(a.off[ab]));
    __m256 term = _mm256_mul_ps(cvt(t), _mm256_mul_ps(dw, _mm256_set1_ps(a.d[ab])));
    if constexpr (has_min(F)) term = _mm256_add_ps(term, _mm256_mul_ps(mw, _mm256_set1_ps(a.s[ab])));
    acc[i] = _mm256_add_ps(acc[i], term);
  }
}

// Q4_0 / Q4_1 / Q5_0 / Q5_1: R activation rows x one panel. Integer bounds (maddubs: u8 x s8 pairs into int16):
// a Q4 product pair is at most 2 * 15 * 127 = 3810, and eight of them (a block) 30480 < 32767; a Q5 pair at most
// 2 * 31 * 127 = 7874, so two slices (four pairs, 31496) are summed in int16 before widening.
template <int F, int R>
void legacy_tile(const uint8_t* panel, const Acts a, int64_t m0, float* out, int64_t ldo) {
  constexpr Layout L = layout_of(F);
  __m256 acc[R];
  const int8_t* ar[R];
  for (int i = 0; i < R; ++i) {
    acc[i] = _mm256_setzero_ps();
    ar[i] = a.q + (m0 + i) * a.K;
  }
  for (int64_t b = 0; b < a.nb; ++b) {
    FF_MCA_BEGIN();
    const uint8_t* P = panel + b * L.panel_bytes;
    prefetch_block<L.panel_bytes>(P);
    const __m256 dw = halfs8(P);
    __m256 mw = _mm256_setzero_ps();
    if constexpr (has_min(F)) mw = halfs8(P + min_at(F));
    V qh = _mm256_setzero_si256();
    if constexpr (is_q5(F)) qh = vload(P + qh_at(F));
    const uint8_t* qs = P + qs_at(F);
    V I[R];
    for (int i = 0; i < R; ++i) I[i] = _mm256_setzero_si256();
#if defined(FF_Q8_VNNI)
    constexpr int C = chains<R>();
    V J[C][R];
    for (int c = 0; c < C; ++c)
      for (int i = 0; i < R; ++i) J[c][i] = _mm256_setzero_si256();
    auto slice = [&](auto sc) {
      constexpr int s = decltype(sc)::value;
      V (&Is)[R] = J[s % C];
      const V w = vload(qs + 32 * s);
      V lo = nib_lo(w), hi = nib_hi(w);
      if constexpr (is_q5(F)) {
        lo = _mm256_or_si256(lo, bit_to_4<2 * s>(qh));
        hi = _mm256_or_si256(hi, bit_to_4<2 * s + 1>(qh));
      }
      for (int i = 0; i < R; ++i) {
        Is[i] = FF_DPBUSD(Is[i], lo, bcast4(ar[i] + 32 * b + 4 * s));
        Is[i] = FF_DPBUSD(Is[i], hi, bcast4(ar[i] + 32 * b + 16 + 4 * s));
      }
    };
    slice(std::integral_constant<int, 0>{});
    slice(std::integral_constant<int, 1>{});
    slice(std::integral_constant<int, 2>{});
    slice(std::integral_constant<int, 3>{});
    for (int i = 0; i < R; ++i) {
      I[i] = J[0][i];
      for (int c = 1; c < C; ++c) I[i] = _mm256_add_epi32(I[i], J[c][i]);
    }
#else
    // The block's quants decoded once (8 registers), then each row's eight products summed in int16 in turn.
    V lo[4], hi[4];
    for (int s = 0; s < 4; ++s) {
      const V w = vload(qs + 32 * s);
      lo[s] = nib_lo(w);
      hi[s] = nib_hi(w);
    }
    if constexpr (is_q5(F)) {
      lo[0] = _mm256_or_si256(lo[0], bit_to_4<0>(qh));
      hi[0] = _mm256_or_si256(hi[0], bit_to_4<1>(qh));
      lo[1] = _mm256_or_si256(lo[1], bit_to_4<2>(qh));
      hi[1] = _mm256_or_si256(hi[1], bit_to_4<3>(qh));
      lo[2] = _mm256_or_si256(lo[2], bit_to_4<4>(qh));
      hi[2] = _mm256_or_si256(hi[2], bit_to_4<5>(qh));
      lo[3] = _mm256_or_si256(lo[3], bit_to_4<6>(qh));
      hi[3] = _mm256_or_si256(hi[3], bit_to_4<7>(qh));
    }
    for (int i = 0; i < R; ++i) {
      const int8_t* ab = ar[i] + 32 * b;
      V p = _mm256_add_epi16(_mm256_maddubs_epi16(lo[0], bcast4(ab)), _mm256_maddubs_epi16(hi[0], bcast4(ab + 16)));
      V q = _mm256_add_epi16(_mm256_maddubs_epi16(lo[1], bcast4(ab + 4)), _mm256_maddubs_epi16(hi[1], bcast4(ab + 20)));
      V r = _mm256_add_epi16(_mm256_maddubs_epi16(lo[2], bcast4(ab + 8)), _mm256_maddubs_epi16(hi[2], bcast4(ab + 24)));
      V t = _mm256_add_epi16(_mm256_maddubs_epi16(lo[3], bcast4(ab + 12)), _mm256_maddubs_epi16(hi[3], bcast4(ab + 28)));
      if constexpr (is_q5(F))  // four Q5 pairs fit int16; eight do not
        I[i] = _mm256_add_epi32(madd_ones(_mm256_add_epi16(p, q)), madd_ones(_mm256_add_epi16(r, t)));
      else
        I[i] = madd_ones(_mm256_add_epi16(_mm256_add_epi16(p, q), _mm256_add_epi16(r, t)));
    }
#endif
    legacy_scale<F, R>(acc, I, a, m0, b, dw, mw);
    FF_MCA_END();
  }
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(out + (m0 + i) * ldo, acc[i]);
}

// Q8_0: signed weights. With VNNI they enter as w + 128 (u8; the activation block's 128 * sum is taken off in
// legacy_scale: act_offset_of); without, each slice multiplies |w| by the activation with w's sign (a pair is at
// most 2 * 128 * 127 = 32512: widened to int32 at once).
template <int R>
void q8_0_tile(const uint8_t* panel, const Acts a, int64_t m0, float* out, int64_t ldo) {
  constexpr Layout L = layout_of(kQ8_0);
  __m256 acc[R];
  const int8_t* ar[R];
  for (int i = 0; i < R; ++i) {
    acc[i] = _mm256_setzero_ps();
    ar[i] = a.q + (m0 + i) * a.K;
  }
  for (int64_t b = 0; b < a.nb; ++b) {
    FF_MCA_BEGIN();
    const uint8_t* P = panel + b * L.panel_bytes;
    prefetch_block<L.panel_bytes>(P);
    const __m256 dw = halfs8(P);
    V I[R];
    for (int i = 0; i < R; ++i) I[i] = _mm256_setzero_si256();
#if defined(FF_Q8_VNNI)
    constexpr int C = chains<R>();
    V J[C][R];
    for (int c = 0; c < C; ++c)
      for (int i = 0; i < R; ++i) J[c][i] = _mm256_setzero_si256();
#endif
    for (int s = 0; s < 8; ++s) {
      const V w = vload(P + qs_at(kQ8_0) + 32 * s);
#if defined(FF_Q8_VNNI)
      const V u = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));  // w + 128
      for (int i = 0; i < R; ++i) J[s % C][i] = FF_DPBUSD(J[s % C][i], u, bcast4(ar[i] + 32 * b + 4 * s));
#else
      const V aw = _mm256_sign_epi8(w, w);
      for (int i = 0; i < R; ++i) {
        const V sa = _mm256_sign_epi8(bcast4(ar[i] + 32 * b + 4 * s), w);
        I[i] = _mm256_add_epi32(I[i], madd_ones(_mm256_maddubs_epi16(aw, sa)));
      }
#endif
    }
#if defined(FF_Q8_VNNI)
    for (int i = 0; i < R; ++i) {
      I[i] = J[0][i];
      for (int c = 1; c < C; ++c) I[i] = _mm256_add_epi32(I[i], J[c][i]);
    }
#endif
    legacy_scale<kQ8_0, R>(acc, I, a, m0, b, dw, _mm256_setzero_ps());
    FF_MCA_END();
  }
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(out + (m0 + i) * ldo, acc[i]);
}

// A K-quant super-block's end, shared by the 256-bit and 512-bit tiles: per row, its integer I (int32 per weight row)
// with the mins' (Q4_K / Q5_K) or the offset's (Q6_K) term from the activation's sums, scaled in fp32 into acc.
struct K4Mins {  // [mn_2k, mn_2k+1] pairs per weight row
  V mn[4];
  explicit K4Mins(const uint8_t* P) {
    for (int k = 0; k < 4; ++k)
      mn[k] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(P + kMnAt + 16 * k)));
  }
};
inline __m256 k4_end(__m256 acc, V I, const K4Mins& m, const Acts& a, int64_t ab, __m256 dw, __m256 dmin) {
  const int16_t* bs = a.bs32 + ab * 8;
  V Im = _mm256_madd_epi16(m.mn[0], bcast4(bs));
  for (int k = 1; k < 4; ++k) Im = _mm256_add_epi32(Im, _mm256_madd_epi16(m.mn[k], bcast4(bs + 2 * k)));
  const __m256 da = _mm256_set1_ps(a.d[ab]);
  const __m256 term = _mm256_sub_ps(_mm256_mul_ps(cvt(I), _mm256_mul_ps(dw, da)),
                                    _mm256_mul_ps(cvt(Im), _mm256_mul_ps(dmin, da)));
  return _mm256_add_ps(acc, term);
}
struct Q6Scales {  // [sc_2k, sc_2k+1] pairs per weight row
  V scp[8];
  explicit Q6Scales(const uint8_t* P) {
    for (int k = 0; k < 8; ++k) {
      const __m128i lo = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(P + kQ6ScAt + 8 * (2 * k)));
      const __m128i hi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(P + kQ6ScAt + 8 * (2 * k + 1)));
      scp[k] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(lo, hi));
    }
  }
};
// less 32 * sum_i sc_i * bsum_i
inline __m256 q6k_end(__m256 acc, V I, const Q6Scales& s, const Acts& a, int64_t ab, __m256 dw) {
  const int16_t* bs = a.bs16 + ab * 16;
  V Io = _mm256_madd_epi16(s.scp[0], bcast4(bs));
  for (int k = 1; k < 8; ++k) Io = _mm256_add_epi32(Io, _mm256_madd_epi16(s.scp[k], bcast4(bs + 2 * k)));
  const V t = _mm256_sub_epi32(I, _mm256_slli_epi32(Io, 5));
  return _mm256_add_ps(acc, _mm256_mul_ps(cvt(t), _mm256_mul_ps(dw, _mm256_set1_ps(a.d[ab]))));
}

// Q4_K / Q5_K: per 32-weight sub-block j, the int16 sums times its 6-bit scale (vpmaddwd with [sc, sc] pairs)
// into the super-block's int32 I; the mins' term from the activation's sums of 32. Bounds: a Q4 sub-block's eight
// pairs sum to at most 30480 in int16, a Q5 one's pairs are widened every four (31496); |I| <= 8 * 32 * 31 * 127 *
// 63 < 2^31.
template <int F, int R>
void k4_tile(const uint8_t* panel, const Acts a, int64_t m0, float* out, int64_t ldo) {
  constexpr Layout L = layout_of(F);
  __m256 acc[R];
  const int8_t* ar[R];
  for (int i = 0; i < R; ++i) {
    acc[i] = _mm256_setzero_ps();
    ar[i] = a.q + (m0 + i) * a.K;
  }
  for (int64_t sb = 0; sb < a.nb; ++sb) {
    FF_MCA_BEGIN();
    const uint8_t* P = panel + sb * L.panel_bytes;
    prefetch_block<L.panel_bytes>(P);
    const __m256 dw = halfs8(P), dmin = halfs8(P + 16);
    const uint8_t* qs = P + k_qs_at(F);
    V I[R];
    for (int i = 0; i < R; ++i) I[i] = _mm256_setzero_si256();
    auto chunk_half = [&](int c, auto hc) {  // sub-block j = 2c + h: the low (h = 0) or high nibbles of chunk c
      constexpr int h = decltype(hc)::value;
      const int j = 2 * c + h;
#if defined(FF_Q8_VNNI)
      V S[R];
      for (int i = 0; i < R; ++i) S[i] = _mm256_setzero_si256();
#else
      const V sc = pairs_u8(P + kScAt + 8 * j);
      V p[R];
      for (int i = 0; i < R; ++i) p[i] = _mm256_setzero_si256();
#endif
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        const uint8_t* wp = qs + 256 * c + 32 * t;
        const V w = vload(wp);
        V x = h ? nib_hi(w) : nib_lo(w);
        if constexpr (F == kQ5_K) {
          const V qh = vload(P + kQ5KQhAt + 32 * t);
          switch (j) {  // bit j of the qh byte is this sub-block's high bit
            case 0: x = _mm256_or_si256(x, bit_to_4<0>(qh)); break;
            case 1: x = _mm256_or_si256(x, bit_to_4<1>(qh)); break;
            case 2: x = _mm256_or_si256(x, bit_to_4<2>(qh)); break;
            case 3: x = _mm256_or_si256(x, bit_to_4<3>(qh)); break;
            case 4: x = _mm256_or_si256(x, bit_to_4<4>(qh)); break;
            case 5: x = _mm256_or_si256(x, bit_to_4<5>(qh)); break;
            case 6: x = _mm256_or_si256(x, bit_to_4<6>(qh)); break;
            default: x = _mm256_or_si256(x, bit_to_4<7>(qh)); break;
          }
        }
        for (int i = 0; i < R; ++i) {
          const V av = bcast4(ar[i] + 256 * sb + 64 * c + 32 * h + 4 * t);
#if defined(FF_Q8_VNNI)
          S[i] = FF_DPBUSD(S[i], x, av);
#else
          p[i] = _mm256_add_epi16(p[i], _mm256_maddubs_epi16(x, av));
#endif
        }
#if !defined(FF_Q8_VNNI)
        if (F == kQ5_K && t == 3) {
          for (int i = 0; i < R; ++i) {
            I[i] = _mm256_add_epi32(I[i], _mm256_madd_epi16(p[i], sc));
            p[i] = _mm256_setzero_si256();
          }
        }
#endif
      }
#if defined(FF_Q8_VNNI)
      const V sc32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(P + kScAt + 8 * j)));
      for (int i = 0; i < R; ++i) I[i] = _mm256_add_epi32(I[i], _mm256_mullo_epi32(S[i], sc32));
#else
      for (int i = 0; i < R; ++i) I[i] = _mm256_add_epi32(I[i], _mm256_madd_epi16(p[i], sc));
#endif
    };
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      chunk_half(c, std::integral_constant<int, 0>{});
      chunk_half(c, std::integral_constant<int, 1>{});
    }
    const K4Mins mins(P);
    for (int i = 0; i < R; ++i) acc[i] = k4_end(acc[i], I[i], mins, a, (m0 + i) * a.nb + sb, dw, dmin);
    FF_MCA_END();
  }
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(out + (m0 + i) * ldo, acc[i]);
}

#if defined(FF_Q8_ZMM)
// The 512-bit K-quant tiles' pieces: a value pair repeated over the 16 lanes; the 8 dwords of a 32-byte slice each
// twice (lanes 2r, 2r + 1: weight row r); 8 bytes of Acts::qp in every 64-bit pair of lanes; each row's integer from
// its two lanes.
inline __m512i lane_pairs(int a, int b) { return _mm512_setr_epi32(a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b); }
inline __m512i dwords_twice(const uint8_t* p) {
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
                                  _mm512_castsi256_si512(vload(p)));
}
inline __m512i act_pair(const int8_t* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm512_set1_epi64(v);
}
inline V row_sums(__m512i I) { return _mm512_cvtepi64_epi32(_mm512_add_epi32(I, _mm512_srli_epi64(I, 32))); }

// Q4_K / Q5_K with 512-bit VNNI, one panel: a chunk's two sub-blocks (low and high nibbles of the same slices) side by
// side in one register, lane 2r the row's sub-block 2c and lane 2r + 1 its sub-block 2c + 1, against the activation
// pair [a(2c) | a(2c + 1)] of Acts::qp broadcast as one 8-byte value: one load and one 512-bit vpdpbusd per row and
// slice, where k4_tile's 256-bit tiles take two of each (Zen 4 runs a 256-bit broadcast + vpdpbusd pair at 60-70% of
// the multiplier's rate). The integer of every (row, sub-block) and their sum over the super-block are k4_tile's
// (exact: the same bounds), and the super-block's fp32 part is k4_tile's code, so every output is its bits.
template <int F, int R>
void k4_tile_z(const uint8_t* panel, const Acts a, int64_t m0, float* out, int64_t ldo) {
  constexpr Layout L = layout_of(F);
  __m256 acc[R];
  const int8_t* ar[R];
  for (int i = 0; i < R; ++i) {
    acc[i] = _mm256_setzero_ps();
    ar[i] = a.qp + (m0 + i) * a.K;
  }
  const __m512i m4 = _mm512_set1_epi8(0x0F), nib = lane_pairs(0, 4);  // low, high nibbles
  for (int64_t sb = 0; sb < a.nb; ++sb) {
    FF_MCA_BEGIN();
    const uint8_t* P = panel + sb * L.panel_bytes;
    prefetch_block<L.panel_bytes>(P);
    const __m256 dw = halfs8(P), dmin = halfs8(P + 16);
    const uint8_t* qs = P + k_qs_at(F);
    __m512i I[R];
    for (int i = 0; i < R; ++i) I[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      // bit 2c (lanes 2r) and 2c + 1 (lanes 2r + 1) of a Q5_K qh byte rotated to bit 4
      const __m512i hb = lane_pairs((36 - 2 * c) % 32, (35 - 2 * c) % 32);
      __m512i S[R];
      for (int i = 0; i < R; ++i) S[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        __m512i x = _mm512_and_si512(_mm512_srlv_epi32(dwords_twice(qs + 256 * c + 32 * t), nib), m4);
        if constexpr (F == kQ5_K)
          x = _mm512_or_si512(x, _mm512_and_si512(_mm512_rolv_epi32(dwords_twice(P + kQ5KQhAt + 32 * t), hb),
                                                  _mm512_set1_epi8(0x10)));
        for (int i = 0; i < R; ++i)
          S[i] = _mm512_dpbusd_epi32(S[i], x, act_pair(ar[i] + 256 * sb + 64 * c + 8 * t));
      }
      const __m128i sc = _mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(P + kScAt + 16 * c)),
                                           _mm_loadl_epi64(reinterpret_cast<const __m128i*>(P + kScAt + 16 * c + 8)));
      const __m512i sc32 = _mm512_cvtepu8_epi32(sc);
      for (int i = 0; i < R; ++i) I[i] = _mm512_add_epi32(I[i], _mm512_mullo_epi32(S[i], sc32));
    }
    const K4Mins mins(P);
    for (int i = 0; i < R; ++i) acc[i] = k4_end(acc[i], row_sums(I[i]), mins, a, (m0 + i) * a.nb + sb, dw, dmin);
    FF_MCA_END();
  }
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(out + (m0 + i) * ldo, acc[i]);
}
#endif

// Q6_K: q in 0..63 (4 low bits from ql, 2 high bits from qh) times the activation, per 16-weight sub-block i
// times its int8 scale, less 32 * sc_i * (the activation's sum over i). A pair is at most 2 * 63 * 127 = 16002,
// so two slices (t, t + 1: same sub-block) are summed in int16; |I| < 16 * 16 * 63 * 127 * 128 < 2^31.
template <int R>
void q6k_tile(const uint8_t* panel, const Acts a, int64_t m0, float* out, int64_t ldo) {
  constexpr Layout L = layout_of(kQ6_K);
  __m256 acc[R];
  const int8_t* ar[R];
  for (int i = 0; i < R; ++i) {
    acc[i] = _mm256_setzero_ps();
    ar[i] = a.q + (m0 + i) * a.K;
  }
  const V m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
  for (int64_t sb = 0; sb < a.nb; ++sb) {
    FF_MCA_BEGIN();
    const uint8_t* P = panel + sb * L.panel_bytes;
    prefetch_block<L.panel_bytes>(P);
    const __m256 dw = halfs8(P);
    V I[R];
    for (int i = 0; i < R; ++i) I[i] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const uint8_t* hp = P + kQ6HalfAt + kQ6HalfBytes * h;
      // pattern g: 0 = A low nibbles (elements 4t..), 1 = B low (32+4t..), 2 = A high (64+4t..), 3 = B high (96+4t..)
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
#pragma GCC unroll 4
        for (int tp = 0; tp < 4; ++tp) {
          const int j = 8 * h + 2 * g + (tp >> 1);  // the sub-block of slices 2tp, 2tp + 1
#if defined(FF_Q8_VNNI)
          V S[R];
          for (int i = 0; i < R; ++i) S[i] = _mm256_setzero_si256();
#else
          V p[R];
          for (int i = 0; i < R; ++i) p[i] = _mm256_setzero_si256();
#endif
#pragma GCC unroll 2
          for (int tt = 0; tt < 2; ++tt) {
            const int t = 2 * tp + tt;
            const uint8_t* sp = hp + 96 * t;
            const V q4 = vload(sp + 32 * (g & 1));
            const V H = vload(sp + 64);
            V x;
            switch (g) {
              case 0: x = _mm256_or_si256(_mm256_and_si256(q4, m4), _mm256_and_si256(_mm256_slli_epi16(H, 4), m2)); break;
              case 1: x = _mm256_or_si256(_mm256_and_si256(q4, m4), _mm256_and_si256(_mm256_slli_epi16(H, 2), m2)); break;
              case 2: x = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4, 4), m4), _mm256_and_si256(H, m2)); break;
              default:
                x = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4, 4), m4),
                                    _mm256_and_si256(_mm256_srli_epi16(H, 2), m2));
            }
            for (int i = 0; i < R; ++i) {
              const V av = bcast4(ar[i] + 256 * sb + 128 * h + 32 * g + 4 * t);
#if defined(FF_Q8_VNNI)
              S[i] = FF_DPBUSD(S[i], x, av);
#else
              p[i] = _mm256_add_epi16(p[i], _mm256_maddubs_epi16(x, av));
#endif
            }
          }
#if defined(FF_Q8_VNNI)
          const V sc32 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(P + kQ6ScAt + 8 * j)));
          for (int i = 0; i < R; ++i) I[i] = _mm256_add_epi32(I[i], _mm256_mullo_epi32(S[i], sc32));
#else
          const V sc = pairs_s8(P + kQ6ScAt + 8 * j);
          for (int i = 0; i < R; ++i) I[i] = _mm256_add_epi32(I[i], _mm256_madd_epi16(p[i], sc));
#endif
        }
      }
    }
    const Q6Scales scales(P);
    for (int i = 0; i < R; ++i) acc[i] = q6k_end(acc[i], I[i], scales, a, (m0 + i) * a.nb + sb, dw);
    FF_MCA_END();
  }
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(out + (m0 + i) * ldo, acc[i]);
}

#if defined(FF_Q8_ZMM)
// Q6_K with 512-bit VNNI, one panel: patterns g and g + 2 (the low and high nibbles of the same ql slice, their high
// bits from the same qh slice) side by side, lane 2r the row's sub-block j = 8h + 2g + u, lane 2r + 1 its sub-block
// j + 4, against the activation pair of Acts::qp. As k4_tile_z: every (row, sub-block) integer and their sum are
// q6k_tile's, and the fp32 part is its code, so every output is its bits.
template <int R>
void q6k_tile_z(const uint8_t* panel, const Acts a, int64_t m0, float* out, int64_t ldo) {
  constexpr Layout L = layout_of(kQ6_K);
  __m256 acc[R];
  const int8_t* ar[R];
  for (int i = 0; i < R; ++i) {
    acc[i] = _mm256_setzero_ps();
    ar[i] = a.qp + (m0 + i) * a.K;
  }
  const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x30), nib = lane_pairs(0, 4);
  // qh bits to 4-5, by rotating each dword left: g = 0 / 2 (bits 0-1 / 4-5) and g = 1 / 3 (bits 2-3 / 6-7)
  const __m512i rot[2] = {lane_pairs(4, 0), lane_pairs(2, 30)};
  for (int64_t sb = 0; sb < a.nb; ++sb) {
    FF_MCA_BEGIN();
    const uint8_t* P = panel + sb * L.panel_bytes;
    prefetch_block<L.panel_bytes>(P);
    const __m256 dw = halfs8(P);
    __m512i I[R];
    for (int i = 0; i < R; ++i) I[i] = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const uint8_t* hp = P + kQ6HalfAt + kQ6HalfBytes * h;
#pragma GCC unroll 2
      for (int g = 0; g < 2; ++g) {
#pragma GCC unroll 2
        for (int u = 0; u < 2; ++u) {
          const int j = 8 * h + 2 * g + u;
          __m512i S[R];
          for (int i = 0; i < R; ++i) S[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
          for (int tt = 0; tt < 4; ++tt) {
            const int t = 4 * u + tt;
            const uint8_t* sp = hp + 96 * t;
            const __m512i x = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi32(dwords_twice(sp + 32 * g), nib), m4),
                                              _mm512_and_si512(_mm512_rolv_epi32(dwords_twice(sp + 64), rot[g]), m2));
            for (int i = 0; i < R; ++i)
              S[i] = _mm512_dpbusd_epi32(S[i], x, act_pair(ar[i] + 256 * sb + 128 * h + 64 * g + 8 * t));
          }
          const __m512i sc32 = _mm512_cvtepi8_epi32(
              _mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(P + kQ6ScAt + 8 * j)),
                                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(P + kQ6ScAt + 8 * (j + 4)))));
          for (int i = 0; i < R; ++i) I[i] = _mm512_add_epi32(I[i], _mm512_mullo_epi32(S[i], sc32));
        }
      }
    }
    const Q6Scales scales(P);
    for (int i = 0; i < R; ++i) acc[i] = q6k_end(acc[i], row_sums(I[i]), scales, a, (m0 + i) * a.nb + sb, dw);
    FF_MCA_END();
  }
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(out + (m0 + i) * ldo, acc[i]);
}
#endif

#if defined(FF_Q8_ZMM)
// AVX-512 VNNI: two panels at once in 512-bit registers (lanes 0-7 the first panel's rows, 8-15 the second's).
// One activation broadcast then feeds 16 weight rows instead of 8: measured on an AMD EPYC (Zen 4), a 512-bit
// broadcast + vpdpbusd runs at the full vpdpbusd rate (16 ymm-equivalents in 8.2 cycles), a 256-bit pair at 60-70%
// of it (16 in 11.5-13 cycles). Every lane computes what the 256-bit tiles compute, in the same order, so the
// outputs are the same bit for bit. The pair is read as one stream (in_pairs): read as two streams a panel apart,
// one row ran 1.5x slower (the hardware prefetchers lost one of them).
using Z = __m512i;
inline Z zload2(const uint8_t* p0, const uint8_t* p1) {  // 32 bytes of each panel
  return _mm512_inserti64x4(_mm512_castsi256_si512(vload(p0)), vload(p1), 1);
}
inline __m512 zhalfs16(const uint8_t* p0, const uint8_t* p1) {  // 8 fp16 of each panel
  const __m128i h0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p0));
  const __m128i h1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(h0), h1, 1));
}
inline Z zbcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
template <int P>
inline Z zbit_to_4(Z w) {
  Z v;
  if constexpr (P < 4) v = _mm512_slli_epi32(w, 4 - P);
  else if constexpr (P > 4) v = _mm512_srli_epi32(w, P - 4);
  else v = w;
  return _mm512_and_si512(v, _mm512_set1_epi8(0x10));
}

// legacy_scale on two panels.
template <int F, int R>
inline void legacy_scale2(__m512 (&acc)[R], Z (&I)[R], const Acts& a, int64_t m0, int64_t b, __m512 dw, __m512 mw) {
  for (int i = 0; i < R; ++i) {
    const int64_t ab = (m0 + i) * a.nb + b;
    Z t = I[i];
    if constexpr (act_offset_of(F) != 0) t = _mm512_sub_epi32(t, _mm512_set1_epi32(a.off[ab]));
    __m512 term = _mm512_mul_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(dw, _mm512_set1_ps(a.d[ab])));
    if constexpr (has_min(F)) term = _mm512_add_ps(term, _mm512_mul_ps(mw, _mm512_set1_ps(a.s[ab])));
    acc[i] = _mm512_add_ps(acc[i], term);
  }
}

// Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0: R activation rows x the pair of panels at ``panel`` (the first's outputs at
// out, the second's at out + 8).
template <int F, int R>
void tile2(const uint8_t* panel, const Acts a, int64_t m0, float* out, int64_t ldo) {
  constexpr Layout L = layout_of(F);
  __m512 acc[R];
  const int8_t* ar[R];
  for (int i = 0; i < R; ++i) {
    acc[i] = _mm512_setzero_ps();
    ar[i] = a.q + (m0 + i) * a.K;
  }
  for (int64_t b = 0; b < a.nb; ++b) {
    FF_MCA_BEGIN();
    const uint8_t* P0 = panel + b * 2 * L.panel_bytes;  // the pair's block b: the first panel's, then the second's
    const uint8_t* P1 = P0 + L.panel_bytes;
    prefetch_block<2 * L.panel_bytes>(P0);
    const __m512 dw = zhalfs16(P0, P1);
    __m512 mw = _mm512_setzero_ps();
    if constexpr (has_min(F)) mw = zhalfs16(P0 + min_at(F), P1 + min_at(F));
    constexpr int C = chains<R>();
    Z J[C][R];
    for (int c = 0; c < C; ++c)
      for (int i = 0; i < R; ++i) J[c][i] = _mm512_setzero_si512();
    if constexpr (F == kQ8_0) {
      for (int s = 0; s < 8; ++s) {
        const Z u = _mm512_xor_si512(zload2(P0 + qs_at(F) + 32 * s, P1 + qs_at(F) + 32 * s),
                                     _mm512_set1_epi8(static_cast<char>(0x80)));  // w + 128
        for (int i = 0; i < R; ++i) J[s % C][i] = _mm512_dpbusd_epi32(J[s % C][i], u, zbcast4(ar[i] + 32 * b + 4 * s));
      }
    } else {
      Z qh = _mm512_setzero_si512();
      if constexpr (is_q5(F)) qh = zload2(P0 + qh_at(F), P1 + qh_at(F));
      auto slice = [&](auto sc) {
        constexpr int s = decltype(sc)::value;
        const Z w = zload2(P0 + qs_at(F) + 32 * s, P1 + qs_at(F) + 32 * s);
        const Z m4 = _mm512_set1_epi8(0x0F);
        Z lo = _mm512_and_si512(w, m4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
        if constexpr (is_q5(F)) {
          lo = _mm512_or_si512(lo, zbit_to_4<2 * s>(qh));
          hi = _mm512_or_si512(hi, zbit_to_4<2 * s + 1>(qh));
        }
        Z (&Is)[R] = J[s % C];
        for (int i = 0; i < R; ++i) {
          Is[i] = _mm512_dpbusd_epi32(Is[i], lo, zbcast4(ar[i] + 32 * b + 4 * s));
          Is[i] = _mm512_dpbusd_epi32(Is[i], hi, zbcast4(ar[i] + 32 * b + 16 + 4 * s));
        }
      };
      slice(std::integral_constant<int, 0>{});
      slice(std::integral_constant<int, 1>{});
      slice(std::integral_constant<int, 2>{});
      slice(std::integral_constant<int, 3>{});
    }
    Z I[R];
    for (int i = 0; i < R; ++i) {
      I[i] = J[0][i];
      for (int c = 1; c < C; ++c) I[i] = _mm512_add_epi32(I[i], J[c][i]);
    }
    legacy_scale2<F, R>(acc, I, a, m0, b, dw, mw);
    FF_MCA_END();
  }
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(out + (m0 + i) * ldo, acc[i]);
}

#ifndef FF_Q8_ZMM_ROWS
#define FF_Q8_ZMM_ROWS 8
#endif
// Rows [m0, m0 + rows) (rows <= FF_Q8_ZMM_ROWS) x two panels.
template <int F, int R = FF_Q8_ZMM_ROWS>
inline void tile2_any(int rows, const uint8_t* panel, const Acts a, int64_t m0, float* out, int64_t ldo) {
  if constexpr (R > 1) {
    if (rows < R) return tile2_any<F, R - 1>(rows, panel, a, m0, out, ldo);
  }
  tile2<F, R>(panel, a, m0, out, ldo);
}
#endif

#if defined(FF_HAVE_AMX_INT8)
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8")
#endif
// ---- integer tiles: AMX-INT8, or its emulation ------------------------------------------------------------------
//
// The same products on AMX tiles (tiles.h: the hardware's tdpbssd, or the same instructions emulated in C++ on CPUs
// without AMX, which is how the tests run everywhere). C [rows x 16] += A [rows x 32 bytes] . B [8 x 64 bytes]:
// A is 16 activation rows' quantised bytes of one block (or sub-block) read in place (stride K), B the block of
// 16 weight rows (a pair of panels) decoded to one signed byte per quant in the VNNI order (B row k holds elements
// 4k..4k+3 of each weight row: exactly what a panel's slices hold, nibbles apart), so C is, per activation row and
// weight row, the block's integer sum(q_w * q_a) -- signed x signed, no +128 offset. Then the per-block scaling of
// the vector kernels, the same fp32 operations in the same order: every output is bitwise what the vector kernels
// give (and the reference), whatever path, rows, tiles or threads.
//
// A call's work: per pair of panels (an odd last panel alone, the second half of B zero), the weight's blocks are
// decoded once into a buffer (every row block of the call then reads them), then per block of 16 activation rows
// (up to four: 64 rows a pass) and per weight block: tileloadd B, tilezero C, tileloadd A, tdpbssd, tilestored C,
// the epilogue for the rows. K-quants: per sub-block of 32 (Q6_K: 16) the integer times its 6-bit (8-bit) scale
// summed in int32 across the super-block, then the super-block's scaling.
//
// The tiles: 0 = C and 2 = A of a full row block (16 rows), 1 = C and 3 = A of the last partial one, 4 = B.

// 16 fp32 / int32 lanes: one 512-bit register, or two 256-bit ones (the same operations lane by lane).
#if defined(FF_ISA_AVX512) && !defined(FF_ISA_EMULATED)
struct F16 {
  __m512 v;
};
struct I16 {
  __m512i v;
};
inline F16 f16_zero() { return {_mm512_setzero_ps()}; }
inline F16 f16_set1(float x) { return {_mm512_set1_ps(x)}; }
inline F16 f16_load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void f16_store(float* p, F16 a) { _mm512_storeu_ps(p, a.v); }
inline F16 operator+(F16 a, F16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F16 operator-(F16 a, F16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F16 operator*(F16 a, F16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F16 f16_cvt(I16 a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline I16 i16_load(const int32_t* p) { return {_mm512_loadu_si512(p)}; }
inline void i16_store(int32_t* p, I16 a) { _mm512_storeu_si512(p, a.v); }
inline I16 i16_set1(int32_t x) { return {_mm512_set1_epi32(x)}; }
inline I16 operator+(I16 a, I16 b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline I16 operator-(I16 a, I16 b) { return {_mm512_sub_epi32(a.v, b.v)}; }
inline I16 operator*(I16 a, I16 b) { return {_mm512_mullo_epi32(a.v, b.v)}; }
inline F16 f16_join(__m256 lo, __m256 hi) {
  return {_mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1))};
}
inline I16 i16_join(__m256i lo, __m256i hi) { return {_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)}; }
#else
struct F16 {
  __m256 lo, hi;
};
struct I16 {
  __m256i lo, hi;
};
inline F16 f16_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16 f16_set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline F16 f16_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void f16_store(float* p, F16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline F16 operator+(F16 a, F16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F16 operator-(F16 a, F16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline F16 operator*(F16 a, F16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F16 f16_cvt(I16 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline I16 i16_load(const int32_t* p) { return {vload(reinterpret_cast<const uint8_t*>(p)), vload(reinterpret_cast<const uint8_t*>(p + 8))}; }
inline void i16_store(int32_t* p, I16 a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a.lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 8), a.hi);
}
inline I16 i16_set1(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
inline I16 operator+(I16 a, I16 b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline I16 operator-(I16 a, I16 b) { return {_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)}; }
inline I16 operator*(I16 a, I16 b) { return {_mm256_mullo_epi32(a.lo, b.lo), _mm256_mullo_epi32(a.hi, b.hi)}; }
inline F16 f16_join(__m256 lo, __m256 hi) { return {lo, hi}; }
inline I16 i16_join(__m256i lo, __m256i hi) { return {lo, hi}; }
#endif

// The 8 fp16 scales at p0 (weight rows 0-7) and at p1 (rows 8-15; zeros where there is no second panel).
inline F16 scales16(const uint8_t* p0, const uint8_t* p1) {
  return f16_join(halfs8(p0), p1 ? halfs8(p1) : _mm256_setzero_ps());
}
// 8 unsigned / signed bytes of each panel widened to 16 int32 lanes.
inline I16 bytes16_u8(const uint8_t* p0, const uint8_t* p1) {
  const __m256i z = _mm256_setzero_si256();
  return i16_join(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p0))),
                  p1 ? _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p1))) : z);
}
inline I16 bytes16_s8(const uint8_t* p0, const uint8_t* p1) {
  const __m256i z = _mm256_setzero_si256();
  return i16_join(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p0))),
                  p1 ? _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p1))) : z);
}

constexpr int kTileBytes = 512;  // one decoded B tile: 8 rows of 64 bytes (Q6_K: 4 rows, 256 bytes used)

// Bytes of A per tile product (a block, or a K-quant sub-block) and the decoded B tiles of one weight block.
template <int F>
constexpr int tile_k() { return F == kQ6_K ? 16 : 32; }
template <int F>
constexpr int tiles_per_block() { return F == kQ6_K ? 16 : is_k(F) ? 8 : 1; }

// B row k = [panel 0's 32 bytes | panel 1's 32 bytes (zeros without one)].
inline void b_row(uint8_t* dst, V lo, V hi) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32), hi);
}

// The B tiles of block b of two panels (blocks at P0 and P1; P1 null for a lone panel) into dst.
template <int F>
void decode_b(const uint8_t* P0, const uint8_t* P1, uint8_t* dst) {
  const V z = _mm256_setzero_si256();
  auto ld = [&](const uint8_t* P, int at) { return P ? vload(P + at) : z; };
  if constexpr (F == kQ8_0) {
    for (int s = 0; s < 8; ++s) b_row(dst + 64 * s, ld(P0, qs_at(F) + 32 * s), ld(P1, qs_at(F) + 32 * s));
  } else if constexpr (!is_k(F)) {  // Q4_0 / Q4_1 / Q5_0 / Q5_1: row s the low nibbles of slice s, row 4 + s the high
    const V qh0 = is_q5(F) ? ld(P0, qh_at(F)) : z, qh1 = is_q5(F) ? ld(P1, qh_at(F)) : z;
    auto slice = [&](auto sc) {
      constexpr int s = decltype(sc)::value;
      const V w0 = ld(P0, qs_at(F) + 32 * s), w1 = ld(P1, qs_at(F) + 32 * s);
      V lo0 = nib_lo(w0), hi0 = nib_hi(w0), lo1 = nib_lo(w1), hi1 = nib_hi(w1);
      if constexpr (is_q5(F)) {
        lo0 = _mm256_or_si256(lo0, bit_to_4<2 * s>(qh0));
        hi0 = _mm256_or_si256(hi0, bit_to_4<2 * s + 1>(qh0));
        lo1 = _mm256_or_si256(lo1, bit_to_4<2 * s>(qh1));
        hi1 = _mm256_or_si256(hi1, bit_to_4<2 * s + 1>(qh1));
      }
      b_row(dst + 64 * s, lo0, lo1);
      b_row(dst + 64 * (4 + s), hi0, hi1);
    };
    slice(std::integral_constant<int, 0>{});
    slice(std::integral_constant<int, 1>{});
    slice(std::integral_constant<int, 2>{});
    slice(std::integral_constant<int, 3>{});
  } else if constexpr (F == kQ4_K || F == kQ5_K) {  // sub-block j = 2c + h: nibble h of chunk c's slices
    for (int j = 0; j < 8; ++j) {
      const int c = j / 2, h = j % 2;
      for (int t = 0; t < 8; ++t) {
        V x[2];
        const uint8_t* Ps[2] = {P0, P1};
        for (int u = 0; u < 2; ++u) {
          const V w = ld(Ps[u], k_qs_at(F) + 256 * c + 32 * t);
          x[u] = h ? nib_hi(w) : nib_lo(w);
          if constexpr (F == kQ5_K) {
            const V qh = ld(Ps[u], kQ5KQhAt + 32 * t);
            x[u] = _mm256_or_si256(x[u], _mm256_and_si256(_mm256_slli_epi32(_mm256_srli_epi32(qh, j), 4),
                                                          _mm256_set1_epi8(0x10)));
          }
        }
        b_row(dst + kTileBytes * j + 64 * t, x[0], x[1]);
      }
    }
  } else {  // Q6_K: sub-block j = 8 hf + 2 g + u, slices t = 4u .. 4u + 3 of half hf, pattern g (see q6k_tile)
    const V m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
    for (int j = 0; j < 16; ++j) {
      const int hf = j / 8, g = (j % 8) / 2, u = j % 2;
      for (int tt = 0; tt < 4; ++tt) {
        const int t = 4 * u + tt;
        V x[2];
        const uint8_t* Ps[2] = {P0, P1};
        for (int p = 0; p < 2; ++p) {
          const int at = kQ6HalfAt + kQ6HalfBytes * hf + 96 * t;
          const V q4 = ld(Ps[p], at + 32 * (g & 1)), H = ld(Ps[p], at + 64);
          switch (g) {
            case 0: x[p] = _mm256_or_si256(_mm256_and_si256(q4, m4), _mm256_and_si256(_mm256_slli_epi16(H, 4), m2)); break;
            case 1: x[p] = _mm256_or_si256(_mm256_and_si256(q4, m4), _mm256_and_si256(_mm256_slli_epi16(H, 2), m2)); break;
            case 2: x[p] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4, 4), m4), _mm256_and_si256(H, m2)); break;
            default:
              x[p] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4, 4), m4),
                                     _mm256_and_si256(_mm256_srli_epi16(H, 2), m2));
          }
        }
        b_row(dst + kTileBytes * j + 64 * tt, x[0], x[1]);
      }
    }
  }
}

// The tile configuration for `rows` activation rows (1..64) of format F.
template <int F>
ff::tiles::Config tile_config(int rows) {
  ff::tiles::Config cfg;
  const int last = rows % 16, kb = tile_k<F>();
  if (rows >= 16) {
    cfg.set(0, 16, 64);
    cfg.set(2, 16, kb);
  }
  if (last) {
    cfg.set(1, last, 64);
    cfg.set(3, last, kb);
  }
  cfg.set(4, kb / 4, 64);
  return cfg;
}

// C = A . B for the activation rows [r0, r0 + n) (n = 16: tiles 0/2, else 1/3) and the B tile at bt; C's int32
// rows into ib [n][16].
template <class Tiles>
inline void tile_product(const int8_t* A, int64_t lda, const uint8_t* bt, int n, int32_t* ib) {
  Tiles::template load<4>(bt, 64);
  if (n == 16) {
    Tiles::template zero<0>();
    Tiles::template load<2>(A, lda);
    Tiles::template dpbssd<0, 2, 4>();
    Tiles::template store<0>(ib, 64);
  } else {
    Tiles::template zero<1>();
    Tiles::template load<3>(A, lda);
    Tiles::template dpbssd<1, 3, 4>();
    Tiles::template store<1>(ib, 64);
  }
}

// Activation rows [0, rows) of `a` (rows <= 64) x the panel pairs [q0, q1) of w, into out (ldo floats a row).
template <class Tiles, int F>
void tiles_pairs(const Acts& a, int rows, const uint8_t* w, int64_t K, int64_t n_panels, int64_t q0, int64_t q1,
                 float* out, int64_t ldo) {
  constexpr Layout L = layout_of(F);
  constexpr int kb = tile_k<F>(), per_block = tiles_per_block<F>();
  const int64_t nb = a.nb;
  thread_local std::vector<uint8_t> b_store;
  const size_t need = static_cast<size_t>(nb * per_block * kTileBytes + 64);
  if (b_store.size() < need) b_store.resize(need);
  uint8_t* bts = b_store.data() + (64 - reinterpret_cast<uintptr_t>(b_store.data()) % 64) % 64;
  alignas(64) int32_t ib[16 * 16];
  alignas(64) int32_t iacc[16 * 16];
  alignas(64) float acc[16 * 16];
  for (int64_t q = q0; q < q1; ++q) {
    const int64_t p = 2 * q;
    const bool two = p + 1 < n_panels;
    for (int64_t b = 0; b < nb; ++b)  // every block of the pair decoded once, for all the row blocks
      decode_b<F>(w + block_at(F, K, n_panels, p, b), two ? w + block_at(F, K, n_panels, p + 1, b) : nullptr,
                  bts + b * per_block * kTileBytes);
    for (int r0 = 0; r0 < rows; r0 += 16) {
      const int n = std::min(16, rows - r0);
      for (int i = 0; i < n; ++i) f16_store(acc + 16 * i, f16_zero());
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* P0 = w + block_at(F, K, n_panels, p, b);
        const uint8_t* P1 = two ? w + block_at(F, K, n_panels, p + 1, b) : nullptr;
        auto at1 = [&](int o) { return P1 ? P1 + o : nullptr; };  // the second panel's byte o, or none
        const uint8_t* bt = bts + b * per_block * kTileBytes;
        const F16 dw = scales16(P0, P1);
        if constexpr (!is_k(F)) {
          tile_product<Tiles>(a.q + r0 * a.K + L.qk * b, a.K, bt, n, ib);
          F16 mw = f16_zero();
          if constexpr (has_min(F)) mw = scales16(P0 + min_at(F), at1(min_at(F)));
          for (int i = 0; i < n; ++i) {  // legacy_scale's operations
            const int64_t ab = (r0 + i) * nb + b;
            I16 t = i16_load(ib + 16 * i);
            if constexpr (offset_of(F) != 0) t = t - i16_set1(a.off[ab]);
            F16 term = f16_cvt(t) * (dw * f16_set1(a.d[ab]));
            if constexpr (has_min(F)) term = term + mw * f16_set1(a.s[ab]);
            f16_store(acc + 16 * i, f16_load(acc + 16 * i) + term);
          }
        } else {
          for (int i = 0; i < n; ++i) i16_store(iacc + 16 * i, i16_set1(0));
          for (int j = 0; j < per_block; ++j) {  // I += sc_j * (the sub-block's integer)
            tile_product<Tiles>(a.q + r0 * a.K + L.qk * b + kb * j, a.K, bt + j * kTileBytes, n, ib);
            const I16 sc = F == kQ6_K ? bytes16_s8(P0 + kQ6ScAt + 8 * j, at1(kQ6ScAt + 8 * j))
                                      : bytes16_u8(P0 + kScAt + 8 * j, at1(kScAt + 8 * j));
            for (int i = 0; i < n; ++i) i16_store(iacc + 16 * i, i16_load(iacc + 16 * i) + i16_load(ib + 16 * i) * sc);
          }
          for (int i = 0; i < n; ++i) {
            const int64_t ab = (r0 + i) * nb + b;
            const F16 da = f16_set1(a.d[ab]);
            I16 I = i16_load(iacc + 16 * i);
            F16 term;
            if constexpr (F == kQ6_K) {  // less 32 * sum_j sc_j * bsum_j (q6k_tile's offset)
              const int16_t* bs = a.bs16 + ab * 16;
              I16 o = i16_set1(0);
              for (int j = 0; j < 16; ++j)
                o = o + bytes16_s8(P0 + kQ6ScAt + 8 * j, at1(kQ6ScAt + 8 * j)) * i16_set1(bs[j]);
              I = I - o * i16_set1(32);
              term = f16_cvt(I) * (dw * da);
            } else {  // the mins: sum_j mn_j * bsum32_j (k4_tile's Im)
              const int16_t* bs = a.bs32 + ab * 8;
              I16 im = i16_set1(0);
              for (int j = 0; j < 8; ++j) {
                const int at = kMnAt + 16 * (j >> 1) + (j & 1);
                alignas(32) uint8_t m0[8], m1[8];
                for (int r = 0; r < 8; ++r) {
                  m0[r] = P0[at + 2 * r];
                  m1[r] = P1 ? P1[at + 2 * r] : 0;
                }
                im = im + bytes16_u8(m0, P1 ? m1 : nullptr) * i16_set1(bs[j]);
              }
              const F16 dmin = scales16(P0 + 16, at1(16));
              term = f16_cvt(I) * (dw * da) - f16_cvt(im) * (dmin * da);
            }
            f16_store(acc + 16 * i, f16_load(acc + 16 * i) + term);
          }
        }
      }
      const int cols = two ? 16 : 8;
      for (int i = 0; i < n; ++i) std::memcpy(out + (r0 + i) * ldo + p * kRows, acc + 16 * i, cols * sizeof(float));
    }
  }
}

// The tile path of a call: rows [0, rows) of `a` (rows <= 64) over every panel pair, threads over the pairs, each
// thread configuring its tiles for the call (and, on the hardware, putting back the configuration it found).
template <class Tiles, int F>
void tiles_run(const Acts& a, int rows, const uint8_t* w, int64_t K, int64_t n_panels, float* out, int64_t ldo) {
  const ff::tiles::Config cfg = tile_config<F>(rows);
  const int64_t pairs = (n_panels + 1) / 2;
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, K * rows));
  at::parallel_for(0, pairs, grain, [&](int64_t q0, int64_t q1) {
    if constexpr (Tiles::kHardware) {
#if defined(FF_HAVE_AMX_INT8)
      const ff::tiles::Config before = Tiles::saved();
      Tiles::configure(cfg);
      tiles_pairs<Tiles, F>(a, rows, w, K, n_panels, q0, q1, out, ldo);
      Tiles::restore(before);
#endif
    } else {
      Tiles::configure(cfg);
      tiles_pairs<Tiles, F>(a, rows, w, K, n_panels, q0, q1, out, ldo);
      Tiles::release();
    }
  });
}

#if defined(FF_HAVE_AMX_INT8)
#pragma GCC pop_options
#endif

// Which kernel a call's rows go to. kAuto: AMX tiles from kTileMinRows rows where the CPU and process have them,
// else the vector kernel; the others force a path (tests, measurements). Every path gives the same bits.
enum class Path { kAuto, kVector, kTiles, kEmulatedTiles };

// From how many rows of a call the integer tiles replace the vector kernel (VNNI) where AMX-INT8 is at hand. NOT
// measured: no CPU with AMX was in reach while the tile kernel was written (it is tested bitwise under emulation);
// llama.cpp sends one row to VNNI and two or more to its tiles, SGLang switches above four. Measure it on an AMX
// machine (FASTFORWARD_Q8_TILE_ROWS=N overrides it per process; 0 keeps every call on the vector kernel).
constexpr int kTileMinRows = 4;

int tile_min_rows() {
  static const int rows = [] {
    const char* env = std::getenv("FASTFORWARD_Q8_TILE_ROWS");
    if (env == nullptr || *env == '\0') return kTileMinRows;
    const long v = std::strtol(env, nullptr, 10);
    return v <= 0 ? 0 : static_cast<int>(std::min<long>(v, 1 << 20));
  }();
  return rows;
}

bool tiles_at_hand() { return ff_amx_int8_ready(); }

Path auto_path(int64_t rows) {
  const int min_rows = tile_min_rows();
  return min_rows > 0 && rows >= min_rows && tiles_at_hand() ? Path::kTiles : Path::kVector;
}

// Activation rows per tile (register blocking) for each format. Measured A/B in one process, calls alternated
// (AVX2 EPYC, 2 threads): legacy formats 4 rows against 3 (default model, 8 / 16 rows: 12.5 / 23.3 ms against
// 14.1 / 25.9); K-quants 2 against 3 (1B Q4_K_M, 8 / 16 rows: 114 / 184 ms against 116 / 194). Tried and dropped:
// slices stored as [rows 0-3 | rows 0-3] pairs against 4-fold repeated activations (no broadcasts; llvm-mca
// predicted 10% fewer cycles, measured 5% slower: the fourfold activation bytes).
#ifndef FF_Q8_LEGACY_ROWS
#define FF_Q8_LEGACY_ROWS 4
#endif
// With AVX-512 VNNI (32 vector registers) the K-quants take more rows per tile: one core, weights in L1 (the AMD
// EPYC, Zen 4), Q4_K 28.7 / 37.3 / 40.3 multiply-adds per cycle at 2 / 4 / 6 rows a tile, Q5_K 25.2 / 33.4 at 2 / 4,
// Q6_K 22.2 / 28.2 / 25.8 at 2 / 4 / 6.
// With 512-bit tiles (k4_tile_z) 8 rows: the 1B Q4_K_M file's products at 4 / 8 / 16 rows 28.7 / 46.9 / 80.7 ms
// against 29.6 / 50.5 / 81.1 at 6 and 28.4 / 50.7 / 85.8 at 4 (Zen 4, 2 threads, alternated in one process).
#ifndef FF_Q8_K_ROWS
#if defined(FF_Q8_ZMM)
#define FF_Q8_K_ROWS 8
#elif defined(FF_VNNI_512)
#define FF_Q8_K_ROWS 6
#else
#define FF_Q8_K_ROWS 2
#endif
#endif
// Q6_K on 512-bit tiles (q6k_tile_z): 8 rows, the 1B Q4_K_M file's products at 8 / 16 rows 43.8 / 76.5 ms against
// 46.0 / 77.4 at 6 and 47.1 / 79.8 at 4.
#ifndef FF_Q8_Q6K_ROWS
#if defined(FF_Q8_ZMM)
#define FF_Q8_Q6K_ROWS 8
#elif defined(FF_VNNI_512)
#define FF_Q8_Q6K_ROWS 4
#else
#define FF_Q8_Q6K_ROWS 2
#endif
#endif
template <int F>
constexpr int tile_rows() {
  return F == kQ6_K ? FF_Q8_Q6K_ROWS : is_k(F) ? FF_Q8_K_ROWS : FF_Q8_LEGACY_ROWS;
}

template <int F, int R>
inline void tile(const uint8_t* panel, const Acts a, int64_t m0, float* out, int64_t ldo) {
  if constexpr (F == kQ8_0) q8_0_tile<R>(panel, a, m0, out, ldo);
#if defined(FF_Q8_ZMM)
  else if constexpr (F == kQ6_K && R >= FF_Q8_KZ_MIN_ROWS) q6k_tile_z<R>(panel, a, m0, out, ldo);
#endif
  else if constexpr (F == kQ6_K) q6k_tile<R>(panel, a, m0, out, ldo);
#if defined(FF_Q8_ZMM)
  else if constexpr (is_k(F) && R >= FF_Q8_KZ_MIN_ROWS) k4_tile_z<F, R>(panel, a, m0, out, ldo);
#endif
  else if constexpr (is_k(F)) k4_tile<F, R>(panel, a, m0, out, ldo);
  else legacy_tile<F, R>(panel, a, m0, out, ldo);
}

// Rows [m0, m0 + rows) (rows <= tile_rows) x one panel.
template <int F, int R = tile_rows<F>()>
inline void tile_any(int rows, const uint8_t* panel, const Acts a, int64_t m0, float* out, int64_t ldo) {
  if constexpr (R > 1) {
    if (rows < R) return tile_any<F, R - 1>(rows, panel, a, m0, out, ldo);
  }
  tile<F, R>(panel, a, m0, out, ldo);
}

template <int F>
void run(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t n_panels, float* out, Path path) {
  constexpr int R = tile_rows<F>();
  const int64_t pb = panel_row_bytes(F, K), ldo = n_panels * kRows;
  // Rows in chunks whose quantised activations stay in L2 while the panels stream past.
  const int64_t chunk = std::max<int64_t>(R, std::min<int64_t>(64, (256 << 10) / K) / R * R);
  for (int64_t c0 = 0; c0 < M; c0 += chunk) {
    const int64_t rows = std::min(chunk, M - c0);
    const Acts a = quantize_rows(x + c0 * K, rows, K, F);
    float* oc = out + c0 * ldo;
    const Path how = path == Path::kAuto ? auto_path(rows) : path;
    if (how == Path::kEmulatedTiles) {
      tiles_run<ff::tiles::Emulated, F>(a, static_cast<int>(rows), w, K, n_panels, oc, ldo);
      continue;
    }
#if defined(FF_HAVE_AMX_INT8)
    if (how == Path::kTiles) {
      tiles_run<ff::tiles::Amx, F>(a, static_cast<int>(rows), w, K, n_panels, oc, ldo);
      continue;
    }
#endif
    const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, K * rows));
#if defined(FF_Q8_ZMM)
    if constexpr (in_pairs(F)) {  // panel pairs (an odd last panel alone)
      constexpr int R2 = FF_Q8_ZMM_ROWS;
      // The rows in tiles of at most R2, as even as can be (9 rows: 5 + 4, not 8 + 1).
      const int64_t n_tiles = (rows + R2 - 1) / R2, base = rows / n_tiles, wider = rows % n_tiles;
      at::parallel_for(0, (n_panels + 1) / 2, std::max<int64_t>(1, grain / 2), [&](int64_t q0, int64_t q1) {
        for (int64_t q = q0; q < q1; ++q) {
          const int64_t p = 2 * q;
          const uint8_t* panel = w + p * pb;
          for (int64_t k = 0, m0 = 0; k < n_tiles; ++k) {
            const int n = static_cast<int>(base + (k < wider ? 1 : 0));
            if (p + 1 < n_panels)
              tile2_any<F>(n, panel, a, m0, oc + p * kRows, ldo);
            else
              for (int64_t r0 = m0; r0 < m0 + n; r0 += R)
                tile_any<F>(static_cast<int>(std::min<int64_t>(R, m0 + n - r0)), panel, a, r0, oc + p * kRows, ldo);
            m0 += n;
          }
        }
      });
      continue;
    }
#endif
    // The rows in tiles of at most R, as even as can be.
    const int64_t n_tiles = (rows + R - 1) / R, base = rows / n_tiles, wider = rows % n_tiles;
    at::parallel_for(0, n_panels, grain, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const uint8_t* panel = w + p * pb;
        for (int64_t k = 0, m0 = 0; k < n_tiles; ++k) {
          const int n = static_cast<int>(base + (k < wider ? 1 : 0));
          tile_any<F>(n, panel, a, m0, oc + p * kRows, ldo);
          m0 += n;
        }
      }
    });
  }
}

// out[M, N_pad] = x[M, K] @ W^T, W a panel weight [N_pad, panel_row_bytes / 8] of GGML type fmt.
at::Tensor q8_mm(const at::Tensor& x_in, const at::Tensor& w, int64_t fmt, int64_t K, Path path = Path::kAuto) {
  const int f = static_cast<int>(fmt);
  check_q8_weight(w, f, K, true);
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "q8_mm: x must be a 2-D fp32 CPU tensor");
  TORCH_CHECK(x_in.size(1) == K, "q8_mm: x has ", x_in.size(1), " columns, the weight ", K);
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), n_panels = w.size(0) / kRows;
  at::Tensor out = at::empty({M, n_panels * kRows}, x.options());
  if (M == 0 || n_panels == 0) return out;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  switch (f) {
    case kQ4_0: run<kQ4_0>(xp, M, K, wp, n_panels, op, path); break;
    case kQ4_1: run<kQ4_1>(xp, M, K, wp, n_panels, op, path); break;
    case kQ5_0: run<kQ5_0>(xp, M, K, wp, n_panels, op, path); break;
    case kQ5_1: run<kQ5_1>(xp, M, K, wp, n_panels, op, path); break;
    case kQ8_0: run<kQ8_0>(xp, M, K, wp, n_panels, op, path); break;
    case kQ4_K: run<kQ4_K>(xp, M, K, wp, n_panels, op, path); break;
    case kQ5_K: run<kQ5_K>(xp, M, K, wp, n_panels, op, path); break;
    default: run<kQ6_K>(xp, M, K, wp, n_panels, op, path); break;
  }
  return out;
}

// The fp32 values of rows `ids` (an embedding lookup): the reference dequantisation, as the exact path gives it.
at::Tensor q8_rows(const at::Tensor& w, int64_t fmt, int64_t K, const at::Tensor& ids) {
  const at::Tensor rows = q8_unpack_rows(w, fmt, K, ids);
  at::Tensor out = at::empty({rows.size(0), K}, at::TensorOptions().dtype(at::kFloat));
  ff_decode_gguf_rows(rows.data_ptr<uint8_t>(), rows.size(0), rows.size(1), static_cast<int>(fmt), K,
                      out.data_ptr<float>());
  return out;
}

// Quantised activation rows as the kernel makes them (for tests against the reference): q [M, K] int8,
// d [M, nb] fp32, and the per-block extra: off (int32), s (fp32) or bs16 [M, nb, 16] (int16).
std::vector<at::Tensor> q8_quantize(const at::Tensor& x_in, int64_t fmt) {
  const int f = static_cast<int>(fmt);
  TORCH_CHECK(q8_format(f), "q8: GGML type ", f, " has no integer kernel");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % layout_of(f).qk == 0, "q8: K is not a multiple of the block size");
  const Acts a = quantize_rows(x.data_ptr<float>(), M, K, f);
  const auto i8 = at::TensorOptions().dtype(at::kChar), f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor q = at::empty({M, K}, i8), d = at::empty({M, a.nb}, f32);
  std::memcpy(q.data_ptr<int8_t>(), a.q, M * K);
  std::memcpy(d.data_ptr<float>(), a.d, M * a.nb * 4);
  if (is_k(f)) {
    at::Tensor bs = at::empty({M, a.nb, 16}, at::TensorOptions().dtype(at::kShort));
    std::memcpy(bs.data_ptr<int16_t>(), a.bs16, M * a.nb * 32);
    return {q, d, bs};
  }
  if (has_min(f)) {
    at::Tensor s = at::empty({M, a.nb}, f32);
    std::memcpy(s.data_ptr<float>(), a.s, M * a.nb * 4);
    return {q, d, s};
  }
  at::Tensor off = at::empty({M, a.nb}, at::TensorOptions().dtype(at::kInt));
  std::memcpy(off.data_ptr<int32_t>(), a.off, M * a.nb * 4);
  return {q, d, off};
}

// ---- this core's clock and multiply-add peak (for reports: fastforward profile) ---------------------------------

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The fastest of `tries` runs of fn (short runs: one of them escapes other processes' interruptions).
template <typename Fn>
double fastest(Fn fn, int tries) {
  double best = 1e30;
  for (int t = 0; t < tries; ++t) {
    const double t0 = seconds_now();
    fn();
    best = std::min(best, seconds_now() - t0);
  }
  return best;
}

// n iterations of 8 dependent one-cycle additions: 8n cycles.
__attribute__((noinline)) uint64_t add_chain(uint64_t n) {
  uint64_t x = 1;
  for (uint64_t i = 0; i < n; ++i)
    asm volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
                 "add $1, %0\n\tadd $1, %0" : "+r"(x));
  return x;
}

// n iterations of 8 independent dot-product instructions of the vector kernel; returns its multiply-adds per
// instruction (0 without one here).
__attribute__((noinline)) int dot_loop(uint64_t n) {
#if defined(FF_VNNI_512) && !defined(FF_ISA_EMULATED)
  asm volatile(
      "vpxord %%zmm0, %%zmm0, %%zmm0\n\tvpxord %%zmm1, %%zmm1, %%zmm1\n\t"
      "1:\n\t"
      "vpdpbusd %%zmm0, %%zmm1, %%zmm8\n\tvpdpbusd %%zmm0, %%zmm1, %%zmm9\n\t"
      "vpdpbusd %%zmm0, %%zmm1, %%zmm10\n\tvpdpbusd %%zmm0, %%zmm1, %%zmm11\n\t"
      "vpdpbusd %%zmm0, %%zmm1, %%zmm12\n\tvpdpbusd %%zmm0, %%zmm1, %%zmm13\n\t"
      "vpdpbusd %%zmm0, %%zmm1, %%zmm14\n\tvpdpbusd %%zmm0, %%zmm1, %%zmm15\n\t"
      "dec %0\n\tjnz 1b"
      : "+r"(n)::"xmm0", "xmm1", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "cc");
  return 64;
#elif defined(FF_VNNI_AVX)
  asm volatile(
      "vpxor %%ymm0, %%ymm0, %%ymm0\n\tvpxor %%ymm1, %%ymm1, %%ymm1\n\t"
      "1:\n\t"
      "{vex} vpdpbusd %%ymm0, %%ymm1, %%ymm8\n\t{vex} vpdpbusd %%ymm0, %%ymm1, %%ymm9\n\t"
      "{vex} vpdpbusd %%ymm0, %%ymm1, %%ymm10\n\t{vex} vpdpbusd %%ymm0, %%ymm1, %%ymm11\n\t"
      "{vex} vpdpbusd %%ymm0, %%ymm1, %%ymm12\n\t{vex} vpdpbusd %%ymm0, %%ymm1, %%ymm13\n\t"
      "{vex} vpdpbusd %%ymm0, %%ymm1, %%ymm14\n\t{vex} vpdpbusd %%ymm0, %%ymm1, %%ymm15\n\t"
      "dec %0\n\tjnz 1b"
      : "+r"(n)::"xmm0", "xmm1", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "cc");
  return 32;
#elif !defined(FF_ISA_EMULATED)
  // AVX2: vpmaddubsw, 32 u8 x s8 products (summed in pairs) per instruction.
  asm volatile(
      "vpxor %%ymm0, %%ymm0, %%ymm0\n\tvpxor %%ymm1, %%ymm1, %%ymm1\n\t"
      "1:\n\t"
      "vpmaddubsw %%ymm0, %%ymm1, %%ymm8\n\tvpmaddubsw %%ymm0, %%ymm1, %%ymm9\n\t"
      "vpmaddubsw %%ymm0, %%ymm1, %%ymm10\n\tvpmaddubsw %%ymm0, %%ymm1, %%ymm11\n\t"
      "vpmaddubsw %%ymm0, %%ymm1, %%ymm12\n\tvpmaddubsw %%ymm0, %%ymm1, %%ymm13\n\t"
      "vpmaddubsw %%ymm0, %%ymm1, %%ymm14\n\tvpmaddubsw %%ymm0, %%ymm1, %%ymm15\n\t"
      "dec %0\n\tjnz 1b"
      : "+r"(n)::"xmm0", "xmm1", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "cc");
  return 32;
#else
  (void)n;
  return 0;
#endif
}

// This core's clock (GHz, from a chain of dependent additions) and the vector kernel's dot instruction's peak
// multiply-adds per cycle, measured (about 0.1 s).
pybind11::dict q8_dot_peak() {
  constexpr uint64_t kIters = 50000;
  const double chain = fastest([] { volatile uint64_t x = add_chain(kIters); (void)x; }, 200);
  const double ghz = 8.0 * kIters / chain / 1e9;
  pybind11::dict out;
  out["ghz"] = ghz;
  int macs = 0;
  const double dots = fastest([&] { macs = dot_loop(kIters / 4); }, 200);
  out["instruction"] = macs == 0 ? "none" : Q8_DOT_NAME;
  out["macs_per_cycle"] = macs == 0 ? 0.0 : 8.0 * (kIters / 4) * macs / (dots * ghz * 1e9);
  return out;
}

}  // namespace

// For quant_gemm.cpp's quant_mm / quant_rows: panel weights go here.
bool ff_is_q8(int64_t fmt) { return fmt > kQ8Base && q8_format(static_cast<int>(fmt - kQ8Base)); }
at::Tensor ff_q8_mm(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t K) { return q8_mm(x, w, fmt - kQ8Base, K); }
at::Tensor ff_q8_rows(const at::Tensor& w, int64_t fmt, int64_t K, const at::Tensor& ids) {
  return q8_rows(w, fmt - kQ8Base, K, ids);
}

void register_q8_gemm(pybind11::module& m) {
  m.attr("Q8_FORMAT_BASE") = kQ8Base;
  // GGML types whose panels are laid out in pairs (a concatenation of such weights must keep the pairs aligned)
  std::vector<int> pairs;
  for (int f : {kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K})
    if (in_pairs(f)) pairs.push_back(f);
  m.attr("q8_panel_pairs") = pybind11::tuple(pybind11::cast(pairs));
  m.attr("q8_dot") = Q8_DOT_NAME;
  m.def("q8_dot_peak", &q8_dot_peak,
        "this core's clock (ghz, measured with dependent additions) and the multiply-adds per cycle of the vector "
        "kernel's dot instruction at full rate (macs_per_cycle; instruction: its name), measured in about 0.1 s");
  m.def("q8_amx_ready", &tiles_at_hand,
        "whether this CPU and process multiply q8 products on AMX-INT8 tiles (CPU flags and the OS's tile state)");
  m.def("q8_tile_min_rows", &tile_min_rows,
        "from how many rows a call goes to the AMX tiles where they are at hand (kTileMinRows, not measured: "
        "FASTFORWARD_Q8_TILE_ROWS overrides it; 0 = never)");
  m.def(
      "q8_kernel_path",
      [](int64_t rows) {
        return std::string(auto_path(rows) == Path::kTiles ? "q8-amx-int8" : "q8-" Q8_DOT_NAME);
      },
      "the kernel a q8 product of `rows` activation rows runs on here: 'q8-amx-int8' or the vector kernel's name",
      pybind11::arg("rows"));
  m.def(
      "q8_mm_path",
      [](const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t K, const std::string& path) {
        TORCH_CHECK(ff_is_q8(fmt), "q8_mm_path: format ", fmt, " is not a panel-layout weight");
        Path p;
        if (path == "vector") p = Path::kVector;
        else if (path == "emulated-tiles") p = Path::kEmulatedTiles;
        else if (path == "tiles") {
          TORCH_CHECK(tiles_at_hand(), "q8_mm_path: this CPU or process has no AMX-INT8 tiles");
          p = Path::kTiles;
        } else if (path == "auto") p = Path::kAuto;
        else TORCH_CHECK(false, "q8_mm_path: path must be auto, vector, tiles or emulated-tiles, got '", path, "'");
        return q8_mm(x, w, fmt - kQ8Base, K, p);
      },
      "quant_mm of a panel-layout weight on a chosen path: 'vector' (AVX2 / VNNI), 'tiles' (AMX-INT8), "
      "'emulated-tiles' (the tile kernel on the C++ emulation of the tile instructions, any CPU; slow: tests) or "
      "'auto'. Every path gives the same bits.",
      pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("fmt"), pybind11::arg("K"), pybind11::arg("path"));
  m.def("q8_pack", &q8_pack,
        "GGUF rows [N, row_bytes] -> the integer kernel's panels [ceil(N/8)*8, panel_row_bytes] (a new tensor; "
        "its format code for quant_mm is Q8_FORMAT_BASE + type)",
        pybind11::arg("w"), pybind11::arg("fmt"), pybind11::arg("K"));
  m.def("q8_unpack", &q8_unpack, "panels -> the first N rows in the GGUF layout", pybind11::arg("w"),
        pybind11::arg("fmt"), pybind11::arg("K"), pybind11::arg("N"));
  m.def("q8_quantize", &q8_quantize, "the kernel's quantised activation rows (q, d, and off / s / bsums)",
        pybind11::arg("x"), pybind11::arg("fmt"));
}
