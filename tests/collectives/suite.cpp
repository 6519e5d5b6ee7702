// One harness, one small case per collective (after nccl-tests): each case builds its inputs
// from pattern(), runs the op on the communicator and compares every element with the value
// computed on the host.
#include "tests/collectives/suite.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <sstream>

#include "engine/engine.h"

namespace quilt::testing {
namespace {

const ReduceOp kAllOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};

// Small integers in [-5, 5] (0/1 for bool): sums over 8 ranks stay exact even in bf16.
double pattern(int rank, int64_t i, DType dt) {
  if (dt == DType::b8) return (rank + i) % 3 == 0 ? 1.0 : 0.0;
  return double((rank * 7 + i * 3) % 11) - 5.0;
}

// Rounds a double to what dtype `dt` stores.
double round_to(DType dt, double x) {
  switch (dt) {
    case DType::f32: return double(float(x));
    case DType::bf16: return double(float(BFloat16(float(x))));
    case DType::f16: return double(float(Half(float(x))));
    case DType::f64: return x;
    case DType::i32:
    case DType::i64: return std::trunc(x);
    case DType::b8: return x != 0 ? 1.0 : 0.0;
  }
  return x;
}

// The reference reduction of values from every rank.
double combine(DType dt, ReduceOp op, const std::vector<double>& v) {
  if (dt == DType::b8) {
    const bool any = std::any_of(v.begin(), v.end(), [](double x) { return x != 0; });
    const bool all = std::all_of(v.begin(), v.end(), [](double x) { return x != 0; });
    return op == ReduceOp::min ? double(all) : double(any);
  }
  switch (op) {
    case ReduceOp::max: return *std::max_element(v.begin(), v.end());
    case ReduceOp::min: return *std::min_element(v.begin(), v.end());
    case ReduceOp::sum: return std::accumulate(v.begin(), v.end(), 0.0);
    case ReduceOp::avg: {
      const double s = std::accumulate(v.begin(), v.end(), 0.0);
      if (dt == DType::i32 || dt == DType::i64) return std::trunc(s / double(v.size()));
      return round_to(dt, s / double(v.size()));
    }
  }
  return 0;
}

struct Ctx {
  Communicator& comm;
  int rank;
  int world;
  Device dev;
  std::vector<std::string>& failures;
};

Tensor make(const Ctx& c, const std::vector<double>& values, const Shape& shape, DType dt) {
  Tensor t = from_vector(values, shape, {.dtype = dt});
  return c.dev.is_cpu() ? t : t.to(c.dev);
}

std::vector<double> pattern_vec(int rank, int64_t n, DType dt, int64_t offset = 0) {
  std::vector<double> v(static_cast<size_t>(std::max<int64_t>(n, 0)));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = pattern(rank, offset + i, dt);
  return v;
}

// Records the first element of `got` that differs from `want`.
void expect(const Ctx& c, const std::string& what, const Tensor& got, const std::vector<double>& want) {
  const std::vector<double> g = got.to_vector();
  if (g.size() != want.size()) {
    c.failures.push_back(detail::concat("[rank ", c.rank, "] ", what, ": got ", g.size(), " elements, expected ",
                                        want.size()));
    return;
  }
  for (size_t i = 0; i < g.size(); ++i) {
    if (g[i] == want[i]) continue;
    c.failures.push_back(detail::concat("[rank ", c.rank, "] ", what, ": element ", i, " is ", g[i], ", expected ",
                                        want[i]));
    return;
  }
}

// Runs `body`, turning an exception into a failure (so one broken case does not hide the rest).
void guarded(const Ctx& c, const std::string& what, const std::function<void()>& body) {
  try {
    body();
  } catch (const std::exception& e) {
    c.failures.push_back(detail::concat("[rank ", c.rank, "] ", what, " threw: ", e.what()));
    throw;  // peers are now out of step: stop this rank's suite
  }
}

std::string label(const char* op, DType dt, int64_t n, const std::string& extra = "") {
  return detail::concat(op, " ", dtype_name(dt), " n=", n, extra.empty() ? "" : " ", extra);
}

// Uneven row counts with zeros: rank r's share of a v-form op of nominal size n.
int64_t uneven_rows(int64_t n, int r) { return n == 0 ? 0 : (n * (r + 1) + 3 * r) % (n + 2); }
// Rows rank `src` sends rank `dst` in the uneven all_to_all.
int64_t a2a_rows(int64_t n, int src, int dst) { return n == 0 ? 0 : (n * (src + 1) + 2 * dst + src) % (n + 3); }
// Value of row k, column j that `src` sends `dst`.
double a2a_value(int src, int dst, int64_t k, int64_t j, DType dt) {
  if (dt == DType::b8) return (src + dst + k + j) % 2 == 0 ? 1.0 : 0.0;
  return double((src * 5 + dst * 3 + k * 2 + j) % 13) - 6.0;
}

void all_reduce_cases(const Ctx& c, DType dt, int64_t n) {
  for (ReduceOp op : kAllOps) {
    if (op == ReduceOp::avg && dt == DType::b8) continue;
    const std::string what = label("all_reduce", dt, n, reduce_op_name(op));
    guarded(c, what, [&] {
      Tensor t = make(c, pattern_vec(c.rank, n, dt), {n}, dt);
      c.comm.all_reduce(t, op);
      std::vector<double> want(static_cast<size_t>(n));
      std::vector<double> per(static_cast<size_t>(c.world));
      for (int64_t i = 0; i < n; ++i) {
        for (int q = 0; q < c.world; ++q) per[size_t(q)] = pattern(q, i, dt);
        want[size_t(i)] = combine(dt, op, per);
      }
      expect(c, what, t, want);
    });
  }
}

void broadcast_cases(const Ctx& c, DType dt, int64_t n) {
  for (int root : {0, c.world - 1}) {
    const std::string what = label("broadcast", dt, n, detail::concat("root ", root));
    guarded(c, what, [&] {
      Tensor t = make(c, pattern_vec(c.rank, n, dt), {n}, dt);
      c.comm.broadcast(t, root);
      expect(c, what, t, pattern_vec(root, n, dt));
    });
    if (c.world == 1) break;
  }
}

void reduce_cases(const Ctx& c, DType dt, int64_t n) {
  for (int root : {c.world - 1, 0}) {
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::avg}) {
      if (op == ReduceOp::avg && dt == DType::b8) continue;
      const std::string what = label("reduce", dt, n, detail::concat(reduce_op_name(op), " root ", root));
      guarded(c, what, [&] {
        Tensor t = make(c, pattern_vec(c.rank, n, dt), {n}, dt);
        c.comm.reduce(t, root, op);
        if (c.rank != root) {
          expect(c, what + " (non-root unchanged)", t, pattern_vec(c.rank, n, dt));
          return;
        }
        std::vector<double> want(static_cast<size_t>(n)), per(static_cast<size_t>(c.world));
        for (int64_t i = 0; i < n; ++i) {
          for (int q = 0; q < c.world; ++q) per[size_t(q)] = pattern(q, i, dt);
          want[size_t(i)] = combine(dt, op, per);
        }
        expect(c, what, t, want);
      });
    }
    if (c.world == 1) break;
  }
}

