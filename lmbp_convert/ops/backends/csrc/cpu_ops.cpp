// Native CPU kernels for lmbp_convert's ops: one pass over memory per direction, fp32 maths in registers,
// one rounding to the output dtype (no fp32 copies of bf16/fp16 tensors).
//
// Plain C++ without torch headers (so it builds in seconds). The approx-act and MS-norm kernels have explicit
// AVX-512 and AVX2+FMA loops (intrinsics, picked by the macros -march=native defines; see "SIMD"); the tails,
// and every kernel on other CPUs (NEON, ...), are branch-free scalar loops the compiler vectorises for the host.
// Multi-threading uses OpenMP with the same chunking as ATen's at::parallel_for; the library links the libgomp
// torch already loaded, so both share one thread pool. Called through ctypes from cpu_native.py, which owns
// every check (dtypes, contiguity, sizes): these functions trust their arguments.
//
// Semantics mirror the PyTorch path of approx_act.py / ms_norm.py (see their docstrings):
//   approx_act forward: y = act(x) in fp32, rounded once to x's dtype; code = #thresholds x exceeds (fp32
//     compare; NaN exceeds none); codes packed low slot first, element i -> byte i / P, bit (i % P) * S.
//   approx_act backward: dx = grad * slope[code] in fp32, rounded once to grad's dtype.
//   MS LayerNorm/RMSNorm forward: per row, fp32 statistics, y = (x - mean) * rstd (RMS: x * rstd).
//   MS norm backward from y: dx = rstd * (g - mean(g) - y * mean(g * y)) (RMS: without mean(g)).
//   exact norm's affine (norm_affine.py): y = x̂·γ + β, product and sum each rounded to fp32 (bitwise the
//     PyTorch path); backward dx̂ = g·γ (bitwise), dw = Σ g·x̂ and dβ = Σ g over rows in fp32.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

// ------------------------------------------------------------------------------------------- dtypes
enum DType : int { F32 = 0, BF16 = 1, F16 = 2 };

static inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

struct bf16 { uint16_t bits; };

template <typename T> struct IO;
template <> struct IO<float> {
  static inline float load(float v) { return v; }
  static inline float store(float v) { return v; }
};
template <> struct IO<bf16> {
  static inline float load(bf16 v) {
    uint32_t u = uint32_t(v.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static inline bf16 store(float f) {  // round to nearest even; NaN -> canonical quiet NaN (as c10::BFloat16)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return bf16{uint16_t(f != f ? 0x7fc0u : r)};
  }
};
// IEEE half through integer bit operations (vectorisable everywhere; no _Float16 or F16C needed):
// F. Giesen's half_to_float / float_to_half_fast3_rtne (round to nearest even, subnormals, inf, NaN).
struct f16 { uint16_t bits; };
template <> struct IO<f16> {
  static inline float load(f16 v) {
    uint32_t h = v.bits;
    uint32_t em = (h & 0x7fffu) << 13;
    float f = bits_to_float(em) * 5.192296858534828e+33f;  // 2**112: rebias (subnormals come out exact)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u = em >= (0x7c00u << 13) ? (em | 0x7f800000u) : u;  // inf / NaN
    return bits_to_float(u | ((h & 0x8000u) << 16));
  }
  static inline f16 store(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    // subnormal results: let the fp32 adder round, by adding 0.5 (exponent 126, mantissa aligned to 2**-24)
    const uint32_t denorm_magic = ((127 - 15) + (23 - 10) + 1) << 23;
    float t = bits_to_float(u) + bits_to_float(denorm_magic);
    uint32_t tu;
    std::memcpy(&tu, &t, 4);
    uint32_t sub = tu - denorm_magic;
    uint32_t norm = (u + ((uint32_t)(15 - 127) << 23) + 0xfffu + ((u >> 13) & 1u)) >> 13;
    uint32_t o = u >= ((127u + 16u) << 23) ? (u > 0x7f800000u ? 0x7e00u : 0x7c00u)
                                            : (u < (113u << 23) ? sub : norm);
    return f16{uint16_t(o | (sign >> 16))};
  }
};

template <typename T> static inline float ld(const T* p, int64_t i) { return IO<T>::load(p[i]); }
template <typename T> static inline void st(T* p, int64_t i, float v) { p[i] = IO<T>::store(v); }

// -------------------------------------------------------------------------------------- threading
static inline int64_t divup(int64_t a, int64_t b) { return (a + b - 1) / b; }

// f(begin, end) over [0, n) in contiguous chunks, one per thread, as at::parallel_for: serial below
// `grain` items per thread, inside a parallel region, or with one thread.
template <typename F>
static void parallel_for(int64_t n, int64_t grain, int nthreads, const F& f) {
  if (n <= 0) return;
#ifdef _OPENMP
  if (nthreads > 1 && n > grain && !omp_in_parallel()) {
    if (omp_get_max_threads() != nthreads) omp_set_num_threads(nthreads);
#pragma omp parallel
    {
      int64_t nt = omp_get_num_threads();
      nt = nt < divup(n, grain) ? nt : divup(n, grain);
      int64_t chunk = divup(n, nt);
      int64_t b = int64_t(omp_get_thread_num()) * chunk;
      if (b < n) f(b, b + chunk < n ? b + chunk : n);
    }
    return;
  }
#endif
  (void)grain;
  (void)nthreads;
  f(0, n);
}

constexpr int64_t kGrain = 32768;  // elements per thread below which a loop stays serial (ATen's GRAIN_SIZE)

// ------------------------------------------------------------------------------------------- maths

// exp(x) for every float: Cephes' polynomial on [-ln2/2, ln2/2] (~1 ulp) times 2**n; +inf above 88.37 and 0
// below -87.33 (where 2**n leaves the normal range: the true values there are within 1.2e-38 of 0 or within
// 1.5 of FLT_MAX, and every activation here divides by or multiplies into them), NaN stays NaN.
static inline float exp_f32(float x) {
  float xc = x < 88.37f ? x : 88.37f;  // min / max (NaN goes to a bound here and is restored at the end)
  xc = xc > -87.33f ? xc : -87.33f;
  float n = std::nearbyint(xc * 1.44269504088896341f);
  float r = std::fma(n, -0.693359375f, xc);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r) + 1.0f;
  float y = p * bits_to_float(uint32_t(int32_t(n) + 127) << 23);
  y = x > 88.37f ? INFINITY : y;
  y = x < -87.33f ? 0.0f : y;
  return x != x ? x : y;
}

// erf(x): Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7), the formula ATen's vectorised CPU erf uses;
// exactly +-1 at +-inf, NaN for NaN.
static inline float erf_f32(float x) {
  float a = std::fabs(x);
  float t = 1.0f / std::fma(0.3275911f, a, 1.0f);
  float r = 1.061405429f;
  r = std::fma(r, t, -1.453152027f);
  r = std::fma(r, t, 1.421413741f);
  r = std::fma(r, t, -0.284496736f);
  r = std::fma(r, t, 0.254829592f);
  float e = 1.0f - r * t * exp_f32(-a * a);
  return std::copysign(e, x);
}

enum Kind : int { GELU = 0, GELU_TANH = 1, SILU = 2, QUICK_GELU = 3 };

template <int KIND>
static inline float act(float x) {
  if (KIND == GELU) return x * 0.5f * (1.0f + erf_f32(x * 0.70710678118654752f));
  if (KIND == GELU_TANH) {  // 0.5 x (1 + tanh(u)) == x * sigmoid(2u): no cancellation for negative u
    float u = 0.79788456080286536f * (x + 0.044715f * x * x * x);
    return x / (1.0f + exp_f32(-2.0f * u));
  }
  if (KIND == SILU) return x / (1.0f + exp_f32(-x));
  return x / (1.0f + exp_f32(-1.702f * x));  // quick_gelu: x * sigmoid(1.702 x)
}

// ------------------------------------------------------------------------------------------- SIMD
// Explicit vector loops for the approx-act kernels where the host has AVX-512F or AVX2+FMA (-march=native
// defines the macros): the activation, its codes and their packing from one register, and the backward's slope
// lookup as one in-register permute. The scalar loops above stay for the tails, for other CPUs (NEON, ...) and
// as the reference the vector code mirrors (same polynomials, same fp32 compares, same rounding).
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define LMBP_SIMD 1

// Bit i of m moved to bit S*i (S = 1, 2, 4; m < 2**16): Morton spreading, branch-free integer maths.
template <int S>
static inline uint64_t spread_bits(uint32_t m) {
  uint64_t x = m;
  if (S == 2) {
    x = (x | (x << 8)) & 0x00FF00FFull;
    x = (x | (x << 4)) & 0x0F0F0F0Full;
    x = (x | (x << 2)) & 0x33333333ull;
    x = (x | (x << 1)) & 0x55555555ull;
  } else if (S == 4) {
    x = (x | (x << 24)) & 0x000000FF000000FFull;
    x = (x | (x << 12)) & 0x000F000F000F000Full;
    x = (x | (x << 6)) & 0x0303030303030303ull;
    x = (x | (x << 3)) & 0x1111111111111111ull;
  }
  return x;
}

#if defined(__AVX512F__)
constexpr int kLanes = 16;
using VF = __m512;
using VI = __m512i;
static inline VF vset(float v) { return _mm512_set1_ps(v); }
static inline VF vadd(VF a, VF b) { return _mm512_add_ps(a, b); }
static inline VF vsub(VF a, VF b) { return _mm512_sub_ps(a, b); }
static inline VF vmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
static inline VF vdiv(VF a, VF b) { return _mm512_div_ps(a, b); }
static inline VF vfma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
static inline VF vmin(VF a, VF b) { return _mm512_min_ps(a, b); }
static inline float vhsum(VF a) { return _mm512_reduce_add_ps(a); }
static inline VF vmax(VF a, VF b) { return _mm512_max_ps(a, b); }
static inline VF vabs(VF a) { return _mm512_abs_ps(a); }
static inline VF vround(VF a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline VF vcopysign(VF mag, VF sgn) {
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(mag), _mm512_castps_si512(sgn),
                                                       _mm512_set1_epi32(0x80000000), 0xD8));  // sign from sgn
}
static inline VF vpow2n(VF n) {  // 2**n for integral n in the normal range
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
// where(a > b, x, y)
static inline VF vsel_gt(VF a, VF b, VF x, VF y) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ), y, x);
}
// codes: #thresholds v exceeds (fp32 compare, NaN exceeds none), as an int vector
template <int NTHR>
static inline VI vcodes(VF v, const VF* thr) {
  VI c = _mm512_setzero_si512();
  const VI one = _mm512_set1_epi32(1);
  for (int j = 0; j < NTHR; ++j) c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(v, thr[j], _CMP_GT_OQ), c, one);
  return c;
}
static inline uint32_t vbit_mask(VI c, int k) { return _mm512_test_epi32_mask(c, _mm512_set1_epi32(1 << k)); }
// lanes i: (word >> (S * i)) & (2**S - 1), for the L*S bits of `bits` (S*16 <= 64)
template <int S>
static inline VI vunpack(uint64_t bits) {
  const VI lo = _mm512_set1_epi32(int32_t(uint32_t(bits)));
  VI w = lo;
  if (S == 4) w = _mm512_mask_blend_epi32(0xFF00, lo, _mm512_set1_epi32(int32_t(uint32_t(bits >> 32))));
  const VI lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const VI sh = _mm512_and_si512(_mm512_mullo_epi32(lane, _mm512_set1_epi32(S)), _mm512_set1_epi32(31));
  return _mm512_and_si512(_mm512_srlv_epi32(w, sh), _mm512_set1_epi32((1 << S) - 1));
}
struct SlopeTable { VF t; };
static inline SlopeTable vtable(const float* slopes16) { return {_mm512_loadu_ps(slopes16)}; }
static inline VF vlookup(const SlopeTable& tab, VI code) { return _mm512_permutexvar_ps(code, tab.t); }

