// The caching host allocator: size classes, reuse without a system allocation, the cap on
// cached bytes (least recently freed blocks go first), trimming, the counters, many threads at
// once, the out-of-memory error and QUILT_CPU_CACHE_MAX values. Tests use deltas of the
// process-wide counters, so they hold whatever else the process has allocated. Also: malloc
// keeps freed heap memory for the GEMM libraries' per-call buffers (and QUILT_MALLOC_KEEP=0
// leaves it as glibc sets it).
#include <doctest/doctest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/error.h"
#include "engine/storage.h"
#include "engine/tensor.h"

using namespace quilt;

namespace {

constexpr size_t kKiB = size_t(1) << 10;
constexpr size_t kMiB = size_t(1) << 20;

void* host_alloc(size_t bytes) { return cpu_allocator()->allocate(bytes, current_stream(Device::cpu())); }
void host_free(void* p, size_t bytes) { cpu_allocator()->deallocate(p, bytes, current_stream(Device::cpu())); }

// Sets the cache limit for one test and puts the previous one back (even when a check fails).
struct LimitGuard {
  explicit LimitGuard(int64_t bytes) : saved(cpu_cache_limit()) {
    empty_cpu_cache();
    set_cpu_cache_limit(bytes);
  }
  ~LimitGuard() { set_cpu_cache_limit(saved); }
  int64_t saved;
};

}  // namespace

TEST_CASE("host allocator: size classes round up by at most an eighth and make nearby sizes share a block") {
  CHECK(cpu_size_class(0) == 0);
  CHECK(cpu_size_class(1) == 64);
  CHECK(cpu_size_class(1000) == 1024);
  CHECK(cpu_size_class(64 * kKiB) == 64 * kKiB);
  CHECK(cpu_size_class(64 * kKiB + 1) == 72 * kKiB);
  CHECK(cpu_size_class(1000000) == kMiB);
  CHECK(cpu_size_class(1000100) == kMiB);
  CHECK(cpu_size_class(kMiB + 1) == kMiB + 128 * kKiB);
  size_t prev = 0;
  for (size_t bytes = 1; bytes < (size_t(64) << 20); bytes = bytes * 9 / 8 + 61) {
    const size_t c = cpu_size_class(bytes);
    CHECK(c >= bytes);
    CHECK(c >= prev);
    CHECK(c % 64 == 0);
    if (bytes >= 64 * kKiB) {
      CHECK(c % (4 * kKiB) == 0);
      CHECK(double(c) <= double(bytes) * 1.125 + 4096);
    }
    prev = c;
  }
}

TEST_CASE("host allocator: a freed block serves the next request of its size class without a system allocation") {
  LimitGuard limit(int64_t(64) * int64_t(kMiB));
  void* a = host_alloc(1000000);
  REQUIRE(a != nullptr);
  CHECK(reinterpret_cast<uintptr_t>(a) % 64 == 0);
  std::memset(a, 1, 1000000);
  host_free(a, 1000000);
  CHECK(cpu_cached_bytes() == int64_t(kMiB));
  const MemoryStats before = cpu_memory_stats();
  void* b = host_alloc(1000100);  // another size, the same class
  const MemoryStats after = cpu_memory_stats();
  CHECK(b == a);
  CHECK(after.num_system_allocs == before.num_system_allocs);
  CHECK(after.num_allocs == before.num_allocs + 1);
  CHECK(after.reserved == before.reserved);
  CHECK(after.allocated == before.allocated + 1000100);
  CHECK(cpu_cached_bytes() == 0);
  host_free(b, 1000100);

  // A request far above every cached block maps a new one and leaves the cache alone.
  void* c = host_alloc(4 * kMiB);
  CHECK(cpu_memory_stats().num_system_allocs == after.num_system_allocs + 1);
  CHECK(cpu_cached_bytes() == int64_t(kMiB));
  host_free(c, 4 * kMiB);
}

TEST_CASE("host allocator: Storage reuses cached blocks, and resize_ to the same size takes its own block back") {
  LimitGuard limit(int64_t(64) * int64_t(kMiB));
  { Storage warm = Storage::allocate(3 * kMiB, Device::cpu()); }
  const MemoryStats before = cpu_memory_stats();
  for (int i = 0; i < 5; ++i) {
    Storage s = Storage::allocate(3 * kMiB - 4096, Device::cpu());
    std::memset(s.data(), i, s.nbytes());
    s.resize_(3 * kMiB);
    CHECK(s.nbytes() == 3 * kMiB);
  }
  const MemoryStats after = cpu_memory_stats();
  CHECK(after.num_system_allocs == before.num_system_allocs);
  CHECK(after.num_allocs == before.num_allocs + 10);
  CHECK(after.allocated == before.allocated);
}

