// The non-matmul work of a Llama decoder layer in a few native calls: rms_norm, add_rms_norm (residual add fused
// with the next norm), silu_mul / gelu_tanh_mul, and attention (RoPE, KV-cache write, GQA attention over a prefix
// plus a tree of new tokens; optionally a sliding window, logit soft-capping and a custom query scale).
//
// exp: every exp here (softmax, SiLU) is exp8 below, a deterministic vector function: x clamped to [-104, 89]
// (NaN passes through), n = round-to-nearest(x * log2(e)), r = x - n*ln2_hi - n*ln2_lo (Cody-Waite, two fused
// multiply-adds), e^r by Cephes' degree-7 polynomial (expf's coefficients, Horner with fused multiply-adds), then
// two exact scalings by 2^(n>>1) and 2^(n - (n>>1)) so that results underflow to subnormals / overflow to inf
// correctly. Within ~2 ulp of the correctly rounded e^x (tests/test_layer_ops.py measures it).
//
// tanh (attention's softcap): tanh8 below, a deterministic vector function of |x| with x's sign copied back: for
// |x| < 0.625 Cephes' tanhf polynomial, x + x*(z*P(z)) with z = x*x (Horner with fused multiply-adds), else
// 1 - 2/(exp8(2|x|) + 1) (rounded sum, division, difference). NaN passes through, +-inf gives +-1.
// gelu_tanh_mul: gelu_tanh(g) * u with gelu_tanh(g) = 0.5*g*(1 + tanh(c*(g + 0.044715*g^3))), c = sqrt(2/pi),
// computed as the equal g / (1 + exp8(-2*c*(g + 0.044715*g*g*g))) (no cancellation for negative g), then * u.
//
// attention: order of operations. Everything below depends only on the query row, its position, and the
// sequence of keys/values it sees -- never on q, on the other rows, on where the prefix ends or on threads:
//   1. RoPE (serial): for every new token i and every q and k head, out[e] = x[e]*cos[pos][e] + rh[e]*sin[pos][e]
//      with rh = cat(-x[d/2:], x[:d/2]): two rounded products, one rounded sum (as torch computes it). The rotated
//      k and the raw v of token i go to slot w_i of k_cache / v_cache: w_i = write_slots[i] when given (each in
//      [start, capacity), distinct), else start+i.
//      Cache precision: the caches are both float32 or both float16. An fp16 cache stores the rotated k and the raw
//      v rounded to fp16 (round to nearest even, F16C), and every key and value steps 3a and 3d read is converted
//      back to fp32 (exact), so the arithmetic below is, bit for bit, that of an fp32 cache holding the rounded
//      values. The queries, scores, softmax and outputs stay fp32.
//   2. The keys row i sees form its list: slots 0..start-1 (the part every row sees), then start+j for every j with
//      visible[i][j], in ascending order (L_i entries). visible is [q, W]: with W = q and the default write slots
//      it is the tree mask over the new tokens; wider (W up to capacity - start) it also names slots after `start`
//      written earlier that only some rows see (a slot pool: threads of one sequence, each seeing the shared prefix
//      and its own slots). None = causal over the new tokens. The list is cut into chunks of kChunk (64)
//      consecutive list positions.
//      Sliding window (window > 0; 0 = none): a key at position k is in row i's window when
//      positions[i] - k < window -- transformers' convention (masking_utils.sliding_window_overlay: visible iff
//      kv_idx > q_idx - sliding_window), as Mistral, Phi-3 and Gemma 2/3's local layers use it. Key positions: a
//      prefix slot s < start holds position s (slot == position: the prefix must be stored in order, not as a ring
//      buffer), and the key of new token j written in this call has position positions[j]. A visible slot after
//      `start` that this call does not write (a slot pool's earlier slots) has no known position: refused when
//      window > 0. The window does not change the list nor its chunks: keys outside it are masked out of their
//      chunk (3b-3c), and a chunk with no key in the window is skipped altogether (it has no partials, step 4
//      leaves it out). So with a window, row i's arithmetic is that of the same row over the same list; when list
//      position == key position (the prefix in order, a row seeing its ancestors in a tree), it depends only on
//      the row, its position and the keys in its window.
//   3. Per (row i, head h, chunk c) with a key in the window (every chunk without a window):
//      a. score of list position t: acc = Σ over d in steps of one vector, ascending, fma(q, k, acc) (masked
//         tail), then the vector's lanes are summed by a fixed tree (fold to 8 lanes -- AVX-512 adds lane l and
//         l+8 -- then ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7))), then multiplied by scale (float: the `scale`
//         argument rounded to float when > 0, else 1/sqrt(d) computed in float). With softcap > 0 (Gemma 2's
//         logit soft-capping, 0 = none): s_t = softcap * tanh8(s_t / softcap) (a rounded division, tanh8, a
//         rounded product; softcap rounded to float). With a window, s_t = -inf for a key outside it.
//      b. m_c = max of the chunk's scores (exact, order-free).
//      c. p_t = exp8(s_t - m_c), and with a window p_t = 0 exactly where s_t = -inf; l_c = 8 lane sums (lane =
//         t mod 8, t ascending), reduced by the same 8-lane tree.
//      d. o_c[e] = Σ_t p_t * v_t[e], t ascending, one fma per term, starting from 0.
//   4. Per (row i, head h), over its ceil(L_i / 64) chunks in ascending order, leaving out those step 3 skipped
//      (no key in the window): M = max_c m_c; w_c = exp8(m_c - M); den = Σ_c w_c * l_c (rounded product, then
//      rounded sum, from 0); num[e] = Σ_c fma(w_c, o_c[e], num[e]) from 0; out[e] = num[e] / den. A row that sees
//      no key at all (none in its window) gets zeros.
// A chunk's members are fixed by list positions, so row i computed among q tokens and row i computed alone on a
// cache that holds its visible keys at slots 0..L_i-1 run exactly the same arithmetic: bitwise equal outputs.
// Work split: step 3 runs as tasks (kv head, chunk) over at::parallel_for; a task does every row's queries of the
// group, tiled (two queries x four keys, or one x eight) over the keys all rows share (list positions < start)
// and per row over its own new keys. Tiling and threading change neither the arithmetic of any (query, key)
// pair nor the order of any accumulation. Step 4 runs per (row, head) over at::parallel_for. Steps 3-4 run
// for blocks of 64 rows at a time (long prefills), which does not matter to any row either.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <tuple>
#include <utility>
#include <vector>

#include "isa.h"

at::Tensor ff_quant_mm(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t K);  // quant_gemm.cpp
at::Tensor ff_quant_rows(const at::Tensor& w, int64_t fmt, int64_t K, const at::Tensor& ids);  // quant_gemm.cpp

namespace {

using ff::Isa;
using ff::kLanes;
using ff::Reg;

// ---- 8-lane helpers (AVX2 + FMA are enabled in both builds) ---------------------------------------------------

inline __m256 exp8(__m256 x) {
  // max/min return their second operand when either is NaN: NaN propagates.
  x = _mm256_min_ps(_mm256_set1_ps(89.0f), _mm256_max_ps(_mm256_set1_ps(-104.0f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_cvtps_epi32(n);  // in [-150, 128]
  const __m256i n1 = _mm256_srai_epi32(ni, 1);
  const __m256i n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(y, s1), s2);
}

inline float exp1(float x) { return _mm256_cvtss_f32(exp8(_mm256_set1_ps(x))); }

#if defined(FF_ISA_AVX512) && !defined(FF_ISA_EMULATED)
// exp8's operations on 16 lanes at once (lane by lane the same IEEE operations, so the same results).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
  const __m512i ni = _mm512_cvtps_epi32(n);  // in [-150, 128]
  const __m512i n1 = _mm512_srai_epi32(ni, 1);
  const __m512i n2 = _mm512_sub_epi32(ni, n1);
  const __m512i bias = _mm512_set1_epi32(127);
  const __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, bias), 23));
  const __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, bias), 23));
  return _mm512_mul_ps(_mm512_mul_ps(y, s1), s2);
}
#endif

// tanh, lane by lane (see the header): Cephes' tanhf polynomial below |x| = 0.625, 1 - 2/(e^2|x| + 1) above, the
// sign of x copied back. Within a few ulp of tanh; NaN passes through, +-inf gives +-1.
inline __m256 tanh8(__m256 x) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 ax = _mm256_andnot_ps(sign, x);
  const __m256 z = _mm256_mul_ps(ax, ax);
  __m256 p = _mm256_set1_ps(-5.70498872745e-3f);
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.06390887954e-2f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-5.37397155531e-2f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.33314422036e-1f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-3.33332819422e-1f));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), ax, ax);
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 large = _mm256_sub_ps(
      one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(exp8(_mm256_add_ps(ax, ax)), one)));
  const __m256 r = _mm256_blendv_ps(large, small, _mm256_cmp_ps(ax, _mm256_set1_ps(0.625f), _CMP_LT_OQ));
  return _mm256_or_ps(r, _mm256_and_ps(sign, x));
}

// Gemma 2's attention logit soft-capping: cap * tanh(s / cap), cap > 0.
inline __m256 softcap8(__m256 s, __m256 cap) { return _mm256_mul_ps(tanh8(_mm256_div_ps(s, cap)), cap); }

// Lane j of the result: the 8 lanes of a[j] summed as ((0+1)+(2+3)) + ((4+5)+(6+7)). Lanes are independent.
inline __m256 reduce8(const __m256 a[8]) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The same tree for one vector.
inline float hsum8(__m256 v) {
  const __m256 t = _mm256_hadd_ps(v, v);
  const __m256 u = _mm256_hadd_ps(t, t);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
}

inline __m256 max8(__m256 a, __m256 b) { return _mm256_max_ps(a, b); }

inline __m256 first8(int n) {  // lanes < n all-ones
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

// A full-width vector folded to 8 lanes (AVX-512: lane l + lane l+8).
#if defined(FF_ISA_AVX512)
inline __m256 fold8(Reg a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
inline Reg vdiv(Reg a, Reg b) { return _mm512_div_ps(a, b); }
#else
inline __m256 fold8(Reg a) { return a; }
inline Reg vdiv(Reg a, Reg b) { return _mm256_div_ps(a, b); }
#endif

// ---- argument checks --------------------------------------------------------------------------------------------

void check_f32(const at::Tensor& t, const char* fn, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), fn, ": ", name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat, fn, ": ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, fn, ": ", name, " must be ", dim, "-D, got shape ", t.sizes());
}

// A KV cache: float32 or float16 (see "Cache precision" above).
void check_cache(const at::Tensor& t, const char* fn, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), fn, ": ", name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf, fn, ": ", name,
              " must be float32 or float16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, fn, ": ", name, " must be ", dim, "-D, got shape ", t.sizes());
}

// ---- rms_norm / add_rms_norm -----------------------------------------------------------------------------------

// y = w * (x * (1 / sqrt(mean(x^2) + eps))) per row; the sum of squares by one vector fma chain over ascending
// columns (masked tail), lanes by the fixed tree.
inline void rms_row(const float* x, const float* w, float* y, int64_t D, float eps) {
  const int64_t full = D / kLanes * kLanes;
  Reg acc = Isa::zero();
  for (int64_t e = 0; e < full; e += kLanes) {
    const Reg v = Isa::load(x + e);
    acc = Isa::fma(v, v, acc);
  }
  const int rest = static_cast<int>(D - full);
  if (rest) {
    const Reg v = Isa::load(x + full, Isa::mask(rest));
    acc = Isa::fma(v, v, acc);
  }
  const float mean = hsum8(fold8(acc)) / static_cast<float>(D);
  const float r = 1.0f / std::sqrt(mean + eps);
  const Reg vr = Isa::set1(r);
  for (int64_t e = 0; e < full; e += kLanes)
    Isa::store(y + e, Isa::mul(Isa::load(w + e), Isa::mul(Isa::load(x + e), vr)));
  if (rest) {
    const auto m = Isa::mask(rest);
    Isa::store(y + full, Isa::mul(Isa::load(w + full, m), Isa::mul(Isa::load(x + full, m), vr)), m);
  }
}

int64_t row_grain(int64_t D) { return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, D)); }

void check_norm(const at::Tensor& x, const at::Tensor& w, const char* fn) {
  check_f32(x, fn, "x", 2);
  check_f32(w, fn, "w", 1);
  TORCH_CHECK(w.size(0) == x.size(1), fn, ": w has ", w.size(0), " elements, x has ", x.size(1), " columns");
  TORCH_CHECK(x.size(1) > 0, fn, ": x has no columns");
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  check_norm(x_in, w_in, "rms_norm");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t Q = x.size(0), D = x.size(1);
  at::Tensor y = at::empty({Q, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, Q, row_grain(D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_row(xp + r * D, wp, yp + r * D, D, e);
  });
  return y;
}

at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& delta_in, const at::Tensor& w_in, double eps) {
  check_norm(x, w_in, "add_rms_norm");
  TORCH_CHECK(x.is_contiguous(), "add_rms_norm: x is updated in place and must be contiguous");
  check_f32(delta_in, "add_rms_norm", "delta", 2);
  TORCH_CHECK(delta_in.sizes() == x.sizes(), "add_rms_norm: delta has shape ", delta_in.sizes(), ", x has ",
              x.sizes());
  const at::Tensor delta = delta_in.contiguous(), w = w_in.contiguous();
  const int64_t Q = x.size(0), D = x.size(1);
  at::Tensor y = at::empty({Q, D}, x.options());
  float* xp = x.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const int64_t full = D / kLanes * kLanes;
  const int rest = static_cast<int>(D - full);
  at::parallel_for(0, Q, row_grain(D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* xr = xp + r * D;
      const float* dr = dp + r * D;
      for (int64_t c = 0; c < full; c += kLanes) Isa::store(xr + c, Isa::add(Isa::load(xr + c), Isa::load(dr + c)));
      if (rest) {
        const auto m = Isa::mask(rest);
        Isa::store(xr + full, Isa::add(Isa::load(xr + full, m), Isa::load(dr + full, m)), m);
      }
      rms_row(xr, wp, yp + r * D, D, e);
    }
  });
  return y;
}

// ---- silu_mul ----------------------------------------------------------------------------------------------------

// silu(g) * u with silu(g) = g / (1 + exp8(-g)), 8 lanes at a time, masked tail.
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 neg = _mm256_xor_ps(g, _mm256_set1_ps(-0.0f));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(neg))), u);
}

