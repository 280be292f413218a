// Native CPU kernels for lmbp_convert's ops: one pass over memory per direction, fp32 maths in registers,
// one rounding to the output dtype (no fp32 copies of bf16/fp16 tensors).
//
// Plain C++ without torch headers (so it builds in seconds), written as branch-free loops that the compiler
// vectorises for the host CPU (-O3 -march=native: AVX2, AVX-512, NEON). Multi-threading uses OpenMP with the
// same chunking as ATen's at::parallel_for; the library links the libgomp torch already loaded, so both share
// one thread pool. Called through ctypes from cpu_native.py, which owns every check (dtypes, contiguity,
// sizes): these functions trust their arguments.
//
// Semantics mirror the PyTorch path of approx_act.py / ms_norm.py (see their docstrings):
//   approx_act forward: y = act(x) in fp32, rounded once to x's dtype; code = #thresholds x exceeds (fp32
//     compare; NaN exceeds none); codes packed low slot first, element i -> byte i / P, bit (i % P) * S.
//   approx_act backward: dx = grad * slope[code] in fp32, rounded once to grad's dtype.
//   MS LayerNorm/RMSNorm forward: per row, fp32 statistics, y = (x - mean) * rstd (RMS: x * rstd).
//   MS norm backward from y: dx = rstd * (g - mean(g) - y * mean(g * y)) (RMS: without mean(g)).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
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

template <typename T, int KIND, int NTHR, int S>
static void act_fwd_impl(const T* x, T* y, uint8_t* packed, int64_t n, const float* thr_in, int nthreads) {
  constexpr int64_t P = 8 / S;
  float thr[NTHR];
  for (int j = 0; j < NTHR; ++j) thr[j] = thr_in[j];
  const int64_t nblocks = divup(n, kBlock);
  parallel_for(nblocks, kGrain / kBlock, nthreads, [&](int64_t b0, int64_t b1) {
    alignas(64) uint8_t codes[kBlock];
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t start = blk * kBlock;
      const int64_t len = n - start < kBlock ? n - start : kBlock;
      const T* xb = x + start;
      T* yb = y + start;
      // Activation and codes of the block, then its codes packed, all from L1. For the cheap activations
      // (silu, quick_gelu) two loops are faster (each vectorises at full float width, where a fused loop runs
      // at the width of the code bytes); for the erf/tanh ones one fused loop is (measured, AVX-512, 1 thread).
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
      pack_block<S>(codes, packed + start / P, nb);
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
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t start = blk * kBlock;
      const int64_t len = n - start < kBlock ? n - start : kBlock;
      const uint8_t* pb = packed + start / P;
      const int64_t nb = divup(len, P);
      for (int64_t b = 0; b < nb; ++b) std::memcpy(slope + b * P, table + int64_t(pb[b]) * P, P * sizeof(float));
      const T* gb = g + start;
      T* db = dx + start;
      for (int64_t i = 0; i < len; ++i) st(db, i, ld(gb, i) * slope[i]);
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

template <typename TI, typename TO>
static void norm_fwd_impl(const TI* x, TO* y, float* rstd, int64_t rows, int64_t n, float eps, bool rms,
                          int nthreads) {
  parallel_for(rows, divup(kGrain, n), nthreads, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(n);
    float* xf = buf.data();
    for (int64_t r = r0; r < r1; ++r) {
      const TI* xr = x + r * n;
      for (int64_t i = 0; i < n; ++i) xf[i] = ld(xr, i);  // the row in fp32, from L1 from here on
      float mean = 0.0f;
      if (!rms) mean = row_sum(n, [&](int64_t i) { return xf[i]; }) / float(n);
      float var = row_sum(n, [&](int64_t i) { float d = xf[i] - mean; return d * d; }) / float(n);
      float rs = 1.0f / std::sqrt(var + eps);
      TO* yr = y + r * n;
      for (int64_t i = 0; i < n; ++i) st(yr, i, (xf[i] - mean) * rs);
      rstd[r] = rs;
    }
  });
}

template <typename TY, typename TD>
static void norm_bwd_impl(const TY* g, const TY* y, const float* rstd, TD* dx, int64_t rows, int64_t n, bool rms,
                          int nthreads) {
  parallel_for(rows, divup(kGrain, n), nthreads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const TY* gr = g + r * n;
      const TY* yr = y + r * n;
      float mg = rms ? 0.0f : row_sum(n, [&](int64_t i) { return ld(gr, i); }) / float(n);
      float mgy = row_sum(n, [&](int64_t i) { return ld(gr, i) * ld(yr, i); }) / float(n);
      float rs = rstd[r];
      TD* dr = dx + r * n;
      for (int64_t i = 0; i < n; ++i) st(dr, i, (ld(gr, i) - mg - ld(yr, i) * mgy) * rs);
    }
  });
}

// ------------------------------------------------------------------------------------- dispatch
// The activation alone (no codes): approx_act without autograd, so both paths give the same values.
template <typename T, int KIND>
static void act_only_impl(const T* x, T* y, int64_t n, int nthreads) {
  parallel_for(divup(n, kBlock), kGrain / kBlock, nthreads, [&](int64_t b0, int64_t b1) {
    const int64_t end = b1 * kBlock < n ? b1 * kBlock : n;
    for (int64_t i = b0 * kBlock; i < end; ++i) st(y, i, act<KIND>(ld(x, i)));
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

}  // namespace

// ------------------------------------------------------------------------------------------ C ABI
// Every entry point returns 0 on success, 1 for an argument combination it does not implement.
// lmbp_act_fwd with bits = 0 computes the activation only (packed and thresholds unused).
extern "C" {

int lmbp_abi_version() { return 1; }

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

}  // extern "C"
