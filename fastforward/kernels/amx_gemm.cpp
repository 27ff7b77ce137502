// quant_mm on Intel AMX for Q4_0 / Q4_1 / Q8_0 weights: the products in bf16 tiles, exactly, the sums in fp32.
//
// Why: with fp32 multiply-adds every extra activation row costs the whole model's multiply-adds again (~0.7 ms a
// row on 2 cores), so a forward over 8 or 16 tokens cost 3-5x one token. An AMX tile multiply does 16 x 16 x 32
// bf16 products per instruction, so on a CPU that has it (Sapphire Rapids and later) the rows of a draft tree are
// nearly free and the forward's cost stays that of streaming the weights once.
//
// Exactness. A weight's quant q is a small integer (Q4_0: q - 8 in -8..7; Q4_1: q in 0..15; Q8_0: q in -128..127),
// exact in bf16. Each fp32 activation x is split into three bf16 pieces, x = h + m + l, exactly (h = bf16(x),
// m = bf16(x - h), l = x - h - m: eight bits of the significand each). So every product q * piece is exact in fp32
// and a block's sum S = sum_k q_k * x_k is a sum of exact products in fp32 -- only the order of the additions
// differs from the fp32 reference. The block's scales are applied once per block: y += d * S (+ m * sum_k x_k for
// Q4_1), the algebraically equal form of sum_k (d * q_k + m) * x_k.
//
// Numerics, the same for every M (row i of the product is bitwise the row computed alone): for each 32-weight
// block, ascending, the tile unit accumulates S = ((0 + A_h B) + A_m B) + A_l B for the row (three tile products
// into one sum tile; each element of a tile product depends only on its own row and column), then
// acc = fma(d, S, acc) and, for Q4_1, acc = fma(m, X, acc) with X = the block's activation sum (two 16-lane halves
// added, then Isa::hsum's tree). How many rows share a tile, how many 16-row blocks share a decoded B tile (tall
// calls of 32 rows or more: up to four) and how columns are split over threads never changes that arithmetic.
//
// Layout ("tiled"): a weight [N, K] with N % 16 == 0 is regrouped at load into groups of 16 output rows; for group
// g and block b (contiguous, b fastest) come the 16 rows' fp16 scales (d x 16, then for Q4_1 m x 16), then the
// quants in the order a B tile wants them (16 rows of k-pairs x 16 columns, bf16 pairs) -- for Q4 packed two
// nibbles to a byte so that one 32-byte load decodes into two tile rows with two table lookups (vpermw). Same
// bytes as the GGUF rows (`amx_tile` / `amx_untile` convert). A tiled weight's format code is kTiledBase + type.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include "isa.h"

#if defined(FF_ISA_AVX512) && !defined(FF_ISA_EMULATED) && defined(__x86_64__) && defined(__GNUC__) && \
    (__GNUC__ >= 11 || defined(__clang__))