// act(gu[:, :I]) * gu[:, I:] for gu [q, 2I], 8 lanes at a time (``Mul8``: the vector function), masked tail.
template <__m256 (*Mul8)(__m256, __m256)>
at::Tensor gated_mul(const at::Tensor& gu_in, const char* fn) {
  check_f32(gu_in, fn, "gu", 2);
  TORCH_CHECK(gu_in.size(1) % 2 == 0, fn, ": gu must have an even number of columns [gate | up], got ",
              gu_in.size(1));
  const at::Tensor gu = gu_in.contiguous();
  const int64_t Q = gu.size(0), I = gu.size(1) / 2;
  at::Tensor out = at::empty({Q, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t full = I / 8 * 8;
  const int rest = static_cast<int>(I - full);
  at::parallel_for(0, Q, row_grain(I * 4), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = gp + r * 2 * I;
      const float* u = g + I;
      float* o = op + r * I;
      for (int64_t c = 0; c < full; c += 8)
        _mm256_storeu_ps(o + c, Mul8(_mm256_loadu_ps(g + c), _mm256_loadu_ps(u + c)));
      if (rest) {
        const __m256i m = _mm256_castps_si256(first8(rest));
        _mm256_maskstore_ps(o + full, m, Mul8(_mm256_maskload_ps(g + full, m), _mm256_maskload_ps(u + full, m)));
      }
    }
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gu) { return gated_mul<silu_mul8>(gu, "silu_mul"); }

// ---- gelu_tanh_mul ----------------------------------------------------------------------------------------------

// gelu_tanh(g) * u (transformers' gelu_pytorch_tanh, torch's gelu(approximate='tanh')), as
// g / (1 + exp8(-2 * sqrt(2/pi) * (g + 0.044715 * g*g*g))) * u: every product, sum and the division rounded.
inline __m256 gelu_tanh_mul8(__m256 g, __m256 u) {
  const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  const __m256 inner = _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(0.044715f), g3));
  const __m256 t = _mm256_mul_ps(_mm256_set1_ps(-2.0f * 0.7978845608028654f), inner);
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(t))), u);
}

at::Tensor gelu_tanh_mul(const at::Tensor& gu) { return gated_mul<gelu_tanh_mul8>(gu, "gelu_tanh_mul"); }

// ---- attention ---------------------------------------------------------------------------------------------------

constexpr int kChunk = 64;           // list positions per partial softmax (a multiple of 8)
constexpr int kStride = kChunk + 8;  // a score row, with room for a whole 8-wide store past its last key
constexpr int64_t kRowBlock = 64;   // rows per pass of steps 3-4

// Cache elements: float (an fp32 cache) or uint16_t (an fp16 cache's IEEE binary16 bits). The loops below are
// templated on the element type; only these accessors differ, and fp16 -> fp32 is exact, so a loop over an fp16
// cache does the arithmetic of the same loop over an fp32 cache holding the fp16 values.
constexpr int kToNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// A full vector of cache values at p, as fp32.
inline Reg load_kv(const float* p) { return Isa::load(p); }
inline Reg load_kv(const uint16_t* p) {
#if defined(FF_ISA_AVX512)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
}

// The first n (< kLanes, m = Isa::mask(n)) cache values at p, the other lanes zero; nothing past p + n is read.
// There are no masked 16-bit loads in AVX2 (nor in AVX-512F without BW): fp16 goes through a zeroed stack buffer.
inline Reg load_kv(const float* p, Isa::Mask m, int) { return Isa::load(p, m); }
inline Reg load_kv(const uint16_t* p, Isa::Mask, int n) {
  uint16_t buf[kLanes] = {};
  std::memcpy(buf, p, static_cast<size_t>(n) * sizeof(uint16_t));
  return load_kv(buf);
}

// Step 1's write of d fp32 values into a cache row: copied, or rounded to fp16 (nearest even).
inline void store_kv(const float* src, float* dst, int64_t d) { std::copy(src, src + d, dst); }
inline void store_kv(const float* src, uint16_t* dst, int64_t d) {
  int64_t e = 0;
  for (; e + 8 <= d; e += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + e), _mm256_cvtps_ph(_mm256_loadu_ps(src + e), kToNearest));
  for (; e < d; ++e) dst[e] = _cvtss_sh(src[e], kToNearest);
}

// The dot products of step 3a before scaling. All tile shapes run, for every (query, key) pair, the same
// arithmetic: one vector accumulator, fma over d ascending (masked tail), fold8, the reduce8 tree.
// Two queries x four keys: lanes [qa.k0 .. qa.k3, qb.k0 .. qb.k3].
template <int64_t DC, typename T>
inline __m256 dot_2x4(const float* qa, const float* qb, const T* const* k, int64_t d_) {
  const int64_t d = DC ? DC : d_;
  Reg acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = Isa::zero();
  const int64_t full = d / kLanes * kLanes;
  for (int64_t e = 0; e < full; e += kLanes) {
    const Reg a = Isa::load(qa + e), b = Isa::load(qb + e);
    for (int j = 0; j < 4; ++j) {
      const Reg kv = load_kv(k[j] + e);
      acc[j] = Isa::fma(a, kv, acc[j]);
      acc[4 + j] = Isa::fma(b, kv, acc[4 + j]);
    }
  }
  if (full < d) {
    const int rest = static_cast<int>(d - full);
    const auto m = Isa::mask(rest);
    const Reg a = Isa::load(qa + full, m), b = Isa::load(qb + full, m);
    for (int j = 0; j < 4; ++j) {
      const Reg kv = load_kv(k[j] + full, m, rest);
      acc[j] = Isa::fma(a, kv, acc[j]);
      acc[4 + j] = Isa::fma(b, kv, acc[4 + j]);
    }
  }
  __m256 f[8];
  for (int j = 0; j < 8; ++j) f[j] = fold8(acc[j]);
  return reduce8(f);
}

// One query x eight keys.
template <int64_t DC, typename T>
inline __m256 dot_1x8(const float* q, const T* const* k, int64_t d_) {
  const int64_t d = DC ? DC : d_;
  Reg acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = Isa::zero();
  const int64_t full = d / kLanes * kLanes;
  for (int64_t e = 0; e < full; e += kLanes) {
    const Reg qv = Isa::load(q + e);
    for (int j = 0; j < 8; ++j) acc[j] = Isa::fma(qv, load_kv(k[j] + e), acc[j]);
  }
  if (full < d) {
    const int rest = static_cast<int>(d - full);
    const auto m = Isa::mask(rest);
    const Reg qv = Isa::load(q + full, m);
    for (int j = 0; j < 8; ++j) acc[j] = Isa::fma(qv, load_kv(k[j] + full, m, rest), acc[j]);
  }
  __m256 f[8];
  for (int j = 0; j < 8; ++j) f[j] = fold8(acc[j]);
  return reduce8(f);
}

// Scaled (and, with softcap > 0, soft-capped) scores of queries qs[0..nq) against keys k[0..n) into
// S[j * kStride + off + t]. k must hold 8 valid pointers past n (padding; their scores land past the segment and
// are overwritten or ignored). DC: d known at compile time (0: at run time) -- the same operations, only the loops
// unrolled. Both tile shapes apply the same lane-wise scale and cap to every score.
template <int64_t DC, typename T>
inline void scores_t(const float* const* qs, int nq, const T* const* k, int n, int64_t d, float scale,
                     float softcap, float* S, int off) {
  const __m256 vs = _mm256_set1_ps(scale), vcap = _mm256_set1_ps(softcap);
  const bool capped = softcap > 0.0f;
  int j = 0;
  for (; j + 2 <= nq; j += 2) {
    float* sa = S + j * kStride + off;
    float* sb = sa + kStride;
    for (int t = 0; t < n; t += 4) {
      __m256 r = _mm256_mul_ps(dot_2x4<DC>(qs[j], qs[j + 1], k + t, d), vs);
      if (capped) r = softcap8(r, vcap);
      _mm_storeu_ps(sa + t, _mm256_castps256_ps128(r));
      _mm_storeu_ps(sb + t, _mm256_extractf128_ps(r, 1));
    }
  }
  if (j < nq) {
    float* sa = S + j * kStride + off;
    for (int t = 0; t < n; t += 8) {
      __m256 r = _mm256_mul_ps(dot_1x8<DC>(qs[j], k + t, d), vs);
      if (capped) r = softcap8(r, vcap);
      _mm256_storeu_ps(sa + t, r);
    }
  }
}

template <typename T>
inline void scores(const float* const* qs, int nq, const T* const* k, int n, int64_t d, float scale, float softcap,
                   float* S, int off) {
  if (d == 64)
    scores_t<64>(qs, nq, k, n, d, scale, softcap, S, off);
  else if (d == 128)
    scores_t<128>(qs, nq, k, n, d, scale, softcap, S, off);
  else
    scores_t<0>(qs, nq, k, n, d, scale, softcap, S, off);
}

// ---- many queries over the keys every row shares ----------------------------------------------------------------
//
// A task with many queries (several rows, each with its group of heads) over the keys every row shares: the keys and
// values are widened to fp32 once for all of them (exactly), and four queries share each key and value load. Every
// (query, key) pair keeps scores()' arithmetic (one accumulator, fma over d ascending, fold8, reduce8, scale, cap)
// and every output pv_queries' (fma over t ascending from zero), so the results are bitwise those of the narrow
// path; only the loads and the registers they land in change.
// Queries in a task from which the shared keys and values are widened once. Below it the widening costs more than
// it saves (Zen 4, 300 / 1,000 cached tokens, 3 queries a key head: 2 rows 20.2 / 56.0 us a layer wide against
// 17.7 / 47.0 narrow, 3 rows 26.3 / 73.2 against 25.9 / 69.5; from 4 rows on both the same, from 8 wide wins).
constexpr int kWideQueries = 12;

template <typename T>
inline void widen_rows(const T* src, int n, int64_t d, float* dst) {  // dst[t * d + e] = fp32 of src[t * d + e]
  if constexpr (std::is_same<T, float>::value) {
    std::memcpy(dst, src, sizeof(float) * n * d);
  } else {
    int64_t i = 0;
    for (; i + kLanes <= n * d; i += kLanes) Isa::store(dst + i, load_kv(src + i));
    for (; i < n * d; ++i) dst[i] = _cvtsh_ss(src[i]);
  }
}

// Four queries x four keys (fp32 rows): lanes [qa.k0..qa.k3, qb.k0..qb.k3] of ra and the same for qc, qd in rc.
template <int64_t DC>
inline void dot_4x4(const float* const* q, const float* const* k, int64_t d_, __m256& ra, __m256& rc) {
  const int64_t d = DC ? DC : d_;
  Reg acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = Isa::zero();
  const int64_t full = d / kLanes * kLanes;
#pragma GCC unroll 8
  for (int64_t e = 0; e < full; e += kLanes) {
    const Reg a = Isa::load(q[0] + e), b = Isa::load(q[1] + e), c = Isa::load(q[2] + e), dd = Isa::load(q[3] + e);
    for (int j = 0; j < 4; ++j) {
      const Reg kv = Isa::load(k[j] + e);
      acc[j] = Isa::fma(a, kv, acc[j]);
      acc[4 + j] = Isa::fma(b, kv, acc[4 + j]);
      acc[8 + j] = Isa::fma(c, kv, acc[8 + j]);
      acc[12 + j] = Isa::fma(dd, kv, acc[12 + j]);
    }
  }
  if (full < d) {
    const auto m = Isa::mask(static_cast<int>(d - full));
    const Reg a = Isa::load(q[0] + full, m), b = Isa::load(q[1] + full, m), c = Isa::load(q[2] + full, m),
              dd = Isa::load(q[3] + full, m);
    for (int j = 0; j < 4; ++j) {
      const Reg kv = Isa::load(k[j] + full, m);
      acc[j] = Isa::fma(a, kv, acc[j]);
      acc[4 + j] = Isa::fma(b, kv, acc[4 + j]);
      acc[8 + j] = Isa::fma(c, kv, acc[8 + j]);
      acc[12 + j] = Isa::fma(dd, kv, acc[12 + j]);
    }
  }
  __m256 f[8];
  for (int j = 0; j < 8; ++j) f[j] = fold8(acc[j]);
  ra = reduce8(f);
  for (int j = 0; j < 8; ++j) f[j] = fold8(acc[8 + j]);
  rc = reduce8(f);
}

// scores() for queries qs[0..nq) against n fp32 key rows k (k[t] = kf + t * d, 8 valid pointers past n): four
// queries at a time, the rest through scores_t.
template <int64_t DC>
inline void scores_wide_t(const float* const* qs, int nq, const float* const* k, int n, int64_t d, float scale,
                          float softcap, float* S) {
  const __m256 vs = _mm256_set1_ps(scale), vcap = _mm256_set1_ps(softcap);
  const bool capped = softcap > 0.0f;
  int j = 0;
  for (; j + 4 <= nq; j += 4) {
    float* s0 = S + j * kStride;
    for (int t = 0; t < n; t += 4) {
      __m256 ra, rc;
      dot_4x4<DC>(qs + j, k + t, d, ra, rc);
      ra = _mm256_mul_ps(ra, vs);
      rc = _mm256_mul_ps(rc, vs);
      if (capped) {
        ra = softcap8(ra, vcap);
        rc = softcap8(rc, vcap);
      }
      _mm_storeu_ps(s0 + t, _mm256_castps256_ps128(ra));
      _mm_storeu_ps(s0 + kStride + t, _mm256_extractf128_ps(ra, 1));
      _mm_storeu_ps(s0 + 2 * kStride + t, _mm256_castps256_ps128(rc));
      _mm_storeu_ps(s0 + 3 * kStride + t, _mm256_extractf128_ps(rc, 1));
    }
  }
  if (j < nq) scores_t<DC>(qs + j, nq - j, k, n, d, scale, softcap, S + j * kStride, 0);
}

inline void scores_wide(const float* const* qs, int nq, const float* const* k, int n, int64_t d, float scale,
                        float softcap, float* S) {
  if (d == 64)
    scores_wide_t<64>(qs, nq, k, n, d, scale, softcap, S);
  else if (d == 128)
    scores_wide_t<128>(qs, nq, k, n, d, scale, softcap, S);
  else
    scores_wide_t<0>(qs, nq, k, n, d, scale, softcap, S);
}

// Steps 3b-3c on one score row of n entries: p in place, returns m and l. Masked (a window): p = 0 exactly where
// s = -inf (a key outside the window; exp8 alone would give e^-104 there).
template <bool Masked>
inline void softmax_row(float* s, int n, float* m_out, float* l_out) {
  const int full = n / 8 * 8, rest = n - full;
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 tail = first8(rest);
  __m256 mx = ninf;
  for (int b = 0; b < full; b += 8) mx = max8(mx, _mm256_loadu_ps(s + b));
  if (rest) mx = max8(mx, _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + full), tail));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  float m = lanes[0];
  for (int j = 1; j < 8; ++j) m = std::max(m, lanes[j]);
  const __m256 vm = _mm256_set1_ps(m);
  __m256 lsum = _mm256_setzero_ps();
  int b0 = 0;
