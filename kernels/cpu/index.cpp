// CPU indexing and ordering kernels. Layout of the work:
//  - gather walks the index positions in row-major order (threads split that range; every
//    output element is written once, so any split is safe);
//  - scatter-add and cumsum split the positions of the *other* dims among threads, so no two
//    threads touch the same target and each target sums in index order (deterministic).
//    When the walked dim is innermost they go a row at a time; otherwise they walk it in
//    order across a block of positions, so the inner loop runs along the other dims;
//  - sort/top-k turn each row into integer keys that order like the values (then by
//    position), and radix-sort (full sorts) or select (top-k) them in a per-thread buffer.
#include "kernels/cpu/index.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/cpu/parallel.h"

namespace quilt::kernels::cpu {
namespace {

// Positions per block in the blocked walks: enough for a vectorised inner loop, small
// enough that a block's accumulators and cache lines stay in L1 across the dim walk.
constexpr int64_t kBlock = 256;

// True when `dim_stride` is no larger than operand k's stride in any dim of the loop: the
// walked dim is then the innermost one for that operand, and a row at a time is the
// cache-friendly order. Otherwise blocks of positions side by side are.
template <int N>
bool dim_is_innermost(const Loop<N>& l, int k, int64_t dim_stride) {
  for (int d = 0; d < l.ndim; ++d)
    if (std::abs(l.strides[k][d]) < std::abs(dim_stride)) return false;
  return true;
}

template <class I>
int64_t load_index(const char* p) {
  return static_cast<int64_t>(*reinterpret_cast<const I*>(p));
}

template <class I>
void index_range_typed(const Loop<1>& l, int64_t* lo, int64_t* hi) {
  std::atomic<int64_t> amin{std::numeric_limits<int64_t>::max()}, amax{std::numeric_limits<int64_t>::min()};
  const size_t es[1] = {sizeof(I)};
  parallel_range(l.numel(), kGrain, [&](int64_t b, int64_t e) {
    int64_t mn = std::numeric_limits<int64_t>::max(), mx = std::numeric_limits<int64_t>::min();
    walk(l, es, b, e, [&](char* const* p, int64_t n, const int64_t* s) {
      const I* x = reinterpret_cast<const I*>(p[0]);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t v = x[i * s[0]];
        mn = std::min(mn, v);
        mx = std::max(mx, v);
      }
    });
    int64_t cur = amin.load();
    while (mn < cur && !amin.compare_exchange_weak(cur, mn)) {}
    cur = amax.load();
    while (mx > cur && !amax.compare_exchange_weak(cur, mx)) {}
  });
  *lo = amin.load();
  *hi = amax.load();
}

template <class T, class I>
void gather_typed(const IndexLoop& il) {
  const Loop<3>& l = il.loop;
  const size_t es[3] = {sizeof(T), sizeof(I), sizeof(T)};
  const int64_t sd = il.self_dim_stride;
  parallel_walk(l, es, [&](char* const* p, int64_t n, const int64_t* s) {
    const T* self = reinterpret_cast<const T*>(p[0]);
    const char* idx = p[1];
    T* out = reinterpret_cast<T*>(p[2]);
    if (s[1] == 0) {  // one index for the whole run (index_select): a strided or plain copy
      const T* row = self + load_index<I>(idx) * sd;
      if (s[0] == 1 && s[2] == 1) std::copy_n(row, n, out);
      else for (int64_t i = 0; i < n; ++i) out[i * s[2]] = row[i * s[0]];
      return;
    }
    const int64_t is = s[1] * int64_t(sizeof(I));
    for (int64_t i = 0; i < n; ++i) out[i * s[2]] = self[i * s[0] + load_index<I>(idx + i * is) * sd];
  });
}

// dst[i * ds] += src[i * ss] for i < n, in T's compute type.
template <class T>
void add_run(T* dst, int64_t ds, const T* src, int64_t ss, int64_t n) {
  using C = compute_t<T>;
  if (ds == 1 && ss == 1) {
    for (int64_t i = 0; i < n; ++i) dst[i] = T(C(dst[i]) + C(src[i]));  // vectorisable
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i * ds] = T(C(dst[i * ds]) + C(src[i * ss]));
  }
}