void all_gather_cases(const Ctx& c, DType dt, int64_t n) {
  const std::string what = label("all_gather", dt, n);
  guarded(c, what, [&] {
    Tensor in = make(c, pattern_vec(c.rank, n, dt), {n}, dt);
    Tensor out = make(c, std::vector<double>(static_cast<size_t>(n * c.world), 0.0), {n * c.world}, dt);
    c.comm.all_gather(out, in);
    std::vector<double> want;
    for (int q = 0; q < c.world; ++q) {
      auto p = pattern_vec(q, n, dt);
      want.insert(want.end(), p.begin(), p.end());
    }
    expect(c, what, out, want);
  });
  const std::string whatv = label("all_gather_v", dt, n, "uneven rows of 3");
  guarded(c, whatv, [&] {
    std::vector<int64_t> rows;
    for (int q = 0; q < c.world; ++q) rows.push_back(uneven_rows(n, q));
    const int64_t total = std::accumulate(rows.begin(), rows.end(), int64_t{0});
    Tensor in = make(c, pattern_vec(c.rank, rows[size_t(c.rank)] * 3, dt), {rows[size_t(c.rank)], 3}, dt);
    Tensor out = make(c, std::vector<double>(static_cast<size_t>(total * 3), 0.0), {total, 3}, dt);
    c.comm.all_gather_v(out, in, rows);
    std::vector<double> want;
    for (int q = 0; q < c.world; ++q) {
      auto p = pattern_vec(q, rows[size_t(q)] * 3, dt);
      want.insert(want.end(), p.begin(), p.end());
    }
    expect(c, whatv, out, want);
  });
}

