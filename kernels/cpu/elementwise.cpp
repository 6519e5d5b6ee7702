// CPU elementwise kernels: unary, binary, where, cast/copy, fill, random, dropout.
#include "kernels/cpu/elementwise.h"

#include <Eigen/Core>
#include <unsupported/Eigen/SpecialFunctions>

#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/vec_math.h"
#include "kernels/elementwise_math.h"
#include "kernels/philox.h"

namespace quilt::kernels::cpu {
namespace {

template <class T> using ArrMap = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;
template <class T> using CArrMap = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;

// Eigen's vectorised form of an op on a contiguous run; returns false when there is none.
template <UnaryOp op, class T>
bool unary_eigen(T* out, const T* in, int64_t n) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    ArrMap<T> o(out, n);
    CArrMap<T> x(in, n);
    if constexpr (op == UnaryOp::neg) o = -x;
    else if constexpr (op == UnaryOp::abs) o = x.abs();
    else if constexpr (op == UnaryOp::square) o = x.square();
    else if constexpr (op == UnaryOp::relu) o = x.max(T(0));
    else if constexpr (op == UnaryOp::exp) o = x.exp();
    else if constexpr (op == UnaryOp::log) o = x.log();
    else if constexpr (op == UnaryOp::sqrt) o = x.sqrt();
    else if constexpr (op == UnaryOp::rsqrt) o = x.rsqrt();
    else if constexpr (op == UnaryOp::tanh) o = x.tanh();
    else if constexpr (op == UnaryOp::sigmoid) o = x.logistic();
    else if constexpr (op == UnaryOp::silu) o = x * x.logistic();
    else if constexpr (op == UnaryOp::gelu) o = T(0.5) * x * (T(1) + (x * T(kInvSqrt2)).erf());
    else if constexpr (op == UnaryOp::sin) o = x.sin();
    else if constexpr (op == UnaryOp::cos) o = x.cos();
    else return false;
    return true;
  }
  return false;
}

// bf16 and f16 have no Eigen form: for the ops with a library call per element (exp, log, roots,
// tanh, sigmoid, silu, gelu, sin, cos), a contiguous run is widened to f32 a block at a time, the
// f32 form run on the block and the result rounded back (bf16 by the lanes' rounding), instead of
// the per-element formula with a conversion on each side (0.2-1.2 GB/s for exp, sigmoid, silu,
// tanh, gelu in bf16 against 19-28 in f32, on an AVX2 EPYC). The rest (neg, abs, relu, ...) the
// compiler vectorises as written, faster than a widened block.
template <UnaryOp op>
constexpr bool kWidenUnary = op == UnaryOp::exp || op == UnaryOp::log || op == UnaryOp::sqrt || op == UnaryOp::rsqrt ||
                             op == UnaryOp::tanh || op == UnaryOp::sigmoid || op == UnaryOp::silu ||
                             op == UnaryOp::gelu || op == UnaryOp::sin || op == UnaryOp::cos;

template <UnaryOp op, class T>
bool unary_widened(T* out, const T* in, int64_t n) {
  if constexpr (kWidenUnary<op> && (std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>)) {
    constexpr int64_t kBlock = 1024;  // two f32 blocks of 4 KiB, on the stack
    alignas(64) float a[kBlock], b[kBlock];
    for (int64_t off = 0; off < n; off += kBlock) {
      const int64_t len = std::min(kBlock, n - off);
      const T* x = in + off;
      T* o = out + off;
      int64_t i = 0;
      if constexpr (std::is_same_v<T, BFloat16>)
        for (; i + 16 <= len; i += 16) vec::store16(a + i, vec::load16(x + i));
      for (; i < len; ++i) a[i] = vec::load(x[i]);
      unary_eigen<op, float>(b, a, len);  // (every op of kWidenUnary has an f32 form)
      i = 0;
      if constexpr (std::is_same_v<T, BFloat16>)
        for (; i + 16 <= len; i += 16) vec::store16(o + i, vec::load16(b + i));
      for (; i < len; ++i) vec::store(o[i], b[i]);
    }
    return true;
  }
  return false;
}