TEST_CASE("host allocator: cached bytes never exceed the cap, and the least recently freed blocks go back first") {
  LimitGuard limit(int64_t(3 * kMiB));
  const MemoryStats base = cpu_memory_stats();
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(host_alloc(kMiB));
  CHECK(cpu_memory_stats().reserved == base.reserved + int64_t(4 * kMiB));
  for (void* p : blocks) {
    host_free(p, kMiB);
    CHECK(cpu_cached_bytes() <= int64_t(3 * kMiB));
  }
  CHECK(cpu_cached_bytes() == int64_t(3 * kMiB));
  CHECK(cpu_memory_stats().reserved == base.reserved + int64_t(3 * kMiB));  // the first one went back

  // The most recently freed block comes back first.
  void* again = host_alloc(kMiB);
  CHECK(again == blocks[3]);
  host_free(again, kMiB);

  // A block bigger than the cap goes straight back to the system.
  const MemoryStats mid = cpu_memory_stats();
  void* big = host_alloc(8 * kMiB);
  CHECK(cpu_memory_stats().reserved == mid.reserved + int64_t(8 * kMiB));
  host_free(big, 8 * kMiB);
  CHECK(cpu_cached_bytes() == int64_t(3 * kMiB));
  CHECK(cpu_memory_stats().reserved == mid.reserved);

  // Lowering the cap trims at once; a cap of 0 caches nothing.
  set_cpu_cache_limit(int64_t(kMiB));
  CHECK(cpu_cached_bytes() == int64_t(kMiB));
  CHECK(cpu_memory_stats().reserved == base.reserved + int64_t(kMiB));
  set_cpu_cache_limit(0);
  CHECK(cpu_cached_bytes() == 0);
  void* p = host_alloc(2 * kMiB);
  host_free(p, 2 * kMiB);
  CHECK(cpu_cached_bytes() == 0);
  CHECK(cpu_memory_stats().reserved == base.reserved);
  CHECK(cpu_cache_limit() == 0);
}

TEST_CASE("host allocator: empty_cpu_cache returns every cached block and reserved drops by as much") {
  LimitGuard limit(int64_t(256) * int64_t(kMiB));
  const MemoryStats base = cpu_memory_stats();
  const size_t sizes[] = {100 * kKiB, kMiB, 5 * kMiB + 3, 17 * kMiB};
  std::vector<void*> blocks;
  int64_t held = 0;
  for (size_t s : sizes) {
    blocks.push_back(host_alloc(s));
    held += int64_t(cpu_size_class(s));
  }
  CHECK(cpu_memory_stats().reserved == base.reserved + held);
  for (size_t i = 0; i < blocks.size(); ++i) host_free(blocks[i], sizes[i]);
  CHECK(cpu_cached_bytes() == held);
  CHECK(cpu_memory_stats().reserved == base.reserved + held);
  empty_cpu_cache();
  CHECK(cpu_cached_bytes() == 0);
  CHECK(cpu_memory_stats().reserved == base.reserved);
  CHECK(cpu_memory_stats().allocated == base.allocated);
}

TEST_CASE("host allocator: counters follow live bytes, the peak and small blocks") {
  LimitGuard limit(int64_t(64) * int64_t(kMiB));
  const MemoryStats base = cpu_memory_stats();
  reset_cpu_peak_memory();
  void* small = host_alloc(1000);
  void* large = host_alloc(2 * kMiB + 5);
  MemoryStats s = cpu_memory_stats();
  CHECK(s.allocated == base.allocated + 1000 + int64_t(2 * kMiB + 5));
  CHECK(s.reserved == base.reserved + int64_t(cpu_size_class(1000) + cpu_size_class(2 * kMiB + 5)));
  CHECK(s.peak_allocated >= s.allocated);
  CHECK(s.num_allocs == base.num_allocs + 2);
  CHECK(s.num_system_allocs == base.num_system_allocs + 2);
  const int64_t peak = s.peak_allocated;
  host_free(large, 2 * kMiB + 5);
  host_free(small, 1000);
  s = cpu_memory_stats();
  CHECK(s.allocated == base.allocated);
  CHECK(s.peak_allocated == peak);  // the peak stays until reset
  CHECK(s.reserved == base.reserved + int64_t(cpu_size_class(2 * kMiB + 5)));  // small blocks go back to malloc
  reset_cpu_peak_memory();
  CHECK(cpu_memory_stats().peak_allocated == base.allocated);
  CHECK(host_alloc(0) == nullptr);
  host_free(nullptr, 0);
}

