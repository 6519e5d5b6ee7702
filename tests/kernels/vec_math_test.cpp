// kernels/cpu/vec_math.h: the vectorisable exp against libm, and the bf16 rounding against
// float_to_bf16_bits, run through the loops the kernels use.
#include "kernels/cpu/vec_math.h"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <bit>
#include <iterator>
#include <limits>
#include <vector>

namespace vec = quilt::kernels::cpu::vec;

namespace {

void exp_loop(float* __restrict y, const float* __restrict x, int64_t n) {
#pragma omp simd simdlen(16)
  for (int64_t i = 0; i < n; ++i) y[i] = vec::exp(x[i]);
}

// The ends both exps share, in this order: 0 at and below -87.34, inf above 88.72, NaN kept, 1 at 0.
const float kInf = std::numeric_limits<float>::infinity();
const std::vector<float> kEnds = {-kInf, -1000.0f, -87.34f, 88.73f, 1000.0f, kInf, std::nanf(""), 0.0f, -0.0f};

void check_ends(const std::vector<float>& y) {
  for (size_t i = 0; i < 3; ++i) CHECK(y[i] == 0.0f);
  for (size_t i = 3; i < 6; ++i) CHECK(y[i] == kInf);
  CHECK(std::isnan(y[6]));
  CHECK(y[7] == 1.0f);
  CHECK(y[8] == 1.0f);
}

}  // namespace

TEST_CASE("vec_math: exp is within 2 ulp of the f64 exp over the normal f32 range") {
  const int64_t n = 1 << 20;
  std::vector<float> x(static_cast<size_t>(n)), y(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[size_t(i)] = -87.3f + 176.0f * float(i) / float(n);
  exp_loop(y.data(), x.data(), n);
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double want = std::exp(double(x[size_t(i)]));
    if (want < double(std::numeric_limits<float>::min()) || want > double(std::numeric_limits<float>::max())) continue;
    const double ulp = std::ldexp(1.0, std::ilogb(want) - 23);
    worst = std::max(worst, std::abs(double(y[size_t(i)]) - want) / ulp);
  }
  CHECK(worst < 2.0);
}

TEST_CASE("vec_math: exp gives 0 below -87.34, inf above 88.72, and keeps NaN") {
  std::vector<float> y(kEnds.size());
  exp_loop(y.data(), kEnds.data(), int64_t(kEnds.size()));
  check_ends(y);
}

TEST_CASE("vec_math: bf16 rounding equals float_to_bf16_bits: ties, NaN, inf, denormals, near the bf16 max") {
  std::vector<uint32_t> bits = {
      0x3f808000u, 0x3f818000u,              // ties: to even (down), to even (up)
      0x3f808001u, 0x3f807fffu,              // just above / below a tie
      0x7f800000u, 0xff800000u,              // +-inf
      0x7fc00000u, 0x7f800001u, 0xff812345u, // quiet NaN, signalling NaNs (quieted, stay NaN)
      0x00000001u, 0x00008000u, 0x00018000u, 0x807fffffu, 0x00800000u,  // denormals, smallest normal
      0x7f7f7fffu, 0x7f7f8000u, 0x7f7fffffu, // near the bf16 max: stays, ties to inf, rounds to inf
      0x00000000u, 0x80000000u,              // signed zeros
  };
  for (uint32_t i = 0; i < 4096; ++i) bits.push_back(i * 0x000fdb97u);  // a spread of others
  for (uint32_t u : bits) {
    CAPTURE(u);
    const float f = std::bit_cast<float>(u);
    CHECK(vec::bf16_bits(f) == quilt::float_to_bf16_bits(f));
    quilt::BFloat16 b;
    vec::store(b, f);
    CHECK(b.bits == quilt::float_to_bf16_bits(f));
    CHECK(std::bit_cast<uint32_t>(vec::load(b)) == uint32_t(b.bits) << 16);
  }
}