#if defined(FF_ISA_AVX512) && !defined(FF_ISA_EMULATED)
  // Sixteen at a time: exp16 is exp8 lane by lane, and the two halves go into lsum in t order.
  const __m512 vm16 = _mm512_set1_ps(m);
  for (; b0 + 16 <= full; b0 += 16) {
    const __m512 x = _mm512_loadu_ps(s + b0);
    __m512 p = exp16(_mm512_sub_ps(x, vm16));
    if (Masked)
      p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                                 _CMP_NEQ_UQ), p);
    _mm512_storeu_ps(s + b0, p);
    lsum = _mm256_add_ps(lsum, _mm512_castps512_ps256(p));
    lsum = _mm256_add_ps(lsum, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1)));
  }
#endif
  for (int b = b0; b < full; b += 8) {
    const __m256 x = _mm256_loadu_ps(s + b);
    __m256 p = exp8(_mm256_sub_ps(x, vm));
    if (Masked) p = _mm256_and_ps(p, _mm256_cmp_ps(x, ninf, _CMP_NEQ_UQ));
    _mm256_storeu_ps(s + b, p);
    lsum = _mm256_add_ps(lsum, p);
  }
  if (rest) {
    const __m256 x = _mm256_loadu_ps(s + full);
    __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(x, vm)), tail);
    if (Masked) p = _mm256_and_ps(p, _mm256_cmp_ps(x, ninf, _CMP_NEQ_UQ));
    _mm256_storeu_ps(s + full, p);
    lsum = _mm256_add_ps(lsum, p);
  }
  *m_out = m;
  *l_out = hsum8(lsum);
}

// Step 3d for two queries: o[e] = fma(p[t], v[t][e], o[e]) over t ascending, from 0 (init) or from o's values,
// for the NR vectors at e0.
template <int NR, typename T>
inline void pv_2(const float* pa, const float* pb, const T* const* v, int n, int64_t e0, float* oa, float* ob,
                 bool init) {
  Reg a[NR], b[NR];
  for (int r = 0; r < NR; ++r) {
    a[r] = init ? Isa::zero() : Isa::load(oa + e0 + r * kLanes);
    b[r] = init ? Isa::zero() : Isa::load(ob + e0 + r * kLanes);
  }
  for (int t = 0; t < n; ++t) {
    const Reg wa = Isa::bcast(pa + t), wb = Isa::bcast(pb + t);
    const T* vt = v[t] + e0;
    for (int r = 0; r < NR; ++r) {
      const Reg vv = load_kv(vt + r * kLanes);
      a[r] = Isa::fma(wa, vv, a[r]);
      b[r] = Isa::fma(wb, vv, b[r]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    Isa::store(oa + e0 + r * kLanes, a[r]);
    Isa::store(ob + e0 + r * kLanes, b[r]);
  }
}

template <int NR, typename T>
inline void pv_1(const float* p, const T* const* v, int n, int64_t e0, float* o, bool init) {
  Reg a[NR];
  for (int r = 0; r < NR; ++r) a[r] = init ? Isa::zero() : Isa::load(o + e0 + r * kLanes);
  for (int t = 0; t < n; ++t) {
    const Reg w = Isa::bcast(p + t);
    const T* vt = v[t] + e0;
    for (int r = 0; r < NR; ++r) a[r] = Isa::fma(w, load_kv(vt + r * kLanes), a[r]);
  }
  for (int r = 0; r < NR; ++r) Isa::store(o + e0 + r * kLanes, a[r]);
}

// The masked last partial vector of d (d % kLanes != 0), one query.
template <typename T>
inline void pv_tail(const float* p, const T* const* v, int n, int64_t e0, int rest, float* o, bool init) {
  const auto m = Isa::mask(rest);
  Reg a = init ? Isa::zero() : Isa::load(o + e0, m);
  for (int t = 0; t < n; ++t) a = Isa::fma(Isa::bcast(p + t), load_kv(v[t] + e0, m, rest), a);
  Isa::store(o + e0, a, m);
}

// Step 3d for queries j < nq with probabilities ps[j][0..n) and outputs os[j][0..d).
template <typename T>
inline void pv_queries(const float* const* ps, float* const* os, int nq, const T* const* v, int n, int64_t d,
                       bool init) {
  const int64_t full = d / kLanes * kLanes;
  const int rest = static_cast<int>(d - full);
  int j = 0;
  for (; j + 2 <= nq; j += 2) {
    int64_t e = 0;
    for (; e + 4 * kLanes <= full; e += 4 * kLanes) pv_2<4>(ps[j], ps[j + 1], v, n, e, os[j], os[j + 1], init);
    if (e + 2 * kLanes <= full) { pv_2<2>(ps[j], ps[j + 1], v, n, e, os[j], os[j + 1], init); e += 2 * kLanes; }
    if (e + kLanes <= full) { pv_2<1>(ps[j], ps[j + 1], v, n, e, os[j], os[j + 1], init); e += kLanes; }
    if (rest) {
      pv_tail(ps[j], v, n, full, rest, os[j], init);
      pv_tail(ps[j + 1], v, n, full, rest, os[j + 1], init);
    }
  }
  if (j < nq) {
    int64_t e = 0;
    for (; e + 8 * kLanes <= full; e += 8 * kLanes) pv_1<8>(ps[j], v, n, e, os[j], init);
    if (e + 4 * kLanes <= full) { pv_1<4>(ps[j], v, n, e, os[j], init); e += 4 * kLanes; }
    if (e + 2 * kLanes <= full) { pv_1<2>(ps[j], v, n, e, os[j], init); e += 2 * kLanes; }
    if (e + kLanes <= full) { pv_1<1>(ps[j], v, n, e, os[j], init); e += kLanes; }
    if (rest) pv_tail(ps[j], v, n, full, rest, os[j], init);
  }
}

// pv_queries (init) for four queries at a time over n fp32 value rows: every output element the same fma chain over t
// ascending from zero, four queries sharing each value load.
template <int NR>
inline void pv_4(const float* const* p, const float* const* v, int n, int64_t e0, float* const* o) {
  Reg a[4][NR];
  for (int q = 0; q < 4; ++q)
    for (int r = 0; r < NR; ++r) a[q][r] = Isa::zero();
  for (int t = 0; t < n; ++t) {
    const float* vt = v[t] + e0;
    const Reg w0 = Isa::bcast(p[0] + t), w1 = Isa::bcast(p[1] + t), w2 = Isa::bcast(p[2] + t),
              w3 = Isa::bcast(p[3] + t);
    for (int r = 0; r < NR; ++r) {
      const Reg vv = Isa::load(vt + r * kLanes);
      a[0][r] = Isa::fma(w0, vv, a[0][r]);
      a[1][r] = Isa::fma(w1, vv, a[1][r]);
      a[2][r] = Isa::fma(w2, vv, a[2][r]);
      a[3][r] = Isa::fma(w3, vv, a[3][r]);
    }
  }
  for (int q = 0; q < 4; ++q)
    for (int r = 0; r < NR; ++r) Isa::store(o[q] + e0 + r * kLanes, a[q][r]);
}

inline void pv_wide(const float* const* ps, float* const* os, int nq, const float* const* v, int n, int64_t d) {
  const int64_t full = d / kLanes * kLanes;
  const int rest = static_cast<int>(d - full);
  int j = 0;
  for (; j + 4 <= nq; j += 4) {
    int64_t e = 0;
    for (; e + 4 * kLanes <= full; e += 4 * kLanes) pv_4<4>(ps + j, v, n, e, os + j);
    if (e + 2 * kLanes <= full) { pv_4<2>(ps + j, v, n, e, os + j); e += 2 * kLanes; }
    if (e + kLanes <= full) { pv_4<1>(ps + j, v, n, e, os + j); e += kLanes; }
    if (rest)
      for (int q = 0; q < 4; ++q) pv_tail(ps[j + q], v, n, full, rest, os[j + q], true);
  }
  if (j < nq) pv_queries(ps + j, os + j, nq - j, v, n, d, true);
}

// Step 4 for one (row, head): nc >= 1 chunks' partials -> out[d] (out doubles as the accumulator). present (a
// window; nullptr: every chunk): the chunks to combine, at least one; the others have no partials.
inline void combine(const float* m, const float* l, const float* o, int64_t nc, int64_t d, float* out,
                    const uint8_t* present) {
  int64_t c0 = 0;
  if (present)
    while (!present[c0]) ++c0;
  float M = m[c0];
  for (int64_t c = c0 + 1; c < nc; ++c)
    if (!present || present[c]) M = std::max(M, m[c]);
  const int64_t full = d / kLanes * kLanes;
  const int rest = static_cast<int>(d - full);
  std::fill(out, out + d, 0.0f);
  float den = 0.0f;
  for (int64_t c = c0; c < nc; ++c) {
    if (present && !present[c]) continue;
    const float w = exp1(m[c] - M);
    const float t = w * l[c];
    den = den + t;
    const Reg vw = Isa::set1(w);
    const float* oc = o + c * d;
    for (int64_t e = 0; e < full; e += kLanes) Isa::store(out + e, Isa::fma(vw, Isa::load(oc + e), Isa::load(out + e)));
    if (rest) {
      const auto mk = Isa::mask(rest);
      Isa::store(out + full, Isa::fma(vw, Isa::load(oc + full, mk), Isa::load(out + full, mk)), mk);
    }
  }
  const Reg vden = Isa::set1(den);
  for (int64_t e = 0; e < full; e += kLanes) Isa::store(out + e, vdiv(Isa::load(out + e), vden));
  if (rest) {
    const auto mk = Isa::mask(rest);
    Isa::store(out + full, vdiv(Isa::load(out + full, mk), vden), mk);
  }
}

// The sliding window of a call (window > 0), per row and per visible column; see the header.
struct Window {
  int64_t window = 0;                   // 0: none (the other fields unused)
  const int64_t* lo = nullptr;          // per row: the lowest key position in its window, positions[i] - window + 1
  const int64_t* col_pos = nullptr;     // per visible column j: the position of slot start+j's key
  const int64_t* chunk_base = nullptr;  // per row: where its chunks' flags begin in `present`
  const uint8_t* present = nullptr;     // per (row, chunk): the chunk has a key in the row's window
  const int64_t* first = nullptr;       // per row: its first such chunk, -1 for none
};

// Steps 3 and 4 for rows [i0, i1): rotated queries qr [Q, nh, d], the caches (T: float or fp16 bits) already
// written; out [Q, nh * d].
template <typename T>
void attend_rows(const float* qr, const T* kc, const T* vc, int64_t cap, int64_t d, int64_t nh, int64_t nkv,
                 int64_t start, const int64_t* vis_off, const int64_t* vis_idx, int64_t i0, int64_t i1, float scale,
                 float softcap, const Window& win, float* op) {
  const int64_t G = nh / nkv, Q = i1 - i0;
  const bool windowed = win.window > 0;
  // Step 3: partials per (row, head, chunk); tasks are (kv head, chunk), each doing all rows and the group's heads.
  int64_t max_len = 0, work = 0;
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t len = start + vis_off[i + 1] - vis_off[i];
    max_len = std::max(max_len, len);
    work += len;
  }
  const int64_t NC = (max_len + kChunk - 1) / kChunk;
  // Chunks below c_lo have no key in any row's window (only with a window): neither tasks nor partials.
  int64_t c_lo = 0;
  if (windowed) {
    c_lo = NC;
    for (int64_t i = i0; i < i1; ++i)
      if (win.first[i] >= 0) c_lo = std::min(c_lo, win.first[i]);
  }
  if (NC - c_lo <= 0) {
    std::fill(op + i0 * nh * d, op + i1 * nh * d, 0.0f);
    return;
  }
  const int64_t NCw = NC - c_lo;  // chunks c_lo .. NC-1, partials indexed by c - c_lo
  // Partials (m, l, o) per (row - i0, head, chunk); uninitialised, only chunks a row has are written and read.
  std::unique_ptr<float[]> pm(new float[Q * nh * NCw]), pl(new float[Q * nh * NCw]),
      po(new float[Q * nh * NCw * d]);
  const int64_t tasks = nkv * NCw;
  // Under ~100k multiply-adds a fork costs more than it saves (the split never changes the results).
  const int64_t grain = work * nh * d < (int64_t{1} << 17) ? tasks : 1;
  at::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
    // Per task: the chunk's keys are the same for every row up to `start` (the shared part: slots p0.. in
    // order, so every row's queries are tiled together there) and the row's own visible new tokens after.
    // Tiling never changes the per-(query, key) arithmetic, nor the t-order of any accumulation.
    thread_local std::vector<float> S;
    thread_local std::vector<const float*> qs, ps;
    thread_local std::vector<const T*> rk, rv;
    thread_local std::vector<float*> os;
    thread_local std::vector<int64_t> rows;
    thread_local std::vector<int> rn;
    thread_local std::vector<float> kf, vf;  // the shared keys and values widened to fp32 (wide tasks)
    const T* sk[kChunk + 8];
    const T* sv[kChunk + 8];
    const float* skf[kChunk + 8];
    const float* svf[kChunk + 8];
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t g = task / NCw, c = c_lo + task % NCw, cw = c - c_lo, p0 = c * kChunk;
      const T* kg = kc + g * cap * d;
      const T* vg = vc + g * cap * d;
      rows.clear();
      rn.clear();
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t len = start + vis_off[i + 1] - vis_off[i];
        if (len > p0 && (!windowed || win.present[win.chunk_base[i] + c])) {
          rows.push_back(i);
          rn.push_back(static_cast<int>(std::min<int64_t>(kChunk, len - p0)));
        }
      }
      const int nr = static_cast<int>(rows.size()), nq = nr * static_cast<int>(G);
      if (nq == 0) continue;
      if (static_cast<int>(S.size()) < nq * kStride) S.resize(static_cast<size_t>(nq) * kStride);
      qs.resize(nq);
      ps.resize(nq);
      os.resize(nq);
      rk.resize(static_cast<size_t>(nr) * (kChunk + 8));
      rv.resize(rk.size());
      for (int a = 0; a < nr; ++a)
        for (int64_t hh = 0; hh < G; ++hh) {
          const int64_t h = g * G + hh, r = (rows[a] - i0) * nh + h;
          const int j = a * static_cast<int>(G) + static_cast<int>(hh);
          qs[j] = qr + (rows[a] * nh + h) * d;
          ps[j] = S.data() + static_cast<int64_t>(j) * kStride;
          os[j] = po.get() + (r * NCw + cw) * d;
        }
      const int nsh = static_cast<int>(std::clamp<int64_t>(start - p0, 0, kChunk));
      // Many queries over the shared keys: keys and values widened to fp32 once for all of them (scores_wide,
      // pv_wide: bitwise the narrow path's results).
      const bool wide = nsh > 0 && nq >= kWideQueries;
      if (wide) {
        if (static_cast<int64_t>(kf.size()) < d * kChunk) {
          kf.resize(static_cast<size_t>(d * kChunk));
          vf.resize(static_cast<size_t>(d * kChunk));
        }
        widen_rows(kg + p0 * d, nsh, d, kf.data());
        widen_rows(vg + p0 * d, nsh, d, vf.data());
        for (int t = 0; t < nsh + 8; ++t) {
          skf[t] = kf.data() + std::min(t, nsh - 1) * d;
          svf[t] = vf.data() + std::min(t, nsh - 1) * d;
        }
        scores_wide(qs.data(), nq, skf, nsh, d, scale, softcap, S.data());
      } else if (nsh > 0) {
        for (int t = 0; t < nsh + 8; ++t) {
          const int64_t slot = p0 + std::min(t, nsh - 1);
          sk[t] = kg + slot * d;
          sv[t] = vg + slot * d;
        }
        scores(qs.data(), nq, sk, nsh, d, scale, softcap, S.data(), 0);
      }
      for (int a = 0; a < nr; ++a) {
        const int n_own = rn[a] - nsh;
        if (n_own <= 0) continue;
        const T** k = rk.data() + static_cast<size_t>(a) * (kChunk + 8);
        const T** v = rv.data() + static_cast<size_t>(a) * (kChunk + 8);
        const int64_t* idx = vis_idx + vis_off[rows[a]] + (p0 + nsh - start);
        for (int t = 0; t < n_own + 8; ++t) {
          const int64_t slot = start + idx[std::min(t, n_own - 1)];
          k[t] = kg + slot * d;
          v[t] = vg + slot * d;
        }
        scores(qs.data() + a * G, static_cast<int>(G), k, n_own, d, scale, softcap, S.data() + a * G * kStride,
               nsh);
      }
      if (windowed) {  // keys outside a row's window: score -inf (the chunk has at least one inside)
        constexpr float ninf = -std::numeric_limits<float>::infinity();
        for (int a = 0; a < nr; ++a) {
          const int64_t lo = win.lo[rows[a]];
          const int cut = static_cast<int>(std::clamp<int64_t>(lo - p0, 0, nsh));  // shared slots p0.. below lo
          const int n_own = rn[a] - nsh;
          const int64_t* idx = n_own > 0 ? vis_idx + vis_off[rows[a]] + (p0 + nsh - start) : nullptr;
          for (int64_t hh = 0; hh < G; ++hh) {
            float* srow = S.data() + (a * G + hh) * kStride;
            std::fill(srow, srow + cut, ninf);
            for (int t = 0; t < n_own; ++t)
              if (win.col_pos[idx[t]] < lo) srow[nsh + t] = ninf;
          }
        }
      }
      for (int a = 0; a < nr; ++a)
        for (int64_t hh = 0; hh < G; ++hh) {
          const int j = a * static_cast<int>(G) + static_cast<int>(hh);
          const int64_t r = ((rows[a] - i0) * nh + g * G + hh) * NCw + cw;
          float* srow = S.data() + static_cast<int64_t>(j) * kStride;
          if (windowed)
            softmax_row<true>(srow, rn[a], &pm[r], &pl[r]);
          else
            softmax_row<false>(srow, rn[a], &pm[r], &pl[r]);
        }
      if (wide)
        pv_wide(ps.data(), os.data(), nq, svf, nsh, d);
      else if (nsh > 0)
        pv_queries(ps.data(), os.data(), nq, sv, nsh, d, true);
      for (int a = 0; a < nr; ++a) {
        const int n_own = rn[a] - nsh;
        if (n_own <= 0) continue;
        const float* pa[64];
        const int gq = static_cast<int>(G);
        for (int hh = 0; hh < gq; hh += 64) {
          const int cnt = std::min(64, gq - hh);
          for (int u = 0; u < cnt; ++u) pa[u] = ps[a * gq + hh + u] + nsh;
          pv_queries(pa, os.data() + a * gq + hh, cnt, rv.data() + static_cast<size_t>(a) * (kChunk + 8), n_own, d,
                     nsh == 0);
        }
      }
    }
  });

  // Step 4: combine the chunks of every (row, head).
  const int64_t grain2 = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, NCw * d));
  at::parallel_for(0, Q * nh, grain2, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t i = i0 + r / nh, h = r % nh;
      const int64_t len = start + vis_off[i + 1] - vis_off[i];
      const int64_t nc = (len + kChunk - 1) / kChunk;  // the row's chunks; c_lo <= its first with a window
      float* o = op + i * nh * d + h * d;
      if (nc == 0 || (windowed && win.first[i] < 0)) {
        std::fill(o, o + d, 0.0f);
        continue;
      }
      combine(&pm[r * NCw], &pl[r * NCw], &po[r * NCw * d], nc - c_lo, d, o,
              windowed ? win.present + win.chunk_base[i] + c_lo : nullptr);
    }
  });
}