template <typename T> struct VIO;
template <> struct VIO<float> {
  static inline VF load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, VF v) { _mm512_storeu_ps(p, v); }
};
template <> struct VIO<bf16> {
  static inline VF load(const bf16* p) {
    VI u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
  }
  static inline void store(bf16* p, VF v) {  // round to nearest even; NaN -> 0x7fc0 (as IO<bf16>::store)
    VI u = _mm512_castps_si512(v);
    VI lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    VI r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
};
template <> struct VIO<f16> {
  static inline VF load(const f16* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline void store(f16* p, VF v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};
#else  // AVX2 + FMA
constexpr int kLanes = 8;
using VF = __m256;
using VI = __m256i;
static inline VF vset(float v) { return _mm256_set1_ps(v); }
static inline VF vadd(VF a, VF b) { return _mm256_add_ps(a, b); }
static inline VF vsub(VF a, VF b) { return _mm256_sub_ps(a, b); }
static inline VF vmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
static inline VF vdiv(VF a, VF b) { return _mm256_div_ps(a, b); }
static inline VF vfma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
static inline VF vmin(VF a, VF b) { return _mm256_min_ps(a, b); }
static inline float vhsum(VF a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline VF vmax(VF a, VF b) { return _mm256_max_ps(a, b); }
static inline VF vabs(VF a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
static inline VF vround(VF a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline VF vcopysign(VF mag, VF sgn) {
  const VF s = _mm256_set1_ps(-0.0f);
  return _mm256_or_ps(_mm256_andnot_ps(s, mag), _mm256_and_ps(s, sgn));
}
static inline VF vpow2n(VF n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline VF vsel_gt(VF a, VF b, VF x, VF y) { return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_GT_OQ)); }
template <int NTHR>
static inline VI vcodes(VF v, const VF* thr) {
  VI c = _mm256_setzero_si256();
  for (int j = 0; j < NTHR; ++j) c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(v, thr[j], _CMP_GT_OQ)));
  return c;
}
static inline uint32_t vbit_mask(VI c, int k) {
  return uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_sll_epi32(c, _mm_cvtsi32_si128(31 - k)))));
}
template <int S>
static inline VI vunpack(uint64_t bits) {  // 8 lanes: at most 32 bits
  const VI w = _mm256_set1_epi32(int32_t(uint32_t(bits)));
  const VI sh = _mm256_setr_epi32(0, S, 2 * S, 3 * S, 4 * S, 5 * S, 6 * S, 7 * S);
  return _mm256_and_si256(_mm256_srlv_epi32(w, sh), _mm256_set1_epi32((1 << S) - 1));
}
struct SlopeTable { VF lo, hi; };
static inline SlopeTable vtable(const float* slopes16) {
  return {_mm256_loadu_ps(slopes16), _mm256_loadu_ps(slopes16 + 8)};
}
static inline VF vlookup(const SlopeTable& tab, VI code) {  // 16 entries: two 8-entry permutes, bit 3 picks
  VF a = _mm256_permutevar8x32_ps(tab.lo, code), b = _mm256_permutevar8x32_ps(tab.hi, code);
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(code, 28)));
}

