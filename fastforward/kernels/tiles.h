// The integer tile instructions of AMX (AMX-TILE + AMX-INT8) behind one small interface, with two implementations:
//
//   ff::tiles::Amx       the hardware's (tile configuration, tileloadd, tilezero, tdpbssd, tilestored), where the
//                        compiler can emit them (FF_HAVE_AMX_INT8); to be called only where ff_amx_int8_ready();
//   ff::tiles::Emulated  the same instructions in plain C++, exactly as Intel's manual defines them, on any CPU.
//
// A kernel written once against this interface (a template over the implementation) runs the same logic on real
// tiles and, on CPUs without AMX, on the emulation, so that its tests run everywhere. The emulation also checks
// what the hardware would fault on (a tile used beyond its configuration, mismatched shapes), so a kernel that
// passes under emulation configures and uses the tiles as the hardware requires.
//
// Tiles are named by compile-time numbers 0..7 (the hardware's instructions take them as immediates).
#pragma once
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(FF_ISA_AVX512) && !defined(FF_ISA_EMULATED) && defined(__x86_64__) && defined(__GNUC__) && \
    (__GNUC__ >= 11 || defined(__clang__))
#define FF_HAVE_AMX_INT8 1
#include <immintrin.h>
#endif

namespace ff {
namespace tiles {

// The 64-byte tile configuration (palette 1): per tile its rows (<= 16) and bytes per row (<= 64).
struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void set(int t, int r, int cb) {
    rows[t] = static_cast<uint8_t>(r);
    colsb[t] = static_cast<uint16_t>(cb);
  }
};
static_assert(sizeof(Config) == 64, "the tile configuration is 64 bytes");

// Plain C++: eight tiles of 16 rows x 64 bytes and the configuration that shapes them.
struct Emulated {
  static constexpr bool kHardware = false;
  struct State {
    Config cfg;
    bool configured = false;
    alignas(64) uint8_t t[8][16][64];
  };
  static State& state() {
    thread_local State s;
    return s;
  }
  static void fail(const char* what) { throw std::logic_error(std::string("emulated AMX: ") + what); }
  static void check(int t) {
    const State& s = state();
    if (!s.configured) fail("tile used before a configuration was loaded");
    if (s.cfg.rows[t] == 0 || s.cfg.colsb[t] == 0) fail("tile not configured");
  }
  // Loads cfg, as ldtilecfg does: every tile zeroed.
  static void configure(const Config& cfg) {
    State& s = state();
    if (cfg.palette != 1) fail("palette must be 1");
    for (int t = 0; t < 8; ++t)
      if (cfg.rows[t] > 16 || cfg.colsb[t] > 64) fail("a tile is configured beyond 16 rows of 64 bytes");
    s.cfg = cfg;
    s.configured = true;
    std::memset(s.t, 0, sizeof s.t);
  }
  static void release() { state().configured = false; }
  template <int T>
  static void zero() {
    check(T);
    std::memset(state().t[T], 0, sizeof state().t[T]);
  }
  // tileloadd: rows of colsb bytes from base + r * stride; the bytes past colsb and the rows past rows read as 0.
  template <int T>
  static void load(const void* base, int64_t stride) {
    check(T);
    State& s = state();
    std::memset(s.t[T], 0, sizeof s.t[T]);
    for (int r = 0; r < s.cfg.rows[T]; ++r)
      std::memcpy(s.t[T][r], static_cast<const uint8_t*>(base) + r * stride, s.cfg.colsb[T]);
  }
  template <int T>
  static void store(void* base, int64_t stride) {
    check(T);
    const State& s = state();
    for (int r = 0; r < s.cfg.rows[T]; ++r)
      std::memcpy(static_cast<uint8_t*>(base) + r * stride, s.t[T][r], s.cfg.colsb[T]);
  }
  // tdpbssd C += A . B: C [M x N] int32, A [M x 4K] signed bytes, B [K x 4N] signed bytes (the VNNI layout):
  // C[m][n] += sum over k < K and i < 4 of A[m][4k + i] * B[k][4n + i], in 32-bit two's complement.
  template <int C, int A, int B>
  static void dpbssd() {
    check(C);
    check(A);
    check(B);
    State& s = state();
    const Config& c = s.cfg;
    if (c.colsb[A] % 4 || c.rows[B] != c.colsb[A] / 4 || c.rows[C] != c.rows[A] || c.colsb[C] != c.colsb[B])
      fail("tdpbssd: shapes do not match (C rows = A rows, B rows = A bytes / 4, C bytes = B bytes)");
    const int M = c.rows[C], N = c.colsb[C] / 4, K = c.colsb[A] / 4;
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n) {
        int32_t acc;
        std::memcpy(&acc, &s.t[C][m][4 * n], 4);
        uint32_t sum = static_cast<uint32_t>(acc);
        for (int k = 0; k < K; ++k)
          for (int i = 0; i < 4; ++i)
            sum += static_cast<uint32_t>(static_cast<int32_t>(static_cast<int8_t>(s.t[A][m][4 * k + i])) *
                                         static_cast<int32_t>(static_cast<int8_t>(s.t[B][k][4 * n + i])));
        acc = static_cast<int32_t>(sum);
        std::memcpy(&s.t[C][m][4 * n], &acc, 4);
      }
  }
};