at::Tensor attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& positions_in, at::Tensor& k_cache, at::Tensor& v_cache, int64_t start,
                     const std::optional<at::Tensor>& visible_in, int64_t n_heads, int64_t n_kv_heads,
                     const std::optional<at::Tensor>& write_slots_in, int64_t window, double softcap,
                     double scale_in) {
  const char* fn = "attention";
  TORCH_CHECK(window >= 0, fn, ": window must be >= 0 (0 = no sliding window), got ", window);
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0.0, fn,
              ": softcap must be finite and >= 0 (0 = no soft-capping), got ", softcap);
  TORCH_CHECK(std::isfinite(scale_in) && scale_in >= 0.0, fn,
              ": scale must be finite and >= 0 (0 = 1/sqrt(head_dim)), got ", scale_in);
  TORCH_CHECK(softcap == 0.0 || static_cast<float>(softcap) > 0.0f, fn, ": softcap ", softcap,
              " is 0 in float32");
  TORCH_CHECK(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0, fn,
              ": n_heads must be a positive multiple of n_kv_heads, got n_heads=", n_heads,
              " n_kv_heads=", n_kv_heads);
  check_cache(k_cache, fn, "k_cache", 3);
  check_cache(v_cache, fn, "v_cache", 3);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), fn, ": k_cache ", k_cache.sizes(), " and v_cache ",
              v_cache.sizes(), " differ in shape");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), fn, ": k_cache (", k_cache.scalar_type(),
              ") and v_cache (", v_cache.scalar_type(), ") differ in dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), fn,
              ": k_cache and v_cache are written in place and must be contiguous [n_kv_heads, capacity, head_dim]");
  TORCH_CHECK(!k_cache.is_same(v_cache), fn, ": k_cache and v_cache are the same tensor");
  const int64_t nh = n_heads, nkv = n_kv_heads;
  TORCH_CHECK(k_cache.size(0) == nkv, fn, ": k_cache has ", k_cache.size(0), " heads, n_kv_heads is ", nkv);
  const int64_t cap = k_cache.size(1), d = k_cache.size(2);
  TORCH_CHECK(d > 0 && d % 2 == 0, fn, ": head_dim (k_cache.size(2)) must be even and positive, got ", d);
  check_f32(qkv, fn, "qkv", 2);
  TORCH_CHECK(qkv.is_contiguous(), fn, ": qkv must be contiguous");
  TORCH_CHECK(qkv.size(1) == (nh + 2 * nkv) * d, fn, ": qkv has ", qkv.size(1),
              " columns, expected (n_heads + 2 * n_kv_heads) * head_dim = ", (nh + 2 * nkv) * d);
  const int64_t Q = qkv.size(0);
  check_f32(cos, fn, "cos", 2);
  check_f32(sin, fn, "sin", 2);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), fn, ": cos and sin must be contiguous");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(1) == d, fn, ": cos ", cos.sizes(), " and sin ", sin.sizes(),
              " must both be [max_positions, head_dim=", d, "]");
  TORCH_CHECK(positions_in.device().is_cpu() && positions_in.scalar_type() == at::kLong && positions_in.dim() == 1 &&
                  positions_in.size(0) == Q,
              fn, ": positions must be a 1-D int64 CPU tensor of ", Q, " entries, got ", positions_in.scalar_type(),
              " of shape ", positions_in.sizes());
  const at::Tensor positions = positions_in.contiguous();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t P = cos.size(0);
  for (int64_t i = 0; i < Q; ++i)
    TORCH_CHECK(pos[i] >= 0 && pos[i] < P, fn, ": position ", pos[i], " outside the RoPE tables [0, ", P, ")");
  // Where each new token's key and value go: write_slots, else start + i.
  std::vector<int64_t> wslot(Q);
  if (write_slots_in.has_value() && write_slots_in->defined()) {
    const at::Tensor& ws = *write_slots_in;
    TORCH_CHECK(ws.device().is_cpu() && ws.scalar_type() == at::kLong && ws.dim() == 1 && ws.size(0) == Q, fn,
                ": write_slots must be a 1-D int64 CPU tensor of ", Q, " entries, got ", ws.scalar_type(),
                " of shape ", ws.sizes());
    const at::Tensor wc = ws.contiguous();
    const int64_t* wp = wc.data_ptr<int64_t>();
    std::vector<bool> used(static_cast<size_t>(cap > start ? cap - start : 0), false);
    for (int64_t i = 0; i < Q; ++i) {
      TORCH_CHECK(start >= 0 && wp[i] >= start && wp[i] < cap, fn, ": write slot ", wp[i], " is outside [start=",
                  start, ", capacity=", cap, ")");
      TORCH_CHECK(!used[wp[i] - start], fn, ": write slot ", wp[i], " is given twice");
      used[wp[i] - start] = true;
      wslot[i] = wp[i];
    }
  } else {
    TORCH_CHECK(start >= 0 && start + Q <= cap, fn, ": slots [", start, ", ", start + Q,
                ") do not fit a cache of capacity ", cap);
    for (int64_t i = 0; i < Q; ++i) wslot[i] = start + i;
  }
  at::Tensor visible;
  int64_t W = Q;  // visible's columns: slots start .. start + W - 1
  if (visible_in.has_value() && visible_in->defined()) {
    const at::Tensor& vis = *visible_in;
    TORCH_CHECK(vis.device().is_cpu() && vis.scalar_type() == at::kBool && vis.dim() == 2 && vis.size(0) == Q &&
                    vis.size(1) >= 1 && start + vis.size(1) <= cap,
                fn, ": visible must be a bool CPU tensor [q, W] with q = ", Q, " and start + W <= capacity (",
                cap, "), got ", vis.scalar_type(), " of shape ", vis.sizes());
    visible = vis.contiguous();
    W = vis.size(1);
  } else {
    for (int64_t i = 0; i < Q; ++i)
      TORCH_CHECK(wslot[i] == start + i, fn, ": with write_slots, give visible (causal needs the default slots)");
  }
  at::Tensor out = at::empty({Q, nh * d}, qkv.options());
  if (Q == 0) return out;

  // The new part of each row's list (step 2): vis_idx[vis_off[i] .. vis_off[i+1]) = the j it sees, ascending.
  std::vector<int64_t> vis_off(Q + 1, 0), vis_idx;
  vis_idx.reserve(visible.defined() ? Q * 4 : Q * (Q + 1) / 2);
  const bool* vp = visible.defined() ? visible.data_ptr<bool>() : nullptr;
  for (int64_t i = 0; i < Q; ++i) {
    for (int64_t j = 0; j < W; ++j)
      if (vp ? vp[i * W + j] : j <= i) vis_idx.push_back(j);
    vis_off[i + 1] = static_cast<int64_t>(vis_idx.size());
  }

  // Step 1: RoPE; k and v into the cache, rotated queries into qr [Q, nh, d].
  const float* x = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  std::unique_ptr<float[]> qr(new float[Q * nh * d]);  // uninitialised: every element is written
  std::unique_ptr<float[]> kr(new float[d]);           // one rotated key, before it is stored
  const int64_t half = d / 2, width = (nh + 2 * nkv) * d;
  auto rope = [&](const float* src, const float* c, const float* s, float* dst) {
    for (int64_t e = 0; e < half; ++e) {
      const float a = src[e] * c[e];
      const float b = -src[e + half] * s[e];
      dst[e] = a + b;
    }
    for (int64_t e = half; e < d; ++e) {
      const float a = src[e] * c[e];
      const float b = src[e - half] * s[e];
      dst[e] = a + b;
    }
  };
  const float scale = scale_in > 0.0 ? static_cast<float>(scale_in) : 1.0f / std::sqrt(static_cast<float>(d));
  const float cap_f = static_cast<float>(softcap);

  // The sliding window (step 2): per row the lowest key position it sees, per visible column its key's position,
  // per (row, chunk) whether the chunk has a key in the window.
  Window win;
  std::vector<int64_t> lo, col_pos, chunk_base, first;
  std::vector<uint8_t> present;
  if (window > 0) {
    col_pos.assign(static_cast<size_t>(W), -1);
    for (int64_t i = 0; i < Q; ++i)
      if (wslot[i] - start < W) col_pos[wslot[i] - start] = pos[i];
    lo.resize(Q);
    chunk_base.resize(Q);
    first.assign(Q, -1);
    for (int64_t i = 0; i < Q; ++i) {
      lo[i] = pos[i] - window + 1;
      const int64_t len = start + vis_off[i + 1] - vis_off[i], nc = (len + kChunk - 1) / kChunk;
      chunk_base[i] = static_cast<int64_t>(present.size());
      present.resize(present.size() + nc, 0);
      for (int64_t t = 0; t < len; ++t) {  // list position t: prefix slot t, or the row's new column
        int64_t kpos = t;
        if (t >= start) {
          const int64_t j = vis_idx[vis_off[i] + t - start];
          TORCH_CHECK(col_pos[j] >= 0, fn, ": with a window, row ", i, " sees slot ", start + j,
                      ", which this call does not write, so its key's position is unknown (with window > 0 every "
                      "visible slot after start must be a write slot of this call)");
          kpos = col_pos[j];
        } else if (t < lo[i]) {
          t = std::min(start, lo[i]) - 1;  // prefix slots below the window: none is in it
          continue;
        }
        if (kpos >= lo[i]) {
          present[chunk_base[i] + t / kChunk] = 1;
          if (first[i] < 0) first[i] = t / kChunk;
        }
      }
    }
    win = Window{window, lo.data(), col_pos.data(), chunk_base.data(), present.data(), first.data()};
  }
  float* op = out.data_ptr<float>();
  // Steps 1 (the writes) and 3-4 over the caches' elements: float* (fp32 caches) or uint16_t* (fp16).
  auto write_and_attend = [&](auto* kc, auto* vc) {
    for (int64_t i = 0; i < Q; ++i) {
      const float* row = x + i * width;
      const float* c = cp + pos[i] * d;
      const float* s = sp + pos[i] * d;
      for (int64_t h = 0; h < nh; ++h) rope(row + h * d, c, s, qr.get() + (i * nh + h) * d);
      for (int64_t g = 0; g < nkv; ++g) {
        const int64_t slot = (g * cap + wslot[i]) * d;
        rope(row + (nh + g) * d, c, s, kr.get());
        store_kv(kr.get(), kc + slot, d);
        store_kv(row + (nh + nkv + g) * d, vc + slot, d);
      }
    }
    // Steps 3 and 4 for blocks of at most kRowBlock rows (bounding the partials' memory in long prefills).
    for (int64_t i0 = 0; i0 < Q; i0 += kRowBlock) {
      const int64_t i1 = std::min(Q, i0 + kRowBlock);
      attend_rows(qr.get(), kc, vc, cap, d, nh, nkv, start, vis_off.data(), vis_idx.data(), i0, i1, scale, cap_f,
                  win, op);
    }
  };
  if (k_cache.scalar_type() == at::kHalf)
    write_and_attend(static_cast<uint16_t*>(k_cache.data_ptr()), static_cast<uint16_t*>(v_cache.data_ptr()));
  else
    write_and_attend(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  return out;
}

