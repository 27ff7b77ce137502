// skinny_mm: out[M, N] = x[M, K] @ w[K, N] in fp32 for a few rows M (1..~32), with w row-major [in, out].
//
// Part of the native module (native.cpp); built with -fopenmp (at::parallel_for is serial without it).
//
// Design
// * Threads split the columns: at::parallel_for hands each an equal run of vectors of columns, so every weight is
//   read from memory once, by one thread, whatever M is.
// * Register tiles: up to MR rows x NR vectors of accumulators; per k, NR vectors of row k of w are loaded and
//   each x[m, k] is broadcast into MR x NR fused multiply-adds. The plan (MR, NR) depends on M (see skinny_mm).
// * Loop order per thread: groups of ~kGroup columns (a 4 KB page of a row) x chunks of kKChunk rows x panels of
//   NR vectors x row blocks of MR rows. A chunk of a panel (kKChunk x NR*kLanes floats) stays in L1 while all row
//   blocks use it, and memory is read a page-wide strip of kKChunk rows at a time. The tile running now prefetches
//   the tile that comes next (the next panel, or the next chunk, or the next group), its lines spread over the row
//   blocks, so memory sees a steady stream however many row blocks there are.
// * Between chunks the accumulators wait in a per-thread scratch buffer laid out contiguously per tile (rows of
//   `out` N floats apart can all map to the same cache sets when N * 4 is a multiple of 4 KB).
// * Numerics (blocked summation): per chunk of kKChunk weight rows every output element has ONE fp32 accumulator
//   that starts at 0 and takes fma(x[m,k], w[k,n], acc) for the chunk's k in order; the chunk's partial sum is
//   then added to the running total of the earlier chunks. This keeps rounding error near MKL's (a single chain
//   over all K drifts ~1e-4 on logits of ~30) and the order stays fixed, so rows are still computed as alone.
//   Plans, blocking and
//   threading only change which elements are computed side by side, never the arithmetic of one element, so row m
//   of skinny_mm(x) is bitwise equal to skinny_mm(x[m:m+1]) and results do not depend on the thread count.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "isa.h"

namespace {

#if defined(FF_ISA_AVX512)
// Plans (MR rows, NR vectors) for M = 1, 2, 3..4 and more (32 zmm registers: MR*NR accumulators + NR + 1).
constexpr int kPlan1 = 8, kPlan2 = 6, kPlan4 = 5, kRowsBig = 8, kVecsBig = 3;
#else
// 16 ymm registers.
constexpr int kPlan1 = 4, kPlan2 = 6, kPlan4 = 3, kRowsBig = 4, kVecsBig = 3;
#endif

using ff::Isa;
using ff::kLanes;
using ff::Mask;
using ff::Reg;
constexpr int64_t kGroup = 1024;  // columns per group: a 4 KB page of a weight row
constexpr int64_t kKChunk = 64;   // weight rows per chunk

// One register tile: acc[0:MR, 0:NR*kLanes] = (first ? 0 : cin) + x[0:MR, 0:kc] @ w[0:kc, 0:NR*kLanes], stored to
// cout; the last vector of columns is masked by `tail` when TAIL. With PF it also prefetches, for k < pf_rows, the
// lines j (bit j of pf_lines) of row k of the region at pf.
struct TileArgs {
  const float* x;
  int64_t ldx;
  const float* w;
  int64_t ldw;
  const float* cin;
  int64_t ldcin;
  float* cout;
  int64_t ldcout;
  int64_t kc;
  bool first;
  Mask tail;
  const float* pf;
  int64_t ldpf;
  int64_t pf_rows;
  unsigned pf_lines;
};

template <int MR, int NR, bool TAIL, bool PF>
void tile(const TileArgs& t) {
  const float* __restrict x = t.x;
  const float* __restrict w = t.w;
  const int64_t ldx = t.ldx, ldw = t.ldw;
  Reg acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = Isa::zero();  // a partial sum per chunk (blocked summation)
  for (int64_t k = 0; k < t.kc; ++k) {
    if (PF && k < t.pf_rows) {
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j)
        if (t.pf_lines >> j & 1u) _mm_prefetch(reinterpret_cast<const char*>(t.pf + k * t.ldpf + j * kLanes), _MM_HINT_T0);
    }
    const float* wk = w + k * ldw;
    Reg b[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j)
      b[j] = (TAIL && j == NR - 1) ? Isa::load(wk + j * kLanes, t.tail) : Isa::load(wk + j * kLanes);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const Reg a = Isa::bcast(x + i * ldx + k);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) acc[i][j] = Isa::fma(a, b[j], acc[i][j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      float* c = t.cout + i * t.ldcout + j * kLanes;
      if (!t.first) {  // add this chunk's partial sum to the running total of the earlier chunks
        const float* r = t.cin + i * t.ldcin + j * kLanes;
        acc[i][j] = Isa::add((TAIL && j == NR - 1) ? Isa::load(r, t.tail) : Isa::load(r), acc[i][j]);
      }
      if (TAIL && j == NR - 1)
        Isa::store(c, acc[i][j], t.tail);
      else
        Isa::store(c, acc[i][j]);
    }
}

using TileFn = void (*)(const TileArgs&);

// tile<mr, NR, TAIL, PF> for a runtime mr in 1..MR.
template <int MR, int NR, bool TAIL, bool PF>
TileFn tile_for_rows(int mr) {
  if constexpr (MR == 1) {
    return tile<1, NR, TAIL, PF>;
  } else {
    return mr == MR ? tile<MR, NR, TAIL, PF> : tile_for_rows<MR - 1, NR, TAIL, PF>(mr);
  }
}

// A per-thread buffer of at least n floats, 64-byte aligned.
float* scratch_buffer(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n + 16) buf.resize(n + 16);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
}