#define FF_HAVE_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int kTiledBase = 1024;  // format code of a tiled weight: kTiledBase + its GGML type
enum : int { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

bool tileable(int fmt) { return fmt == kQ4_0 || fmt == kQ4_1 || fmt == kQ8_0; }
int n_scales(int fmt) { return fmt == kQ4_1 ? 2 : 1; }
int64_t quant_bytes(int fmt) { return fmt == kQ8_0 ? 32 : 16; }                       // per 32 weights
int64_t gguf_block_bytes(int fmt) { return 2 * n_scales(fmt) + quant_bytes(fmt); }  // 18, 20, 34
int64_t group_block_bytes(int fmt) { return 16 * gguf_block_bytes(fmt); }            // 16 rows x one block
// The same for a format known at compile time (the kernel's templates): scales, then the quants of a B tile.
template <int F>
constexpr int n_scales_of() { return F == kQ4_1 ? 2 : 1; }
template <int F>
constexpr int64_t group_block_bytes_of() { return 32 * n_scales_of<F>() + (F == kQ8_0 ? 512 : 256); }

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The quant (as an integer, before any offset) of element k (0..31) of a GGUF block of `fmt`.
inline int gguf_quant(const uint8_t* blk, int fmt, int k) {
  const uint8_t* qs = blk + 2 * n_scales(fmt);
  if (fmt == kQ8_0) return static_cast<int8_t>(qs[k]);
  return k < 16 ? (qs[k] & 0x0F) : (qs[k - 16] >> 4);
}

// Where the quant of (column n, element k) of a group-block lives in the tiled quants: for Q8_0 the byte index;
// for Q4 the byte index * 2 + (1 if in the high nibble). B tile row r holds k = 2r, 2r+1; its word w = 2n + e
// holds (n, k = 2r + e). Q4: the 32 bytes of chunk P (tile rows 2P and 2P+1) decode as N[t] = low nibble of byte
// t (t < 32) or high nibble of byte t - 32; tile row 2P + (t & 1) takes word t >> 1 from N[t].
inline int tiled_slot(int fmt, int n, int k) {
  const int r = k >> 1, w = 2 * n + (k & 1);
  if (fmt == kQ8_0) return r * 32 + w;
  const int P = r >> 1, t = 2 * w + (r & 1);
  const int byte = P * 32 + (t & 31);
  return byte * 2 + (t >> 5);
}

void check_tileable(const at::Tensor& w, int fmt, int64_t K) {
  TORCH_CHECK(tileable(fmt), "amx: GGML type ", fmt, " has no tiled layout");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.device().is_cpu(),
              "amx: the weight must be a contiguous CPU uint8 tensor [N, row_bytes]");
  TORCH_CHECK(K > 0 && K % 32 == 0, "amx: K=", K, " is not a multiple of 32");
  TORCH_CHECK(w.size(0) % 16 == 0, "amx: a tiled weight needs a multiple of 16 rows, got ", w.size(0));
  TORCH_CHECK(w.size(1) == K / 32 * gguf_block_bytes(fmt), "amx: a row of ", K, " weights takes ",
              K / 32 * gguf_block_bytes(fmt), " bytes, the tensor has ", w.size(1));
}

// GGUF rows -> tiled layout, in place: group g's 16 rows and its tiled group-blocks occupy the same bytes
// (16 * row_bytes from g * 16 * row_bytes), so each group goes through a small copy and no second copy of the
// weight is ever made.
at::Tensor amx_tile_(at::Tensor& w, int64_t fmt_in, int64_t K) {
  const int fmt = static_cast<int>(fmt_in);
  check_tileable(w, fmt, K);
  const int64_t N = w.size(0), nb = K / 32, rb = w.size(1), gbb = group_block_bytes(fmt);
  const int ns = n_scales(fmt);
  uint8_t* base = w.data_ptr<uint8_t>();
  at::parallel_for(0, N / 16, 1, [&](int64_t g0, int64_t g1) {
    std::vector<uint8_t> rows(static_cast<size_t>(16 * rb));
    for (int64_t g = g0; g < g1; ++g) {
      std::memcpy(rows.data(), base + g * 16 * rb, rows.size());  // the group's GGUF rows
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* gb = base + (g * nb + b) * gbb;
        uint8_t* quants = gb + 32 * ns;
        if (fmt != kQ8_0) std::memset(quants, 0, 256);
        for (int n = 0; n < 16; ++n) {
          const uint8_t* blk = rows.data() + n * rb + b * gguf_block_bytes(fmt);
          for (int s = 0; s < ns; ++s) std::memcpy(gb + s * 32 + n * 2, blk + 2 * s, 2);
          for (int k = 0; k < 32; ++k) {
            const int q = gguf_quant(blk, fmt, k);
            const int slot = tiled_slot(fmt, n, k);
            if (fmt == kQ8_0)
              quants[slot] = static_cast<uint8_t>(static_cast<int8_t>(q));
            else
              quants[slot >> 1] |= static_cast<uint8_t>(q << (4 * (slot & 1)));
          }
        }
      }
    }
  });
  return w;
}