template <typename T> struct VIO;
template <> struct VIO<float> {
  static inline VF load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, VF v) { _mm256_storeu_ps(p, v); }
};
template <> struct VIO<bf16> {
  static inline VF load(const bf16* p) {
    VI u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  }
  static inline void store(bf16* p, VF v) {
    VI u = _mm256_castps_si256(v);
    VI lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    VI r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc0)),
                                             _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
};
#if defined(__F16C__)
template <> struct VIO<f16> {
  static inline VF load(const f16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static inline void store(f16* p, VF v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};
#endif
#endif  // ISA

// Store of a forward output (a value compared within tolerance, never bit for bit): with AVX512-BF16 one
// instruction rounds to nearest even (NaN stays NaN; fp32 subnormals, |v| < 2**-126, become ±0). Everything
// compared bit for bit (the backward's dx) goes through VIO<T>::store.
template <typename T>
static inline void vstore_out(T* p, VF v) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (std::is_same<T, bf16>::value) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
    return;
  }
#endif
  VIO<T>::store(p, v);
}

// dtypes with vector loads and stores (fp16 on AVX2 needs F16C)
template <typename T> constexpr bool kVec = true;
#if !defined(__AVX512F__) && !defined(__F16C__)
template <> constexpr bool kVec<f16> = false;
#endif

// exp_f32 on a vector: the same clamp and Cephes polynomial. NaN propagates through the clamp (x86 min/max return
// their second operand when either is NaN); above 88.37 the result is +inf, as exp_f32's. Below -87.33 it stays
// at the clamp's 2**-126-ish value instead of exp_f32's 0: every caller adds it to 1 or multiplies it into a
// factor < 1, where the two agree.
static inline VF vexp(VF x) {
  VF xc = vmax(vset(-87.33f), vmin(vset(88.37f), x));
  VF n = vround(vmul(xc, vset(1.44269504088896341f)));
  VF r = vfma(n, vset(-0.693359375f), xc);
  r = vfma(n, vset(2.12194440e-4f), r);
  VF p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  p = vadd(vfma(p, vmul(r, r), r), vset(1.0f));
  VF y = vmul(p, vpow2n(n));
  return vsel_gt(x, vset(88.37f), vset(INFINITY), y);
}

static inline VF verf(VF x) {
  VF a = vabs(x);
  VF t = vdiv(vset(1.0f), vfma(vset(0.3275911f), a, vset(1.0f)));
  VF r = vset(1.061405429f);
  r = vfma(r, t, vset(-1.453152027f));
  r = vfma(r, t, vset(1.421413741f));
  r = vfma(r, t, vset(-0.284496736f));
  r = vfma(r, t, vset(0.254829592f));
  VF e = vsub(vset(1.0f), vmul(vmul(r, t), vexp(vmul(vmul(a, vset(-1.0f)), a))));
  return vcopysign(e, x);
}

template <int KIND>
static inline VF vact(VF x) {
  if (KIND == GELU) return vmul(vmul(x, vset(0.5f)), vadd(vset(1.0f), verf(vmul(x, vset(0.70710678118654752f)))));
  if (KIND == GELU_TANH) {
    VF u = vmul(vset(0.79788456080286536f), vadd(x, vmul(vmul(vmul(vset(0.044715f), x), x), x)));
    return vdiv(x, vadd(vset(1.0f), vexp(vmul(vset(-2.0f), u))));
  }
  if (KIND == SILU) return vdiv(x, vadd(vset(1.0f), vexp(vmul(x, vset(-1.0f)))));
  return vdiv(x, vadd(vset(1.0f), vexp(vmul(vset(-1.702f), x))));
}

// Forward over [0, len) of one block, len a multiple of kLanes: y = act(x), codes packed into `out`
// (kLanes * S / 8 bytes per vector).
template <typename T, int KIND, int NTHR, int S>
static inline void act_fwd_vec(const T* x, T* y, uint8_t* out, int64_t len, const VF* thr) {
  // Two vectors per iteration: the activations are long dependency chains (a division, a polynomial), and two
  // independent ones keep the FMA units busy where one leaves them waiting on latency.
  int64_t i = 0;
  for (; i + 2 * kLanes <= len; i += 2 * kLanes) {
    VF v0 = VIO<T>::load(x + i), v1 = VIO<T>::load(x + i + kLanes);
    VF a0 = vact<KIND>(v0), a1 = vact<KIND>(v1);
    vstore_out(y + i, a0);
    vstore_out(y + i + kLanes, a1);
    VI c0 = vcodes<NTHR>(v0, thr), c1 = vcodes<NTHR>(v1, thr);
    uint64_t w0 = 0, w1 = 0;
    for (int k = 0; k < S; ++k) {
      w0 |= spread_bits<S>(vbit_mask(c0, k)) << k;
      w1 |= spread_bits<S>(vbit_mask(c1, k)) << k;
    }
    std::memcpy(out + i * S / 8, &w0, kLanes * S / 8);
    std::memcpy(out + (i + kLanes) * S / 8, &w1, kLanes * S / 8);
  }
  for (; i < len; i += kLanes) {
    VF v = VIO<T>::load(x + i);
    vstore_out(y + i, vact<KIND>(v));
    VI c = vcodes<NTHR>(v, thr);
    uint64_t word = 0;
    for (int k = 0; k < S; ++k) word |= spread_bits<S>(vbit_mask(c, k)) << k;
    std::memcpy(out + i * S / 8, &word, kLanes * S / 8);
  }
}

template <typename T, int S>
static inline void act_bwd_vec(const T* g, const uint8_t* packed, T* dx, int64_t len, const SlopeTable& tab) {
  for (int64_t i = 0; i < len; i += kLanes) {
    uint64_t word = 0;
    std::memcpy(&word, packed + i * S / 8, kLanes * S / 8);
    VIO<T>::store(dx + i, vmul(VIO<T>::load(g + i), vlookup(tab, vunpack<S>(word))));
  }
}
#endif  // LMBP_SIMD

// --------------------------------------------------------------------------------- approx act fwd
constexpr int64_t kBlock = 1024;  // elements per inner block: codes staged in L1, then packed