void reduce_scatter_cases(const Ctx& c, DType dt, int64_t n) {
  for (ReduceOp op : kAllOps) {
    if (op == ReduceOp::avg && dt == DType::b8) continue;
    const std::string what = label("reduce_scatter", dt, n, reduce_op_name(op));
    guarded(c, what, [&] {
      Tensor in = make(c, pattern_vec(c.rank, n * c.world, dt), {n * c.world}, dt);
      Tensor out = make(c, std::vector<double>(static_cast<size_t>(n), 0.0), {n}, dt);
      c.comm.reduce_scatter(out, in, op);
      std::vector<double> want(static_cast<size_t>(n)), per(static_cast<size_t>(c.world));
      for (int64_t i = 0; i < n; ++i) {
        for (int q = 0; q < c.world; ++q) per[size_t(q)] = pattern(q, c.rank * n + i, dt);
        want[size_t(i)] = combine(dt, op, per);
      }
      expect(c, what, out, want);
    });
  }
  const ReduceOp op = dt == DType::b8 ? ReduceOp::sum : ReduceOp::avg;
  const std::string whatv = label("reduce_scatter_v", dt, n, detail::concat(reduce_op_name(op), " uneven rows of 2"));
  guarded(c, whatv, [&] {
    std::vector<int64_t> rows;
    for (int q = 0; q < c.world; ++q) rows.push_back(uneven_rows(n, q));
    const int64_t total = std::accumulate(rows.begin(), rows.end(), int64_t{0});
    const int64_t before = std::accumulate(rows.begin(), rows.begin() + c.rank, int64_t{0});
    Tensor in = make(c, pattern_vec(c.rank, total * 2, dt), {total, 2}, dt);
    Tensor out = make(c, std::vector<double>(static_cast<size_t>(rows[size_t(c.rank)] * 2), 0.0), {rows[size_t(c.rank)], 2}, dt);
    c.comm.reduce_scatter_v(out, in, rows, op);
    std::vector<double> want(static_cast<size_t>(rows[size_t(c.rank)] * 2)), per(static_cast<size_t>(c.world));
    for (size_t i = 0; i < want.size(); ++i) {
      for (int q = 0; q < c.world; ++q) per[size_t(q)] = pattern(q, before * 2 + int64_t(i), dt);
      want[i] = combine(dt, op, per);
    }
    expect(c, whatv, out, want);
  });
}

void all_to_all_cases(const Ctx& c, DType dt, int64_t n) {
  const std::string what = label("all_to_all_single", dt, n, "uneven splits, rows of 2");
  guarded(c, what, [&] {
    std::vector<int64_t> in_splits, out_splits;
    std::vector<double> in_values, want;
    for (int q = 0; q < c.world; ++q) {
      in_splits.push_back(a2a_rows(n, c.rank, q));
      out_splits.push_back(a2a_rows(n, q, c.rank));
      for (int64_t k = 0; k < in_splits.back(); ++k)
        for (int64_t j = 0; j < 2; ++j) in_values.push_back(a2a_value(c.rank, q, k, j, dt));
      for (int64_t k = 0; k < out_splits.back(); ++k)
        for (int64_t j = 0; j < 2; ++j) want.push_back(a2a_value(q, c.rank, k, j, dt));
    }
    const int64_t in_rows = std::accumulate(in_splits.begin(), in_splits.end(), int64_t{0});
    const int64_t out_rows = std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0});
    Tensor in = make(c, in_values, {in_rows, 2}, dt);
    Tensor out = make(c, std::vector<double>(static_cast<size_t>(out_rows * 2), 0.0), {out_rows, 2}, dt);
    c.comm.all_to_all_single(out, in, out_splits, in_splits);
    expect(c, what, out, want);
  });
  const std::string whate = label("all_to_all_single", dt, n, "even splits");
  guarded(c, whate, [&] {
    // Chunk q of rank r's input holds pattern(r, q * n + i); after the exchange chunk q of the
    // output is rank q's chunk r.
    Tensor in = make(c, pattern_vec(c.rank, n * c.world, dt), {n * c.world}, dt);
    Tensor out = make(c, std::vector<double>(static_cast<size_t>(n * c.world), 0.0), {n * c.world}, dt);
    c.comm.all_to_all_single(out, in);
    std::vector<double> want;
    for (int q = 0; q < c.world; ++q) {
      auto p = pattern_vec(q, n, dt, int64_t(c.rank) * n);
      want.insert(want.end(), p.begin(), p.end());
    }
    expect(c, whate, out, want);
  });
}