// Tiled layout -> GGUF rows.
at::Tensor amx_untile(const at::Tensor& w, int64_t fmt_in, int64_t K) {
  const int fmt = static_cast<int>(fmt_in);
  check_tileable(w, fmt, K);
  const int64_t N = w.size(0), nb = K / 32, rb = w.size(1), gbb = group_block_bytes(fmt);
  const int ns = n_scales(fmt);
  at::Tensor out = at::zeros_like(w);
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t g = 0; g < N / 16; ++g)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* gb = src + (g * nb + b) * gbb;
      const uint8_t* quants = gb + 32 * ns;
      for (int n = 0; n < 16; ++n) {
        uint8_t* blk = dst + (g * 16 + n) * rb + b * gguf_block_bytes(fmt);
        for (int s = 0; s < ns; ++s) std::memcpy(blk + 2 * s, gb + s * 32 + n * 2, 2);
        uint8_t* qs = blk + 2 * ns;
        for (int k = 0; k < 32; ++k) {
          const int slot = tiled_slot(fmt, n, k);
          if (fmt == kQ8_0) {
            qs[k] = quants[slot];
          } else {
            const int q = (quants[slot >> 1] >> (4 * (slot & 1))) & 0x0F;
            if (k < 16)
              qs[k] |= static_cast<uint8_t>(q);
            else
              qs[k - 16] |= static_cast<uint8_t>(q << 4);
          }
        }
      }
    }
  return out;
}

// fp32 rows of a tiled weight (an embedding lookup), each weight decoded as the reference does: Q4_0 d * (q - 8),
// Q4_1 d * q + m, Q8_0 d * q (the build passes -ffp-contract=off: no fused multiply-add here).
at::Tensor amx_rows(const at::Tensor& w, int64_t fmt_in, int64_t K, const at::Tensor& ids_in) {
  const int fmt = static_cast<int>(fmt_in);
  check_tileable(w, fmt, K);
  TORCH_CHECK(ids_in.dim() == 1 && ids_in.scalar_type() == at::kLong, "quant_rows: ids must be 1-D int64");
  const at::Tensor ids = ids_in.contiguous();
  const int64_t R = ids.size(0), N = w.size(0), nb = K / 32, gbb = group_block_bytes(fmt);
  const int ns = n_scales(fmt);
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(idp[r] >= 0 && idp[r] < N, "quant_rows: row ", idp[r], " out of range");
  at::Tensor out = at::empty({R, K}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* src = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t g = idp[r] / 16;
    const int n = static_cast<int>(idp[r] % 16);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* gb = src + (g * nb + b) * gbb;
      const uint8_t* quants = gb + 32 * ns;
      const float d = half_to_float(gb + n * 2);
      const float m = ns > 1 ? half_to_float(gb + 32 + n * 2) : 0.0f;
      for (int k = 0; k < 32; ++k) {
        const int slot = tiled_slot(fmt, n, k);
        float v;
        if (fmt == kQ8_0) {
          v = d * static_cast<float>(static_cast<int8_t>(quants[slot]));
        } else {
          const int q = (quants[slot >> 1] >> (4 * (slot & 1))) & 0x0F;
          if (fmt == kQ4_0) {
            v = d * static_cast<float>(q - 8);
          } else {
            const float dq = d * static_cast<float>(q);
            v = dq + m;
          }
        }
        op[r * K + b * 32 + k] = v;
      }
    }
  }
  return out;
}

#if defined(FF_HAVE_AMX)

// ---- AMX availability: the CPU has it and the kernel grants this process the tile state ------------------------

bool cpu_has_amx() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool amx_bf16 = d & (1u << 22), amx_tile = d & (1u << 24), avx512bw = b & (1u << 30);
  if (!(amx_bf16 && amx_tile && avx512bw)) return false;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  return a & (1u << 5);  // AVX512_BF16
}

bool request_tile_state() {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

bool amx_ready() {
  static std::once_flag once;
  static bool ready = false;
  std::call_once(once, [] { ready = cpu_has_amx() && request_tile_state(); });
  return ready;
}

// AMX-TILE and AMX-INT8 (CPUID.(7,0):EDX bits 24, 25), for the integer tiles of q8_gemm.cpp.
bool cpu_has_amx_int8() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (d & (1u << 24)) && (d & (1u << 25));
}