// `attention` for several sequences in one call: sequence j's rows qkv[row_starts[j] : row_starts[j+1]] over its
// own cache (k_all[j][layer], v_all[j][layer]), the sequences spread over the threads. Each sequence runs exactly
// `attention` (inside a parallel region its own parallel_for runs inline, and no split changes its arithmetic),
// so every row is bitwise what the per-sequence call gives; this only saves the calls and fills both cores when
// each sequence's attention is too small to split (one new token over a short cache). Sequences sharing a cache
// tensor run one after another.
at::Tensor attention_many(const at::Tensor& qkv, const std::vector<int64_t>& row_starts, const at::Tensor& cos,
                          const at::Tensor& sin, const std::vector<at::Tensor>& positions,
                          const std::vector<at::Tensor>& k_all, const std::vector<at::Tensor>& v_all, int64_t layer,
                          const std::vector<int64_t>& starts, const std::vector<std::optional<at::Tensor>>& visible,
                          int64_t n_heads, int64_t n_kv_heads,
                          const std::vector<std::optional<at::Tensor>>& write_slots, int64_t window, double softcap,
                          double scale) {
  const int64_t S = static_cast<int64_t>(positions.size());
  TORCH_CHECK(S > 0 && static_cast<int64_t>(row_starts.size()) == S + 1 && static_cast<int64_t>(k_all.size()) == S &&
                  static_cast<int64_t>(v_all.size()) == S && static_cast<int64_t>(starts.size()) == S &&
                  static_cast<int64_t>(visible.size()) == S && static_cast<int64_t>(write_slots.size()) == S,
              "attention_many: one entry per sequence in positions, k_all, v_all, starts, visible and write_slots, "
              "and row_starts with one more");
  check_f32(qkv, "attention_many", "qkv", 2);
  TORCH_CHECK(row_starts[0] == 0 && row_starts[S] == qkv.size(0), "attention_many: row_starts must run from 0 to ",
              qkv.size(0));
  bool shared = false;
  for (int64_t j = 0; j < S; ++j) {
    TORCH_CHECK(row_starts[j + 1] >= row_starts[j], "attention_many: row_starts must not decrease");
    TORCH_CHECK(k_all[j].dim() == 4 && v_all[j].dim() == 4 && layer >= 0 && layer < k_all[j].size(0) &&
                    layer < v_all[j].size(0),
                "attention_many: k_all and v_all must be [layers, n_kv_heads, capacity, head_dim] and layer in range");
    for (int64_t i = 0; i < j; ++i) shared = shared || k_all[i].is_same(k_all[j]) || v_all[i].is_same(v_all[j]);
  }
  std::vector<at::Tensor> outs(static_cast<size_t>(S));
  auto one = [&](int64_t j) {
    at::Tensor k = k_all[j].select(0, layer), v = v_all[j].select(0, layer);
    outs[j] = attention(qkv.narrow(0, row_starts[j], row_starts[j + 1] - row_starts[j]).contiguous(), cos, sin,
                        positions[j], k, v, starts[j], visible[j], n_heads, n_kv_heads, write_slots[j], window,
                        softcap, scale);
  };
  if (shared) {
    for (int64_t j = 0; j < S; ++j) one(j);
  } else {
    at::parallel_for(0, S, 1, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) one(j);
    });
  }
  return S == 1 ? outs[0] : at::cat(outs);
}

// One decoder layer of one sequence whose four linears are packed GGUF weights, in a single call: the same
// calls the Python forward makes per layer (qkv, attention, o, add_rms_norm, gate|up, silu_mul, down,
// add_rms_norm), so every value is bitwise the same, without ~8 Python-level calls and tensor views per layer.
// window, softcap and scale go to `attention` as they are; the MLP is always silu(gate) * up.
// x [q, hidden] is the residual stream (updated in place), h its normed input; returns the next normed input.
at::Tensor packed_layer(at::Tensor& x, const at::Tensor& h, const at::Tensor& w_qkv, int64_t f_qkv,
                        const at::Tensor& w_o, int64_t f_o, const at::Tensor& w_gu, int64_t f_gu,
                        const at::Tensor& w_down, int64_t f_down, const at::Tensor& post_norm,
                        const at::Tensor& next_norm, double eps, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& positions, at::Tensor& k_all, at::Tensor& v_all, int64_t layer,
                        int64_t start, const std::optional<at::Tensor>& visible, int64_t n_heads, int64_t n_kv_heads,
                        const std::optional<at::Tensor>& write_slots, int64_t window, double softcap, double scale) {
  TORCH_CHECK(k_all.dim() == 4 && v_all.dim() == 4 && layer >= 0 && layer < k_all.size(0),
              "packed_layer: k_all and v_all must be [layers, n_kv_heads, capacity, head_dim] and layer in range");
  at::Tensor k_cache = k_all.select(0, layer), v_cache = v_all.select(0, layer);
  const at::Tensor qkv = ff_quant_mm(h, w_qkv, f_qkv, h.size(1));
  const at::Tensor attn = attention(qkv, cos, sin, positions, k_cache, v_cache, start, visible, n_heads, n_kv_heads,
                                    write_slots, window, softcap, scale);
  const at::Tensor o = ff_quant_mm(attn, w_o, f_o, attn.size(1));
  const at::Tensor h2 = add_rms_norm(x, o, post_norm, eps);
  const at::Tensor act = silu_mul(ff_quant_mm(h2, w_gu, f_gu, h2.size(1)));
  const at::Tensor down = ff_quant_mm(act, w_down, f_down, act.size(1));
  return add_rms_norm(x, down, next_norm, eps);
}


// torch.argmax of each row of x [r, V] (fp32): the column of the row's first largest value, or of its first NaN
// when it has one (torch's NaN-propagating max) -- a greedy verification's argmax over a vocabulary in a few
// microseconds instead of torch's ~40 per row. One pass of 8-lane max (and NaN test), then the first column equal
// to it; rows run in parallel.
at::Tensor argmax_rows(const at::Tensor& x_in) {
  check_f32(x_in, "argmax_rows", "x", 2);
  const at::Tensor x = x_in.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0, "argmax_rows: rows must have at least one column");
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + r * V;
      const int64_t full = V / 8 * 8;
      __m256 vm = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      __m256 nan = _mm256_setzero_ps();
      for (int64_t c = 0; c < full; c += 8) {
        const __m256 v = _mm256_loadu_ps(row + c);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vm = _mm256_max_ps(vm, v);
      }
      bool has_nan = _mm256_movemask_ps(nan) != 0;
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, vm);
      float m = lanes[0];
      for (int j = 1; j < 8; ++j) m = std::max(m, lanes[j]);
      for (int64_t c = full; c < V; ++c) {
        has_nan = has_nan || row[c] != row[c];
        m = std::max(m, row[c]);
      }
      // the first column holding m (or a NaN): 8 columns at a time, then the lanes of the first block that has it
      const __m256 vmax = _mm256_set1_ps(m);
      int64_t at = 0;
      for (; at < full; at += 8) {
        const __m256 v = _mm256_loadu_ps(row + at);
        if (_mm256_movemask_ps(has_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, vmax, _CMP_EQ_OQ)))
          break;
      }
      while (has_nan ? row[at] == row[at] : row[at] != m) ++at;
      op[r] = at;
    }
  });
  return out;
}

// Greedy verification of a draft tree in one call: node i >= 1 is accepted when its parent is and tokens[i] equals
// the argmax of the parent's row (torch.argmax's: the first largest value, or the first NaN); the kept node is the
// first accepted node of the greatest depth, and the bonus token the argmax of its row. A row's argmax is computed
// only when some node needs it (the parent of a node whose parent was accepted, and the kept node): a 30-node tree
// of which two drafts are right reads 3 rows, not 30. parents: int64 [n], parents[0] = -1, every other parent an
// earlier node. Returns int64 [len(path) + 1]: the path from the root to the kept node, then the bonus token.
at::Tensor greedy_verify(const at::Tensor& logits_in, const at::Tensor& tokens_in, const at::Tensor& parents_in) {
  check_f32(logits_in, "greedy_verify", "logits", 2);
  TORCH_CHECK(tokens_in.dim() == 1 && parents_in.dim() == 1 && tokens_in.scalar_type() == at::kLong &&
                  parents_in.scalar_type() == at::kLong,
              "greedy_verify: tokens and parents must be 1-D int64");
  const int64_t n = tokens_in.size(0), V = logits_in.size(1);
  TORCH_CHECK(n >= 1 && parents_in.size(0) == n && logits_in.size(0) >= n && V > 0,
              "greedy_verify: one parent per token and at least as many logit rows as tokens");
  const at::Tensor logits = logits_in.contiguous(), tokens = tokens_in.contiguous(), parents = parents_in.contiguous();
  const int64_t* tp = tokens.data_ptr<int64_t>();
  const int64_t* pp = parents.data_ptr<int64_t>();
  TORCH_CHECK(pp[0] == -1, "greedy_verify: node 0 is the root (parent -1)");
  for (int64_t i = 1; i < n; ++i)
    TORCH_CHECK(pp[i] >= 0 && pp[i] < i, "greedy_verify: node ", i, "'s parent must be an earlier node");
  std::vector<int64_t> pred(static_cast<size_t>(n), -1), depth(static_cast<size_t>(n), 0);
  std::vector<uint8_t> ok(static_cast<size_t>(n), 0);
  auto argmax_of = [&](int64_t i) {
    if (pred[i] < 0) {
      at::Tensor row = logits.narrow(0, i, 1);
      pred[i] = argmax_rows(row).data_ptr<int64_t>()[0];
    }
    return pred[i];
  };
  ok[0] = 1;
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i) {
    const int64_t p = pp[i];
    depth[i] = depth[p] + 1;
    if (ok[p] && tp[i] == argmax_of(p)) {
      ok[i] = 1;
      if (depth[i] > depth[best]) best = i;
    }
  }
  std::vector<int64_t> path;
  for (int64_t v = best; v >= 0; v = pp[v]) path.push_back(v);
  at::Tensor out = at::empty({static_cast<int64_t>(path.size()) + 1}, tokens.options());
  int64_t* op = out.data_ptr<int64_t>();
  for (size_t j = 0; j < path.size(); ++j) op[j] = path[path.size() - 1 - j];
  op[path.size()] = argmax_of(best);
  return out;
}

// The k largest log-probabilities of each row of logits [r, V] (fp32) and their columns, best first (equal values:
// the lower column first), without writing the rows' log-softmax: one pass for the row's max m, one for
// sum exp8(x - m) (8 lanes, masked tail) that also keeps the k best values in a sorted list (a block of 8 is looked
// at lane by lane only when one of its values beats the list's last), then value - (m + log(sum)). What a
// drafter's top-k needs of its head's logits; rows run in parallel. NaN logits are never selected.
std::tuple<at::Tensor, at::Tensor> log_softmax_topk(const at::Tensor& logits_in, int64_t k) {
  check_f32(logits_in, "log_softmax_topk", "logits", 2);
  const at::Tensor logits = logits_in.contiguous();
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= 64 && k <= V, "log_softmax_topk: k must be in [1, min(64, columns)], got ", k);
  at::Tensor values = at::empty({R, k}, logits.options());
  at::Tensor index = at::empty({R, k}, logits.options().dtype(at::kLong));
  const float* xp = logits.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = index.data_ptr<int64_t>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    float best[64];
    int64_t cols[64];
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = xp + r * V;
      const int64_t full = V / 8 * 8;
      __m256 vm = _mm256_set1_ps(neg_inf);
      for (int64_t c = 0; c < full; c += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + c));
      float m = neg_inf;
      {
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, vm);
        for (float v : lanes) m = std::max(m, v);
        for (int64_t c = full; c < V; ++c) m = std::max(m, x[c]);
      }
      int n = 0;  // entries in best (sorted, largest first)
      float floor = neg_inf;  // a value must beat this to enter (the list's last once it is full)
      auto offer = [&](float v, int64_t c) {  // NaN and -inf never enter
        if (!(v > floor)) return;
        int at = n < k ? n++ : static_cast<int>(k) - 1;  // the free slot: the next one, or the last's
        for (; at > 0 && best[at - 1] < v; --at) {
          best[at] = best[at - 1];
          cols[at] = cols[at - 1];
        }
        best[at] = v;
        cols[at] = c;
        if (n == k) floor = best[k - 1];
      };
      const __m256 vmax = _mm256_set1_ps(m);
      __m256 acc = _mm256_setzero_ps();
      for (int64_t c = 0; c < full; c += 8) {
        const __m256 v = _mm256_loadu_ps(x + c);
        acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(v, vmax)));
        if (_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(floor), _CMP_GT_OQ)))
          for (int j = 0; j < 8; ++j) offer(x[c + j], c + j);
      }
      float sum = hsum8(acc);
      for (int64_t c = full; c < V; ++c) {
        sum += exp1(x[c] - m);
        offer(x[c], c);
      }
      const float lse = m + std::log(sum);
      for (int j = 0; j < k; ++j) {
        vp[r * k + j] = j < n ? best[j] - lse : neg_inf;
        ip[r * k + j] = j < n ? cols[j] : 0;
      }
    }
  });
  return {values, index};
}

// The decoder layers of a model whose layers are all `packed_layer`'s, kept once (their weights, formats, norms and
// attention options) so that a forward of one sequence runs every layer in one call: exactly the `packed_layer`
// calls the Python loop makes, in the same order (bitwise the same values), without ~30 Python-level calls of ~26
// arguments each per forward. The GIL is released while it runs (it touches no Python object).
struct PackedStack {
  std::vector<at::Tensor> weights;      // 4 per layer: qkv, o, gate|up, down
  std::vector<int64_t> formats;         // their kernel formats
  std::vector<at::Tensor> post_norms;   // per layer
  std::vector<at::Tensor> next_norms;   // per layer: the next layer's input norm, the final norm after the last
  std::vector<int64_t> windows;         // per layer: attention options (0: none)
  std::vector<double> softcaps, scales;
  double eps;
  int64_t n_heads, n_kv_heads;