TEST_CASE("vec_math: sixteen lanes load and round bf16 like the scalar forms, and hsum adds every lane") {
  std::vector<uint32_t> bits = {0x3f808000u, 0x3f818000u, 0x3f808001u, 0x3f807fffu, 0x7f800000u, 0xff800000u,
                                0x7fc00000u, 0x7f800001u, 0xff812345u, 0x7f7f7fffu, 0x7f7f8000u, 0x7f7fffffu,
                                0x00000000u, 0x80000000u, 0x00800000u, 0x00000001u, 0x807fffffu};
  for (uint32_t i = 0; i < 4096; ++i) bits.push_back(i * 0x000fdb97u);
  while (bits.size() % 16) bits.push_back(0x3f800000u);
  std::vector<float> f(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) f[i] = std::bit_cast<float>(bits[i]);
  std::vector<quilt::BFloat16> b(f.size());
  std::vector<float> back(f.size());
  for (size_t i = 0; i < f.size(); i += 16) vec::store16(b.data() + i, vec::load16(f.data() + i));
  for (size_t i = 0; i < f.size(); i += 16) vec::store16(back.data() + i, vec::load16(b.data() + i));
  for (size_t i = 0; i < f.size(); ++i) {
    CAPTURE(bits[i]);
    const uint16_t want = quilt::float_to_bf16_bits(f[i]);
    // With AVX512-BF16 the CPU's conversion flushes f32 denormals to a signed zero.
    const bool denormal = (bits[i] & 0x7f800000u) == 0 && (bits[i] & 0x007fffffu) != 0;
    if (denormal) CHECK((b[i].bits == want || b[i].bits == (uint16_t(bits[i] >> 16) & 0x8000u)));
    else CHECK(b[i].bits == want);
    CHECK(std::bit_cast<uint32_t>(back[i]) == uint32_t(b[i].bits) << 16);
  }
  float lanes[16];
  for (int i = 0; i < 16; ++i) lanes[i] = float(1 << i);
  CHECK(vec::hsum(vec::load16(lanes)) == 65535.0f);
  CHECK(vec::hsum(vec::splat16(0.5f)) == 8.0f);
}

namespace {

std::vector<float> exp16_all(const std::vector<float>& x) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i + 16 <= x.size(); i += 16) vec::store16(y.data() + i, vec::exp16(vec::load16(x.data() + i)));
  return y;
}

}  // namespace

// (Eigen's AVX-512 packet exp loses about 0.05 ulp per unit of |x| in its range reduction: 4.5 ulp
// at the ends here, the accuracy the array exp of the Eigen kernels always had.)
TEST_CASE("vec_math: exp16 is within 5 ulp of the f64 exp from -87.3 to 88.3") {
  const int64_t n = 1 << 20;  // a multiple of 16
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[size_t(i)] = -87.3f + 175.6f * float(i) / float(n);
  const std::vector<float> y = exp16_all(x);
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double want = std::exp(double(x[size_t(i)]));
    const double ulp = std::ldexp(1.0, std::ilogb(want) - 23);
    worst = std::max(worst, std::abs(double(y[size_t(i)]) - want) / ulp);
  }
  CAPTURE(vec::kFastExp16);
  CHECK(worst < 5.0);
}

// The lanes' ends: those of the scalar exp; with Eigen's packet exp (AVX-512) inf from 88.38 up
// already (its 2^n overflows at n = 128).
TEST_CASE("vec_math: exp16 gives 0 at -inf and below -87.34, inf above 88.73, keeps NaN, 1 at zero") {
  std::vector<float> x = kEnds;
  for (float v : {88.3f, -87.0f, 1.0f, -kInf, std::nanf(""), 89.0f, -87.35f}) x.push_back(v);
  const std::vector<float> y = exp16_all(x);
  check_ends(y);
  CHECK(y[9] == doctest::Approx(std::exp(double(88.3f))).epsilon(1e-6));
  CHECK(y[10] == doctest::Approx(std::exp(-87.0)).epsilon(1e-6).scale(0));
  CHECK(y[11] == doctest::Approx(std::exp(1.0)).epsilon(1e-6));
  CHECK(y[12] == 0.0f);
  CHECK(std::isnan(y[13]));
  CHECK(y[14] == kInf);
  CHECK(y[15] == 0.0f);
}