template <class T, class I>
void scatter_add_typed(const IndexLoop& il) {
  using C = compute_t<T>;
  const Loop<3>& l = il.loop;
  const size_t es[3] = {sizeof(T), sizeof(I), sizeof(T)};
  const int64_t sd = il.self_dim_stride;
  const int64_t positions = l.numel();
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, il.n));
  if (dim_is_innermost(l, 2, il.other_dim_stride)) {
    // The indexed dim is src's innermost: walk each position's row along it. (Blocks of
    // positions would stride by whole rows here, and power-of-two row lengths thrash L1.)
    const int64_t isd = il.index_dim_stride * int64_t(sizeof(I)), osd = il.other_dim_stride;
    parallel_range(positions, grain, [&](int64_t b, int64_t e) {
      walk(l, es, b, e, [&](char* const* p, int64_t cnt, const int64_t* s) {
        for (int64_t r = 0; r < cnt; ++r) {
          T* self = reinterpret_cast<T*>(p[0]) + r * s[0];
          const char* idx = p[1] + r * s[1] * int64_t(sizeof(I));
          const T* src = reinterpret_cast<const T*>(p[2]) + r * s[2];
          for (int64_t j = 0; j < il.n; ++j) {
            T& t = self[load_index<I>(idx + j * isd) * sd];
            t = T(C(t) + C(src[j * osd]));
          }
        }
      });
    });
    return;
  }
  parallel_range(positions, grain, [&](int64_t b, int64_t e) {
    for (int64_t bb = b; bb < e; bb += kBlock) {
      const int64_t be = std::min(e, bb + kBlock);
      for (int64_t j = 0; j < il.n; ++j) {
        const int64_t ioff = j * il.index_dim_stride * int64_t(sizeof(I));
        const int64_t ooff = j * il.other_dim_stride;
        walk(l, es, bb, be, [&](char* const* p, int64_t n, const int64_t* s) {
          T* self = reinterpret_cast<T*>(p[0]);
          const char* idx = p[1] + ioff;
          const T* src = reinterpret_cast<const T*>(p[2]) + ooff;
          if (s[1] == 0) {  // one index for the whole run (index_add): add a slice
            add_run(self + load_index<I>(idx) * sd, s[0], src, s[2], n);
            return;
          }
          const int64_t is = s[1] * int64_t(sizeof(I));
          for (int64_t i = 0; i < n; ++i) {
            T& t = self[i * s[0] + load_index<I>(idx + i * is) * sd];
            t = T(C(t) + C(src[i * s[2]]));
          }
        });
      }
    }
  });
}

// Sorting compares unsigned integer keys that order like the values: floats map through
// their bits (negatives flipped), with every NaN on the largest key and -0 folded onto +0 so
// they tie as equal numbers do; signed integers flip their sign bit. Keys of 32 bits or less
// are packed above the 32-bit position into one u64, so a plain integer sort orders by value
// and then by position: the stable order, and top-k's lower-position-first rule, for free.
template <class T> using key_t = std::conditional_t<sizeof(T) == 8, uint64_t, uint32_t>;

template <class T>
key_t<T> sort_key(T v) {
  using K = key_t<T>;
  using C = compute_t<T>;
  constexpr K sign = K(1) << (8 * sizeof(K) - 1);
  if constexpr (std::is_same_v<T, bool>) {
    return K(v);
  } else if constexpr (std::is_floating_point_v<C>) {
    using F = std::conditional_t<sizeof(K) == 8, double, float>;
    F f = F(C(v));
    if (std::isnan(f)) return ~K(0);
    if (f == F(0)) f = F(0);
    const K u = std::bit_cast<K>(f);
    return (u & sign) ? K(~u) : K(u | sign);
  } else {
    return K(static_cast<std::make_unsigned_t<T>>(v)) ^ sign;
  }
}