template <UnaryOp op, class T>
void unary_typed(const Loop<2>& l) {
  using C = compute_t<T>;
  if constexpr (op == UnaryOp::logical_not) {
    const size_t es[2] = {1, sizeof(T)};
    parallel_walk(l, es, [](char** p, int64_t n, const int64_t* s) {
      auto* o = reinterpret_cast<bool*>(p[0]);
      auto* x = reinterpret_cast<const T*>(p[1]);
      for (int64_t i = 0; i < n; ++i) o[i * s[0]] = UnaryMath<op>{}(static_cast<C>(x[i * s[1]]));
    });
  } else {
    const size_t es[2] = {sizeof(T), sizeof(T)};
    parallel_walk(l, es, [](char** p, int64_t n, const int64_t* s) {
      auto* o = reinterpret_cast<T*>(p[0]);
      auto* x = reinterpret_cast<const T*>(p[1]);
      if (s[0] == 1 && s[1] == 1) {
        if (unary_eigen<op, T>(o, x, n) || unary_widened<op, T>(o, x, n)) return;
        for (int64_t i = 0; i < n; ++i) o[i] = T(UnaryMath<op>{}(C(x[i])));
      } else {
        for (int64_t i = 0; i < n; ++i) o[i * s[0]] = T(UnaryMath<op>{}(C(x[i * s[1]])));
      }
    });
  }
}

template <class T>
void unary_dispatch(UnaryOp op, const Loop<2>& l) {
  switch (op) {
#define Q(name) case UnaryOp::name: return unary_typed<UnaryOp::name, T>(l);
    Q(neg) Q(exp) Q(log) Q(sqrt) Q(rsqrt) Q(tanh) Q(sigmoid) Q(silu) Q(gelu) Q(relu) Q(abs) Q(sign)
    Q(sin) Q(cos) Q(square) Q(logical_not) Q(gelu_grad)
#undef Q
  }
}

template <BinaryOp op, class T>
void binary_typed(const Loop<3>& l) {
  using C = compute_t<T>;
  using O = std::conditional_t<is_predicate(op), bool, T>;
  const size_t es[3] = {sizeof(O), sizeof(T), sizeof(T)};
  parallel_walk(l, es, [](char** p, int64_t n, const int64_t* s) {
    auto* o = reinterpret_cast<O*>(p[0]);
    auto* a = reinterpret_cast<const T*>(p[1]);
    auto* b = reinterpret_cast<const T*>(p[2]);
    if (s[0] == 1 && s[1] == 1 && s[2] == 1) {
      for (int64_t i = 0; i < n; ++i) o[i] = O(BinaryMath<op>{}(C(a[i]), C(b[i])));
    } else if (s[0] == 1 && s[1] == 1 && s[2] == 0) {
      const C bv = C(b[0]);
      for (int64_t i = 0; i < n; ++i) o[i] = O(BinaryMath<op>{}(C(a[i]), bv));
    } else if (s[0] == 1 && s[1] == 0 && s[2] == 1) {
      const C av = C(a[0]);
      for (int64_t i = 0; i < n; ++i) o[i] = O(BinaryMath<op>{}(av, C(b[i])));
    } else {
      for (int64_t i = 0; i < n; ++i)
        o[i * s[0]] = O(BinaryMath<op>{}(C(a[i * s[1]]), C(b[i * s[2]])));
    }
  });
}

template <class T>
void binary_dispatch(BinaryOp op, const Loop<3>& l) {
  switch (op) {
#define Q(name) case BinaryOp::name: return binary_typed<BinaryOp::name, T>(l);
    Q(add) Q(sub) Q(mul) Q(div) Q(pow) Q(maximum) Q(minimum) Q(eq) Q(ne) Q(lt) Q(le) Q(gt) Q(ge)
    Q(logical_and) Q(logical_or)
#undef Q
  }
}

}  // namespace

void unary(UnaryOp op, DType dt, const Loop<2>& loop) {
  QUILT_DISPATCH_ALL(dt, [&] { unary_dispatch<scalar_t>(op, loop); });
}

void binary(BinaryOp op, DType dt, const Loop<3>& loop) {
  QUILT_DISPATCH_ALL(dt, [&] { binary_dispatch<scalar_t>(op, loop); });
}