// Pack n codes (bytes < 2**S) from `codes` into ceil(n / P) bytes: the P code bytes of one packed byte are
// read as one little-endian word and gathered by one multiply (as pack_codes in approx_act.py).
template <int S>
static inline void pack_block(const uint8_t* codes, uint8_t* out, int64_t nbytes) {
  if (S == 1) {
    for (int64_t b = 0; b < nbytes; ++b) {
      uint64_t w; std::memcpy(&w, codes + 8 * b, 8);
      out[b] = uint8_t((w * 0x0102040810204080ull) >> 56);
    }
  } else if (S == 2) {
    for (int64_t b = 0; b < nbytes; ++b) {
      uint32_t w; std::memcpy(&w, codes + 4 * b, 4);
      out[b] = uint8_t((w * 0x01041040u) >> 24);
    }
  } else {
    for (int64_t b = 0; b < nbytes; ++b) {
      uint16_t w; std::memcpy(&w, codes + 2 * b, 2);
      out[b] = uint8_t((uint32_t(w) * 0x110u) >> 8);
    }
  }
}

// Scalar forward over [0, len) of one block: activation and codes (staged in L1), then the codes packed into
// `out` (ceil(len / P) bytes, the last one zero-padded).
template <typename T, int KIND, int NTHR, int S>
static void act_fwd_scalar(const T* xb, T* yb, uint8_t* out, int64_t len, const float* thr, uint8_t* codes) {
  constexpr int64_t P = 8 / S;
  // For the cheap activations (silu, quick_gelu) two loops are faster (each vectorises at full float width, where
  // a fused loop runs at the width of the code bytes); for the erf/tanh ones one fused loop is.
  if (KIND == SILU || KIND == QUICK_GELU) {
    for (int64_t i = 0; i < len; ++i) st(yb, i, act<KIND>(ld(xb, i)));
    for (int64_t i = 0; i < len; ++i) {
      float v = ld(xb, i);
      int32_t c = 0;
      for (int j = 0; j < NTHR; ++j) c += int32_t(v > thr[j]);  // NaN exceeds none
      codes[i] = uint8_t(c);
    }
  } else {
    for (int64_t i = 0; i < len; ++i) {
      float v = ld(xb, i);
      st(yb, i, act<KIND>(v));
      int32_t c = 0;
      for (int j = 0; j < NTHR; ++j) c += int32_t(v > thr[j]);
      codes[i] = uint8_t(c);
    }
  }
  const int64_t nb = divup(len, P);
  for (int64_t i = len; i < nb * P; ++i) codes[i] = 0;
  pack_block<S>(codes, out, nb);
}

template <typename T, int KIND, int NTHR, int S>
static void act_fwd_impl(const T* x, T* y, uint8_t* packed, int64_t n, const float* thr_in, int nthreads) {
  constexpr int64_t P = 8 / S;
  float thr[NTHR];
  for (int j = 0; j < NTHR; ++j) thr[j] = thr_in[j];
  const int64_t nblocks = divup(n, kBlock);
  parallel_for(nblocks, kGrain / kBlock, nthreads, [&](int64_t b0, int64_t b1) {
    alignas(64) uint8_t codes[kBlock];
#ifdef LMBP_SIMD
    VF vthr[NTHR];
    for (int j = 0; j < NTHR; ++j) vthr[j] = vset(thr[j]);
#endif
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t start = blk * kBlock;
      const int64_t len = n - start < kBlock ? n - start : kBlock;
      int64_t done = 0;
#ifdef LMBP_SIMD
      if constexpr (kVec<T>) {
        done = len / kLanes * kLanes;  // kBlock is a multiple of kLanes: only the last block has a tail
        act_fwd_vec<T, KIND, NTHR, S>(x + start, y + start, packed + start / P, done, vthr);
      }
#endif
      if (done < len)
        act_fwd_scalar<T, KIND, NTHR, S>(x + start + done, y + start + done, packed + (start + done) / P, len - done,
                                         thr, codes);
    }
  });
}

// ---------------------------------------------------------------------------------- approx act bwd
// dx = g * slope, slope read from a [256][P] table indexed by the packed byte (one lookup per P elements).
template <typename T, int S>
static void act_bwd_impl(const T* g, const uint8_t* packed, T* dx, int64_t n, const float* table,
                         int nthreads) {
  constexpr int64_t P = 8 / S;
  const int64_t nblocks = divup(n, kBlock);
  parallel_for(nblocks, kGrain / kBlock, nthreads, [&](int64_t b0, int64_t b1) {
    alignas(64) float slope[kBlock];
#ifdef LMBP_SIMD
    // the slope of code c is the first slot of byte c: table[c * P] (codes < 2**S <= 16; unused entries are 0)
    alignas(64) float per_code[16] = {0};
    for (int c = 0; c < (1 << S); ++c) per_code[c] = table[c * P];
    const SlopeTable vtab = vtable(per_code);
#endif
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t start = blk * kBlock;
      const int64_t len = n - start < kBlock ? n - start : kBlock;
      int64_t done = 0;
#ifdef LMBP_SIMD
      if constexpr (kVec<T>) {
        done = len / kLanes * kLanes;
        act_bwd_vec<T, S>(g + start, packed + start / P, dx + start, done, vtab);
      }
#endif
      if (done == len) continue;
      const uint8_t* pb = packed + (start + done) / P;
      const int64_t rest = len - done;
      const int64_t nb = divup(rest, P);
      for (int64_t b = 0; b < nb; ++b) std::memcpy(slope + b * P, table + int64_t(pb[b]) * P, P * sizeof(float));
      const T* gb = g + start + done;
      T* db = dx + start + done;
      for (int64_t i = 0; i < rest; ++i) st(db, i, ld(gb, i) * slope[i]);
    }
  });
}

// -------------------------------------------------------------------------------------- MS norms
// Sum of f(i) over [0, n) with 16 independent accumulators, so the loop vectorises without reassociation
// flags; the partial sums are added in a fixed order (deterministic for any thread count).
template <typename F>
static inline float row_sum(int64_t n, const F& f) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += f(i + j);
  for (int j = 0; i < n; ++i, ++j) acc[j] += f(i);
  float s = 0.0f;
  for (int j = 0; j < 16; ++j) s += acc[j];
  return s;
}

#ifdef LMBP_SIMD
// Sum over a row of f(v) for v the row's values in fp32: two vector accumulators, then the scalar tail.
template <typename T, typename VFn, typename SFn>
static inline float vrow_sum(const T* p, int64_t n, const VFn& vf, const SFn& sf) {
  VF a0 = vset(0.0f), a1 = vset(0.0f);
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    a0 = vadd(a0, vf(VIO<T>::load(p + i)));
    a1 = vadd(a1, vf(VIO<T>::load(p + i + kLanes)));
  }
  for (; i + kLanes <= n; i += kLanes) a0 = vadd(a0, vf(VIO<T>::load(p + i)));
  float s = vhsum(vadd(a0, a1));
  for (; i < n; ++i) s += sf(ld(p, i));
  return s;
}
#endif