// Stable LSD radix sort of packed (key << 32 | position) items on their key bytes. The
// positions start ascending, so the result is ordered by key, then position. A byte that all
// items share costs one counting pass and no scatter (small integer keys skip most passes).
void radix_sort_packed(std::vector<uint64_t>& buf, std::vector<uint64_t>& tmp) {
  const size_t n = buf.size();
  tmp.resize(n);
  size_t count[4][256] = {};
  for (uint64_t v : buf)
    for (int b = 0; b < 4; ++b) ++count[b][(v >> (32 + 8 * b)) & 0xff];
  uint64_t* src = buf.data();
  uint64_t* dst = tmp.data();
  for (int b = 0; b < 4; ++b) {
    const int shift = 32 + 8 * b;
    if (count[b][(src[0] >> shift) & 0xff] == n) continue;
    size_t start[256];
    size_t sum = 0;
    for (int d = 0; d < 256; ++d) { start[d] = sum; sum += count[b][d]; }
    for (size_t i = 0; i < n; ++i) dst[start[(src[i] >> shift) & 0xff]++] = src[i];
    std::swap(src, dst);
  }
  if (src != buf.data()) std::copy(src, src + n, buf.data());
}

// Puts the first k (of n) items of buf in order; the items' own order is total.
template <class Item>
void order_prefix(std::vector<Item>& buf, std::vector<Item>& tmp, int64_t k) {
  const int64_t n = int64_t(buf.size());
  if (k <= 0) return;
  if (k < n) {  // top-k: select, then order the k
    std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end());
    std::sort(buf.begin(), buf.begin() + (k - 1));
  } else if constexpr (std::is_same_v<Item, uint64_t>) {
    if (n >= 64) radix_sort_packed(buf, tmp);
    else std::sort(buf.begin(), buf.end());
  } else {
    std::sort(buf.begin(), buf.end());
  }
}

template <class T, class Item>
void sort_rows(const RowLoop& rl, bool descending) {
  const Loop<3>& l = rl.rows;
  const size_t es[3] = {sizeof(T), sizeof(int64_t), sizeof(T)};
  const int64_t n = rl.n, k = rl.k;
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, n));
  parallel_range(l.numel(), grain, [&](int64_t b, int64_t e) {
    std::vector<Item> buf(static_cast<size_t>(n)), tmp;
    walk(l, es, b, e, [&](char* const* p, int64_t cnt, const int64_t* s) {
      for (int64_t r = 0; r < cnt; ++r) {
        T* vals = reinterpret_cast<T*>(p[0]) + r * s[0];
        int64_t* idx = reinterpret_cast<int64_t*>(p[1]) + r * s[1];
        const T* in = reinterpret_cast<const T*>(p[2]) + r * s[2];
        for (int64_t j = 0; j < n; ++j) {
          key_t<T> key = sort_key(in[j * rl.dim_strides[2]]);
          if (descending) key = ~key;  // positions stay ascending: ties keep their order
          if constexpr (std::is_integral_v<Item>) buf[size_t(j)] = (Item(key) << 32) | Item(j);
          else buf[size_t(j)] = {key, j};
        }
        order_prefix(buf, tmp, k);
        for (int64_t j = 0; j < k; ++j) {
          int64_t src;
          if constexpr (std::is_integral_v<Item>) src = int64_t(buf[size_t(j)] & 0xffffffffu);
          else src = buf[size_t(j)].second;
          vals[j * rl.dim_strides[0]] = in[src * rl.dim_strides[2]];  // the stored value, bit for bit
          idx[j * rl.dim_strides[1]] = src;
        }
      }
    });
  });
}

template <class T>
void sort_typed(const RowLoop& rl, bool descending) {
  if constexpr (sizeof(key_t<T>) == 4) {
    if (rl.n <= (int64_t(1) << 32)) return sort_rows<T, uint64_t>(rl, descending);
  }
  sort_rows<T, std::pair<key_t<T>, int64_t>>(rl, descending);
}

