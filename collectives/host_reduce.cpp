// Host reduction kernels of the collectives: element-wise sum/max/min over buffers of any dtype.
// 16-bit floats are widened to float for the arithmetic and rounded once per store (never
// summed as raw bits); integer sums wrap like the hardware does; bool sum/max are "or", min "and".
// Loops work on blocks with the op chosen outside the loop, so they vectorise; the 16-bit
// conversions are branch-free (bf16) or use F16C (f16) when the CPU has it.
#include <algorithm>
#include <bit>
#include <cstring>
#include <type_traits>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "collectives/internal.h"

namespace quilt::detail {
namespace {

constexpr int64_t kBlock = 2048;  // elements per block: accumulators stay in L1

template <class T>
constexpr bool is_half_v = std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>;

// ---- 16-bit <-> float over a block ----
void to_float(const BFloat16* p, float* out, int64_t m) {
  const uint16_t* b = reinterpret_cast<const uint16_t*>(p);
  for (int64_t i = 0; i < m; ++i) out[i] = std::bit_cast<float>(uint32_t(b[i]) << 16);
}

// Same rounding as float_to_bf16_bits (nearest even, NaN stays NaN), written without branches.
void from_float(const float* in, BFloat16* p, int64_t m) {
  uint16_t* b = reinterpret_cast<uint16_t*>(p);
  for (int64_t i = 0; i < m; ++i) {
    const uint32_t u = std::bit_cast<uint32_t>(in[i]);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = (u >> 16) | 0x40u;
    b[i] = uint16_t((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
  }
}

void to_float(const Half* p, float* out, int64_t m) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= m; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
#endif
  for (; i < m; ++i) out[i] = float(p[i]);
}

void from_float(const float* in, Half* p, int64_t m) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= m; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < m; ++i) p[i] = Half(in[i]);
}

// ---- element-wise combiners (one per op, so the loops stay branch-free) ----
template <class A>
struct Sum {
  A operator()(A a, A b) const {
    if constexpr (std::is_same_v<A, bool>) return a || b;
    else if constexpr (std::is_integral_v<A>) return A(std::make_unsigned_t<A>(a) + std::make_unsigned_t<A>(b));
    else return a + b;
  }
};
template <class A>
struct Max {
  A operator()(A a, A b) const {
    if constexpr (std::is_floating_point_v<A>) return (a > b || a != a) ? a : b;  // NaN propagates
    else return a > b ? a : b;
  }
};
template <class A>
struct Min {
  A operator()(A a, A b) const {
    if constexpr (std::is_floating_point_v<A>) return (a < b || a != a) ? a : b;
    else return a < b ? a : b;
  }
};

// Calls f(Combiner{}) for `op`; avg reduces as a sum (the caller divides afterwards).
template <class A, class F>
void with_op(ReduceOp op, F&& f) {
  switch (op) {
    case ReduceOp::max: f(Max<A>{}); break;
    case ReduceOp::min: f(Min<A>{}); break;
    default: f(Sum<A>{}); break;
  }
}

template <class T>
void reduce_many_t(ReduceOp op, T* dst, const T* const* srcs, int nsrc, int64_t n) {
  if constexpr (is_half_v<T>) {
    // Accumulate every source in float, round once: more accurate than pairwise 16-bit sums.
    with_op<float>(op, [&](auto comb) {
      float acc[kBlock], tmp[kBlock];
      for (int64_t b = 0; b < n; b += kBlock) {
        const int64_t m = std::min(kBlock, n - b);
        to_float(srcs[0] + b, acc, m);
        for (int s = 1; s < nsrc; ++s) {
          to_float(srcs[s] + b, tmp, m);
          for (int64_t i = 0; i < m; ++i) acc[i] = comb(acc[i], tmp[i]);
        }
        from_float(acc, dst + b, m);
      }
    });
  } else {
    with_op<T>(op, [&](auto comb) {
      T acc[kBlock];
      for (int64_t b = 0; b < n; b += kBlock) {
        const int64_t m = std::min(kBlock, n - b);
        std::memcpy(acc, srcs[0] + b, size_t(m) * sizeof(T));
        for (int s = 1; s < nsrc; ++s) {
          const T* p = srcs[s] + b;
          for (int64_t i = 0; i < m; ++i) acc[i] = comb(acc[i], p[i]);
        }
        std::memcpy(dst + b, acc, size_t(m) * sizeof(T));
      }
    });
  }
}

template <class T>
void divide_t(T* data, int64_t n, int divisor) {
  if constexpr (is_half_v<T>) {
    float tmp[kBlock];
    for (int64_t b = 0; b < n; b += kBlock) {
      const int64_t m = std::min(kBlock, n - b);
      to_float(data + b, tmp, m);
      for (int64_t i = 0; i < m; ++i) tmp[i] /= float(divisor);
      from_float(tmp, data + b, m);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) data[i] = T(data[i] / T(divisor));
  }
}

}  // namespace

void reduce_many(DType dt, ReduceOp op, void* dst, const void* const* srcs, int nsrc, int64_t n) {
  if (n <= 0 || nsrc <= 0) return;
  QUILT_DISPATCH_ALL(dt, [&] {
    reduce_many_t<scalar_t>(op, static_cast<scalar_t*>(dst), reinterpret_cast<const scalar_t* const*>(srcs), nsrc, n);
  });
}

void combine_into(DType dt, ReduceOp op, void* inout, const void* in, int64_t n) {
  const void* srcs[2] = {inout, in};
  reduce_many(dt, op, inout, srcs, 2, n);
}

void divide_by(DType dt, void* data, int64_t n, int divisor) {
  QUILT_CHECK(dt != DType::b8, "[collectives] avg is not defined for bool tensors");
  if (n <= 0 || divisor == 1) return;
  QUILT_DISPATCH_ALL(dt, [&] {
    if constexpr (!std::is_same_v<scalar_t, bool>) divide_t<scalar_t>(static_cast<scalar_t*>(data), n, divisor);
  });
}

}  // namespace quilt::detail
