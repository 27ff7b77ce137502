// The vector ISA a native source is compiled for: exactly one of FF_ISA_AVX512 / FF_ISA_AVX2 is defined by the
// build (fastforward/kernels/__init__.py). `Isa` wraps the handful of float-vector operations the kernels use.
#pragma once
#include <immintrin.h>
#if defined(FF_ISA_EMULATED)
// For testing on CPUs without AVX-512 only: the AVX-512 source built against SIMDe's portable versions of the
// AVX-512 intrinsics (header-only, e.g. Debian's libsimde-dev), so that code path can run and be checked here.
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

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
}  // namespace ff_emulated
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
};
#else
#error "define FF_ISA_AVX512 or FF_ISA_AVX2"
#endif

using Reg = Isa::Reg;
using Mask = Isa::Mask;
constexpr int kLanes = Isa::kLanes;

}  // namespace ff