TEST_CASE("host allocator: many threads allocating and freeing at once never share a block and balance the counters") {
  LimitGuard limit(int64_t(32) * int64_t(kMiB));  // small enough that threads also trim
  const MemoryStats base = cpu_memory_stats();
  constexpr int kThreads = 8, kIters = 1500;
  std::vector<int> bad(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t, &bad] {
      std::mt19937 rng(uint32_t(1234 + t));
      std::uniform_int_distribution<size_t> size(1, 3 * kMiB);
      std::vector<std::pair<unsigned char*, size_t>> live;
      for (int i = 0; i < kIters; ++i) {
        if (live.size() < 4 && (rng() % 3 != 0 || live.empty())) {
          const size_t n = size(rng);
          auto* p = static_cast<unsigned char*>(host_alloc(n));
          p[0] = p[n / 2] = p[n - 1] = static_cast<unsigned char>(t + 1);  // where the check below looks
          live.emplace_back(p, n);
        } else {
          const size_t k = rng() % live.size();
          auto [p, n] = live[k];
          // Another thread writing into this block would show here.
          if (p[0] != t + 1 || p[n / 2] != t + 1 || p[n - 1] != t + 1) ++bad[size_t(t)];
          host_free(p, n);
          live.erase(live.begin() + std::ptrdiff_t(k));
        }
        if (cpu_cached_bytes() > int64_t(32 * kMiB)) ++bad[size_t(t)];
      }
      for (auto [p, n] : live) host_free(p, n);
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) CHECK(bad[size_t(t)] == 0);
  const MemoryStats after = cpu_memory_stats();
  CHECK(after.allocated == base.allocated);
  CHECK(after.num_allocs > base.num_allocs);
  CHECK(cpu_cached_bytes() <= int64_t(32 * kMiB));
  empty_cpu_cache();
  CHECK(cpu_memory_stats().reserved == base.reserved);
}

TEST_CASE("host allocator: an impossible request names its bytes, and the cache is returned before giving up") {
  LimitGuard limit(int64_t(64) * int64_t(kMiB));
  void* p = host_alloc(2 * kMiB);
  host_free(p, 2 * kMiB);
  REQUIRE(cpu_cached_bytes() == int64_t(2 * kMiB));
  const MemoryStats before = cpu_memory_stats();
  const size_t pib = size_t(1) << 50;  // more than any machine maps
  CHECK_THROWS_WITH_AS(host_alloc(pib), doctest::Contains("out of memory allocating 1125899906842624 bytes"), Error);
  CHECK(cpu_cached_bytes() == 0);  // the retry released the cache
  const MemoryStats after = cpu_memory_stats();
  CHECK(after.allocated == before.allocated);
  CHECK(after.num_allocs == before.num_allocs);
  CHECK(after.reserved == before.reserved - int64_t(2 * kMiB));
  const size_t absurd = size_t(1) << 62;
  CHECK_THROWS_WITH_AS(host_alloc(absurd), doctest::Contains("out of memory allocating 4611686018427387904 bytes"),
                       Error);
  CHECK_THROWS_WITH_AS(Tensor::empty({int64_t(1) << 40, int64_t(1) << 10}, {.dtype = DType::f32}),
                       doctest::Contains("out of memory allocating 4503599627370496 bytes"), Error);
}

TEST_CASE("host allocator: QUILT_CPU_CACHE_MAX values are byte counts with an optional binary suffix") {
  CHECK(parse_cpu_cache_limit("0") == 0);
  CHECK(parse_cpu_cache_limit("1073741824") == int64_t(1) << 30);
  CHECK(parse_cpu_cache_limit("512M") == int64_t(512) << 20);
  CHECK(parse_cpu_cache_limit("512m") == int64_t(512) << 20);
  CHECK(parse_cpu_cache_limit("4G") == int64_t(4) << 30);
  CHECK(parse_cpu_cache_limit("2KB") == 2048);
  CHECK(parse_cpu_cache_limit("3T") == int64_t(3) << 40);
  for (const char* bad : {"", "abc", "12X", "-1", "1.5G", "G", "4GiB", "99999999999999999999", "9000000000000000T"}) {
    const std::string expected = std::string("QUILT_CPU_CACHE_MAX=\"") + bad + "\" is not a byte count";
    CHECK_THROWS_WITH_AS(parse_cpu_cache_limit(bad), doctest::Contains(expected.c_str()), Error);
  }
  CHECK(cpu_cache_limit() >= 0);
  CHECK_THROWS_WITH_AS(set_cpu_cache_limit(-1), doctest::Contains("the cache limit must be >= 0 bytes, got -1"), Error);
}