// c ? a : b on the bits, by a mask of the condition's byte: written as a choice on a bool, GCC
// branched on it (a random mask mispredicted half the time: 10 ms for 4 Mi f32 elements on an AVX2
// EPYC) and could not vectorise a loop of bool loads; as a byte mask the loop vectorises.
template <class T>
inline T select_bits(uint8_t c, T a, T b) {
  using U = std::conditional_t<sizeof(T) == 1, uint8_t,
            std::conditional_t<sizeof(T) == 2, uint16_t, std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>>>;
  static_assert(sizeof(U) == sizeof(T));
  U ua, ub;
  std::memcpy(&ua, &a, sizeof ua);
  std::memcpy(&ub, &b, sizeof ub);
  const U m = U(U(0) - U(c != 0));
  const U r = U((ua & m) | (ub & U(~m)));
  T out;
  std::memcpy(static_cast<void*>(&out), &r, sizeof out);
  return out;
}

void where(DType dt, const Loop<4>& loop) {
  QUILT_DISPATCH_ALL(dt, [&] {
    using T = scalar_t;
    const size_t es[4] = {sizeof(T), 1, sizeof(T), sizeof(T)};
    parallel_walk(loop, es, [](char** p, int64_t n, const int64_t* s) {
      auto* o = reinterpret_cast<T*>(p[0]);
      auto* c = reinterpret_cast<const uint8_t*>(p[1]);  // (b8: one byte per element)
      auto* a = reinterpret_cast<const T*>(p[2]);
      auto* b = reinterpret_cast<const T*>(p[3]);
      const bool dense = s[0] == 1 && s[1] == 1;
      if (dense && s[2] == 1 && s[3] == 1) {
        for (int64_t i = 0; i < n; ++i) o[i] = select_bits(c[i], a[i], b[i]);
      } else if (dense && s[2] == 0 && s[3] == 1) {  // a scalar (masked_fill)
        const T av = a[0];
        for (int64_t i = 0; i < n; ++i) o[i] = select_bits(c[i], av, b[i]);
      } else if (dense && s[2] == 1 && s[3] == 0) {
        const T bv = b[0];
        for (int64_t i = 0; i < n; ++i) o[i] = select_bits(c[i], a[i], bv);
      } else {
        for (int64_t i = 0; i < n; ++i) o[i * s[0]] = select_bits(c[i * s[1]], a[i * s[2]], b[i * s[3]]);
      }
    });
  });
}

#if defined(__AVX2__)
// dst[k * ds + j] = src[k + j * ss] for an 8 x 8 block of 4- or 2-byte values: eight row loads,
// an unpack / shuffle transpose in registers, eight row stores. Element by element, the transposing
// copy ran at 3.4-4.2 GB/s on an AVX2 EPYC (2048 x 2048 f32).
template <class B>
inline void transpose8x8(B* dst, int64_t ds, const B* src, int64_t ss) {
  static_assert(sizeof(B) == 4 || sizeof(B) == 2);
  if constexpr (sizeof(B) == 2) {  // eight 16-byte rows: unpacks of 16, 32 and 64 bits
    __m128i a[8], b[8];
    for (int j = 0; j < 8; ++j) a[j] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j * ss));
    for (int j = 0; j < 8; j += 2) {
      b[j / 2] = _mm_unpacklo_epi16(a[j], a[j + 1]);
      b[j / 2 + 4] = _mm_unpackhi_epi16(a[j], a[j + 1]);
    }
    for (int h = 0; h < 8; h += 4) {
      a[h] = _mm_unpacklo_epi32(b[h], b[h + 1]);
      a[h + 1] = _mm_unpackhi_epi32(b[h], b[h + 1]);
      a[h + 2] = _mm_unpacklo_epi32(b[h + 2], b[h + 3]);
      a[h + 3] = _mm_unpackhi_epi32(b[h + 2], b[h + 3]);
    }
    for (int h = 0; h < 8; h += 4) {
      const int k = h == 0 ? 0 : 4;  // rows k..k+3 from a[h..h+3]
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (k + 0) * ds), _mm_unpacklo_epi64(a[h], a[h + 2]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (k + 1) * ds), _mm_unpackhi_epi64(a[h], a[h + 2]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (k + 2) * ds), _mm_unpacklo_epi64(a[h + 1], a[h + 3]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (k + 3) * ds), _mm_unpackhi_epi64(a[h + 1], a[h + 3]));
    }
    return;
  }
  __m256 v[8], t[8];
  for (int j = 0; j < 8; ++j) v[j] = _mm256_loadu_ps(reinterpret_cast<const float*>(src + j * ss));
  for (int j = 0; j < 8; j += 2) {
    t[j] = _mm256_unpacklo_ps(v[j], v[j + 1]);
    t[j + 1] = _mm256_unpackhi_ps(v[j], v[j + 1]);
  }
  for (int j = 0; j < 8; j += 4) {
    v[j] = _mm256_shuffle_ps(t[j], t[j + 2], _MM_SHUFFLE(1, 0, 1, 0));
    v[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], _MM_SHUFFLE(3, 2, 3, 2));
    v[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], _MM_SHUFFLE(1, 0, 1, 0));
    v[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int k = 0; k < 4; ++k) {
    _mm256_storeu_ps(reinterpret_cast<float*>(dst + k * ds), _mm256_permute2f128_ps(v[k], v[k + 4], 0x20));
    _mm256_storeu_ps(reinterpret_cast<float*>(dst + (k + 4) * ds), _mm256_permute2f128_ps(v[k], v[k + 4], 0x31));
  }
}
#endif