// Once per process: the CPU has the integer tiles and the kernel grants this process the tile state (every thread
// then gets it on its first tile instruction); false on any failure, and the integer kernel uses its vector path.
bool amx_int8_ready() {
  static std::once_flag once;
  static bool ready = false;
  std::call_once(once, [] { ready = cpu_has_amx_int8() && request_tile_state(); });
  return ready;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int kMaxRows = 16;
// The weights stream once per call; each group-block asks for the bytes kPrefetchAhead further on into L2 and
// kPrefetchNear further on into L1. Measured (default model, the 30 layers' products, one row, 2 threads): 4 KB into
// L1 alone 4.98 ms; 16 KB into L2 3.86; plus 2 KB into L1 3.65 (1 KB 3.70, 4 KB 3.91; 32 or 64 KB into L2 no better).
constexpr int64_t kPrefetchAhead = 16384, kPrefetchNear = 2048;

// The first 64-byte boundary at or after p (scratch vectors hold 32 spare elements for it).
inline uint16_t* align64(uint16_t* p) {
  return reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
}

// bf16 bits of the small integer v (exact).
inline uint16_t bf16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return static_cast<uint16_t>(u >> 16);
}

// The 32-entry table vpermw looks nibble values up in: bf16(v + offset) for v = 0..15 (twice).
inline __m512i nibble_table(int offset) {
  alignas(64) uint16_t t[32];
  for (int v = 0; v < 32; ++v) t[v] = bf16_bits(static_cast<float>((v & 15) + offset));
  return _mm512_load_si512(t);
}

// x rows [R, K] fp32 -> A [3R, K] bf16: rows 0..R-1 the h pieces, R..2R-1 the m pieces, 2R..3R-1 the l pieces.
void split_activations(const float* x, int R, int64_t K, uint16_t* a) {
  for (int i = 0; i < R; ++i)
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 v = _mm512_loadu_ps(x + i * K + k);
      const __m256bh h = _mm512_cvtneps_pbh(v);
      const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
      const __m512 r1 = _mm512_sub_ps(v, hf);
      const __m256bh m = _mm512_cvtneps_pbh(r1);
      const __m512 mf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)m), 16));
      const __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(r1, mf));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + (0 * R + i) * K + k), (__m256i)h);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + (1 * R + i) * K + k), (__m256i)m);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + (2 * R + i) * K + k), (__m256i)l);
    }
}

// Q4_1: the 32-weight block sums of x rows [R, K] -> xs[i * nb + b] (two 16-lane halves added, then Isa::hsum).
void block_sums(const float* x, int R, int64_t K, float* xs) {
  const int64_t nb = K / 32;
  for (int i = 0; i < R; ++i)
    for (int64_t b = 0; b < nb; ++b) {
      const float* p = x + i * K + b * 32;
      xs[i * nb + b] = ff::Isa::hsum(_mm512_add_ps(_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16)));
    }
}

// The B tile (16 rows x 64 bytes, bf16 pairs) of one group-block's quants.
template <int F>
inline void decode_b(const uint8_t* quants, __m512i table, uint16_t* bt) {
  if constexpr (F == kQ8_0) {
    for (int r = 0; r < 16; ++r) {
      const __m128i* p = reinterpret_cast<const __m128i*>(quants + r * 32);
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
      _mm512_store_si512(bt + r * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  } else {
    const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int P = 0; P < 8; ++P) {
      const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + P * 32)));
      const __m512i nib = _mm512_and_si512(_mm512_srlv_epi16(v, shifts), low4);  // N[t], t = 0..63
      _mm512_store_si512(bt + (2 * P) * 32, _mm512_permutexvar_epi16(nib, table));
      _mm512_store_si512(bt + (2 * P + 1) * 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(nib, 8), table));
    }
  }
}

#define FF_INLINE inline __attribute__((always_inline))

// The pieces shared by the row-block loops below.

// Tiles 0, 1, 2, 5, 6 of R rows (A pieces and sums), 3 and 4 of 16 (B tiles); returns the thread's previous
// configuration. Another library may have configured the tiles of this thread (OpenMP threads are shared:
// llama.cpp's AMX kernels configure theirs once per thread and keep it), so `tiles_end` puts it back.
template <int R>
FF_INLINE TileConfig tiles_begin() {
  TileConfig cfg;
  for (int t : {0, 1, 2, 5, 6}) {
    cfg.rows[t] = R;
    cfg.colsb[t] = 64;
  }
  for (int t : {3, 4}) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  TileConfig before;
  _tile_storeconfig(&before);
  _tile_loadconfig(&cfg);
  return before;
}