TEST_CASE("host allocator: pinned host tensors still allocate, hold data and free") {
  const MemoryStats base = cpu_memory_stats();
  {
    Tensor t = Tensor::empty({1 << 18}, {.dtype = DType::f32, .pinned = true});
    REQUIRE(t.data_ptr() != nullptr);
    CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 64 == 0);
    float* d = static_cast<float*>(t.data_ptr());
    for (int64_t i = 0; i < t.numel(); ++i) d[i] = float(i);
    CHECK(d[12345] == 12345.0f);
    Storage s = Storage::allocate_pinned(100);
    CHECK(s.data() != nullptr);
    CHECK(s.nbytes() == 100);
    // Page-locked only where CUDA is present; without it the ordinary host allocator serves.
    CHECK(t.is_pinned() == cuda::is_available());
    CHECK_FALSE(Tensor::empty({4}).is_pinned());
    // A non-blocking copy to the tensor's own device is the tensor itself, as a blocking one.
    CHECK(t.to(Device::cpu(), true).is_same(t));
  }
  CHECK(cpu_memory_stats().allocated == base.allocated);
}

namespace {

long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

// Page faults of one malloc of 24 MiB (6,144 pages), written through and freed: the buffer a GEMM
// library allocates per call. 24 MiB is below glibc's largest mmap threshold and larger than any
// block this process freed before, so without the engine's setting the second round still maps it
// afresh (glibc raises its threshold only when such a block is freed).
long faults_of_one_round() {
  constexpr size_t kBytes = size_t(24) << 20;
  const long before = minor_faults();
  char* p = static_cast<char*>(std::malloc(kBytes));
  REQUIRE(p != nullptr);
  std::memset(p, 1, kBytes);
  asm volatile("" : : "r"(p) : "memory");  // the writes happen
  std::free(p);
  return minor_faults() - before;
}

// True where glibc's malloc is not the one in use (ASan brings its own allocator) or the
// environment tunes it: the two tests below then have nothing to check.
#if defined(__SANITIZE_ADDRESS__)  // gcc
#define QUILT_TEST_ASAN 1
#elif defined(__has_feature)  // clang
#if __has_feature(address_sanitizer)
#define QUILT_TEST_ASAN 1
#endif
#endif

bool malloc_env_set() {
#ifdef QUILT_TEST_ASAN
  return true;
#endif
  for (const char* v : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
                        "GLIBC_TUNABLES"})
    if (std::getenv(v)) return true;
  return false;
}

}  // namespace

TEST_CASE("host allocator: malloc keeps a freed 24 MiB block, so the next one is not faulted in again") {
  if (malloc_env_set() || std::getenv("QUILT_MALLOC_KEEP")) {
    MESSAGE("skipped: malloc is not glibc's or is tuned by this environment");
    return;
  }
  (void)Tensor::empty({4});  // the engine's host allocator exists, and with it the setting
  faults_of_one_round();     // first touch of the heap's pages
  CHECK(faults_of_one_round() < 256);
}

TEST_CASE("host allocator: QUILT_MALLOC_KEEP=0 leaves malloc as glibc sets it") {
  if (const char* keep = std::getenv("QUILT_MALLOC_KEEP"); keep && std::string(keep) == "0") {
    // The child: glibc's defaults hand the block back, so the second round faults it in again.
    (void)Tensor::empty({4});
    faults_of_one_round();
    CHECK(faults_of_one_round() > 3000);
    return;
  }
  if (malloc_env_set()) {
    MESSAGE("skipped: malloc is not glibc's or is tuned by this environment");
    return;
  }
  char exe[4096];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  REQUIRE(n > 0);
  exe[n] = 0;
  const std::string cmd = "QUILT_MALLOC_KEEP=0 '" + std::string(exe) +
                          "' -tc='host allocator: QUILT_MALLOC_KEEP=0 leaves*' > /dev/null 2>&1";
  CHECK(std::system(cmd.c_str()) == 0);
}

TEST_CASE("host allocator: blocks from 2 MiB up start on a 2 MiB boundary (transparent huge pages)") {
  if (const char* v = std::getenv("QUILT_HUGEPAGES"); v && std::string(v) == "0") {
    MESSAGE("skipped: QUILT_HUGEPAGES=0");
    return;
  }
  empty_cpu_cache();  // a fresh mapping, not a cached block of another size
  for (size_t bytes : {2 * kMiB, 3 * kMiB + 12345, 40 * kMiB}) {
    void* p = host_alloc(bytes);
    CHECK(reinterpret_cast<uintptr_t>(p) % (2 * kMiB) == 0);
    std::memset(p, 7, bytes);  // the whole block is mapped and writable
    CHECK(static_cast<unsigned char*>(p)[bytes - 1] == 7);
    host_free(p, bytes);
  }
  void* small = host_alloc(256 * kKiB);  // below 2 MiB: page-aligned only
  CHECK(reinterpret_cast<uintptr_t>(small) % 4096 == 0);
  host_free(small, 256 * kKiB);
}
