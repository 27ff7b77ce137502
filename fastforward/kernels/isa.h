// The vector ISA a native source is compiled for: exactly one of FF_ISA_AVX512 / FF_ISA_AVX2 is defined by the
// build (fastforward/kernels/__init__.py). `Isa` wraps the handful of float-vector operations the kernels use.
#pragma once
#include <immintrin.h>
#if defined(FF_ISA_EMULATED)
// For testing on CPUs without AVX-512 only: the AVX-512 source built against SIMDe's portable versions of the
// AVX-512 intrinsics (header-only, e.g. Debian's libsimde-dev), so that code path can run and be checked here.
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <cstdint>
#include <cstring>
// The intrinsics the kernels use that SIMDe 0.7 does not provide, lane by lane (masked-off lanes are neither read
// nor written, as on the hardware).
namespace ff_emulated {
template <typename To, typename From, typename V>
inline void convert16(V a, To out[16]) {  // the 16 lanes of a, as From, converted to To
  From in[16];
  std::memcpy(in, &a, sizeof in);
  for (int i = 0; i < 16; ++i) out[i] = static_cast<To>(in[i]);
}
template <typename To, typename From, typename V>
inline simde__m512i widen16(V a) {
  To out[16];
  convert16<To, From>(a, out);
  return simde_mm512_loadu_si512(out);
}
inline simde__m512 cvtepi32_ps(simde__m512i a) {
  float out[16];
  convert16<float, int32_t>(a, out);
  return simde_mm512_loadu_ps(out);
}
inline simde__m512 maskz_loadu_ps(simde__mmask16 k, const void* p) {
  float out[16];
  for (int i = 0; i < 16; ++i) out[i] = (k >> i) & 1 ? static_cast<const float*>(p)[i] : 0.0f;
  return simde_mm512_loadu_ps(out);
}
inline void mask_storeu_ps(void* p, simde__mmask16 k, simde__m512 a) {
  float in[16];
  std::memcpy(in, &a, sizeof in);
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) static_cast<float*>(p)[i] = in[i];
}
inline simde__m512 shuffle_f32x4(simde__m512 a, simde__m512 b, int imm) {  // 128-bit quarters: two of a, two of b
  float in_a[16], in_b[16], out[16];
  std::memcpy(in_a, &a, sizeof in_a);
  std::memcpy(in_b, &b, sizeof in_b);
  for (int q = 0; q < 4; ++q)
    std::memcpy(out + 4 * q, (q < 2 ? in_a : in_b) + 4 * ((imm >> (2 * q)) & 3), 4 * sizeof(float));
  return simde_mm512_loadu_ps(out);
}
inline simde__m512 cvtph_ps(simde__m256i a) {  // 16 fp16 lanes to fp32 (exact), each by F16C's scalar conversion
  uint16_t in[16];
  float out[16];
  std::memcpy(in, &a, sizeof in);
  for (int i = 0; i < 16; ++i) out[i] = _cvtsh_ss(in[i]);
  return simde_mm512_loadu_ps(out);
}
}  // namespace ff_emulated
#define _mm512_cvtph_ps ff_emulated::cvtph_ps
#define _mm512_shuffle_f32x4 ff_emulated::shuffle_f32x4
#define _mm512_cvtepi32_ps ff_emulated::cvtepi32_ps
#define _mm512_cvtepi8_epi32 ff_emulated::widen16<int32_t, int8_t>
#define _mm512_cvtepu8_epi32 ff_emulated::widen16<int32_t, uint8_t>
#define _mm512_cvtepu16_epi32 ff_emulated::widen16<int32_t, uint16_t>
#define _mm512_maskz_loadu_ps ff_emulated::maskz_loadu_ps
#define _mm512_mask_storeu_ps ff_emulated::mask_storeu_ps
#endif

#include <cstdint>