// Where the lanes are the scalar exp on registers (AVX2 + FMA, or no AVX at all), a row's tail
// taken element by element matches its lanes bit for bit; elsewhere (Eigen's packet exp) the two
// agree only within the ulp bounds above, and this case is skipped.
TEST_CASE("vec_math: exp16 gives the scalar exp's bits where kExp16IsScalar") {
  if (!vec::kExp16IsScalar) {
    MESSAGE("skipped: exp16 is Eigen's packet exp on this target (AVX-512, or AVX without AVX2)");
    return;
  }
  std::vector<float> x;
  for (int64_t i = 0; i < (1 << 18); ++i) x.push_back(-100.0f + 200.0f * float(i) / float(1 << 18));
  for (float v : {-87.33654f, -87.3365f, 88.7228f, 88.72284f, -88.0f, 88.8f, 0.0f, -0.0f}) x.push_back(v);
  for (float v : kEnds) x.push_back(v);
  while (x.size() % 16 != 0) x.push_back(1.0f);
  const std::vector<float> y = exp16_all(x);
  int64_t same = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const float want = vec::exp(x[i]);
    same += std::isnan(want) ? int64_t(std::isnan(y[i])) : int64_t(std::bit_cast<uint32_t>(y[i]) == std::bit_cast<uint32_t>(want));
  }
  CHECK(same == int64_t(x.size()));
}

TEST_CASE("vec_math: max16 and hmax find the largest lane") {
  float a[16], b[16];
  for (int i = 0; i < 16; ++i) {
    a[i] = float(i) - 100.0f;
    b[i] = float(15 - i) * 0.5f - 100.0f;
  }
  a[9] = 7.5f;
  const vec::F32x16 m = vec::max16(vec::load16(a), vec::load16(b));
  for (int i = 0; i < 16; ++i) CHECK(m[i] == std::max(a[i], b[i]));
  CHECK(vec::hmax(m) == 7.5f);
  CHECK(vec::hmax(vec::splat16(-std::numeric_limits<float>::infinity())) == -std::numeric_limits<float>::infinity());
}

// The operators the kernels use, lane by lane against scalar arithmetic: one AVX-512 vector or,
// without AVX-512, two 8-lane halves (where a lane mixed up between halves shows here).
TEST_CASE("vec_math: sixteen-lane arithmetic is lane-wise, with floats on either side") {
  float a[16], b[16], out[16];
  for (int i = 0; i < 16; ++i) {
    a[i] = 1.5f + float(i) * 0.25f;
    b[i] = -3.0f + float(i * i) * 0.125f;
  }
  const vec::F32x16 va = vec::load16(a), vb = vec::load16(b);
  vec::F32x16 acc = va;
  acc += vb;
  const vec::F32x16 results[] = {va + vb, va - vb, va * vb, va / vb, 2.0f * va, va * 2.0f, 1.0f - vb,
                                 vb - 1.0f, 3.0f / va, va / 4.0f, 5.0f + va, va + 5.0f, -va, acc};
  for (size_t k = 0; k < std::size(results); ++k) {
    vec::store16(out, results[k]);
    for (int i = 0; i < 16; ++i) {
      CAPTURE(k);
      CAPTURE(i);
      const float want[] = {a[i] + b[i], a[i] - b[i], a[i] * b[i], a[i] / b[i], 2.0f * a[i], a[i] * 2.0f,
                            1.0f - b[i], b[i] - 1.0f, 3.0f / a[i], a[i] / 4.0f, 5.0f + a[i], a[i] + 5.0f,
                            -a[i], a[i] + b[i]};
      CHECK(out[i] == want[k]);
      CHECK(results[k][i] == want[k]);
    }
  }
}
