// Scalar types shared by every layer: the DType enum and the 16-bit float storage types.
// Kernels see only these and raw pointers; the engine builds Tensor on top of them.
//
//   quilt::BFloat16 b = 1.5f;  float f = b;   // round-to-nearest-even conversions
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

namespace quilt {

/// Element type of a tensor.
enum class DType : uint8_t { f32, bf16, f16, f64, i32, i64, b8 };

inline constexpr int kNumDTypes = 7;

/// Bytes per element.
constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::bf16: return 2;
    case DType::f16: return 2;
    case DType::f64: return 8;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::b8: return 1;
  }
  return 0;
}

/// Name as it appears in errors and printing ("f32", "bf16", ..., "bool").
constexpr const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::f64: return "f64";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::b8: return "bool";
  }
  return "?";
}

/// True for f32, bf16, f16, f64.
constexpr bool is_floating(DType t) {
  return t == DType::f32 || t == DType::bf16 || t == DType::f16 || t == DType::f64;
}

/// Round-to-nearest-even float -> bfloat16 bits (NaN stays NaN).
constexpr uint16_t float_to_bf16_bits(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
constexpr float bf16_bits_to_float(uint16_t b) { return std::bit_cast<float>(uint32_t(b) << 16); }

/// Round-to-nearest-even float -> IEEE half bits, with subnormals, overflow to inf, NaN kept.
constexpr uint16_t float_to_half_bits(float ff) {
  constexpr uint32_t f32_inf = 255u << 23;
  constexpr uint32_t f16_max = (127u + 16u) << 23;  // 65536: first value that rounds to inf
  constexpr uint32_t denorm_magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  uint32_t f = std::bit_cast<uint32_t>(ff);
  const uint32_t sign = f & 0x80000000u;
  f ^= sign;
  uint32_t o = 0;
  if (f >= f16_max) {
    o = f > f32_inf ? 0x7e00u : 0x7c00u;
  } else if (f < (113u << 23)) {  // below the smallest normal half: let the FPU round
    float v = std::bit_cast<float>(f) + std::bit_cast<float>(denorm_magic);
    o = std::bit_cast<uint32_t>(v) - denorm_magic;
  } else {
    const uint32_t mant_odd = (f >> 13) & 1u;
    f += (uint32_t(15 - 127) << 23) + 0xfffu;
    f += mant_odd;
    o = f >> 13;
  }
  return static_cast<uint16_t>(o | (sign >> 16));
}
constexpr float half_bits_to_float(uint16_t h) {
  constexpr uint32_t shifted_exp = 0x7c00u << 13;
  uint32_t o = (uint32_t(h) & 0x7fffu) << 13;
  const uint32_t exp = shifted_exp & o;
  o += uint32_t(127 - 15) << 23;
  if (exp == shifted_exp) {
    o += uint32_t(128 - 16) << 23;  // inf / NaN
  } else if (exp == 0) {            // zero / subnormal: renormalise
    o += 1u << 23;
    float f = std::bit_cast<float>(o) - std::bit_cast<float>(113u << 23);
    o = std::bit_cast<uint32_t>(f);
  }
  o |= (uint32_t(h) & 0x8000u) << 16;
  return std::bit_cast<float>(o);
}

/// bfloat16 storage type; arithmetic happens in float.
struct BFloat16 {
  uint16_t bits = 0;
  constexpr BFloat16() = default;
  constexpr BFloat16(float f) : bits(float_to_bf16_bits(f)) {}  // NOLINT: implicit by design
  constexpr operator float() const { return bf16_bits_to_float(bits); }
  static constexpr BFloat16 from_bits(uint16_t b) { BFloat16 r; r.bits = b; return r; }
};

/// IEEE half storage type; arithmetic happens in float.
struct Half {
  uint16_t bits = 0;
  constexpr Half() = default;
  constexpr Half(float f) : bits(float_to_half_bits(f)) {}  // NOLINT: implicit by design
  constexpr operator float() const { return half_bits_to_float(bits); }
  static constexpr Half from_bits(uint16_t b) { Half r; r.bits = b; return r; }
};

/// C++ type of each DType (bool is stored as one byte).
template <DType T> struct dtype_traits;
template <> struct dtype_traits<DType::f32> { using type = float; };
template <> struct dtype_traits<DType::bf16> { using type = BFloat16; };
template <> struct dtype_traits<DType::f16> { using type = Half; };
template <> struct dtype_traits<DType::f64> { using type = double; };
template <> struct dtype_traits<DType::i32> { using type = int32_t; };
template <> struct dtype_traits<DType::i64> { using type = int64_t; };
template <> struct dtype_traits<DType::b8> { using type = bool; };

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<BFloat16>() { return DType::bf16; }
template <> constexpr DType dtype_of<Half>() { return DType::f16; }
template <> constexpr DType dtype_of<double>() { return DType::f64; }
template <> constexpr DType dtype_of<int32_t>() { return DType::i32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::i64; }
template <> constexpr DType dtype_of<bool>() { return DType::b8; }

/// Arithmetic type a kernel computes in for storage type T (16-bit floats widen to float).
template <class T> struct compute_type { using type = T; };
template <> struct compute_type<BFloat16> { using type = float; };
template <> struct compute_type<Half> { using type = float; };
template <class T> using compute_t = typename compute_type<T>::type;

}  // namespace quilt

/// Calls F with the C++ type of `dt` bound to `scalar_t` (all seven dtypes).
#define QUILT_DISPATCH_ALL(dt, ...)                                                    \
  [&] {                                                                                \
    switch (dt) {                                                                      \
      case ::quilt::DType::f32: { using scalar_t = float; return __VA_ARGS__(); }       \
      case ::quilt::DType::bf16: { using scalar_t = ::quilt::BFloat16; return __VA_ARGS__(); } \
      case ::quilt::DType::f16: { using scalar_t = ::quilt::Half; return __VA_ARGS__(); } \
      case ::quilt::DType::f64: { using scalar_t = double; return __VA_ARGS__(); }      \
      case ::quilt::DType::i32: { using scalar_t = int32_t; return __VA_ARGS__(); }     \
      case ::quilt::DType::i64: { using scalar_t = int64_t; return __VA_ARGS__(); }     \
      case ::quilt::DType::b8: { using scalar_t = bool; return __VA_ARGS__(); }         \
    }                                                                                  \
    using scalar_t = float;                                                            \
    return __VA_ARGS__();                                                              \
  }()

/// Calls F with `scalar_t` bound for the four floating dtypes; other dtypes are a caller error.
#define QUILT_DISPATCH_FLOATING(dt, ...)                                               \
  [&] {                                                                                \
    switch (dt) {                                                                      \
      case ::quilt::DType::bf16: { using scalar_t = ::quilt::BFloat16; return __VA_ARGS__(); } \
      case ::quilt::DType::f16: { using scalar_t = ::quilt::Half; return __VA_ARGS__(); } \
      case ::quilt::DType::f64: { using scalar_t = double; return __VA_ARGS__(); }      \
      default: { using scalar_t = float; return __VA_ARGS__(); }                        \
    }                                                                                  \
  }()