// Strided tensors go through contiguous copies and land back in place.
void strided_cases(const Ctx& c) {
  const DType dt = DType::f32;
  guarded(c, "all_reduce on a transposed view", [&] {
    auto base_of = [&](int r) { return from_vector(pattern_vec(r, 15, dt), {3, 5}, {.dtype = dt}).transpose(0, 1); };
    Tensor x = make(c, pattern_vec(c.rank, 15, dt), {3, 5}, dt).transpose(0, 1);
    c.comm.all_reduce(x, ReduceOp::sum);
    std::vector<double> want(15, 0.0);
    for (int q = 0; q < c.world; ++q) {
      auto v = base_of(q).to_vector();
      for (size_t i = 0; i < v.size(); ++i) want[i] += v[i];
    }
    expect(c, "all_reduce on a transposed view", x, want);
  });
  guarded(c, "all_gather into a strided column", [&] {
    Tensor in = make(c, pattern_vec(c.rank, 4, dt), {4}, dt);
    Tensor base = make(c, std::vector<double>(static_cast<size_t>(8 * c.world), -1.0), {4 * c.world, 2}, dt);
    c.comm.all_gather(base.select(1, 0), in);
    std::vector<double> want;
    for (int q = 0; q < c.world; ++q)
      for (double v : pattern_vec(q, 4, dt)) {
        want.push_back(v);
        want.push_back(-1.0);
      }
    expect(c, "all_gather into a strided column", base, want);
  });
  guarded(c, "all_gather in place from a view of its own output", [&] {
    Tensor out = make(c, std::vector<double>(static_cast<size_t>(3 * c.world), 0.0), {3 * c.world}, dt);
    out.narrow(0, 3 * c.rank, 3).copy_(from_vector(pattern_vec(c.rank, 3, dt), {3}, {.dtype = dt}));
    c.comm.all_gather(out, out.narrow(0, 3 * c.rank, 3));
    std::vector<double> want;
    for (int q = 0; q < c.world; ++q)
      for (double v : pattern_vec(q, 3, dt)) want.push_back(v);
    expect(c, "all_gather in place from a view of its own output", out, want);
  });
}

