// Element functions for loops the compiler vectorises for the build's target (AVX2, AVX-512;
// not SSE-only builds, where the selects stay branches): branchless, no calls into libm,
// integer tricks through std::bit_cast. Used by the SwiGLU backward's block loop where the lanes
// are not taken (f16, or no AVX);
// load/store let a loop read and write bf16 in place. Sixteen-lane values (F32x16, below) carry
// the norms, RoPE and, with AVX or AVX-512, the exp-bound SwiGLU and cross entropy (exp16).
//
//   #pragma omp simd simdlen(16)
//   for (int64_t i = 0; i < n; ++i) y[i] = vec::exp(x[i]);           // f32
//   #pragma omp simd
//   for (int64_t i = 0; i < n; ++i) vec::store(o[i], vec::load(b[i]) * 2.0f);  // bf16 o, b
#pragma once

#include <Eigen/Core>
#include <immintrin.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/dtype.h"

// Forced inline: a loop calling a function the inliner gave up on (large callers, many template
// instances) is not vectorised at all.
#if defined(__GNUC__)
#define QUILT_VEC_INLINE inline __attribute__((always_inline))
#else
#define QUILT_VEC_INLINE inline
#endif

namespace quilt::kernels::cpu::vec {

// Exp-bound loops ask for `#pragma omp simd simdlen(16)`: GCC otherwise picks 256-bit vectors
// on AVX-512 CPUs (its default preference), half the width the polynomial can use; on AVX2 the
// loop runs as two 8-lane halves, on SSE as four.

/// a * b + c, fused where the target has FMA (one rounding), else two roundings (f32 and f64).
QUILT_VEC_INLINE float mul_add(float a, float b, float c) {
#if defined(__FP_FAST_FMAF)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}
QUILT_VEC_INLINE double mul_add(double a, double b, double c) {
#if defined(__FP_FAST_FMA)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

/// exp's constants, shared by the scalar form and the AVX2 lanes (exp8) so both give the same bits.
namespace exp_detail {
// Inputs are clamped to [kLo, kHi]: kLo is below -127·ln2 and kHi above 128·ln2, so the clamped
// ends make 2^n 0 (n = -127) or inf (n = 128) without a mask.
inline constexpr float kLo = -88.0f, kHi = 88.8f;
inline constexpr float kShift = 12582912.0f;  // 1.5·2^23: t = z + kShift holds round(z) in its low bits
inline constexpr float kLog2e = 1.44269504088896341f;
inline constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln2 = hi + lo, n·hi exact
// (exp(r) - 1) / r on [0, ln2] to 4e-9 relative (a Remez fit), highest degree first.
inline constexpr float kQ[6] = {0x1.02e39cp-9f, 0x1.fba0bap-8f, 0x1.5799bep-5f,
                                0x1.55341ap-3f, 0x1.0000d2p-1f, 0x1.fffffap-1f};
}  // namespace exp_detail

/// exp(x) in f32 within 1.6 ulp: x = n·ln2 + r with n = floor(x / ln2) and r in [0, ln2]
/// (Cody-Waite, ln2 split so n·ln2_hi is exact), exp(r) = 1 + r·q(r) with q of degree 5, then one
/// multiply by 2^n built in the exponent field. Below -87.34 (-126·ln2, where f32 turns denormal)
/// the result is 0, from 88.7228 (ln FLT_MAX) it is inf, NaN stays NaN: with n = floor, the clamp
/// alone gives both ends (2^-127 is built as 0, 2^128 as inf), so no mask is needed. Twenty
/// instructions in a vector loop; exp8 below is the same on AVX2 registers.
QUILT_VEC_INLINE float exp(float x) {
  using namespace exp_detail;
  float xc = x > kHi ? kHi : x;  // NaN compares false: passes through
  xc = xc < kLo ? kLo : xc;
  // n = floor(x / ln2) as round(x / ln2 - 1/2) by the shifter (z - 1 at an integer z, which
  // leaves r = ln2, still in q's range).
  const float t = mul_add(xc, kLog2e, -0.5f) + kShift;
  const float n = t - kShift;
  float r = mul_add(n, -kLn2Hi, xc);
  r = mul_add(n, -kLn2Lo, r);
  // (Written out: a loop here would be control flow in the callers' loops, which GCC then does
  // not vectorise.)
  float q = mul_add(kQ[0], r, kQ[1]);
  q = mul_add(q, r, kQ[2]);
  q = mul_add(q, r, kQ[3]);
  q = mul_add(q, r, kQ[4]);
  q = mul_add(q, r, kQ[5]);
  const float y = mul_add(q, r, 1.0f);
  // 2^n: n + 127 in the exponent field; n = -127 gives the bits of 0, n = 128 those of inf.
  const uint32_t e = (std::bit_cast<uint32_t>(t) - (std::bit_cast<uint32_t>(kShift) - 127u)) << 23;
  return y * std::bit_cast<float>(e);
}

/// 1 / (1 + exp(-x)), the logistic sigmoid, within a few ulp; 0 below -87.34 and 1 above
/// 88.72 (where the f32 result is 0 or 1 to within a denormal).
QUILT_VEC_INLINE float sigmoid(float x) { return 1.0f / (1.0f + exp(-x)); }

/// A bf16 value as f32 (exact: bf16 is the top half of an f32).
QUILT_VEC_INLINE float load(BFloat16 b) { return std::bit_cast<float>(uint32_t(b.bits) << 16); }
/// An f32 value as itself (so kernels template over the storage type).
QUILT_VEC_INLINE float load(float f) { return f; }
QUILT_VEC_INLINE double load(double f) { return f; }
QUILT_VEC_INLINE float load(Half h) { return float(h); }  // scalar: f16 rows are rare

/// The bf16 bits of f32 bit patterns u (a uint32_t or a vector of them), in the low 16 bits: u
/// rounded to nearest even, and u's NaN quieted; which applies is the caller's select.
template <class U>
QUILT_VEC_INLINE U bf16_rounded(U u) { return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16; }
template <class U>
QUILT_VEC_INLINE U bf16_quiet(U u) { return (u >> 16) | 0x40u; }

/// f32 -> bf16 bits, round to nearest even, NaN kept NaN (quieted): float_to_bf16_bits of
/// kernels/dtype.h bit for bit (denormals rounded, not flushed), written with a select instead
/// of its early return so a loop of it vectorises.
QUILT_VEC_INLINE uint16_t bf16_bits(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  return uint16_t((u & 0x7fffffffu) > 0x7f800000u ? bf16_quiet(u) : bf16_rounded(u));
}

/// Stores an f32 result as T: rounded to bf16 as above, or as is.
QUILT_VEC_INLINE void store(BFloat16& dst, float v) { dst.bits = bf16_bits(v); }
QUILT_VEC_INLINE void store(float& dst, float v) { dst = v; }
QUILT_VEC_INLINE void store(double& dst, double v) { dst = v; }
QUILT_VEC_INLINE void store(Half& dst, float v) { dst = Half(v); }

// ---- sixteen lanes at a time ----
//
// A row kernel that reduces (a sum of squares, a dot product) written as a plain loop keeps one
// accumulator, so it runs at the add's latency, not at memory speed; and bf16 rows widened into
// scratch first cost a store and a load per element. These 16-lane values let a kernel load and
// store T in place and keep several independent accumulators, with the same source on every x86
// target:
//
//   F32x16 a0{}, a1{};  for (...; i += 32) { a0 += sq(load16(x + i)); a1 += sq(load16(x + i + 16)); }
//   const float s = hsum(a0 + a1);
//
// With AVX-512, F32x16 is a 64-byte vector (GCC/Clang vector extensions), one register. Without
// it, a 64-byte vector has no register to live in and GCC keeps it in memory, moving it in 8-byte
// pieces (a bf16 RMSNorm forward ran at 0.06x its f32 form so on an AVX2 EPYC); there F32x16 is
// a pair of 8-lane vectors (each one AVX register; on SSE-only builds two SSE ones, or memory),
// with the same operators. Kernels use only what both forms have: + - * / (lane-wise, or with a
// float on either side), unary -, +=, and reading lane i.

// On targets without AVX-512 both compilers note, at every use, that passing 32- or 64-byte
// vectors to a function would follow a different ABI there. These values never cross a real call
// (every function here is forced inline), so the note is switched off for the files that use them.
#if defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

#if defined(__AVX512F__)

using F32x16 = float __attribute__((vector_size(64)));
using U32x16 = uint32_t __attribute__((vector_size(64)));
using U16x16 = uint16_t __attribute__((vector_size(32)));

QUILT_VEC_INLINE F32x16 splat16(float v) { return F32x16{} + v; }
QUILT_VEC_INLINE F32x16 load16(const float* p) {
  F32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
/// Sixteen bf16 values widened to f32 (exact). (One vpmovzxwd of the whole register: GCC 12
/// splits the generic conversion into 128-bit pieces and reassembles them.)
QUILT_VEC_INLINE F32x16 load16(const BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return std::bit_cast<F32x16>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// The stores go through memcpy, which may alias any object: a loop that stores lanes should read
// its bounds from locals, or the compiler reloads them (from a lambda's captures, say) each step.
QUILT_VEC_INLINE void store16(float* p, const F32x16& v) { std::memcpy(p, &v, sizeof v); }
/// Sixteen f32 values rounded to bf16: by the CPU's `vcvtneps2bf16` where it has AVX512-BF16
/// (which flushes inputs below 2^-126 to zero), else as bf16_bits above, lane by lane.
QUILT_VEC_INLINE void store16(BFloat16* p, const F32x16& v) {
#if defined(__AVX512BF16__)
  const __m256bh h = _mm512_cvtneps_pbh(std::bit_cast<__m512>(v));
  std::memcpy(static_cast<void*>(p), &h, sizeof h);
#else
  const U32x16 u = std::bit_cast<U32x16>(v);
  const U32x16 nan = U32x16((u & 0x7fffffffu) > 0x7f800000u);  // all ones where NaN
  const U16x16 h = __builtin_convertvector((bf16_quiet(u) & nan) | (bf16_rounded(u) & ~nan), U16x16);
  std::memcpy(static_cast<void*>(p), &h, sizeof h);
#endif
}
/// Lane-wise max(a, b), b where either is NaN (the argument order of x86's maxps).
QUILT_VEC_INLINE F32x16 max16(const F32x16& a, const F32x16& b) { return a > b ? a : b; }

#else  // two 8-lane halves

using F32x8 = float __attribute__((vector_size(32)));
using U32x8 = uint32_t __attribute__((vector_size(32)));
using U16x8 = uint16_t __attribute__((vector_size(16)));

struct F32x16 {
  F32x8 lo{}, hi{};  // lanes 0-7, 8-15
  QUILT_VEC_INLINE float operator[](int i) const { return i < 8 ? lo[i] : hi[i - 8]; }
  QUILT_VEC_INLINE F32x16& operator+=(const F32x16& b) { lo += b.lo; hi += b.hi; return *this; }
};
#define QUILT_VEC_HALVES_OP(OP)                                                                              \
  QUILT_VEC_INLINE F32x16 operator OP(const F32x16& a, const F32x16& b) { return {a.lo OP b.lo, a.hi OP b.hi}; } \
  QUILT_VEC_INLINE F32x16 operator OP(float a, const F32x16& b) { return {a OP b.lo, a OP b.hi}; }           \
  QUILT_VEC_INLINE F32x16 operator OP(const F32x16& a, float b) { return {a.lo OP b, a.hi OP b}; }
QUILT_VEC_HALVES_OP(+)
QUILT_VEC_HALVES_OP(-)
QUILT_VEC_HALVES_OP(*)
QUILT_VEC_HALVES_OP(/)
#undef QUILT_VEC_HALVES_OP
QUILT_VEC_INLINE F32x16 operator-(const F32x16& a) { return {-a.lo, -a.hi}; }

QUILT_VEC_INLINE F32x16 splat16(float v) { return {F32x8{} + v, F32x8{} + v}; }
QUILT_VEC_INLINE F32x16 load16(const float* p) {
  F32x16 v;
  std::memcpy(&v.lo, p, sizeof v.lo);
  std::memcpy(&v.hi, p + 8, sizeof v.hi);
  return v;
}
QUILT_VEC_INLINE F32x8 widen8(const BFloat16* p) {
#if defined(__AVX2__)
  // (One vpmovzxwd from memory: GCC 12 splits the generic conversion below into 128-bit pieces.)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return std::bit_cast<F32x8>(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
  U16x8 h;
  std::memcpy(&h, static_cast<const void*>(p), sizeof h);
  return std::bit_cast<F32x8>(__builtin_convertvector(h, U32x8) << 16);
#endif
}
/// Sixteen bf16 values widened to f32 (exact).
QUILT_VEC_INLINE F32x16 load16(const BFloat16* p) { return {widen8(p), widen8(p + 8)}; }
// The stores go through memcpy, which may alias any object: a loop that stores lanes should read
// its bounds from locals, or the compiler reloads them (from a lambda's captures, say) each step.
QUILT_VEC_INLINE void store16(float* p, const F32x16& v) {
  std::memcpy(p, &v.lo, sizeof v.lo);
  std::memcpy(p + 8, &v.hi, sizeof v.hi);
}
/// Eight f32 values as bf16 bits (as bf16_bits above, lane by lane), each in a 32-bit lane.
QUILT_VEC_INLINE U32x8 bf16_bits8(const F32x8& v) {
  const U32x8 u = std::bit_cast<U32x8>(v);
  const U32x8 rounded = bf16_rounded(u), quiet = bf16_quiet(u);
#if defined(__AVX__)
  // NaN lanes by an unordered compare and a blend (the normalise-and-store loop of an L1-resident
  // bf16 row ran 1.15x the integer test below on an AVX2 EPYC; the same bits).
  const __m256 f = std::bit_cast<__m256>(v);
  const __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
  return std::bit_cast<U32x8>(_mm256_blendv_ps(std::bit_cast<__m256>(rounded), std::bit_cast<__m256>(quiet), nan));
#else
  const U32x8 nan = U32x8((u & 0x7fffffffu) > 0x7f800000u);  // all ones where NaN
  return (quiet & nan) | (rounded & ~nan);
#endif
}
/// Sixteen f32 values rounded to bf16 as bf16_bits above.
QUILT_VEC_INLINE void store16(BFloat16* p, const F32x16& v) {
  const U32x8 lo = bf16_bits8(v.lo), hi = bf16_bits8(v.hi);
#if defined(__AVX2__)
  // Every lane is below 2^16, so packing with unsigned saturation keeps it; the pack interleaves
  // the halves by 128-bit lane, and the permute puts the 64-bit quarters back in order.
  const __m256i h = _mm256_permute4x64_epi64(
      _mm256_packus_epi32(std::bit_cast<__m256i>(lo), std::bit_cast<__m256i>(hi)), 0xd8);
  std::memcpy(static_cast<void*>(p), &h, sizeof h);
#else
  const U16x8 a = __builtin_convertvector(lo, U16x8), b = __builtin_convertvector(hi, U16x8);
  std::memcpy(static_cast<void*>(p), &a, sizeof a);
  std::memcpy(static_cast<void*>(p + 8), &b, sizeof b);
#endif
}
/// Lane-wise max(a, b), b where either is NaN (the argument order of x86's maxps).
QUILT_VEC_INLINE F32x16 max16(const F32x16& a, const F32x16& b) {
  return {a.lo > b.lo ? a.lo : b.lo, a.hi > b.hi ? a.hi : b.hi};
}
#endif

/// The lanes' sum in a fixed (pairwise) order.
QUILT_VEC_INLINE float hsum(const F32x16& v) {
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = v[i] + v[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}
/// Σ f(i) over [0, n) in four independent accumulators: add16(i, acc) adds lanes i..i+15 into acc,
/// f1(i) gives element i. 64-element steps into the four, then 16-element steps into the first,
/// then the scalar tail, so the order is a function of n alone. (The lanes go by reference: a
/// lambda returning sixteen lanes draws GCC's ABI note off AVX-512.)
template <class F16, class F1>
QUILT_VEC_INLINE float sum16(int64_t n, F16&& add16, F1&& f1) {
  F32x16 a0{}, a1{}, a2{}, a3{};
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    add16(i, a0);
    add16(i + 16, a1);
    add16(i + 32, a2);
    add16(i + 48, a3);
  }
  for (; i + 16 <= n; i += 16) add16(i, a0);
  float s = hsum((a0 + a1) + (a2 + a3));
  for (; i < n; ++i) s += f1(i);
  return s;
}
/// The lanes' maximum. With NaN lanes the result is one of the lanes, unspecified which (a row's
/// exp(x - max) sum that follows still carries the NaN).
QUILT_VEC_INLINE float hmax(const F32x16& v) {
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

/// exp of sixteen lanes. With AVX-512, Eigen's packet exp (Cephes' polynomial with its terms
/// split for instruction-level parallelism) on one register: within 5 ulp from -87.3 to 88.3 (it
/// loses ~0.05 ulp per unit of |x|); in a loop summing exp over an L1-resident row it ran 1.15x a
/// version of our own on `vrndscaleps`/`vscalefps` (1.3 ulp) and 2x the earlier scalar exp
/// vectorised, on an AVX-512 EPYC (family 26). Its low end is made the scalar exp's (0 below
/// -87.34; Eigen's gives ~3e-39 down to -inf); at the top it gives inf from 88.38 (its 2^n
/// overflows at n = 128). With AVX2 and FMA, the scalar exp itself on two 8-lane halves (exp8:
/// the same bits, ends included). With AVX alone, Eigen's AVX packet exp, 0 below -87.34.
/// kFastExp16 tells the exp-bound kernels whether to take their exps in lanes (see nn.cpp); off
/// AVX they keep Eigen's array form. kExp16IsScalar: exp16 gives the scalar exp's bits.
#if defined(EIGEN_VECTORIZE_AVX512)
inline constexpr bool kFastExp16 = true, kExp16IsScalar = false;
QUILT_VEC_INLINE F32x16 exp16(const F32x16& x) {
  const F32x16 y = std::bit_cast<F32x16>(Eigen::internal::pexp(std::bit_cast<__m512>(x)));
  return x < -87.33654f ? splat16(0.0f) : y;  // (NaN compares false: Eigen's NaN stays)
}
#elif defined(__AVX2__) && defined(__FMA__)
inline constexpr bool kFastExp16 = true, kExp16IsScalar = true;
/// The scalar exp above on eight lanes, the same bits: its clamp, shifter and exponent-field 2^n
/// in twenty instructions. In a loop summing exp over an L1-resident row it ran 1.95x Eigen's AVX
/// packet exp (0.45 against 0.88 ns per element, one thread, AVX2 EPYC family 25), which spends
/// its extra instructions on a generic ldexp and a mask for the low end.
QUILT_VEC_INLINE F32x8 exp8(const F32x8& x) {
  using namespace exp_detail;
  const auto c = [](float v) { return _mm256_set1_ps(v); };
  // min/max return their second operand where either is NaN: a NaN x passes through.
  const __m256 xc = _mm256_max_ps(c(kLo), _mm256_min_ps(c(kHi), std::bit_cast<__m256>(x)));
  const __m256 t = _mm256_add_ps(_mm256_fmadd_ps(xc, c(kLog2e), c(-0.5f)), c(kShift));
  const __m256 n = _mm256_sub_ps(t, c(kShift));
  __m256 r = _mm256_fmadd_ps(n, c(-kLn2Hi), xc);
  r = _mm256_fmadd_ps(n, c(-kLn2Lo), r);
  __m256 q = _mm256_fmadd_ps(c(kQ[0]), r, c(kQ[1]));
  q = _mm256_fmadd_ps(q, r, c(kQ[2]));
  q = _mm256_fmadd_ps(q, r, c(kQ[3]));
  q = _mm256_fmadd_ps(q, r, c(kQ[4]));
  q = _mm256_fmadd_ps(q, r, c(kQ[5]));
  const __m256 y = _mm256_fmadd_ps(q, r, c(1.0f));
  const __m256i bias = _mm256_set1_epi32(int32_t(std::bit_cast<uint32_t>(kShift) - 127u));
  const __m256i e = _mm256_slli_epi32(_mm256_sub_epi32(_mm256_castps_si256(t), bias), 23);
  return std::bit_cast<F32x8>(_mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}
QUILT_VEC_INLINE F32x16 exp16(const F32x16& x) { return {exp8(x.lo), exp8(x.hi)}; }
#elif defined(EIGEN_VECTORIZE_AVX)
inline constexpr bool kFastExp16 = true;
/// AVX without AVX2 (no 256-bit integer ops): Eigen's packet exp, 0 below -87.34 as the scalar's.
inline constexpr bool kExp16IsScalar = false;
QUILT_VEC_INLINE F32x8 exp8(const F32x8& x) {
  const F32x8 y = std::bit_cast<F32x8>(Eigen::internal::pexp(std::bit_cast<__m256>(x)));
  return x < -87.33654f ? F32x8{} : y;
}
QUILT_VEC_INLINE F32x16 exp16(const F32x16& x) { return {exp8(x.lo), exp8(x.hi)}; }
#else
/// Without AVX the scalar exp lane by lane: the same values, not the same speed, and kFastExp16
/// tells the kernels to keep their Eigen array form.
inline constexpr bool kFastExp16 = false, kExp16IsScalar = true;
QUILT_VEC_INLINE F32x16 exp16(const F32x16& x) {
  float in[16], out[16];
  store16(in, x);
  for (int i = 0; i < 16; ++i) out[i] = exp(in[i]);
  return load16(out);
}
#endif

}  // namespace quilt::kernels::cpu::vec