// One row: y = (x - mean) * rstd (RMS: x * rstd), fp32 statistics; returns rstd. ``buf``: n floats of scratch
// (the scalar path's fp32 copy of the row).
template <typename TI, typename TO>
static inline float norm_fwd_row(const TI* xr, TO* yr, int64_t n, float eps, bool rms, float* buf) {
#ifdef LMBP_SIMD
  if constexpr (kVec<TI> && kVec<TO>) {  // straight from the row (L1/L2 after the first pass), no fp32 copy
    (void)buf;
    float mean = 0.0f;
    if (!rms) mean = vrow_sum(xr, n, [](VF v) { return v; }, [](float v) { return v; }) / float(n);
    const VF vm = vset(mean);
    float var = vrow_sum(xr, n, [&](VF v) { VF d = vsub(v, vm); return vmul(d, d); },
                         [&](float v) { float d = v - mean; return d * d; }) / float(n);
    float rs = 1.0f / std::sqrt(var + eps);
    const VF vr = vset(rs);
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) vstore_out(yr + i, vmul(vsub(VIO<TI>::load(xr + i), vm), vr));
    for (; i < n; ++i) st(yr, i, (ld(xr, i) - mean) * rs);
    return rs;
  }
#endif
  float* xf = buf;
  for (int64_t i = 0; i < n; ++i) xf[i] = ld(xr, i);  // the row in fp32, from L1 from here on
  float mean = 0.0f;
  if (!rms) mean = row_sum(n, [&](int64_t i) { return xf[i]; }) / float(n);
  float var = row_sum(n, [&](int64_t i) { float d = xf[i] - mean; return d * d; }) / float(n);
  float rs = 1.0f / std::sqrt(var + eps);
  for (int64_t i = 0; i < n; ++i) st(yr, i, (xf[i] - mean) * rs);
  return rs;
}

template <typename TI, typename TO>
static void norm_fwd_impl(const TI* x, TO* y, float* rstd, int64_t rows, int64_t n, float eps, bool rms,
                          int nthreads) {
  parallel_for(rows, divup(kGrain, n), nthreads, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(n);
    for (int64_t r = r0; r < r1; ++r) rstd[r] = norm_fwd_row(x + r * n, y + r * n, n, eps, rms, buf.data());
  });
}

// One row of the MS norm's backward from its output y: dx = rstd * (g - mean(g) - y * mean(g * y)).
template <typename TY, typename TD>
static inline void norm_bwd_row(const TY* gr, const TY* yr, float rs, TD* dr, int64_t n, bool rms) {
#ifdef LMBP_SIMD
  if constexpr (kVec<TY> && kVec<TD>) {
    VF s0 = vset(0.0f), s1 = vset(0.0f), p0 = vset(0.0f), p1 = vset(0.0f);  // sum g, sum g*y
    int64_t i = 0;
    for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
      VF g0 = VIO<TY>::load(gr + i), g1 = VIO<TY>::load(gr + i + kLanes);
      s0 = vadd(s0, g0);
      s1 = vadd(s1, g1);
      p0 = vfma(g0, VIO<TY>::load(yr + i), p0);
      p1 = vfma(g1, VIO<TY>::load(yr + i + kLanes), p1);
    }
    for (; i + kLanes <= n; i += kLanes) {
      VF g0 = VIO<TY>::load(gr + i);
      s0 = vadd(s0, g0);
      p0 = vfma(g0, VIO<TY>::load(yr + i), p0);
    }
    float sg = vhsum(vadd(s0, s1)), sgy = vhsum(vadd(p0, p1));
    for (; i < n; ++i) {
      sg += ld(gr, i);
      sgy += ld(gr, i) * ld(yr, i);
    }
    const float mg = rms ? 0.0f : sg / float(n), mgy = sgy / float(n);
    const VF vmg = vset(mg), vmgy = vset(mgy), vrs = vset(rs);
    for (i = 0; i + kLanes <= n; i += kLanes) {
      VF d = vsub(vsub(VIO<TY>::load(gr + i), vmg), vmul(VIO<TY>::load(yr + i), vmgy));
      vstore_out(dr + i, vmul(d, vrs));
    }
    for (; i < n; ++i) st(dr, i, (ld(gr, i) - mg - ld(yr, i) * mgy) * rs);
    return;
  }
#endif
  float mg = rms ? 0.0f : row_sum(n, [&](int64_t i) { return ld(gr, i); }) / float(n);
  float mgy = row_sum(n, [&](int64_t i) { return ld(gr, i) * ld(yr, i); }) / float(n);
  for (int64_t i = 0; i < n; ++i) st(dr, i, (ld(gr, i) - mg - ld(yr, i) * mgy) * rs);
}

template <typename TY, typename TD>
static void norm_bwd_impl(const TY* g, const TY* y, const float* rstd, TD* dx, int64_t rows, int64_t n, bool rms,
                          int nthreads) {
  parallel_for(rows, divup(kGrain, n), nthreads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_bwd_row(g + r * n, y + r * n, rstd[r], dx + r * n, n, rms);
  });
}

// ------------------------------------------------------------------------------ exact norm's affine
// y = x̂·γ + β (ops/norm_affine.py): the product and the sum each rounded to fp32, then once to y's dtype, as
// torch.mul(out=fp32) then torch.add(out=y) compute them, so the values are bitwise the PyTorch path's. KEEP makes
// the product opaque to the optimiser, which would otherwise fuse it with the add into one FMA (one rounding).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LMBP_KEEP(v) asm("" : "+v"(v))
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#define LMBP_KEEP(v) asm("" : "+w"(v))
#else
#define LMBP_KEEP(v) do { volatile float lmbp_keep_ = (v); (v) = lmbp_keep_; } while (0)
#endif

template <typename TX, typename TO>
static inline void affine_fwd_row(const TX* xr, const float* gamma, const float* beta, TO* yr, int64_t n) {
  int64_t i = 0;
#ifdef LMBP_SIMD
  if constexpr (kVec<TX> && kVec<TO>) {  // VIO stores (never vstore_out): bitwise the PyTorch path's rounding
    if (beta != nullptr) {
      for (; i + kLanes <= n; i += kLanes) {
        VF p = vmul(VIO<TX>::load(xr + i), VIO<float>::load(gamma + i));
        LMBP_KEEP(p);
        VIO<TO>::store(yr + i, vadd(p, VIO<float>::load(beta + i)));
      }
    } else {
      for (; i + kLanes <= n; i += kLanes)
        VIO<TO>::store(yr + i, vmul(VIO<TX>::load(xr + i), VIO<float>::load(gamma + i)));
    }
  }
#endif
  for (; i < n; ++i) {
    float p = ld(xr, i) * gamma[i];
    if (beta != nullptr) {
      LMBP_KEEP(p);
      p = p + beta[i];
    }
    st(yr, i, p);
  }
}

template <typename TX, typename TO>
static void affine_fwd_impl(const TX* x, const float* gamma, const float* beta, TO* y, int64_t rows, int64_t n,
                            int nthreads) {
  parallel_for(rows, divup(kGrain, n), nthreads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) affine_fwd_row(x + r * n, gamma, beta, y + r * n, n);
  });
}