FF_INLINE void tiles_end(const TileConfig& before) {
  if (before.palette != 0)
    _tile_loadconfig(&before);
  else
    _tile_release();
}

// A group-block's B tile into dst, asking for the weights kPrefetchAhead / kPrefetchNear further on.
template <int F>
FF_INLINE void decode_group_block(const uint8_t* gb, __m512i table, uint16_t* dst) {
  constexpr int64_t gbb = group_block_bytes_of<F>();
  for (int64_t off = 0; off < gbb; off += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(gb + kPrefetchAhead + off), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(gb + kPrefetchNear + off), _MM_HINT_T0);
  }
  decode_b<F>(gb + 32 * n_scales_of<F>(), table, dst);
}

// One step's tile products: the row block's pieces (h at ab, m and l piece_stride elements further on, rows
// a_stride bytes apart) times the two groups' B tiles, sums into c0 and c1: C = ((0 + A_h B) + A_m B) + A_l B.
FF_INLINE void tile_products(const uint16_t* ab, int64_t piece_stride, int64_t a_stride, const uint16_t* b0,
                             const uint16_t* b1, float* c0, float* c1) {
  _tile_loadd(3, b0, 64);
  _tile_loadd(4, b1, 64);
  _tile_loadd(0, ab, a_stride);
  _tile_loadd(1, ab + piece_stride, a_stride);
  _tile_loadd(2, ab + 2 * piece_stride, a_stride);
  _tile_zero(5);
  _tile_zero(6);
  _tile_dpbf16ps(5, 0, 3);
  _tile_dpbf16ps(6, 0, 4);
  _tile_dpbf16ps(5, 1, 3);
  _tile_dpbf16ps(6, 1, 4);
  _tile_dpbf16ps(5, 2, 3);
  _tile_dpbf16ps(6, 2, 4);
  _tile_stored(5, c0, 64);
  _tile_stored(6, c1, 64);
}

// One group-block's sums c (R x 16) into the R rows' accumulators: acc = fma(d, S, acc), then for Q4_1
// acc = fma(m, X, acc) with X = the row's block sum (xb[i * nb]).
template <int F, int R>
FF_INLINE void scale_block(const uint8_t* gb, const float* c, const float* xb, int64_t nb, __m512* acc) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb)));
  if constexpr (F == kQ4_1) {
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 32)));
    for (int i = 0; i < R; ++i) {
      acc[i] = _mm512_fmadd_ps(d, _mm512_load_ps(c + i * 16), acc[i]);
      acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(xb[i * nb]), acc[i]);
    }
  } else {
    for (int i = 0; i < R; ++i) acc[i] = _mm512_fmadd_ps(d, _mm512_load_ps(c + i * 16), acc[i]);
  }
}

