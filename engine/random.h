// Counter-based random numbers (Philox4x32-10): every value is a pure function of
// (seed, key, global index), so any layout or call order draws the same numbers.
//
//   Tensor w = randn({out, in}, RngKey(seed, "model.layers.0.mlp.up_proj.weight"));
//   Generator g(seed);  Tensor m = dropout(x, 0.1, g);   // g hands out a fresh key per call
#pragma once

#include <cstdint>
#include <string_view>

namespace quilt {

/// 64-bit FNV-1a of a string (stable across runs and platforms).
constexpr uint64_t stable_hash(std::string_view s) {
  uint64_t h = 1469598103934665603ull;
  for (char c : s) { h ^= static_cast<uint8_t>(c); h *= 1099511628211ull; }
  return h;
}

/// Identifies a random stream: a seed plus a key (typically a parameter's name hash).
struct RngKey {
  uint64_t seed = 0;
  uint64_t key = 0;
  constexpr RngKey() = default;
  constexpr RngKey(uint64_t s, uint64_t k) : seed(s), key(k) {}
  constexpr RngKey(uint64_t s, std::string_view name) : seed(s), key(stable_hash(name)) {}
};

/// Hands out keys in sequence for ops that need fresh randomness per call (dropout).
/// Its state is one counter, so it can be saved and replayed (activation checkpointing).
class Generator {
 public:
  explicit Generator(uint64_t seed = 0, uint64_t stream = 0) : seed_(seed), stream_(stream) {}
  /// The next key; advances the counter.
  RngKey next() { return RngKey(seed_, stream_ * 0x9E3779B97F4A7C15ull + (counter_++)); }
  uint64_t seed() const { return seed_; }
  uint64_t counter() const { return counter_; }
  void set_counter(uint64_t c) { counter_ = c; }

 private:
  uint64_t seed_;
  uint64_t stream_;
  uint64_t counter_ = 0;
};

/// The thread's default generator (seeded with 0 unless set).
Generator& default_generator();
/// Reseeds this thread's default generator.
void manual_seed(uint64_t seed);

}  // namespace quilt