template <class T> using scan_acc_t = std::conditional_t<std::is_same_v<T, double>, double,
                                        std::conditional_t<std::is_floating_point_v<compute_t<T>>, float, int64_t>>;

template <class T, class O>
void cumsum_typed(const RowLoop& rl, bool reverse) {
  using A = scan_acc_t<T>;
  const Loop<3>& l = rl.rows;
  const size_t es[3] = {sizeof(O), 1, sizeof(T)};
  const int64_t n = rl.n;
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, n));
  const int64_t od = rl.dim_strides[0], xd = rl.dim_strides[2];
  if (dim_is_innermost(l, 2, xd)) {  // the scanned dim is the innermost one: one row at a time
    parallel_range(l.numel(), grain, [&](int64_t b, int64_t e) {
      walk(l, es, b, e, [&](char* const* p, int64_t cnt, const int64_t* s) {
        for (int64_t r = 0; r < cnt; ++r) {
          O* out = reinterpret_cast<O*>(p[0]) + r * s[0];
          const T* in = reinterpret_cast<const T*>(p[2]) + r * s[2];
          A acc = A(0);
          for (int64_t step = 0; step < n; ++step) {
            const int64_t j = reverse ? n - 1 - step : step;
            acc += A(static_cast<compute_t<T>>(in[j * xd]));
            out[j * od] = O(static_cast<compute_t<O>>(acc));
          }
        }
      });
    });
    return;
  }
  // Otherwise walk blocks of rows side by side, so the inner loop runs along the other dims.
  parallel_range(l.numel(), grain, [&](int64_t b, int64_t e) {
    A acc[kBlock];
    for (int64_t bb = b; bb < e; bb += kBlock) {
      const int64_t be = std::min(e, bb + kBlock);
      std::fill(acc, acc + (be - bb), A(0));
      for (int64_t step = 0; step < n; ++step) {
        const int64_t j = reverse ? n - 1 - step : step;
        int64_t c = 0;
        walk(l, es, bb, be, [&](char* const* p, int64_t cnt, const int64_t* s) {
          O* out = reinterpret_cast<O*>(p[0]) + j * od;
          const T* in = reinterpret_cast<const T*>(p[2]) + j * xd;
          for (int64_t i = 0; i < cnt; ++i, ++c) {
            acc[c] += A(static_cast<compute_t<T>>(in[i * s[2]]));
            out[i * s[0]] = O(static_cast<compute_t<O>>(acc[c]));
          }
        });
      }
    }
  });
}

}  // namespace

bool index_range(DType index_dt, const Loop<1>& loop, int64_t* lo, int64_t* hi) {
  if (loop.numel() == 0) return false;
  if (index_dt == DType::i32) index_range_typed<int32_t>(loop, lo, hi);
  else index_range_typed<int64_t>(loop, lo, hi);
  return true;
}

void gather(DType dt, DType index_dt, const IndexLoop& l) {
  QUILT_DISPATCH_ALL(dt, [&] {
    if (index_dt == DType::i32) gather_typed<scalar_t, int32_t>(l);
    else gather_typed<scalar_t, int64_t>(l);
  });
}

void scatter_add(DType dt, DType index_dt, const IndexLoop& l) {
  QUILT_DISPATCH_ALL(dt, [&] {
    if constexpr (!std::is_same_v<scalar_t, bool>) {
      if (index_dt == DType::i32) scatter_add_typed<scalar_t, int32_t>(l);
      else scatter_add_typed<scalar_t, int64_t>(l);
    }
  });
}

void sort(DType dt, const RowLoop& l, bool descending) {
  QUILT_DISPATCH_ALL(dt, [&] { sort_typed<scalar_t>(l, descending); });
}

void cumsum(DType in_dt, DType out_dt, const RowLoop& l, bool reverse) {
  QUILT_DISPATCH_ALL(in_dt, [&] {
    using T = scalar_t;
    if (out_dt == in_dt) cumsum_typed<T, T>(l, reverse);
    else cumsum_typed<T, int64_t>(l, reverse);
  });
}

}  // namespace quilt::kernels::cpu