// Rows [0, R) of the activations (split into a, block sums xs) times groups [g0, g1) of the tiled weight, two
// groups at a time. Tiles: 0, 1, 2 = the h, m, l pieces of the R rows for one block (R x 32 bf16 each), 3 and 4 =
// the two groups' B tiles, 5 and 6 = their sums (R x 16 fp32): C = ((0 + A_h B) + A_m B) + A_l B, each element
// in the tile unit's fixed order, the same for any R.
template <int F, int R>
void run_groups(const uint16_t* a, const float* xs, int64_t K, const uint8_t* w, int64_t g0, int64_t g1, float* out,
                int64_t N) {
  const int64_t nb = K / 32, gbb = group_block_bytes_of<F>();
  const TileConfig before = tiles_begin<R>();
  // Software-pipelined over the thread's pair-blocks j = pair * nb + b, in order: B tiles are decoded kAhead
  // pair-blocks before the tile unit loads them (a tile load of freshly stored bytes waits for the stores to drain:
  // decoding just before the load cost twice the time), and pair-block j's sums are read back after j + 1's tile
  // products are issued.
  constexpr int kRing = 4, kAhead = 2;
  alignas(64) uint16_t bt[kRing][2][16 * 32];
  alignas(64) float cbuf[2][2][R * 16];
  const __m512i table = nibble_table(F == kQ4_0 ? -8 : 0);
  const int64_t groups = g1 - g0, pairs = (groups + 1) / 2, J = pairs * nb;
  const bool odd = groups % 2 == 1;  // the last pair has one group (its second B tile repeats the first)
  auto group_block = [&](int64_t j, int half) {  // bytes of pair-block j's group `half`
    const int64_t g = g0 + 2 * (j / nb) + half;
    return w + (g * nb + j % nb) * gbb;
  };
  auto decode = [&](int64_t j) {
    const bool single = odd && j / nb == pairs - 1;
    for (int half = 0; half < (single ? 1 : 2); ++half)
      decode_group_block<F>(group_block(j, half), table, bt[j % kRing][half]);
    if (single) std::memcpy(bt[j % kRing][1], bt[j % kRing][0], sizeof bt[0][0]);
  };
  __m512 acc[2][R];
  // Pair-block j's sums into the accumulators (a group's blocks in ascending order); a group's last block writes
  // its 16 outputs per row.
  auto accumulate = [&](int64_t j) {
    const int64_t b = j % nb;
    const bool single = odd && j / nb == pairs - 1;
    for (int half = 0; half < (single ? 1 : 2); ++half) {
      if (b == 0)
        for (int i = 0; i < R; ++i) acc[half][i] = _mm512_setzero_ps();
      scale_block<F, R>(group_block(j, half), cbuf[j & 1][half], xs + b, nb, acc[half]);
      if (b == nb - 1) {
        const int64_t g = g0 + 2 * (j / nb) + half;
        for (int i = 0; i < R; ++i) _mm512_storeu_ps(out + i * N + g * 16, acc[half][i]);
      }
    }
  };
  for (int64_t j = 0; j < std::min<int64_t>(kAhead, J); ++j) decode(j);
  for (int64_t j = 0; j < J; ++j) {
    if (j + kAhead < J) decode(j + kAhead);
    tile_products(a + (j % nb) * 32, R * K, K * 2, bt[j % kRing][0], bt[j % kRing][1], cbuf[j & 1][0],
                  cbuf[j & 1][1]);
    if (j > 0) accumulate(j - 1);
  }
  if (J > 0) accumulate(J - 1);
  tiles_end(before);
}