void copy(DType out_dt, DType in_dt, const Loop<2>& loop) {
  if (out_dt == in_dt && loop.contiguous()) {
    const size_t es = dtype_size(out_dt);
    char* o = static_cast<char*>(loop.data[0]);
    const char* x = static_cast<const char*>(loop.data[1]);
    parallel_range(loop.numel(), kGrain * 4, [&](int64_t b, int64_t e) {
      std::memcpy(o + b * es, x + b * es, size_t(e - b) * es);
    });
    return;
  }
  if (out_dt == in_dt) {  // same type: move bits (keeps NaN payloads, -0, signalling NaNs)
    auto strided = [&](auto tag) {
      using B = decltype(tag);
      const int nd = loop.ndim;
      // A transposing copy (output rows contiguous, input columns contiguous) goes tile by tile,
      // so both sides stay in cache lines instead of striding through memory.
      if (nd >= 2 && nd <= 3 && loop.strides[0][nd - 1] == 1 && loop.strides[1][nd - 2] == 1 &&
          loop.strides[1][nd - 1] != 1) {
        constexpr int64_t kTile = 32;
        const int64_t rows = loop.shape[nd - 2], cols = loop.shape[nd - 1], batch = nd == 3 ? loop.shape[0] : 1;
        const int64_t ors = loop.strides[0][nd - 2], ics = loop.strides[1][nd - 1];
        const int64_t obs = nd == 3 ? loop.strides[0][0] : 0, ibs = nd == 3 ? loop.strides[1][0] : 0;
        const int64_t row_tiles = (rows + kTile - 1) / kTile;
        B* out = static_cast<B*>(loop.data[0]);
        const B* in = static_cast<const B*>(loop.data[1]);
        parallel_range(batch * row_tiles, 1, [&](int64_t b, int64_t e) {
          for (int64_t t = b; t < e; ++t) {
            const int64_t bi = t / row_tiles, r0 = (t % row_tiles) * kTile, r1 = std::min(rows, r0 + kTile);
            B* o = out + bi * obs;
            const B* x = in + bi * ibs;
            for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
              const int64_t c1 = std::min(cols, c0 + kTile);
              int64_t r = r0;
#if defined(__AVX2__)
              if constexpr (sizeof(B) == 4 || sizeof(B) == 2) {  // 8 x 8 blocks in registers, the edges by element
                for (; r + 8 <= r1; r += 8) {
                  int64_t c = c0;
                  for (; c + 8 <= c1; c += 8) transpose8x8(o + r * ors + c, ors, x + r + c * ics, ics);
                  for (; c < c1; ++c)
                    for (int64_t k = r; k < r + 8; ++k) o[k * ors + c] = x[k + c * ics];
                }
              }
#endif
              for (; r < r1; ++r)
                for (int64_t c = c0; c < c1; ++c) o[r * ors + c] = x[r + c * ics];
            }
          }
        });
        return;
      }
      const size_t es[2] = {sizeof(B), sizeof(B)};
      parallel_walk(loop, es, [](char** p, int64_t n, const int64_t* s) {
        auto* o = reinterpret_cast<B*>(p[0]);
        auto* x = reinterpret_cast<const B*>(p[1]);
        for (int64_t i = 0; i < n; ++i) o[i * s[0]] = x[i * s[1]];
      });
    };
    switch (dtype_size(out_dt)) {
      case 1: return strided(uint8_t{});
      case 2: return strided(uint16_t{});
      case 4: return strided(uint32_t{});
      default: return strided(uint64_t{});
    }
  }
  QUILT_DISPATCH_ALL(out_dt, [&] {
    using O = scalar_t;
    QUILT_DISPATCH_ALL(in_dt, [&] {
      using I = scalar_t;
      const size_t es[2] = {sizeof(O), sizeof(I)};
      parallel_walk(loop, es, [](char** p, int64_t n, const int64_t* s) {
        auto* o = reinterpret_cast<O*>(p[0]);
        auto* x = reinterpret_cast<const I*>(p[1]);
        for (int64_t i = 0; i < n; ++i) o[i * s[0]] = O(CastMath<O, I>{}(static_cast<compute_t<I>>(x[i * s[1]])));
      });
    });
  });
}