void p2p_cases(const Ctx& c) {
  const DType dt = DType::f32;
  const int next = (c.rank + 1) % c.world, prev = (c.rank + c.world - 1) % c.world;
  guarded(c, "send/recv ring with the receive posted first", [&] {
    for (int64_t n : {int64_t{0}, int64_t{5}, int64_t{100003}}) {
      Tensor got = make(c, std::vector<double>(static_cast<size_t>(n), 0.0), {n}, dt);
      Work r = c.comm.recv(got, prev, /*tag=*/7, /*async_op=*/true);
      Work s = c.comm.send(make(c, pattern_vec(c.rank, n, dt), {n}, dt), next, 7, true);
      s.wait();
      r.wait();
      expect(c, detail::concat("recv of ", n, " from rank ", prev), got, pattern_vec(prev, n, dt));
    }
  });
  guarded(c, "batch_p2p exchanges with both neighbours in one group", [&] {
    Tensor from_prev = make(c, std::vector<double>(9, 0.0), {9}, DType::i64);
    Tensor from_next = make(c, std::vector<double>(4, 0.0), {4}, DType::bf16);
    std::vector<P2POp> ops = {
        P2POp::recv(from_prev, prev, 1),
        P2POp::recv(from_next, next, 2),
        P2POp::send(make(c, pattern_vec(c.rank, 9, DType::i64), {9}, DType::i64), next, 1),
        P2POp::send(make(c, pattern_vec(c.rank + 100, 4, DType::bf16), {4}, DType::bf16), prev, 2),
    };
    c.comm.batch_p2p(ops);
    expect(c, "batch_p2p from the previous rank", from_prev, pattern_vec(prev, 9, DType::i64));
    expect(c, "batch_p2p from the next rank", from_next, pattern_vec(next + 100, 4, DType::bf16));
  });
  guarded(c, "batch_p2p of braced lists, two then four ops (the call's item storage is reused), and an empty one", [&] {
    Tensor a = make(c, std::vector<double>(3, 0.0), {3}, dt);
    c.comm.batch_p2p({P2POp::send(make(c, pattern_vec(c.rank, 3, dt), {3}, dt), next), P2POp::recv(a, prev)});
    expect(c, "braced batch of two from the previous rank", a, pattern_vec(prev, 3, dt));
    Tensor b = make(c, std::vector<double>(2, 0.0), {2}, dt);
    Tensor d = make(c, std::vector<double>(5, 0.0), {5}, dt);
    c.comm.batch_p2p({P2POp::recv(b, prev, 4), P2POp::recv(d, prev, 5),
                      P2POp::send(make(c, pattern_vec(c.rank + 50, 5, dt), {5}, dt), next, 5),
                      P2POp::send(make(c, pattern_vec(c.rank + 20, 2, dt), {2}, dt), next, 4)});
    expect(c, "braced batch of four, tag 4", b, pattern_vec(prev + 20, 2, dt));
    expect(c, "braced batch of four, tag 5", d, pattern_vec(prev + 50, 5, dt));
    if (!c.comm.batch_p2p({}).is_completed()) c.failures.push_back(detail::concat("[rank ", c.rank, "] an empty braced batch is not complete"));
  });
  guarded(c, "messages with one tag arrive in order", [&] {
    std::vector<Tensor> got;
    std::vector<Work> works;
    for (int k = 0; k < 3; ++k) {
      got.push_back(make(c, {0.0, 0.0}, {2}, dt));
      works.push_back(c.comm.recv(got.back(), prev, 3, true));
    }
    for (int k = 0; k < 3; ++k)
      works.push_back(c.comm.send(make(c, {double(k), double(c.rank)}, {2}, dt), next, 3, true));
    wait_all(works);
    for (int k = 0; k < 3; ++k) expect(c, detail::concat("message ", k, " of 3"), got[size_t(k)], {double(k), double(prev)});
  });
}

void async_cases(const Ctx& c) {
  guarded(c, "async ops in flight together complete in order", [&] {
    std::vector<Tensor> ts;
    std::vector<Work> ws;
    for (int k = 0; k < 4; ++k) {
      ts.push_back(make(c, pattern_vec(c.rank + k, 33, DType::f32), {33}, DType::f32));
      ws.push_back(c.comm.all_reduce(ts.back(), ReduceOp::sum, /*async_op=*/true));
    }
    Tensor g = make(c, std::vector<double>(static_cast<size_t>(5 * c.world), 0.0), {5 * c.world}, DType::i32);
    ws.push_back(c.comm.all_gather(g, make(c, pattern_vec(c.rank, 5, DType::i32), {5}, DType::i32), true));
    ws.push_back(c.comm.barrier(true));
    wait_all(ws);
    for (auto& w : ws)
      if (!w.is_completed()) c.failures.push_back(detail::concat("[rank ", c.rank, "] ", w.describe(), " not completed after wait"));
    for (int k = 0; k < 4; ++k) {
      std::vector<double> want(33, 0.0);
      for (int q = 0; q < c.world; ++q) {
        auto p = pattern_vec(q + k, 33, DType::f32);
        for (size_t i = 0; i < 33; ++i) want[i] += p[i];
      }
      expect(c, detail::concat("async all_reduce ", k), ts[size_t(k)], want);
    }
    std::vector<double> want;
    for (int q = 0; q < c.world; ++q)
      for (double v : pattern_vec(q, 5, DType::i32)) want.push_back(v);
    expect(c, "async all_gather", g, want);
  });
  // Synchronous ops borrow the caller's tensors without a reference (OpCall::own); an
  // asynchronous one must hold them, since the caller's handles may be gone before wait().
  guarded(c, "an async op keeps its tensors after the caller drops every handle to them", [&] {
    Tensor view, gathered;
    Work reduce, gather;
    {
      Tensor t = make(c, pattern_vec(c.rank, 17, DType::f32), {17}, DType::f32);
      Tensor g = make(c, std::vector<double>(static_cast<size_t>(2 * c.world), 0.0), {2 * c.world}, DType::f32);
      view = t.narrow(0, 0, 17);  // shares the storage, not t's handle
      gathered = g.narrow(0, 0, 2 * c.world);
      reduce = c.comm.all_reduce(t, ReduceOp::sum, /*async_op=*/true);
      gather = c.comm.all_gather(g, make(c, pattern_vec(c.rank, 2, DType::f32), {2}, DType::f32), true);
    }
    reduce.wait();
    gather.wait();
    std::vector<double> want(17, 0.0), want_g;
    for (int q = 0; q < c.world; ++q) {
      const auto p = pattern_vec(q, 17, DType::f32);
      for (size_t i = 0; i < 17; ++i) want[i] += p[i];
      for (double v : pattern_vec(q, 2, DType::f32)) want_g.push_back(v);
    }
    expect(c, "async all_reduce of a dropped tensor", view, want);
    expect(c, "async all_gather into a dropped tensor", gathered, want_g);
  });
}