// Tall calls (prefills, wide verify steps): S blocks of 16 rows (a: the h pieces of all 16 S rows, then their m
// pieces, then their l pieces; xs [16 S, nb]) share each decoded B tile, so the weights are decoded and streamed
// once per 16 S rows instead of once per 16. The row blocks take turns over each pair of groups: its B tiles are
// decoded once, for the first row block, into a ring that holds the pair's nb blocks and the kAhead of the next
// pair, and every row block then runs run_groups<F, 16>'s steps over that pair (the same tile products, the same
// scaling in ascending block order), so every row is bitwise what it gets alone.
template <int F, int S>
void run_groups_tall(const uint16_t* a, const float* xs, int64_t K, const uint8_t* w, int64_t g0, int64_t g1,
                     float* out, int64_t N) {
  constexpr int R = 16, kAhead = 2;
  constexpr int64_t kTile = 16 * 32;  // bf16 values in a B tile
  const int64_t nb = K / 32, gbb = group_block_bytes_of<F>(), ring = nb + kAhead;
  const TileConfig before = tiles_begin<R>();
  thread_local std::vector<uint16_t> bt_store;
  if (static_cast<int64_t>(bt_store.size()) < ring * 2 * kTile + 32) bt_store.resize(ring * 2 * kTile + 32);
  uint16_t* bt = align64(bt_store.data());
  alignas(64) float cbuf[2][2][R * 16];
  const __m512i table = nibble_table(F == kQ4_0 ? -8 : 0);
  const int64_t groups = g1 - g0, pairs = (groups + 1) / 2;
  const bool odd = groups % 2 == 1;
  // A step: pair `pair` (groups g0 + 2 pair and the next), row block c, weight block b; its B tiles in ring slot
  // `slot` (the pair's blocks take nb consecutive slots from `base`). Advanced by counting, without divisions.
  struct Step {
    int64_t pair = 0, c = 0, b = 0, base = 0;
  };
  auto next = [&](Step& t) {
    if (++t.b < nb) return;
    t.b = 0;
    if (++t.c < S) return;
    t.c = 0;
    ++t.pair;
    t.base = (t.base + nb) % ring;
  };
  auto slot = [&](const Step& t) {
    const int64_t q = t.base + t.b;
    return q < ring ? q : q - ring;
  };
  auto single = [&](const Step& t) { return odd && t.pair == pairs - 1; };
  auto group_block = [&](const Step& t, int half) { return w + ((g0 + 2 * t.pair + half) * nb + t.b) * gbb; };
  auto b_tile = [&](const Step& t, int half) { return bt + (slot(t) * 2 + half) * kTile; };
  auto decode = [&](const Step& t) {
    if (t.c != 0) return;  // decoded for the pair's first row block
    for (int half = 0; half < (single(t) ? 1 : 2); ++half)
      decode_group_block<F>(group_block(t, half), table, b_tile(t, half));
    if (single(t)) std::memcpy(b_tile(t, 1), b_tile(t, 0), kTile * sizeof(uint16_t));
  };
  __m512 acc[2][R];
  auto accumulate = [&](const Step& t, const float (*c)[R * 16]) {
    const int64_t rows0 = t.c * R;
    for (int half = 0; half < (single(t) ? 1 : 2); ++half) {
      if (t.b == 0)
        for (int i = 0; i < R; ++i) acc[half][i] = _mm512_setzero_ps();
      scale_block<F, R>(group_block(t, half), c[half], xs + rows0 * nb + t.b, nb, acc[half]);
      if (t.b == nb - 1) {
        float* o = out + rows0 * N + (g0 + 2 * t.pair + half) * 16;
        for (int i = 0; i < R; ++i) _mm512_storeu_ps(o + i * N, acc[half][i]);
      }
    }
  };
  const int64_t J = pairs * S * nb;
  Step ahead, now, prev;
  for (int64_t j = 0; j < std::min<int64_t>(kAhead, J); ++j, next(ahead)) decode(ahead);
  for (int64_t j = 0; j < J; ++j) {
    if (j + kAhead < J) {
      decode(ahead);
      next(ahead);
    }
    tile_products(a + now.c * R * K + now.b * 32, S * R * K, K * 2, b_tile(now, 0), b_tile(now, 1), cbuf[j & 1][0],
                  cbuf[j & 1][1]);
    if (j > 0) accumulate(prev, cbuf[(j - 1) & 1]);
    prev = now;
    next(now);
  }
  if (J > 0) accumulate(prev, cbuf[(J - 1) & 1]);
  tiles_end(before);
}

template <int F, int S>
void run_tall_fixed(const uint16_t* a, const float* xs, int64_t K, const uint8_t* w, int64_t N, float* out) {
  const int64_t groups = N / 16, pairs = (groups + 1) / 2;  // threads take whole pairs of groups
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    run_groups_tall<F, S>(a, xs, K, w, 2 * p0, std::min(groups, 2 * p1), out, N);
  });
}

constexpr int kMaxBlocks = 4;  // row blocks of 16 per tall pass

// 2..kMaxBlocks blocks of 16 rows.
template <int F, int S = kMaxBlocks>
void run_tall(int blocks, const uint16_t* a, const float* xs, int64_t K, const uint8_t* w, int64_t N, float* out) {
  if constexpr (S > 2) {
    if (blocks < S) return run_tall<F, S - 1>(blocks, a, xs, K, w, N, out);
  }
  run_tall_fixed<F, S>(a, xs, K, w, N, out);
}

template <int F, int R>
void run_rows_fixed(const uint16_t* a, const float* xs, int64_t K, const uint8_t* w, int64_t N, float* out) {
  const int64_t groups = N / 16, pairs = (groups + 1) / 2;  // threads take whole pairs of groups
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    run_groups<F, R>(a, xs, K, w, 2 * p0, std::min(groups, 2 * p1), out, N);
  });
}

template <int F, int R = kMaxRows>
void run_rows(int rows, const uint16_t* a, const float* xs, int64_t K, const uint8_t* w, int64_t N, float* out) {
  if constexpr (R > 1) {
    if (rows < R) return run_rows<F, R - 1>(rows, a, xs, K, w, N, out);
  }
  run_rows_fixed<F, R>(a, xs, K, w, N, out);
}