void fill(DType dt, double value, const Loop<1>& loop) {
  QUILT_DISPATCH_ALL(dt, [&] {
    using T = scalar_t;
    const T v = T(CastMath<T, double>{}(value));
    const size_t es[1] = {sizeof(T)};
    parallel_walk(loop, es, [v](char** p, int64_t n, const int64_t* s) {
      auto* o = reinterpret_cast<T*>(p[0]);
      for (int64_t i = 0; i < n; ++i) o[i * s[0]] = v;
    });
  });
}

void random_uniform(DType dt, void* out, const RandomArgs& args) {
  QUILT_DISPATCH_FLOATING(dt, [&] {
    auto* o = static_cast<scalar_t*>(out);
    parallel_range(args.numel(), kGrain / 4, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const uint64_t g = args.global_index(i);
        const Philox4 r = philox_block(args.seed, args.key, g);
        const double u = uniform_draw<scalar_t>(r);
        o[i] = scalar_t(static_cast<compute_t<scalar_t>>(args.a + (args.b - args.a) * u));
      }
    });
  });
}

void random_normal(DType dt, void* out, const RandomArgs& args) {
  QUILT_DISPATCH_FLOATING(dt, [&] {
    auto* o = static_cast<scalar_t*>(out);
    parallel_range(args.numel(), kGrain / 4, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const uint64_t g = args.global_index(i);
        const Philox4 r = philox_block(args.seed, args.key, g);
        const double z = normal_draw(r);
        o[i] = scalar_t(static_cast<compute_t<scalar_t>>(args.a + args.b * z));
      }
    });
  });
}

void random_int(DType dt, void* out, int64_t n, int64_t low, int64_t high, uint64_t seed, uint64_t key) {
  const uint64_t range = static_cast<uint64_t>(high - low);
  QUILT_DISPATCH_ALL(dt, [&] {
    auto* o = static_cast<scalar_t*>(out);
    parallel_range(n, kGrain / 4, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const int64_t v = int_draw(philox_block(seed, key, static_cast<uint64_t>(i)), low, range);
        o[i] = scalar_t(static_cast<compute_t<scalar_t>>(v));
      }
    });
  });
}

void dropout(DType dt, void* out, const void* x, int64_t n, double p, uint64_t seed, uint64_t key) {
  QUILT_DISPATCH_FLOATING(dt, [&] {
    auto* o = static_cast<scalar_t*>(out);
    auto* in = static_cast<const scalar_t*>(x);
    using C = compute_t<scalar_t>;
    const C scale = C(1.0 / (1.0 - p));
    parallel_range(n, kGrain / 4, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const Philox4 r = philox_block(seed, key, static_cast<uint64_t>(i));
        const bool keep = double(uint_to_unit(r.v[0])) > p;
        o[i] = scalar_t(keep ? C(in[i]) * scale : C(0));
      }
    });
  });
}

}  // namespace quilt::kernels::cpu