#if defined(FF_HAVE_AMX_INT8)
// The hardware. Its member functions are compiled for AMX (target attributes), so the rest of the build does not
// need AMX flags; they must run only on a CPU and in a process that have it (ff_amx_int8_ready()).
#define FF_AMX_FN __attribute__((target("amx-tile,amx-int8"), always_inline)) static inline
struct Amx {
  static constexpr bool kHardware = true;
  FF_AMX_FN void configure(const Config& cfg) { _tile_loadconfig(&cfg); }
  FF_AMX_FN void release() { _tile_release(); }
  // GCC's tile intrinsics paste their tile numbers into the assembly text: literal numbers, one branch each.
#define FF_TILE_CASES(OP) \
  if constexpr (T == 0) OP(0); \
  else if constexpr (T == 1) OP(1); \
  else if constexpr (T == 2) OP(2); \
  else if constexpr (T == 3) OP(3); \
  else if constexpr (T == 4) OP(4); \
  else if constexpr (T == 5) OP(5); \
  else if constexpr (T == 6) OP(6); \
  else OP(7)
  template <int T>
  FF_AMX_FN void zero() {
#define FF_OP(t) _tile_zero(t)
    FF_TILE_CASES(FF_OP);
#undef FF_OP
  }
  template <int T>
  FF_AMX_FN void load(const void* base, int64_t stride) {
#define FF_OP(t) _tile_loadd(t, base, stride)
    FF_TILE_CASES(FF_OP);
#undef FF_OP
  }
  template <int T>
  FF_AMX_FN void store(void* base, int64_t stride) {
#define FF_OP(t) _tile_stored(t, base, stride)
    FF_TILE_CASES(FF_OP);
#undef FF_OP
  }
#undef FF_TILE_CASES
  // The (C, A, B) tile triples the kernels use.
  template <int C, int A, int B>
  FF_AMX_FN void dpbssd() {
    static_assert((C == 0 && A == 2 && B == 4) || (C == 1 && A == 3 && B == 4), "add this tile triple");
    if constexpr (C == 0) _tile_dpbssd(0, 2, 4);
    else _tile_dpbssd(1, 3, 4);
  }
  // The thread's configuration before ours (another library's, or none): put back by restore().
  FF_AMX_FN Config saved() {
    Config before;
    _tile_storeconfig(&before);
    return before;
  }
  FF_AMX_FN void restore(const Config& before) {
    if (before.palette != 0)
      _tile_loadconfig(&before);
    else
      _tile_release();
  }
};
#undef FF_AMX_FN
#endif

}  // namespace tiles
}  // namespace ff