// The exact norm's forward in one pass: x̂ as norm_fwd computes it, then y from the x̂ just stored (read back in
// its dtype, from L1), so y is bitwise affine_fwd(x̂).
template <typename TI, typename TH, typename TO>
static void norm_affine_fwd_impl(const TI* x, TH* xhat, float* rstd, const float* gamma, const float* beta, TO* y,
                                 int64_t rows, int64_t n, float eps, bool rms, int nthreads) {
  parallel_for(rows, divup(kGrain, n), nthreads, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(n);
    for (int64_t r = r0; r < r1; ++r) {
      rstd[r] = norm_fwd_row(x + r * n, xhat + r * n, n, eps, rms, buf.data());
      affine_fwd_row(xhat + r * n, gamma, beta, y + r * n, n);
    }
  });
}

// Its backward from g and x̂: dx̂ = g·γ rounded once to x̂'s dtype (bitwise torch.mul(g, γ, out=dx̂)); dw = Σ g·x̂
// and dβ = Σ g over the rows in fp32. Rows go in blocks of kAffineRows, each block's sums into its own slice of
// ``part`` (2 × n floats, the caller's scratch), and the blocks are added in order: the same result for any
// thread count.
constexpr int64_t kAffineRows = 64;

// One row of it: dx̂ into dr (where wanted), g·x̂ and g added into the block's partial sums pw, pb (where wanted).
template <typename TG, typename TX>
static inline void affine_bwd_row(const TG* gr, const TX* xr, const float* gamma, TX* dr, float* pw, float* pb,
                                  int64_t n) {
  int64_t i = 0;
#ifdef LMBP_SIMD
  if constexpr (kVec<TG> && kVec<TX>) {
    for (; i + kLanes <= n; i += kLanes) {
      VF gv = VIO<TG>::load(gr + i);
      if (dr != nullptr) VIO<TX>::store(dr + i, vmul(gv, VIO<float>::load(gamma + i)));
      if (pw != nullptr) VIO<float>::store(pw + i, vfma(gv, VIO<TX>::load(xr + i), VIO<float>::load(pw + i)));
      if (pb != nullptr) VIO<float>::store(pb + i, vadd(VIO<float>::load(pb + i), gv));
    }
  }
#endif
  for (; i < n; ++i) {
    const float gi = ld(gr, i);
    if (dr != nullptr) st(dr, i, gi * gamma[i]);
    if (pw != nullptr) pw[i] += gi * ld(xr, i);
    if (pb != nullptr) pb[i] += gi;
  }
}

// Rows in blocks of kAffineRows: zero the block's partial sums, run ``row(r, pw, pb)`` over its rows; then the
// blocks' partials are added in order into dw, db.
template <typename RowFn>
static void affine_blocks(int64_t rows, int64_t n, float* dw, float* db, float* part, int nthreads, const RowFn& row) {
  const int64_t blocks = divup(rows, kAffineRows);
  parallel_for(blocks, divup(kGrain, kAffineRows * n), nthreads, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* pw = dw == nullptr ? nullptr : part + b * 2 * n;
      float* pb = db == nullptr ? nullptr : part + b * 2 * n + n;
      if (pw != nullptr) std::fill(pw, pw + n, 0.0f);
      if (pb != nullptr) std::fill(pb, pb + n, 0.0f);
      const int64_t r1 = (b + 1) * kAffineRows < rows ? (b + 1) * kAffineRows : rows;
      for (int64_t r = b * kAffineRows; r < r1; ++r) row(r, pw, pb);
    }
  });
  for (int64_t b = 0; b < blocks; ++b) {
    const float* pw = part + b * 2 * n;
    const float* pb = pw + n;
    if (dw != nullptr)
      for (int64_t i = 0; i < n; ++i) dw[i] = b == 0 ? pw[i] : dw[i] + pw[i];
    if (db != nullptr)
      for (int64_t i = 0; i < n; ++i) db[i] = b == 0 ? pb[i] : db[i] + pb[i];
  }
}

template <typename TG, typename TX>
static void affine_bwd_impl(const TG* g, const TX* x, const float* gamma, TX* dx, float* dw, float* db, float* part,
                            int64_t rows, int64_t n, int nthreads) {
  affine_blocks(rows, n, dw, db, part, nthreads, [&](int64_t r, float* pw, float* pb) {
    affine_bwd_row(g + r * n, x + r * n, gamma, dx == nullptr ? nullptr : dx + r * n, pw, pb, n);
  });
}

// The exact norm's backward in one pass: per row, dx̂ (rounded to x̂'s dtype, in a row of scratch) and the
// parameter sums as affine_bwd, then dx from dx̂ as norm_bwd: bitwise the two kernels one after the other.
template <typename TG, typename TX, typename TD>
static void norm_affine_bwd_impl(const TG* g, const TX* x, const float* rstd, const float* gamma, TD* dx, float* dw,
                                 float* db, float* part, int64_t rows, int64_t n, bool rms, int nthreads) {
  affine_blocks(rows, n, dw, db, part, nthreads, [&](int64_t r, float* pw, float* pb) {
    thread_local std::vector<TX> dxh;
    if (int64_t(dxh.size()) < n) dxh.resize(n);
    affine_bwd_row(g + r * n, x + r * n, gamma, dxh.data(), pw, pb, n);
    norm_bwd_row(dxh.data(), x + r * n, rstd[r], dx + r * n, n, rms);
  });
}

// ------------------------------------------------------------------------------------- dispatch
// The activation alone (no codes): approx_act without autograd, so both paths give the same values.
template <typename T, int KIND>
static void act_only_impl(const T* x, T* y, int64_t n, int nthreads) {
  parallel_for(divup(n, kBlock), kGrain / kBlock, nthreads, [&](int64_t b0, int64_t b1) {
    const int64_t end = b1 * kBlock < n ? b1 * kBlock : n;
    int64_t i = b0 * kBlock;
#ifdef LMBP_SIMD
    if constexpr (kVec<T>)
      for (; i + kLanes <= end; i += kLanes) vstore_out(y + i, vact<KIND>(VIO<T>::load(x + i)));
#endif
    for (; i < end; ++i) st(y, i, act<KIND>(ld(x, i)));
  });
}

template <typename T, int KIND>
static int act_fwd_bits(const void* x, void* y, uint8_t* packed, int64_t n, int bits, const float* thr, int nt) {
  const T* xp = static_cast<const T*>(x);
  T* yp = static_cast<T*>(y);
  switch (bits) {
    case 0: act_only_impl<T, KIND>(xp, yp, n, nt); return 0;
    case 1: act_fwd_impl<T, KIND, 1, 1>(xp, yp, packed, n, thr, nt); return 0;
    case 2: act_fwd_impl<T, KIND, 3, 2>(xp, yp, packed, n, thr, nt); return 0;
    case 3: act_fwd_impl<T, KIND, 7, 4>(xp, yp, packed, n, thr, nt); return 0;
    case 4: act_fwd_impl<T, KIND, 15, 4>(xp, yp, packed, n, thr, nt); return 0;
  }
  return 1;
}