namespace ff {

#if defined(FF_ISA_AVX512)
#if defined(FF_ISA_EMULATED)
constexpr const char* kIsaName = "avx512-emulated";
#else
constexpr const char* kIsaName = "avx512";
#endif
struct Isa {
  using Reg = __m512;
  using Mask = __mmask16;
  static constexpr int kLanes = 16;
  static inline Mask mask(int n) { return static_cast<Mask>((1u << n) - 1u); }  // first n lanes, n in 1..16
  static inline Reg zero() { return _mm512_setzero_ps(); }
  static inline Reg load(const float* p) { return _mm512_loadu_ps(p); }
  static inline Reg load(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
  static inline void store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static inline void store(float* p, Reg v, Mask m) { _mm512_mask_storeu_ps(p, m, v); }
  static inline Reg bcast(const float* p) { return _mm512_set1_ps(*p); }
  static inline Reg set1(float v) { return _mm512_set1_ps(v); }
  static inline Reg fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static inline Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static inline Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static inline Reg sub(Reg a, Reg b) { return _mm512_sub_ps(a, b); }
  // A fixed reduction tree over the lanes: halves added pairwise down to one lane.
  static inline float hsum(Reg v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
  }
  // out[j] = hsum(v[j]) for j < 16, bitwise: the same pairwise additions, four stages over all sixteen vectors at
  // once (15 shuffle pairs and 15 additions, then one permutation, instead of 16 x 7 operations).
  static inline void hsum_lanes(const Reg* v, float* out) {
    Reg s1[8], s2[4], s3[2];
    for (int j = 0; j < 8; ++j)  // lanes i + (i + 8): vector 2j's in lanes 0-7, 2j+1's in lanes 8-15
      s1[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                            _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
    for (int k = 0; k < 4; ++k)  // then i + (i + 4): quarter t of s2[k] is vector 4k + t's
      s2[k] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * k], s1[2 * k + 1], 0x88),
                            _mm512_shuffle_f32x4(s1[2 * k], s1[2 * k + 1], 0xDD));
    for (int m = 0; m < 2; ++m) {  // then i + (i + 2)
      const __m512d a = _mm512_castps_pd(s2[2 * m]), b = _mm512_castps_pd(s2[2 * m + 1]);
      s3[m] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    // then 0 + 1: lane 4L + t holds vector 4t + L's sum
    const Reg s4 = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], 0x88), _mm512_shuffle_ps(s3[0], s3[1], 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, s4));
  }
};
#elif defined(FF_ISA_AVX2)
constexpr const char* kIsaName = "avx2";
struct Isa {
  using Reg = __m256;
  using Mask = __m256i;
  static constexpr int kLanes = 8;
  static inline Mask mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static inline Reg zero() { return _mm256_setzero_ps(); }
  static inline Reg load(const float* p) { return _mm256_loadu_ps(p); }
  static inline Reg load(const float* p, Mask m) { return _mm256_maskload_ps(p, m); }
  static inline void store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  static inline void store(float* p, Reg v, Mask m) { _mm256_maskstore_ps(p, m, v); }
  static inline Reg bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static inline Reg set1(float v) { return _mm256_set1_ps(v); }
  static inline Reg fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static inline Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static inline Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static inline Reg sub(Reg a, Reg b) { return _mm256_sub_ps(a, b); }
  static inline float hsum(Reg v) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
  }
  // out[j] = hsum(v[j]) for j < 8, bitwise: the same pairwise additions, three stages over all eight vectors.
  static inline void hsum_lanes(const Reg* v, float* out) {
    Reg s1[4], s2[2];
    for (int j = 0; j < 4; ++j)  // lanes i + (i + 4): vector 2j's in lanes 0-3, 2j+1's in lanes 4-7
      s1[j] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * j], v[2 * j + 1], 0x20),
                            _mm256_permute2f128_ps(v[2 * j], v[2 * j + 1], 0x31));
    for (int k = 0; k < 2; ++k) {  // then i + (i + 2)
      const __m256d a = _mm256_castps_pd(s1[2 * k]), b = _mm256_castps_pd(s1[2 * k + 1]);
      s2[k] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
    }
    // then 0 + 1: lane 4L + t holds vector 2t + L's sum
    const Reg s3 = _mm256_add_ps(_mm256_shuffle_ps(s2[0], s2[1], 0x88), _mm256_shuffle_ps(s2[0], s2[1], 0xDD));
    _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(s3, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
};
#else
#error "define FF_ISA_AVX512 or FF_ISA_AVX2"
#endif

using Reg = Isa::Reg;
using Mask = Isa::Mask;
constexpr int kLanes = Isa::kLanes;

}  // namespace ff