void subgroup_cases(const Ctx& c) {
  guarded(c, "split by parity, ranks ordered by descending key", [&] {
    const int color = c.rank % 2;
    auto sub = c.comm.split(color, /*key=*/-c.rank);
    if (!sub) {
      c.failures.push_back(detail::concat("[rank ", c.rank, "] split returned no communicator"));
      return;
    }
    std::vector<int> members;
    for (int q = 0; q < c.world; ++q)
      if (q % 2 == color) members.push_back(q);
    std::reverse(members.begin(), members.end());
    const int want_rank = int(std::find(members.begin(), members.end(), c.rank) - members.begin());
    if (sub->size() != int(members.size()) || sub->rank() != want_rank)
      c.failures.push_back(detail::concat("[rank ", c.rank, "] split gave rank ", sub->rank(), " of ", sub->size(),
                                          ", expected ", want_rank, " of ", members.size()));
    Tensor t = make(c, {double(c.rank), 1.0}, {2}, DType::f64);
    sub->all_reduce(t, ReduceOp::sum);
    double s = 0;
    for (int m : members) s += m;
    expect(c, "all_reduce on the parity group", t, {s, double(members.size())});
    Tensor g = make(c, std::vector<double>(members.size(), 0.0), {int64_t(members.size())}, DType::i64);
    sub->all_gather(g, make(c, {double(c.rank)}, {1}, DType::i64));
    std::vector<double> want(members.begin(), members.end());
    expect(c, "all_gather on the parity group (ordered by key)", g, want);
  });
  guarded(c, "split with a negative color leaves the rank out", [&] {
    auto sub = c.comm.split(c.rank == 0 ? -1 : 5, 0);
    if (c.rank == 0 && sub)
      c.failures.push_back(detail::concat("[rank 0] split with color -1 returned a communicator"));
    if (c.rank != 0) {
      if (!sub || sub->size() != c.world - 1) {
        c.failures.push_back(detail::concat("[rank ", c.rank, "] split without rank 0 has the wrong size"));
        return;
      }
      Tensor t = make(c, {1.0}, {1}, DType::i32);
      sub->all_reduce(t);
      expect(c, "all_reduce without rank 0", t, {double(c.world - 1)});
    }
  });
}

}  // namespace

std::vector<std::string> run_collectives_suite(Communicator& comm, const SuiteConfig& cfg) {
  std::vector<std::string> failures;
  NoGradGuard ng;
  Ctx c{comm, comm.rank(), comm.size(), comm.device(), failures};
  try {
    for (DType dt : cfg.dtypes) {
      for (int64_t n : cfg.sizes) {
        all_reduce_cases(c, dt, n);
        broadcast_cases(c, dt, n);
        reduce_cases(c, dt, n);
        all_gather_cases(c, dt, n);
        reduce_scatter_cases(c, dt, n);
        all_to_all_cases(c, dt, n);
      }
    }
    guarded(c, "barrier", [&] { comm.barrier(); });
    strided_cases(c);
    if (cfg.async) async_cases(c);
    if (cfg.p2p) p2p_cases(c);
    if (cfg.subgroups) subgroup_cases(c);
  } catch (const std::exception&) {
    // Recorded by guarded(); the remaining cases would only hang against out-of-step peers.
  }
  return failures;
}

}  // namespace quilt::testing