  PackedStack(std::vector<at::Tensor> w, std::vector<int64_t> f, std::vector<at::Tensor> post,
              std::vector<at::Tensor> next, std::vector<int64_t> window, std::vector<double> softcap,
              std::vector<double> scale, double eps_, int64_t nh, int64_t nkv)
      : weights(std::move(w)), formats(std::move(f)), post_norms(std::move(post)), next_norms(std::move(next)),
        windows(std::move(window)), softcaps(std::move(softcap)), scales(std::move(scale)), eps(eps_), n_heads(nh),
        n_kv_heads(nkv) {
    const size_t L = post_norms.size();
    TORCH_CHECK(L > 0 && weights.size() == 4 * L && formats.size() == 4 * L && next_norms.size() == L &&
                    windows.size() == L && softcaps.size() == L && scales.size() == L,
                "PackedStack: 4 weights and formats, and one post norm, next norm, window, softcap and scale per "
                "layer");
  }

  int64_t layers() const { return static_cast<int64_t>(post_norms.size()); }

  // x [q, hidden]: the residual stream (updated in place); h: the first layer's normed input. Layer i's keys and
  // values go to layer i of k_all / v_all. Returns the last layer's next normed input and, for each layer in
  // `taps` (ascending), a copy of x after that layer.
  std::pair<at::Tensor, std::vector<at::Tensor>> run(at::Tensor& x, at::Tensor h, const at::Tensor& cos,
                                                      const at::Tensor& sin, const at::Tensor& positions,
                                                      at::Tensor& k_all, at::Tensor& v_all, int64_t start,
                                                      const std::optional<at::Tensor>& visible,
                                                      const std::optional<at::Tensor>& write_slots,
                                                      const std::vector<int64_t>& taps) const {
    TORCH_CHECK(k_all.dim() == 4 && v_all.dim() == 4 && k_all.size(0) >= layers() && v_all.size(0) >= layers(),
                "PackedStack.run: k_all and v_all must be [layers, n_kv_heads, capacity, head_dim] with every layer");
    std::vector<at::Tensor> tapped;
    size_t next_tap = 0;
    for (int64_t i = 0; i < layers(); ++i) {
      const size_t w = static_cast<size_t>(4 * i);
      h = packed_layer(x, h, weights[w], formats[w], weights[w + 1], formats[w + 1], weights[w + 2], formats[w + 2],
                       weights[w + 3], formats[w + 3], post_norms[i], next_norms[i], eps, cos, sin, positions, k_all,
                       v_all, i, start, visible, n_heads, n_kv_heads, write_slots, windows[i], softcaps[i],
                       scales[i]);
      if (next_tap < taps.size() && taps[next_tap] == i) {
        tapped.push_back(x.clone());
        ++next_tap;
      }
    }
    TORCH_CHECK(next_tap == taps.size(), "PackedStack.run: taps must be ascending layer indices");
    return {h, tapped};
  }
};


// A feature drafter's rows gathered from the target's forwards in one call: out [R, n_taps * d] (their dtype), where entry
// p's rows rows[p] of its n_taps sources (sources[p * n_taps + t], each [n_p, d]) sit side by side, the entries one
// after another -- what EAGLE's `torch.cat([torch.stack([hidden[l][rows] for l in taps], 1) for ...])` builds with
// ~4 tensor operations per entry, each of them paying torch's dispatch on caches the target's forward just cooled.
at::Tensor gather_tap_rows(const std::vector<at::Tensor>& sources, const std::vector<std::vector<int64_t>>& rows,
                           int64_t n_taps) {
  const int64_t P = static_cast<int64_t>(rows.size());
  TORCH_CHECK(n_taps >= 1 && P >= 1 && static_cast<int64_t>(sources.size()) == P * n_taps,
              "gather_tap_rows: n_taps sources per entry of rows");
  const int64_t d = sources[0].size(-1);
  int64_t R = 0;
  for (const auto& r : rows) R += static_cast<int64_t>(r.size());
  std::vector<at::Tensor> src(sources.size());
  for (size_t i = 0; i < sources.size(); ++i) {
    TORCH_CHECK(sources[i].dim() == 2 && sources[i].size(1) == d &&
                    sources[i].scalar_type() == sources[0].scalar_type(),
                "gather_tap_rows: every source must be 2-D with ", d, " columns and one dtype");
    src[i] = sources[i].contiguous();
  }
  at::Tensor out = at::empty({R, n_taps * d}, sources[0].options());
  const int64_t bytes = d * static_cast<int64_t>(out.element_size());
  char* op = static_cast<char*>(out.data_ptr());
  int64_t o = 0;
  for (int64_t p = 0; p < P; ++p) {
    for (const int64_t row : rows[p]) {
      for (int64_t t = 0; t < n_taps; ++t) {
        const at::Tensor& s = src[p * n_taps + t];
        TORCH_CHECK(row >= 0 && row < s.size(0), "gather_tap_rows: row ", row, " out of range for a source of ",
                    s.size(0), " rows");
        std::memcpy(op + (o * n_taps + t) * bytes, static_cast<const char*>(s.data_ptr()) + row * bytes, bytes);
      }
      ++o;
    }
  }
  return out;
}

// EAGLE-3's drafter at decode time, kept once: its feature fusion (fc), the decoder layer whose attention reads
// [input_norm(embedding) ; hidden_norm(feature)], the final norm and the head, whose log-softmax top-k it returns.
// One call runs a step's rows through all of it -- what the Python runner does in ~25 tensor operations (the
// fusion, the norms, the concatenation, the layer, the norm, the head, the top-k), each paying torch's dispatch on
// caches the target's forward has just cooled. The same kernels in the same order: bitwise the runner's values.
// The GIL is released while it runs.
struct DraftLayerHead {
  at::Tensor fc;                 // [3 d_t] -> [d] packed (may be undefined when the caller fuses)
  int64_t f_fc;
  at::Tensor in_norm, hidden_norm;
  std::vector<at::Tensor> weights;  // qkv, o, gate|up, down
  std::vector<int64_t> formats;
  at::Tensor post_norm, final_norm, head;
  int64_t f_head;
  double eps;
  int64_t n_heads, n_kv_heads;

  at::Tensor embedding;        // the target's token embedding: packed rows (f_embedding >= 0) or fp32 [V, d]
  int64_t f_embedding = -1;

  DraftLayerHead(at::Tensor fc_, int64_t f_fc_, at::Tensor in_norm_, at::Tensor hidden_norm_,
                 std::vector<at::Tensor> w, std::vector<int64_t> f, at::Tensor post, at::Tensor final_,
                 at::Tensor head_, int64_t f_head_, double eps_, int64_t nh, int64_t nkv)
      : fc(std::move(fc_)), f_fc(f_fc_), in_norm(std::move(in_norm_)), hidden_norm(std::move(hidden_norm_)),
        weights(std::move(w)), formats(std::move(f)), post_norm(std::move(post)), final_norm(std::move(final_)),
        head(std::move(head_)), f_head(f_head_), eps(eps_), n_heads(nh), n_kv_heads(nkv) {
    TORCH_CHECK(weights.size() == 4 && formats.size() == 4, "DraftLayerHead: 4 layer weights and formats");
  }

  // feat: [n, 3 d_t] target taps when `fuse` (through fc first), else [n, d] earlier rows' outputs; `pick`: the rows
  // of it the r new rows read (empty: all of them, in order). emb [r, d]: the new rows' token embeddings (or their
  // token ids [r], int64, looked up in the embedding set_embedding gave), at
  // `positions` [r]; their keys and values go to k / v [n_kv_heads, capacity, head_dim] at write_slots (None:
  // start ..), each row seeing the first `start` slots and the slots after them `visible` names (None: causal).
  // last_only: only the last row goes on past the attention. top_k > 0: the k best of the head's log-softmax of
  // each output row. Returns (the rows' outputs h [r or 1, d], their top-k log-probabilities, their draft ids).
  std::tuple<at::Tensor, at::Tensor, at::Tensor> run(const at::Tensor& feat, bool fuse,
                                                     const std::vector<int64_t>& pick, const at::Tensor& emb,
                                                     const at::Tensor& cos, const at::Tensor& sin,
                                                     const at::Tensor& positions, at::Tensor& k, at::Tensor& v,
                                                     int64_t start, const std::optional<at::Tensor>& visible,
                                                     const std::optional<at::Tensor>& write_slots, bool last_only,
                                                     int64_t top_k) const {
    check_f32(feat, "DraftLayerHead.run", "feat", 2);
    TORCH_CHECK(!fuse || fc.defined(), "DraftLayerHead.run: no fc weight to fuse with");
    at::Tensor x = fuse ? ff_quant_mm(feat.contiguous(), fc, f_fc, feat.size(1)) : feat;
    if (!pick.empty()) {
      at::Tensor index = at::empty({static_cast<int64_t>(pick.size())}, positions.options().dtype(at::kLong));
      std::memcpy(index.data_ptr<int64_t>(), pick.data(), sizeof(int64_t) * pick.size());
      x = x.index_select(0, index);
    } else if (!fuse) {
      x = x.contiguous().clone();  // the residual stream is updated in place: never the caller's
    }
    x = x.contiguous();
    const int64_t r = x.size(0);
    const at::Tensor e = emb.scalar_type() == at::kLong ? embed(emb.contiguous()) : emb.contiguous();
    TORCH_CHECK(r >= 1 && e.size(0) == r, "DraftLayerHead.run: one embedding row (or token id) per new row");
    const at::Tensor h = at::cat({rms_norm(e, in_norm, eps), rms_norm(x, hidden_norm, eps)}, 1);
    at::Tensor k4 = k.unsqueeze(0), v4 = v.unsqueeze(0);
    at::Tensor out = x;
    if (!last_only || r == 1) {
      packed_layer(x, h, weights[0], formats[0], weights[1], formats[1], weights[2], formats[2], weights[3],
                   formats[3], post_norm, final_norm, eps, cos, sin, positions, k4, v4, 0, start, visible, n_heads,
                   n_kv_heads, write_slots, 0, 0.0, 0.0);
    } else {  // every row's keys and values, then the last row alone
      const at::Tensor qkv = ff_quant_mm(h, weights[0], formats[0], h.size(1));
      const at::Tensor attn = attention(qkv, cos, sin, positions, k, v, start, visible, n_heads, n_kv_heads,
                                        write_slots, 0, 0.0, 0.0)
                                  .narrow(0, r - 1, 1);
      out = x.narrow(0, r - 1, 1);
      const at::Tensor o = ff_quant_mm(attn, weights[1], formats[1], attn.size(1));
      const at::Tensor h2 = add_rms_norm(out, o, post_norm, eps);
      const at::Tensor act = silu_mul(ff_quant_mm(h2, weights[2], formats[2], h2.size(1)));
      add_rms_norm(out, ff_quant_mm(act, weights[3], formats[3], act.size(1)), final_norm, eps);
    }
    if (top_k <= 0) return {out, at::Tensor(), at::Tensor()};
    const at::Tensor normed = rms_norm(out, final_norm, eps);
    auto [values, ids] = log_softmax_topk(ff_quant_mm(normed, head, f_head, normed.size(1)), top_k);
    return {out, values, ids};
  }

  // The target's token embedding, for `expand` to look its draft tokens up: packed rows of kernel format `fmt`
  // (quant_rows), or with fmt < 0 an fp32 table [V, d].
  void set_embedding(at::Tensor table, int64_t fmt) {
    TORCH_CHECK(fmt >= 0 || (table.dim() == 2 && table.scalar_type() == at::kFloat),
                "DraftLayerHead.set_embedding: a dense table must be fp32 [V, d]");
    embedding = fmt >= 0 ? std::move(table) : table.contiguous();
    f_embedding = fmt;
  }

  at::Tensor embed(const at::Tensor& ids) const {
    TORCH_CHECK(embedding.defined(), "DraftLayerHead: token ids given, but no embedding set");
    if (f_embedding >= 0) return ff_quant_rows(embedding, f_embedding, in_norm.size(0), ids);
    return embedding.index_select(0, ids);
  }