template <typename T>
static int act_fwd_kind(const void* x, void* y, uint8_t* packed, int64_t n, int kind, int bits, const float* thr,
                        int nt) {
  switch (kind) {
    case GELU: return act_fwd_bits<T, GELU>(x, y, packed, n, bits, thr, nt);
    case GELU_TANH: return act_fwd_bits<T, GELU_TANH>(x, y, packed, n, bits, thr, nt);
    case SILU: return act_fwd_bits<T, SILU>(x, y, packed, n, bits, thr, nt);
    case QUICK_GELU: return act_fwd_bits<T, QUICK_GELU>(x, y, packed, n, bits, thr, nt);
  }
  return 1;
}

template <typename T>
static int act_bwd_slot(const void* g, const uint8_t* packed, void* dx, int64_t n, int slot, const float* table,
                        int nt) {
  const T* gp = static_cast<const T*>(g);
  T* dp = static_cast<T*>(dx);
  switch (slot) {
    case 1: act_bwd_impl<T, 1>(gp, packed, dp, n, table, nt); return 0;
    case 2: act_bwd_impl<T, 2>(gp, packed, dp, n, table, nt); return 0;
    case 4: act_bwd_impl<T, 4>(gp, packed, dp, n, table, nt); return 0;
  }
  return 1;
}

template <typename TI>
static int norm_fwd_out(const void* x, void* y, float* rstd, int64_t rows, int64_t n, float eps, bool rms, int odt,
                        int nt) {
  const TI* xp = static_cast<const TI*>(x);
  switch (odt) {
    case F32: norm_fwd_impl(xp, static_cast<float*>(y), rstd, rows, n, eps, rms, nt); return 0;
    case BF16: norm_fwd_impl(xp, static_cast<bf16*>(y), rstd, rows, n, eps, rms, nt); return 0;
    case F16: norm_fwd_impl(xp, static_cast<f16*>(y), rstd, rows, n, eps, rms, nt); return 0;
  }
  return 1;
}

template <typename TY>
static int norm_bwd_out(const void* g, const void* y, const float* rstd, void* dx, int64_t rows, int64_t n, bool rms,
                        int ddt, int nt) {
  const TY* gp = static_cast<const TY*>(g);
  const TY* yp = static_cast<const TY*>(y);
  switch (ddt) {
    case F32: norm_bwd_impl(gp, yp, rstd, static_cast<float*>(dx), rows, n, rms, nt); return 0;
    case BF16: norm_bwd_impl(gp, yp, rstd, static_cast<bf16*>(dx), rows, n, rms, nt); return 0;
    case F16: norm_bwd_impl(gp, yp, rstd, static_cast<f16*>(dx), rows, n, rms, nt); return 0;
  }
  return 1;
}

template <typename TX>
static int affine_fwd_out(const void* x, const float* gamma, const float* beta, void* y, int64_t rows, int64_t n,
                          int odt, int nt) {
  const TX* xp = static_cast<const TX*>(x);
  switch (odt) {
    case F32: affine_fwd_impl(xp, gamma, beta, static_cast<float*>(y), rows, n, nt); return 0;
    case BF16: affine_fwd_impl(xp, gamma, beta, static_cast<bf16*>(y), rows, n, nt); return 0;
    case F16: affine_fwd_impl(xp, gamma, beta, static_cast<f16*>(y), rows, n, nt); return 0;
  }
  return 1;
}

template <typename TI, typename TH>
static int norm_affine_fwd_y(const void* x, void* xhat, float* rstd, const float* gamma, const float* beta, void* y,
                             int64_t rows, int64_t n, float eps, bool rms, int ydt, int nt) {
  const TI* xp = static_cast<const TI*>(x);
  TH* hp = static_cast<TH*>(xhat);
  switch (ydt) {
    case F32: norm_affine_fwd_impl(xp, hp, rstd, gamma, beta, static_cast<float*>(y), rows, n, eps, rms, nt); return 0;
    case BF16: norm_affine_fwd_impl(xp, hp, rstd, gamma, beta, static_cast<bf16*>(y), rows, n, eps, rms, nt); return 0;
    case F16: norm_affine_fwd_impl(xp, hp, rstd, gamma, beta, static_cast<f16*>(y), rows, n, eps, rms, nt); return 0;
  }
  return 1;
}

template <typename TI>
static int norm_affine_fwd_h(const void* x, void* xhat, float* rstd, const float* gamma, const float* beta, void* y,
                             int64_t rows, int64_t n, float eps, bool rms, int hdt, int ydt, int nt) {
  switch (hdt) {
    case F32: return norm_affine_fwd_y<TI, float>(x, xhat, rstd, gamma, beta, y, rows, n, eps, rms, ydt, nt);
    case BF16: return norm_affine_fwd_y<TI, bf16>(x, xhat, rstd, gamma, beta, y, rows, n, eps, rms, ydt, nt);
    case F16: return norm_affine_fwd_y<TI, f16>(x, xhat, rstd, gamma, beta, y, rows, n, eps, rms, ydt, nt);
  }
  return 1;
}

template <typename TG, typename TX>
static int norm_affine_bwd_d(const void* g, const void* x, const float* rstd, const float* gamma, void* dx, float* dw,
                             float* db, float* part, int64_t rows, int64_t n, bool rms, int ddt, int nt) {
  const TG* gp = static_cast<const TG*>(g);
  const TX* xp = static_cast<const TX*>(x);
  switch (ddt) {
    case F32: norm_affine_bwd_impl(gp, xp, rstd, gamma, static_cast<float*>(dx), dw, db, part, rows, n, rms, nt);
      return 0;
    case BF16: norm_affine_bwd_impl(gp, xp, rstd, gamma, static_cast<bf16*>(dx), dw, db, part, rows, n, rms, nt);
      return 0;
    case F16: norm_affine_bwd_impl(gp, xp, rstd, gamma, static_cast<f16*>(dx), dw, db, part, rows, n, rms, nt);
      return 0;
  }
  return 1;
}

template <typename TG>
static int norm_affine_bwd_x(const void* g, const void* x, const float* rstd, const float* gamma, void* dx, float* dw,
                             float* db, float* part, int64_t rows, int64_t n, bool rms, int xdt, int ddt, int nt) {
  switch (xdt) {
    case F32: return norm_affine_bwd_d<TG, float>(g, x, rstd, gamma, dx, dw, db, part, rows, n, rms, ddt, nt);
    case BF16: return norm_affine_bwd_d<TG, bf16>(g, x, rstd, gamma, dx, dw, db, part, rows, n, rms, ddt, nt);
    case F16: return norm_affine_bwd_d<TG, f16>(g, x, rstd, gamma, dx, dw, db, part, rows, n, rms, ddt, nt);
  }
  return 1;
}