template <int F>
void run(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* out) {
  // The pieces and block sums of the rows of one pass, in per-thread scratch that only grows (no allocation or
  // zero-filling per call: for one row that was ~9 MB of memset per forward).
  const int64_t pass_rows = M >= 2 * kMaxRows ? kMaxRows * kMaxBlocks : std::min<int64_t>(M, kMaxRows);
  thread_local std::vector<uint16_t> a_store;
  thread_local std::vector<float> xs_store;
  if (static_cast<int64_t>(a_store.size()) < 3 * pass_rows * K + 32)
    a_store.resize(static_cast<size_t>(3 * pass_rows * K + 32));
  if (F == kQ4_1 && static_cast<int64_t>(xs_store.size()) < pass_rows * (K / 32))
    xs_store.resize(static_cast<size_t>(pass_rows * (K / 32)));
  uint16_t* a = align64(a_store.data());  // every A tile row one cache line (K * 2 bytes is a multiple of 64)
  float* xs = xs_store.data();
  int64_t m0 = 0;
  while (M - m0 >= 2 * kMaxRows) {  // tall passes: 2..kMaxBlocks whole row blocks at a time
    const int blocks = static_cast<int>(std::min<int64_t>(kMaxBlocks, (M - m0) / kMaxRows));
    split_activations(x + m0 * K, blocks * kMaxRows, K, a);
    if constexpr (F == kQ4_1) block_sums(x + m0 * K, blocks * kMaxRows, K, xs);
    run_tall<F>(blocks, a, xs, K, w, N, out + m0 * N);
    m0 += blocks * kMaxRows;
  }
  for (; m0 < M; m0 += kMaxRows) {
    const int R = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
    split_activations(x + m0 * K, R, K, a);
    if constexpr (F == kQ4_1) block_sums(x + m0 * K, R, K, xs);
    run_rows<F>(R, a, xs, K, w, N, out + m0 * N);
  }
}

#pragma GCC pop_options

#else  // no AMX in this build

bool amx_ready() { return false; }
bool amx_int8_ready() { return false; }

#endif

}  // namespace

bool ff_amx_ready() { return amx_ready(); }
bool ff_amx_int8_ready() { return amx_int8_ready(); }

// For quant_gemm.cpp's quant_mm / quant_rows: a tiled weight's product and rows.
bool ff_is_tiled(int64_t fmt) { return fmt > kTiledBase && tileable(static_cast<int>(fmt - kTiledBase)); }

at::Tensor ff_amx_mm(const at::Tensor& x_in, const at::Tensor& w, int64_t fmt, int64_t K) {
  const int f = static_cast<int>(fmt - kTiledBase);
  check_tileable(w, f, K);
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "quant_mm: x must be a 2-D fp32 CPU tensor");
  TORCH_CHECK(x_in.size(1) == K, "quant_mm: x has ", x_in.size(1), " columns, the weight ", K);
  TORCH_CHECK(amx_ready(), "quant_mm: a tiled weight needs AMX, which this CPU or process does not have");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), N = w.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
#if defined(FF_HAVE_AMX)
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  switch (f) {
    case kQ4_0: run<kQ4_0>(xp, M, K, wp, N, op); break;
    case kQ4_1: run<kQ4_1>(xp, M, K, wp, N, op); break;
    default: run<kQ8_0>(xp, M, K, wp, N, op); break;
  }
#endif
  return out;
}

at::Tensor ff_amx_rows(const at::Tensor& w, int64_t fmt, int64_t K, const at::Tensor& ids) {
  return amx_rows(w, static_cast<int>(fmt - kTiledBase), K, ids);
}

void register_amx_gemm(pybind11::module& m) {
  m.attr("TILED_FORMAT_BASE") = kTiledBase;
  m.def("amx_ready", &amx_ready, "whether AMX tile products can run here (CPU flags and the OS's tile state)");
  m.def("amx_tile_", &amx_tile_,
        "in place: GGUF rows [N, row_bytes] of Q4_0 / Q4_1 / Q8_0 (N % 16 == 0) -> the AMX kernel's tiled layout "
        "(same bytes, regrouped); its format code is TILED_FORMAT_BASE + type",
        pybind11::arg("w"), pybind11::arg("fmt"), pybind11::arg("K"));
  m.def("amx_untile", &amx_untile, "the tiled layout -> GGUF rows (a new tensor)", pybind11::arg("w"),
        pybind11::arg("fmt"), pybind11::arg("K"));
}