  // EAGLE-2's expansion of one step's draft (fastforward/proposers/eagle.py's `expand`, the same candidates), after
  // the committed rows: the root's top-k (root_values / root_ids [1, k], log-probabilities and draft ids) are depth
  // 1's candidates; then depth by depth, the k candidates of the best path score each get a drafter row -- reading
  // its parent's output (last_h for depth 1's), its own token at position root_position + depth - 2, and the rows of
  // its ancestors -- and contribute their top-k children. Expansion stops at `depth`, when the best frontier path's
  // probability falls under min_prob, or (token_ms > 0) when the frontier's summed path probability times token_ms
  // is less than a call's measured milliseconds (call_ms, a moving average updated with `smoothing` after each call;
  // < 0: none measured yet). Draft rows are written at slots length .. of k / v (the caller has made room).
  // Returns (draft ids, log path scores (float64), parent candidate indices (-1: root), depths) [c] and
  // (rows, calls, unpaid stops, call_ms).
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, std::vector<double>> expand(
      const at::Tensor& root_values, const at::Tensor& root_ids, const at::Tensor& last_h, const at::Tensor& d2t_in,
      int64_t k, int64_t depth, double min_prob, double token_ms, double call_ms, double smoothing,
      const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kc, at::Tensor& vc, int64_t length,
      int64_t root_position) const {
    TORCH_CHECK(embedding.defined(), "DraftLayerHead.expand: no embedding set");
    TORCH_CHECK(root_values.numel() == k && root_ids.numel() == k && k >= 1 && depth >= 1,
                "DraftLayerHead.expand: the root's k values and ids");
    const at::Tensor d2t = d2t_in.contiguous();
    const int64_t* mp = d2t.data_ptr<int64_t>();
    std::vector<int64_t> tok, parent, dep;
    std::vector<float> score;  // float32 sums, as the proposer's numpy arrays
    {
      const at::Tensor rv = root_values.contiguous(), ri = root_ids.contiguous();
      for (int64_t j = 0; j < k; ++j) {
        tok.push_back(ri.data_ptr<int64_t>()[j]);
        score.push_back(rv.data_ptr<float>()[j]);
        parent.push_back(-1);
        dep.push_back(1);
      }
    }
    const int64_t max_rows = k * std::max<int64_t>(depth - 1, 0);
    std::vector<uint8_t> sees(static_cast<size_t>(std::max<int64_t>(max_rows, 1) * std::max<int64_t>(max_rows, 1)), 0);
    std::vector<int64_t> row_of(static_cast<size_t>(k + std::max<int64_t>(depth - 1, 0) * k * k), -1);
    at::Tensor src_h = last_h.contiguous();
    std::vector<int64_t> src_row(static_cast<size_t>(k), 0);
    int64_t n_rows = 0, offset = 0, prev = 0, calls = 0, unpaid = 0;  // prev: the first candidate of the last depth
    const auto long_opts = at::TensorOptions().dtype(at::kLong);
    for (int64_t d = 2; d <= depth; ++d) {
      const int64_t c = static_cast<int64_t>(score.size()) - prev;  // candidates at depth d - 1
      const int64_t r = std::min(k, c);
      std::vector<int64_t> sel(static_cast<size_t>(c));
      for (int64_t i = 0; i < c; ++i) sel[i] = i;
      std::stable_sort(sel.begin(), sel.end(), [&](int64_t a, int64_t b) { return score[prev + a] > score[prev + b]; });
      sel.resize(static_cast<size_t>(r));
      std::vector<float> best(static_cast<size_t>(r));
      double mass = 0.0;
      for (int64_t i = 0; i < r; ++i) {
        best[i] = score[prev + sel[i]];
        mass += std::exp(static_cast<double>(best[i]));
      }
      if (std::exp(static_cast<double>(best[0])) < min_prob) break;
      if (token_ms > 0.0 && call_ms >= 0.0 && mass * token_ms < call_ms) {
        ++unpaid;
        break;
      }
      at::Tensor tokens = at::empty({r}, long_opts), visible = at::zeros({r, n_rows + r}, at::kBool),
                 pick = at::empty({r}, long_opts);
      int64_t* tp = tokens.data_ptr<int64_t>();
      int64_t* pk = pick.data_ptr<int64_t>();
      bool* vp = visible.data_ptr<bool>();
      for (int64_t i = 0; i < r; ++i) {
        const int64_t glob = sel[i] + offset, up = parent[glob], row = n_rows + i;
        uint8_t* mine = sees.data() + row * max_rows;
        if (up >= 0) std::memcpy(mine, sees.data() + row_of[up] * max_rows, static_cast<size_t>(n_rows));
        mine[row] = 1;
        row_of[glob] = row;
        for (int64_t j = 0; j < n_rows + r; ++j) vp[i * (n_rows + r) + j] = mine[j] != 0;
        tp[i] = tok[glob] + mp[tok[glob]];
        pk[i] = src_row[sel[i]];
      }
      const auto t0 = std::chrono::steady_clock::now();
      const at::Tensor positions = at::full({r}, root_position + d - 2, long_opts);
      const int64_t slot = length + n_rows;
      std::optional<at::Tensor> write;
      if (n_rows) write = at::arange(slot, slot + r, long_opts);
      const std::vector<int64_t> none;
      auto [h, values, ids] = run(src_h.index_select(0, pick), false, none, embed(tokens), cos, sin, positions, kc, vc,
                                  length, visible, write, false, k);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      call_ms = call_ms < 0.0 ? ms : call_ms + smoothing * (ms - call_ms);
      ++calls;
      n_rows += r;
      offset += c;
      prev = static_cast<int64_t>(score.size());
      const float* vv = values.data_ptr<float>();
      const int64_t* iv = ids.data_ptr<int64_t>();
      for (int64_t i = 0; i < r; ++i)
        for (int64_t j = 0; j < k; ++j) {
          tok.push_back(iv[i * k + j]);
          score.push_back(best[i] + vv[i * k + j]);
          parent.push_back(sel[i] + offset - c);
          dep.push_back(d);
        }
      src_h = h;
      src_row.assign(static_cast<size_t>(r * k), 0);
      for (int64_t i = 0; i < r * k; ++i) src_row[i] = i / k;
    }
    const int64_t n = static_cast<int64_t>(score.size());
    at::Tensor out_tok = at::empty({n}, long_opts), out_score = at::empty({n}, at::kDouble),
               out_parent = at::empty({n}, long_opts), out_depth = at::empty({n}, long_opts);
    std::memcpy(out_tok.data_ptr<int64_t>(), tok.data(), sizeof(int64_t) * n);
    std::memcpy(out_parent.data_ptr<int64_t>(), parent.data(), sizeof(int64_t) * n);
    std::memcpy(out_depth.data_ptr<int64_t>(), dep.data(), sizeof(int64_t) * n);
    double* sp = out_score.data_ptr<double>();
    for (int64_t i = 0; i < n; ++i) sp[i] = static_cast<double>(score[i]);
    return {out_tok, out_score, out_parent, out_depth,
            {static_cast<double>(n_rows), static_cast<double>(calls), static_cast<double>(unpaid), call_ms}};
  }
};


// EAGLE-2's rerank and the tree it keeps, in one call (fastforward/proposers/_rerank.py's rank, best_size and
// build_tree, the same answers): candidates c with log path scores, target tokens, parents (a candidate index, -1:
// the root) and depths are ranked by score (descending; equal scores: shallower first, then by index; NaN last);
// the tree keeps the first n - 1 under the root, n = `nodes` when fixed (at most `limit`), else the n in 1..limit
// with the most expected tokens per millisecond, (1 + sum of the first n - 1 scores' exp) / curve_ms[n - 1] (the
// first of equals). Returns the tree's tokens, parents and depths [n] (int64), root first, parents before children.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rerank_tree(const std::vector<double>& scores,
                                                           const std::vector<int64_t>& tokens,
                                                           const std::vector<int64_t>& parents,
                                                           const std::vector<int64_t>& depths,
                                                           const std::vector<double>& curve_ms, int64_t limit,
                                                           int64_t nodes, int64_t root) {
  const int64_t c = static_cast<int64_t>(scores.size());
  TORCH_CHECK(static_cast<int64_t>(tokens.size()) == c && static_cast<int64_t>(parents.size()) == c &&
                  static_cast<int64_t>(depths.size()) == c,
              "rerank_tree: one token, parent and depth per score");
  TORCH_CHECK(limit >= 1 && limit <= c + 1 && nodes >= 0, "rerank_tree: limit must be in [1, candidates + 1]");
  TORCH_CHECK(nodes > 0 || static_cast<int64_t>(curve_ms.size()) >= limit, "rerank_tree: curve_ms needs ", limit,
              " entries");
  std::vector<int64_t> order(static_cast<size_t>(c));
  for (int64_t i = 0; i < c; ++i) order[i] = i;
  auto key = [&](int64_t i) { return std::isnan(scores[i]) ? -std::numeric_limits<double>::infinity() : scores[i]; };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const double sa = key(a), sb = key(b);
    if (sa != sb) return sa > sb;
    if (std::isnan(scores[a]) != std::isnan(scores[b])) return !std::isnan(scores[a]);
    return depths[a] < depths[b];
  });
  int64_t n = 1;
  if (nodes > 0) {
    n = std::min(nodes, limit);
  } else {
    double sum = 0.0, best = 1.0 / curve_ms[0];
    for (int64_t i = 1; i < limit; ++i) {
      sum += std::exp(scores[order[i - 1]]);
      const double rate = (1.0 + sum) / curve_ms[i];
      if (rate > best) {
        best = rate;
        n = i + 1;
      }
    }
  }
  std::vector<int64_t> chosen(order.begin(), order.begin() + (n - 1));
  std::stable_sort(chosen.begin(), chosen.end(), [&](int64_t a, int64_t b) { return depths[a] < depths[b]; });
  std::vector<int64_t> index(static_cast<size_t>(c), -1);
  for (int64_t j = 0; j < n - 1; ++j) index[chosen[j]] = j + 1;
  at::Tensor out_tokens = at::empty({n}, at::kLong), out_parents = at::empty({n}, at::kLong),
             out_depths = at::empty({n}, at::kLong);
  int64_t *tp = out_tokens.data_ptr<int64_t>(), *pp = out_parents.data_ptr<int64_t>(),
          *dp = out_depths.data_ptr<int64_t>();
  tp[0] = root;
  pp[0] = -1;
  dp[0] = 0;
  for (int64_t j = 1; j < n; ++j) {
    const int64_t cand = chosen[j - 1], up = parents[cand];
    TORCH_CHECK(up >= -1 && up < c, "rerank_tree: a parent index out of range");
    const int64_t at = up < 0 ? 0 : index[up];
    TORCH_CHECK(at >= 0 && at < j && depths[cand] == dp[at] + 1,
                "rerank: a chosen node's parent was not chosen, or the depths disagree with it");
    tp[j] = tokens[cand];
    pp[j] = at;
    dp[j] = depths[cand];
  }
  return {out_tokens, out_parents, out_depths};
}


// FastEagle's cascaded drafter at decode time, kept once: the feature fusion (fc), the input projection over
// [e_norm(embedding) ; g_norm(feature)] (fc_in, with its bias), N target-shaped decoder layers in cascade (layer i
// reads layer i - 1's output) and the head (no norm: the layers are trained towards the target's normed state).
// One call commits r accepted rows through all of it and returns the last row's output of every layer with the
// head's top-k of each -- what the Python runner does in ~30 tensor operations. The same kernels in the same order:
// bitwise the runner's values. The GIL is released while it runs.
struct CascadeDrafter {
  at::Tensor fc, fc_in, fc_in_bias, e_norm, g_norm, head;
  int64_t f_fc, f_fc_in, f_head;
  std::vector<at::Tensor> weights;  // 4 per layer: qkv, o, gate|up, down
  std::vector<int64_t> formats;
  std::vector<at::Tensor> in_norms, post_norms;  // per layer
  double eps;
  int64_t n_heads, n_kv_heads;

  CascadeDrafter(at::Tensor fc_, int64_t f_fc_, at::Tensor fc_in_, int64_t f_fc_in_, at::Tensor bias,
                 at::Tensor e_norm_, at::Tensor g_norm_, std::vector<at::Tensor> w, std::vector<int64_t> f,
                 std::vector<at::Tensor> in_n, std::vector<at::Tensor> post_n, at::Tensor head_, int64_t f_head_,
                 double eps_, int64_t nh, int64_t nkv)
      : fc(std::move(fc_)), fc_in(std::move(fc_in_)), fc_in_bias(std::move(bias)), e_norm(std::move(e_norm_)),
        g_norm(std::move(g_norm_)), head(std::move(head_)), f_fc(f_fc_), f_fc_in(f_fc_in_), f_head(f_head_),
        weights(std::move(w)), formats(std::move(f)), in_norms(std::move(in_n)), post_norms(std::move(post_n)),
        eps(eps_), n_heads(nh), n_kv_heads(nkv) {
    const size_t L = in_norms.size();
    TORCH_CHECK(L > 0 && weights.size() == 4 * L && formats.size() == 4 * L && post_norms.size() == L,
                "CascadeDrafter: 4 weights and formats, an input norm and a post norm per layer");
  }

  // taps [r, n_taps * d_t] (fp32), emb [r, d] the next tokens' embeddings, at positions [r], their keys and values
  // into slots start .. start + r - 1 of k_all / v_all [layers, n_kv_heads, capacity, head_dim] (causal after the
  // first `start`). Returns (the last row's output of each layer [N, d], with top_k > 0 the head's top-k
  // log-probabilities and draft ids of each [N, k]).
  std::tuple<at::Tensor, at::Tensor, at::Tensor> run(const at::Tensor& taps, const at::Tensor& emb,
                                                     const at::Tensor& cos, const at::Tensor& sin,
                                                     const at::Tensor& positions, at::Tensor& k_all,
                                                     at::Tensor& v_all, int64_t start, int64_t top_k) const {
    check_f32(taps, "CascadeDrafter.run", "taps", 2);
    const int64_t n = static_cast<int64_t>(in_norms.size());
    TORCH_CHECK(k_all.dim() == 4 && v_all.dim() == 4 && k_all.size(0) >= n && v_all.size(0) >= n,
                "CascadeDrafter.run: k_all and v_all must be [layers, n_kv_heads, capacity, head_dim]");
    const at::Tensor t = taps.contiguous();
    const at::Tensor g = ff_quant_mm(t, fc, f_fc, t.size(1));
    TORCH_CHECK(emb.size(0) == g.size(0), "CascadeDrafter.run: one embedding row per row");
    const at::Tensor cat = at::cat({rms_norm(emb.contiguous(), e_norm, eps), rms_norm(g, g_norm, eps)}, 1);
    at::Tensor x = ff_quant_mm(cat, fc_in, f_fc_in, cat.size(1)).add(fc_in_bias).contiguous();
    const int64_t r = x.size(0);
    at::Tensor last = at::empty({n, x.size(1)}, x.options());
    at::Tensor normed = rms_norm(x, in_norms[0], eps);
    for (int64_t i = 0; i < n; ++i) {
      const size_t w = static_cast<size_t>(4 * i);
      const at::Tensor& next_norm = i + 1 < n ? in_norms[i + 1] : post_norms[i];
      if (i + 1 < n || r == 1) {
        normed = packed_layer(x, normed, weights[w], formats[w], weights[w + 1], formats[w + 1], weights[w + 2],
                              formats[w + 2], weights[w + 3], formats[w + 3], post_norms[i], next_norm, eps, cos, sin,
                              positions, k_all, v_all, i, start, std::nullopt, n_heads, n_kv_heads, std::nullopt, 0,
                              0.0, 0.0);
      } else {  // the last layer: every row's keys and values, then the last row alone
        const at::Tensor qkv = ff_quant_mm(normed, weights[w], formats[w], normed.size(1));
        at::Tensor k_cache = k_all.select(0, i), v_cache = v_all.select(0, i);
        const at::Tensor attn = attention(qkv, cos, sin, positions, k_cache, v_cache, start, std::nullopt, n_heads,
                                          n_kv_heads, std::nullopt, 0, 0.0, 0.0)
                                    .narrow(0, r - 1, 1);
        at::Tensor xl = x.narrow(0, r - 1, 1);
        const at::Tensor h2 = add_rms_norm(xl, ff_quant_mm(attn, weights[w + 1], formats[w + 1], attn.size(1)),
                                           post_norms[i], eps);
        const at::Tensor act = silu_mul(ff_quant_mm(h2, weights[w + 2], formats[w + 2], h2.size(1)));
        add_rms_norm(xl, ff_quant_mm(act, weights[w + 3], formats[w + 3], act.size(1)), next_norm, eps);
      }
      last.select(0, i).copy_(x.select(0, r - 1));
    }
    if (top_k <= 0) return {last, at::Tensor(), at::Tensor()};
    auto [values, ids] = log_softmax_topk(ff_quant_mm(last, head, f_head, last.size(1)), top_k);
    return {last, values, ids};
  }
};