template <typename TG>
static int affine_bwd_x(const void* g, const void* x, const float* gamma, void* dx, float* dw, float* db, float* part,
                        int64_t rows, int64_t n, int xdt, int nt) {
  const TG* gp = static_cast<const TG*>(g);
  switch (xdt) {
    case F32: affine_bwd_impl(gp, static_cast<const float*>(x), gamma, static_cast<float*>(dx), dw, db, part, rows,
                              n, nt); return 0;
    case BF16: affine_bwd_impl(gp, static_cast<const bf16*>(x), gamma, static_cast<bf16*>(dx), dw, db, part, rows,
                               n, nt); return 0;
    case F16: affine_bwd_impl(gp, static_cast<const f16*>(x), gamma, static_cast<f16*>(dx), dw, db, part, rows,
                              n, nt); return 0;
  }
  return 1;
}

}  // namespace

// ------------------------------------------------------------------------------------------ C ABI
// Every entry point returns 0 on success, 1 for an argument combination it does not implement.
// lmbp_act_fwd with bits = 0 computes the activation only (packed and thresholds unused).
extern "C" {

int lmbp_abi_version() { return 4; }

int lmbp_act_fwd(const void* x, void* y, uint8_t* packed, int64_t n, int dtype, int kind, int bits,
                 const float* thresholds, int nthreads) {
  switch (dtype) {
    case F32: return act_fwd_kind<float>(x, y, packed, n, kind, bits, thresholds, nthreads);
    case BF16: return act_fwd_kind<bf16>(x, y, packed, n, kind, bits, thresholds, nthreads);
    case F16: return act_fwd_kind<f16>(x, y, packed, n, kind, bits, thresholds, nthreads);
  }
  return 1;
}

int lmbp_act_bwd(const void* g, const uint8_t* packed, void* dx, int64_t n, int dtype, int slot,
                 const float* byte_table, int nthreads) {
  switch (dtype) {
    case F32: return act_bwd_slot<float>(g, packed, dx, n, slot, byte_table, nthreads);
    case BF16: return act_bwd_slot<bf16>(g, packed, dx, n, slot, byte_table, nthreads);
    case F16: return act_bwd_slot<f16>(g, packed, dx, n, slot, byte_table, nthreads);
  }
  return 1;
}

int lmbp_norm_fwd(const void* x, void* y, float* rstd, int64_t rows, int64_t n, double eps, int rms, int in_dtype,
                  int out_dtype, int nthreads) {
  float e = float(eps);
  switch (in_dtype) {
    case F32: return norm_fwd_out<float>(x, y, rstd, rows, n, e, rms != 0, out_dtype, nthreads);
    case BF16: return norm_fwd_out<bf16>(x, y, rstd, rows, n, e, rms != 0, out_dtype, nthreads);
    case F16: return norm_fwd_out<f16>(x, y, rstd, rows, n, e, rms != 0, out_dtype, nthreads);
  }
  return 1;
}

int lmbp_norm_bwd(const void* g, const void* y, const float* rstd, void* dx, int64_t rows, int64_t n, int rms,
                  int y_dtype, int dx_dtype, int nthreads) {
  switch (y_dtype) {
    case F32: return norm_bwd_out<float>(g, y, rstd, dx, rows, n, rms != 0, dx_dtype, nthreads);
    case BF16: return norm_bwd_out<bf16>(g, y, rstd, dx, rows, n, rms != 0, dx_dtype, nthreads);
    case F16: return norm_bwd_out<f16>(g, y, rstd, dx, rows, n, rms != 0, dx_dtype, nthreads);
  }
  return 1;
}

// y = x̂·γ + β (beta may be null) over rows of n; gamma and beta fp32.
int lmbp_affine_fwd(const void* x, const float* gamma, const float* beta, void* y, int64_t rows, int64_t n,
                    int x_dtype, int y_dtype, int nthreads) {
  switch (x_dtype) {
    case F32: return affine_fwd_out<float>(x, gamma, beta, y, rows, n, y_dtype, nthreads);
    case BF16: return affine_fwd_out<bf16>(x, gamma, beta, y, rows, n, y_dtype, nthreads);
    case F16: return affine_fwd_out<f16>(x, gamma, beta, y, rows, n, y_dtype, nthreads);
  }
  return 1;
}

// The exact norm's forward: x̂ (xhat_dtype) and rstd as lmbp_norm_fwd, and y = x̂·γ + β as lmbp_affine_fwd.
int lmbp_norm_affine_fwd(const void* x, void* xhat, float* rstd, const float* gamma, const float* beta, void* y,
                         int64_t rows, int64_t n, double eps, int rms, int x_dtype, int xhat_dtype, int y_dtype,
                         int nthreads) {
  float e = float(eps);
  switch (x_dtype) {
    case F32: return norm_affine_fwd_h<float>(x, xhat, rstd, gamma, beta, y, rows, n, e, rms != 0, xhat_dtype,
                                              y_dtype, nthreads);
    case BF16: return norm_affine_fwd_h<bf16>(x, xhat, rstd, gamma, beta, y, rows, n, e, rms != 0, xhat_dtype,
                                              y_dtype, nthreads);
    case F16: return norm_affine_fwd_h<f16>(x, xhat, rstd, gamma, beta, y, rows, n, e, rms != 0, xhat_dtype,
                                            y_dtype, nthreads);
  }
  return 1;
}

// The exact norm's backward from g, x̂ (x_dtype), rstd: dx (dx_dtype) as lmbp_affine_bwd's dx̂ then lmbp_norm_bwd,
// and dw, db as lmbp_affine_bwd (each may be null; part as there).
int lmbp_norm_affine_bwd(const void* g, const void* x, const float* rstd, const float* gamma, void* dx, float* dw,
                         float* db, float* part, int64_t rows, int64_t n, int rms, int g_dtype, int x_dtype,
                         int dx_dtype, int nthreads) {
  switch (g_dtype) {
    case F32: return norm_affine_bwd_x<float>(g, x, rstd, gamma, dx, dw, db, part, rows, n, rms != 0, x_dtype,
                                              dx_dtype, nthreads);
    case BF16: return norm_affine_bwd_x<bf16>(g, x, rstd, gamma, dx, dw, db, part, rows, n, rms != 0, x_dtype,
                                              dx_dtype, nthreads);
    case F16: return norm_affine_bwd_x<f16>(g, x, rstd, gamma, dx, dw, db, part, rows, n, rms != 0, x_dtype,
                                            dx_dtype, nthreads);
  }
  return 1;
}

// dx (x's dtype), dw, db (fp32, n each) of y = x̂·γ + β from g; each output may be null (not wanted);
// part: 2 * n * ceil(rows / 64) floats of scratch where dw or db is wanted.
int lmbp_affine_bwd(const void* g, const void* x, const float* gamma, void* dx, float* dw, float* db, float* part,
                    int64_t rows, int64_t n, int g_dtype, int x_dtype, int nthreads) {
  switch (g_dtype) {
    case F32: return affine_bwd_x<float>(g, x, gamma, dx, dw, db, part, rows, n, x_dtype, nthreads);
    case BF16: return affine_bwd_x<bf16>(g, x, gamma, dx, dw, db, part, rows, n, x_dtype, nthreads);
    case F16: return affine_bwd_x<f16>(g, x, gamma, dx, dw, db, part, rows, n, x_dtype, nthreads);
  }
  return 1;
}

}  // extern "C"
