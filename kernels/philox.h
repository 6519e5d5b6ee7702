// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11).
// Header-only and host/device-agnostic so the CPU and CUDA kernels draw identical numbers.
#pragma once

#include <cstdint>

#include "kernels/host_device.h"

namespace quilt::kernels {

struct Philox4 { uint32_t v[4]; };

QUILT_HD void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

/// Ten rounds of Philox4x32 on `ctr` under `key` (two 32-bit words).
QUILT_HD Philox4 philox4x32(Philox4 ctr, uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(0xD2511F53u, ctr.v[0], hi0, lo0);
    philox_mulhilo(0xCD9E8D57u, ctr.v[2], hi1, lo1);
    ctr = Philox4{{hi1 ^ ctr.v[1] ^ k0, lo1, hi0 ^ ctr.v[3] ^ k1, lo0}};
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return ctr;
}

/// Four 32-bit random words for block `block` of stream (seed, key).
QUILT_HD Philox4 philox_block(uint64_t seed, uint64_t key, uint64_t block) {
  Philox4 c{{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
             static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32)}};
  return philox4x32(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

/// Uniform in (0, 1] from 32 random bits (never 0, so log() is safe).
QUILT_HD float uint_to_unit(uint32_t x) { return (static_cast<float>(x >> 8) + 1.0f) * (1.0f / 16777216.0f); }
/// Uniform in (0, 1] with 53 bits from two words.
QUILT_HD double uint2_to_unit(uint32_t a, uint32_t b) {
  const uint64_t x = (static_cast<uint64_t>(a) << 21) ^ (b >> 11);
  return (static_cast<double>(x & ((1ull << 53) - 1)) + 1.0) * (1.0 / 9007199254740992.0);
}

}  // namespace quilt::kernels