// FastEagle's draft in one call (fastforward/proposers/fasteagle.py's expected_tokens, _best_shape and
// backbone_tree, the same answers): from every depth's top-K draft probabilities probs [room, K] (fp32, best first)
// and draft ids, the backbone tree of `levels` depths of k candidates each -- depth i's candidates children of depth
// i - 1's first -- with the most expected tokens per millisecond on curve_ms (t(q) = curve_ms[q - 1]) among those of
// at most `limit` nodes, or nothing (a plain step) when that is best. Expected tokens: 1 + sum over depths i of
// reach(i) * (the sum of depth i's first k probabilities), reach(i) the product of the first probabilities above it
// (float64, summed in the same order). Returns (tokens, parents, depths) [levels * k + 1] int64 (target ids, root
// first; [1] when nothing is drafted), levels, k.
std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t> backbone_draft(
    const at::Tensor& probs_in, const at::Tensor& ids_in, const at::Tensor& d2t_in,
    const std::vector<double>& curve_ms, int64_t limit, int64_t root) {
  check_f32(probs_in, "backbone_draft", "probs", 2);
  TORCH_CHECK(ids_in.sizes() == probs_in.sizes() && ids_in.scalar_type() == at::kLong &&
                  d2t_in.scalar_type() == at::kLong && d2t_in.dim() == 1,
              "backbone_draft: int64 ids shaped as probs and a 1-D int64 d2t");
  const int64_t room = probs_in.size(0), K = probs_in.size(1);
  TORCH_CHECK(room >= 1 && K >= 1 && limit >= 1 && static_cast<int64_t>(curve_ms.size()) >= limit,
              "backbone_draft: at least one depth and candidate, limit >= 1 and curve_ms of limit entries");
  const at::Tensor probs = probs_in.contiguous(), ids = ids_in.contiguous(), d2t = d2t_in.contiguous();
  const float* pp = probs.data_ptr<float>();
  std::vector<double> reach(static_cast<size_t>(room)), gain(static_cast<size_t>(K), 0.0);
  reach[0] = 1.0;
  for (int64_t i = 1; i < room; ++i)
    reach[i] = i == 1 ? static_cast<double>(pp[0]) : reach[i - 1] * static_cast<double>(pp[(i - 1) * K]);
  double best = 1.0 / curve_ms[0];
  int64_t levels = 0, k = 0;
  for (int64_t i = 0; i < room; ++i) {
    double cs = 0.0;
    for (int64_t j = 0; j < K; ++j) {
      cs = j == 0 ? static_cast<double>(pp[i * K]) : cs + static_cast<double>(pp[i * K + j]);
      gain[j] = i == 0 ? reach[0] * cs : gain[j] + reach[i] * cs;
      const int64_t nodes = (i + 1) * (j + 1) + 1;
      if (nodes > limit) continue;
      const double rate = (1.0 + gain[j]) / curve_ms[nodes - 1];
      if (rate > best) {
        best = rate;
        levels = i + 1;
        k = j + 1;
      }
    }
  }
  const int64_t n = levels * k + 1;
  at::Tensor tokens = at::empty({n}, at::kLong), parents = at::empty({n}, at::kLong), depths = at::empty({n}, at::kLong);
  int64_t *tp = tokens.data_ptr<int64_t>(), *up = parents.data_ptr<int64_t>(), *dp = depths.data_ptr<int64_t>();
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t* mp = d2t.data_ptr<int64_t>();
  const int64_t V = d2t.size(0);
  tp[0] = root;
  up[0] = -1;
  dp[0] = 0;
  for (int64_t i = 0; i < levels; ++i)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t node = 1 + i * k + j, id = ip[i * K + j];
      TORCH_CHECK(id >= 0 && id < V, "backbone_draft: a draft id outside the draft vocabulary");
      tp[node] = id + mp[id];
      up[node] = i == 0 ? 0 : 1 + (i - 1) * k;
      dp[node] = i + 1;
    }
  return {tokens, parents, depths, levels, k};
}

}  // namespace

void register_layer_ops(pybind11::module& m) {
  m.def("rms_norm", &rms_norm, "y = w * (x / sqrt(mean(x^2, -1) + eps)) per row of x [q, D] (fp32)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("eps"));
  m.def("add_rms_norm", &add_rms_norm, "x += delta (in place), then return rms_norm(x, w, eps)", pybind11::arg("x"),
        pybind11::arg("delta"), pybind11::arg("w"), pybind11::arg("eps"));
  m.def("silu_mul", &silu_mul, "silu(gu[:, :I]) * gu[:, I:] for gu [q, 2I] (fp32)", pybind11::arg("gu"));
  m.def("gelu_tanh_mul", &gelu_tanh_mul,
        "gelu_tanh(gu[:, :I]) * gu[:, I:] for gu [q, 2I] (fp32): torch's gelu(approximate='tanh'), transformers' "
        "gelu_pytorch_tanh",
        pybind11::arg("gu"));
  m.def("packed_layer", &packed_layer,
        "one decoder layer with packed weights: x += attention and MLP outputs in place, returns the next normed "
        "input", pybind11::arg("x"), pybind11::arg("h"), pybind11::arg("w_qkv"), pybind11::arg("f_qkv"),
        pybind11::arg("w_o"), pybind11::arg("f_o"), pybind11::arg("w_gu"), pybind11::arg("f_gu"),
        pybind11::arg("w_down"), pybind11::arg("f_down"), pybind11::arg("post_norm"), pybind11::arg("next_norm"),
        pybind11::arg("eps"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("positions"),
        pybind11::arg("k_all"), pybind11::arg("v_all"), pybind11::arg("layer"), pybind11::arg("start"),
        pybind11::arg("visible"), pybind11::arg("n_heads"), pybind11::arg("n_kv_heads"),
        pybind11::arg("write_slots"), pybind11::kw_only(), pybind11::arg("window") = 0,
        pybind11::arg("softcap") = 0.0, pybind11::arg("scale") = 0.0);
  m.def("argmax_rows", &argmax_rows,
        "torch.argmax of each row of x [r, V] (fp32): the first largest value's column, or the first NaN's",
        pybind11::arg("x"));
  m.def("greedy_verify", &greedy_verify,
        "greedy verification of a draft tree: the path from the root to the first accepted node of the greatest "
        "depth, then the bonus token (argmax rows computed only where needed)",
        pybind11::arg("logits"), pybind11::arg("tokens"), pybind11::arg("parents"));
  m.def("log_softmax_topk", &log_softmax_topk,
        "the k largest log-softmax values of each row of logits [r, V] (fp32) and their columns, best first "
        "(ties: the lower column first), without writing the rows' log-softmax",
        pybind11::arg("logits"), pybind11::arg("k"));
  pybind11::class_<PackedStack>(m, "PackedStack",
                                "the decoder layers of a model whose layers all run as packed_layer, kept once")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<at::Tensor>,
                          std::vector<at::Tensor>, std::vector<int64_t>, std::vector<double>, std::vector<double>,
                          double, int64_t, int64_t>(),
           pybind11::arg("weights"), pybind11::arg("formats"), pybind11::arg("post_norms"),
           pybind11::arg("next_norms"), pybind11::arg("windows"), pybind11::arg("softcaps"), pybind11::arg("scales"),
           pybind11::arg("eps"), pybind11::arg("n_heads"), pybind11::arg("n_kv_heads"))
      .def_property_readonly("layers", &PackedStack::layers)
      .def("run", &PackedStack::run,
           "every layer's packed_layer call in order over one sequence's rows: x += each layer's attention and MLP "
           "outputs in place; returns (the final normed rows, copies of x after each layer in taps)",
           pybind11::arg("x"), pybind11::arg("h"), pybind11::arg("cos"), pybind11::arg("sin"),
           pybind11::arg("positions"), pybind11::arg("k_all"), pybind11::arg("v_all"), pybind11::arg("start"),
           pybind11::arg("visible"), pybind11::arg("write_slots"), pybind11::arg("taps"),
           pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("gather_tap_rows", &gather_tap_rows,
        "a feature drafter's input rows: entry p's rows of its n_taps sources side by side, the entries in order "
        "([R, n_taps * d], the sources' dtype)",
        pybind11::arg("sources"), pybind11::arg("rows"), pybind11::arg("n_taps"));
  pybind11::class_<DraftLayerHead>(m, "DraftLayerHead",
                                   "an EAGLE-3 drafter's fusion, decoder layer, final norm and head, kept once")
      .def(pybind11::init<at::Tensor, int64_t, at::Tensor, at::Tensor, std::vector<at::Tensor>, std::vector<int64_t>,
                          at::Tensor, at::Tensor, at::Tensor, int64_t, double, int64_t, int64_t>(),
           pybind11::arg("fc"), pybind11::arg("f_fc"), pybind11::arg("in_norm"), pybind11::arg("hidden_norm"),
           pybind11::arg("weights"), pybind11::arg("formats"), pybind11::arg("post_norm"),
           pybind11::arg("final_norm"), pybind11::arg("head"), pybind11::arg("f_head"), pybind11::arg("eps"),
           pybind11::arg("n_heads"), pybind11::arg("n_kv_heads"))
      .def("run", &DraftLayerHead::run,
           "rows through the drafter's layer (fused from target taps first with fuse): returns (their outputs, or "
           "the last row's with last_only; the top_k log-probabilities of the head; their draft ids)",
           pybind11::arg("feat"), pybind11::arg("fuse"), pybind11::arg("pick"), pybind11::arg("emb"),
           pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("positions"), pybind11::arg("k"),
           pybind11::arg("v"), pybind11::arg("start"), pybind11::arg("visible"), pybind11::arg("write_slots"),
           pybind11::arg("last_only"), pybind11::arg("top_k"), pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("set_embedding", &DraftLayerHead::set_embedding,
           "the target's token embedding for expand: packed rows of kernel format fmt, or (fmt < 0) an fp32 table",
           pybind11::arg("table"), pybind11::arg("fmt"))
      .def("expand", &DraftLayerHead::expand,
           "EAGLE-2's expansion of a step's draft after the committed rows: (draft ids, log path scores, parents, "
           "depths, [rows, calls, unpaid stops, call_ms])",
           pybind11::arg("root_values"), pybind11::arg("root_ids"), pybind11::arg("last_h"), pybind11::arg("d2t"),
           pybind11::arg("k"), pybind11::arg("depth"), pybind11::arg("min_prob"), pybind11::arg("token_ms"),
           pybind11::arg("call_ms"), pybind11::arg("smoothing"), pybind11::arg("cos"), pybind11::arg("sin"),
           pybind11::arg("kc"), pybind11::arg("vc"), pybind11::arg("length"), pybind11::arg("root_position"),
           pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rerank_tree", &rerank_tree,
        "EAGLE-2's rerank in one call: the candidates ranked by score, the tree of the first n - 1 (n fixed, or the "
        "most expected tokens per millisecond on curve_ms): its tokens, parents and depths, root first",
        pybind11::arg("scores"), pybind11::arg("tokens"), pybind11::arg("parents"), pybind11::arg("depths"),
        pybind11::arg("curve_ms"), pybind11::arg("limit"), pybind11::arg("nodes"), pybind11::arg("root"));
  pybind11::class_<CascadeDrafter>(m, "CascadeDrafter",
                                   "a FastEagle drafter's fusion, input projection, cascaded layers and head, kept once")
      .def(pybind11::init<at::Tensor, int64_t, at::Tensor, int64_t, at::Tensor, at::Tensor, at::Tensor,
                          std::vector<at::Tensor>, std::vector<int64_t>, std::vector<at::Tensor>,
                          std::vector<at::Tensor>, at::Tensor, int64_t, double, int64_t, int64_t>(),
           pybind11::arg("fc"), pybind11::arg("f_fc"), pybind11::arg("fc_in"), pybind11::arg("f_fc_in"),
           pybind11::arg("fc_in_bias"), pybind11::arg("e_norm"), pybind11::arg("g_norm"), pybind11::arg("weights"),
           pybind11::arg("formats"), pybind11::arg("in_norms"), pybind11::arg("post_norms"), pybind11::arg("head"),
           pybind11::arg("f_head"), pybind11::arg("eps"), pybind11::arg("n_heads"), pybind11::arg("n_kv_heads"))
      .def("run", &CascadeDrafter::run,
           "commit rows through every layer: (the last row's output of each layer, the head's top_k "
           "log-probabilities of each, their draft ids)",
           pybind11::arg("taps"), pybind11::arg("emb"), pybind11::arg("cos"), pybind11::arg("sin"),
           pybind11::arg("positions"), pybind11::arg("k_all"), pybind11::arg("v_all"), pybind11::arg("start"),
           pybind11::arg("top_k"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("backbone_draft", &backbone_draft,
        "FastEagle's backbone tree with the most expected tokens per millisecond from every depth's top-K draft "
        "probabilities and ids: (tokens, parents, depths, levels, k); a root alone when nothing pays",
        pybind11::arg("probs"), pybind11::arg("ids"), pybind11::arg("d2t"), pybind11::arg("curve_ms"),
        pybind11::arg("limit"), pybind11::arg("root"));
  m.def("attention_many", &attention_many,
        "attention for several sequences in one call: sequence j's rows qkv[row_starts[j]:row_starts[j+1]] over "
        "k_all[j][layer] / v_all[j][layer] with its positions, start, visible and write_slots, as `attention` "
        "computes them (bitwise), the sequences spread over the threads; returns the rows' outputs in order",
        pybind11::arg("qkv"), pybind11::arg("row_starts"), pybind11::arg("cos"), pybind11::arg("sin"),
        pybind11::arg("positions"), pybind11::arg("k_all"), pybind11::arg("v_all"), pybind11::arg("layer"),
        pybind11::arg("starts"), pybind11::arg("visible"), pybind11::arg("n_heads"), pybind11::arg("n_kv_heads"),
        pybind11::arg("write_slots"), pybind11::kw_only(), pybind11::arg("window") = 0,
        pybind11::arg("softcap") = 0.0, pybind11::arg("scale") = 0.0);
  m.def("attention", &attention,
        "RoPE, KV-cache write and GQA attention of q new tokens over a prefix of `start` cached tokens plus the "
        "slots after it each row sees (visible [q, W] bool: row i sees slot start+j where visible[i, j]; None = "
        "causal); the new tokens' keys/values go to write_slots (default start..start+q-1); returns "
        "[q, n_heads * head_dim]. The caches [n_kv_heads, capacity, head_dim] are both float32 or both float16 "
        "(written rounded to nearest, read back exactly). Row i is bitwise what row i alone gives on a cache "
        "holding exactly its visible keys in order. Keyword options (defaults: none, today's bits): window > 0, "
        "a sliding window (row i sees a key at position k only if positions[i] - k < window; prefix slot s holds "
        "position s, new token j's key positions[j]); softcap > 0, scores capped to softcap * tanh(s / softcap) "
        "(Gemma 2); scale > 0, the query scale instead of 1/sqrt(head_dim).",
        pybind11::arg("qkv"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("positions"),
        pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("start"), pybind11::arg("visible"),
        pybind11::arg("n_heads"), pybind11::arg("n_kv_heads"), pybind11::arg("write_slots") = pybind11::none(),
        pybind11::kw_only(), pybind11::arg("window") = 0, pybind11::arg("softcap") = 0.0,
        pybind11::arg("scale") = 0.0);
}