// A blocking plan: register tiles of up to MR rows x NR vectors; column panels NR vectors wide.
template <int MR, int NR>
struct Plan {
  static constexpr int64_t kPanel = NR * kLanes;
  static constexpr int64_t kGroupCols = std::max<int64_t>(kPanel, kGroup / kPanel * kPanel);

  // Columns [n_begin, n_end) of out, all rows.
  static void run(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* out, int64_t n_begin,
                  int64_t n_end) {
    const int64_t blocks = (M + MR - 1) / MR;
    // Parked accumulators: an MR x kPanel block per (panel of the group, row block).
    float* scratch = K > kKChunk ? scratch_buffer(kGroupCols * blocks * MR) : nullptr;
    for (int64_t g0 = n_begin; g0 < n_end; g0 += kGroupCols) {
      const int64_t g1 = std::min(n_end, g0 + kGroupCols);
      for (int64_t k0 = 0; k0 < K; k0 += kKChunk) {
        const int64_t kc = std::min(kKChunk, K - k0);
        const bool first = k0 == 0, last = k0 + kc >= K;
        for (int64_t n = g0; n < g1; n += kPanel) {
          const int64_t nb = std::min(kPanel, g1 - n);
          // The tile after this one: the next panel of this chunk, else the group's first panel in the next
          // chunk, else the next group's first panel in the first chunk.
          int64_t pf_k = k0, pf_n = n + kPanel, pf_end = g1;
          if (pf_n >= g1) {
            pf_n = g0;
            pf_k = k0 + kc;
            if (pf_k >= K) {
              pf_k = 0;
              pf_n = g1;
              pf_end = std::min(n_end, g1 + kGroupCols);
            }
          }
          const int64_t pf_rows = pf_n < pf_end ? std::min(kKChunk, K - pf_k) : 0;
          const int64_t pf_vecs = (std::min(kPanel, pf_end - pf_n) + kLanes - 1) / kLanes;
          const unsigned pf_all = pf_rows > 0 ? (1u << pf_vecs) - 1u : 0u;
          for (int64_t m0 = 0, blk = 0; m0 < M; m0 += MR, ++blk) {
            const int mr = static_cast<int>(std::min<int64_t>(MR, M - m0));
            unsigned lines = 0;  // row block blk prefetches lines blk, blk + blocks, ...
            for (int64_t j = blk; j < NR; j += blocks) lines |= 1u << j;
            lines &= pf_all;
            float* final_c = out + m0 * N + n;
            float* park = scratch ? scratch + ((n - g0) / kPanel * blocks + blk) * MR * kPanel : final_c;
            const int64_t ldpark = scratch ? kPanel : N;
            TileArgs t{x + m0 * K + k0, K, w + k0 * N + n, N, park, ldpark, last ? final_c : park,
                       last ? N : ldpark, kc, first, Isa::mask(kLanes), w + pf_k * N + pf_n, N, pf_rows, lines};
            if (nb == kPanel) {
              (lines ? tile_for_rows<MR, NR, false, true>(mr) : tile_for_rows<MR, NR, false, false>(mr))(t);
              continue;
            }
            // A thread's last, narrower panel: one vector of columns at a time, the matrix's last one masked.
            for (int64_t v = 0; v < nb; v += kLanes) {
              const int64_t cols = std::min<int64_t>(kLanes, nb - v);
              TileArgs tv = t;
              tv.w += v;
              tv.cin += v;
              tv.cout += v;
              tv.tail = Isa::mask(static_cast<int>(cols));
              (cols < kLanes ? tile_for_rows<MR, 1, true, false>(mr) : tile_for_rows<MR, 1, false, false>(mr))(tv);
            }
          }
        }
      }
    }
  }

  static void parallel(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* out) {
    // Equal runs of whole vectors of columns per thread; a share should be worth a fork (>= ~64K multiply-adds).
    const int64_t vecs = (N + kLanes - 1) / kLanes;
    const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, K * M * kLanes));
    at::parallel_for(0, vecs, grain, [&](int64_t v0, int64_t v1) {
      run(x, M, K, w, N, out, v0 * kLanes, std::min(N, v1 * kLanes));
    });
  }
};

at::Tensor skinny_mm(const at::Tensor& x_in, const at::Tensor& w_in) {
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2, "skinny_mm: x [M, K] and w [K, N] must be 2-D");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w_in.scalar_type() == at::kFloat, "skinny_mm: fp32 only");
  TORCH_CHECK(x_in.device().is_cpu() && w_in.device().is_cpu(), "skinny_mm: CPU tensors only");
  TORCH_CHECK(x_in.size(1) == w_in.size(0), "skinny_mm: shapes ", x_in.sizes(), " and ", w_in.sizes(),
              " cannot be multiplied");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor w = w_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(1);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (M == 1)
    Plan<1, kPlan1>::parallel(xp, M, K, wp, N, op);
  else if (M == 2)
    Plan<2, kPlan2>::parallel(xp, M, K, wp, N, op);
  else if (M <= 4)
    Plan<4, kPlan4>::parallel(xp, M, K, wp, N, op);
  else
    Plan<kRowsBig, kVecsBig>::parallel(xp, M, K, wp, N, op);
  return out;
}

}  // namespace

void register_skinny_gemm(pybind11::module& m) {
  m.def("skinny_mm", &skinny_mm, "out = x @ w for few rows of x (fp32, w row-major [K, N])");
}
