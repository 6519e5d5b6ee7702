// The NCCL backend: collectives on device tensors of one CUDA device. Every op runs on the
// communicator's own communication stream, ordered after the work already queued on the
// caller's current (compute) stream by an event; its completion is another event, which
// Work::wait() makes the current stream wait on (the host does not block) and which the
// watchdog polls against the op's deadline (ncclCommAbort, then MPI_Abort, when it expires).
// Point-to-point ops, all_to_all_single and the variable-size gathers/scatters are NCCL group
// calls. The unique id is broadcast over the bootstrap (MPI) communicator.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>
#include <numeric>

#include "collectives/internal.h"
#include "engine/ops/creation.h"
#include "engine/random.h"

#define QUILT_CHECK_NCCL(call)                                                                          \
  do {                                                                                                  \
    const ncclResult_t quilt_nccl_rc_ = (call);                                                         \
    if (quilt_nccl_rc_ != ncclSuccess) ::quilt::detail::throw_nccl_error(quilt_nccl_rc_, #call, __FILE__, __LINE__); \
  } while (0)

namespace quilt {
namespace detail {
namespace {

[[noreturn]] void throw_nccl_error(ncclResult_t rc, const char* expr, const char* file, int line) {
  std::string f(file);
  const size_t at = f.rfind("/collectives/");
  fail("[nccl] ", expr, " failed: ", ncclGetErrorString(rc), " (", int(rc), ") at ",
       at == std::string::npos ? f : f.substr(at + 1), ":", line);
}

ncclDataType_t nccl_type(DType dt) {
  switch (dt) {
    case DType::f32: return ncclFloat32;
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
    case DType::f64: return ncclFloat64;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::b8: return ncclUint8;
  }
  return ncclUint8;
}

ncclRedOp_t nccl_op(DType dt, ReduceOp op) {
  if (dt == DType::b8) return op == ReduceOp::min ? ncclMin : ncclMax;  // or / and on 0-1 bytes
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ncclAvg;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::min: return ncclMin;
  }
  return ncclSum;
}

// Group calls: ncclGroupEnd runs even when an enqueue inside throws.
class Group {
 public:
  Group() { QUILT_CHECK_NCCL(ncclGroupStart()); }
  ~Group() noexcept(false) {
    if (!ended_) end();
  }
  void end() {
    ended_ = true;
    QUILT_CHECK_NCCL(ncclGroupEnd());
  }

 private:
  bool ended_ = false;
};

// World ranks of a bootstrap communicator's members (the rank printed in log prefixes).
std::vector<int> world_ranks_of(Communicator& boot) {
  Tensor mine = full({1}, double(log_rank()), {.dtype = DType::i64});
  Tensor all = Tensor::empty({boot.size()}, {.dtype = DType::i64});
  boot.all_gather(all, mine);
  std::vector<int> out;
  for (int64_t i = 0; i < boot.size(); ++i) out.push_back(int(all.data<int64_t>()[i]));
  return out;
}


class NcclWork final : public WorkState {
 public:
  NcclWork(OpDesc d, std::chrono::milliseconds t, Device dev, ncclComm_t comm, std::shared_ptr<CommTrace> trace)
      : WorkState(std::move(d), t), device(dev), done(dev), comm_(comm), trace_(std::move(trace)) {}
  Device device;
  Event done;

  void mark_complete() {
    if (is_collective(desc.kind) && trace_) {
      uint64_t prev = trace_->completed.load();
      while (prev < desc.seq && !trace_->completed.compare_exchange_weak(prev, desc.seq)) {
      }
    }
    mark_done();
  }

  bool poll() override {
    if (done_flag()) return true;
    if (done.query()) {
      mark_complete();  // the buffers go with this state once the watchdog drops it
      return true;
    }
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress)
      mark_failed(concat("[", op_kind_name(desc.kind), "] ", desc.str(), " failed in NCCL: ", ncclGetErrorString(async)));
    return done_flag();
  }

  bool block_until(std::optional<Clock::time_point> until) override {
    if (!until) {
      done.synchronize();
      mark_complete();
      return true;
    }
    while (Clock::now() < *until) {
      if (poll()) return true;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    return poll();
  }

  // Stream semantics: later work on the caller's current stream runs after the collective.
  void wait_for_use() override { done.wait(current_stream(device)); }

 private:
  ncclComm_t comm_;
  std::shared_ptr<CommTrace> trace_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, std::string name, int rank, int size, Device dev, const CommOptions& opts,
                   std::shared_ptr<Communicator> bootstrap, std::vector<int> world_ranks)
      : Communicator("nccl", name, rank, size, dev, opts), comm_(comm), opts_(opts), boot_(std::move(bootstrap)) {
    stream_ = new_stream(dev);
    trace_ = std::make_shared<CommTrace>();
    trace_->name = name;
    trace_->uid = stable_hash(name);
    trace_->world_ranks = std::move(world_ranks);
    watchdog::register_trace(trace_);
    abort_hook_ = watchdog::add_abort_hook([c = comm_] { ncclCommAbort(c); });
  }

  ~NcclCommunicator() override {
    watchdog::remove_abort_hook(abort_hook_);
    try {
      synchronize(stream_);
    } catch (...) {
    }
    if (comm_) ncclCommDestroy(comm_);
  }

 protected:
  bool host_memory_only() const override { return false; }

  std::shared_ptr<WorkState> start(OpCall&& c) override {
    cuda::set_device(device().index);
    c.own();  // the work keeps what the stream has not finished with
    c.expand_even_splits(size());
    if (is_collective(c.desc.kind)) {
      trace_->issued.store(c.desc.seq);
      trace_->started_kind.store(int(c.desc.kind));
      trace_->started.store(c.desc.seq);
      if (debug_checks()) debug_check(c);
    }
    auto w = std::make_shared<NcclWork>(c.desc, timeout(), device(), comm_, trace_);
    // The collective reads what the compute stream has produced so far.
    Event ready(device());
    ready.record(current_stream(device()));
    ready.wait(stream_);
    enqueue(c, *w);
    w->done.record(stream_);
    // The buffers were made on the compute stream: record the communication stream on them so
    // the allocator does not reuse them before the op is done. Only memory it does not own
    // (borrowed) stays alive with the work until the watchdog sees it complete.
    auto hold = [&](const Tensor& t) {
      if (t.defined() && !t.record_stream(stream_)) w->keep.push_back(t);
    };
    hold(c.in);
    hold(c.out);
    for (auto& it : c.p2p) hold(it.tensor);
    watchdog::watch(w, trace_);
    return w;
  }

  std::shared_ptr<Communicator> do_split(int color, int key, uint64_t seq) override {
    cuda::set_device(device().index);
    // The bootstrap splits the same way, so the child can map its ranks to world ranks.
    std::shared_ptr<Communicator> boot_child = boot_->split(color, key);
    ncclComm_t sub = nullptr;
    QUILT_CHECK_NCCL(ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &sub, nullptr));
    if (!sub) return nullptr;
    int r = 0, n = 0;
    QUILT_CHECK_NCCL(ncclCommUserRank(sub, &r));
    QUILT_CHECK_NCCL(ncclCommCount(sub, &n));
    std::vector<int> members = world_ranks_of(*boot_child);
    return std::make_shared<NcclCommunicator>(sub, child_name(seq, color), r, n, device(), opts_, boot_child,
                                              std::move(members));
  }

 private:
  void debug_check(const OpCall& c) {
    Tensor mine = Tensor::empty({int64_t(sizeof(Signature))}, {.dtype = DType::b8});
    std::memcpy(mine.data_ptr(), &c.sig, sizeof(Signature));
    Tensor dev_in = mine.to(device());
    Tensor dev_out = Tensor::empty({int64_t(sizeof(Signature)) * size()}, {.dtype = DType::b8, .device = device()});
    Event ready(device());
    ready.record(current_stream(device()));
    ready.wait(stream_);
    QUILT_CHECK_NCCL(ncclAllGather(dev_in.data_ptr(), dev_out.data_ptr(), sizeof(Signature), ncclUint8, comm_,
                                   static_cast<cudaStream_t>(stream_.handle)));
    synchronize(stream_);
    Tensor host = dev_out.to(Device::cpu());
    std::vector<Signature> all(static_cast<size_t>(size()));
    std::memcpy(all.data(), host.data_ptr(), all.size() * sizeof(Signature));
    check_signatures(all, c.desc);
  }

  void enqueue(OpCall& c, NcclWork& w) {
    const OpDesc& d = c.desc;
    cudaStream_t s = static_cast<cudaStream_t>(stream_.handle);
    const ncclDataType_t type = nccl_type(d.dtype);
    const size_t es = dtype_size(d.dtype);
    char* out = c.out.defined() ? static_cast<char*>(c.out.data_ptr()) : nullptr;
    const char* in = c.in.defined() ? static_cast<const char*>(c.in.data_ptr()) : nullptr;
    const size_t n_out = c.out.defined() ? size_t(c.out.numel()) : 0;
    const size_t n_in = c.in.defined() ? size_t(c.in.numel()) : 0;
    auto offsets = [](const std::vector<int64_t>& counts) {
      std::vector<int64_t> o(counts.size(), 0);
      for (size_t i = 1; i < counts.size(); ++i) o[i] = o[i - 1] + counts[i - 1];
      return o;
    };
    switch (d.kind) {
      case OpKind::all_reduce:
        if (n_out) QUILT_CHECK_NCCL(ncclAllReduce(out, out, n_out, type, nccl_op(d.dtype, *d.rop), comm_, s));
        break;
      case OpKind::broadcast:
        if (n_out) QUILT_CHECK_NCCL(ncclBroadcast(out, out, n_out, type, d.root, comm_, s));
        break;
      case OpKind::reduce:
        if (n_in) QUILT_CHECK_NCCL(ncclReduce(in, out, n_in, type, nccl_op(d.dtype, *d.rop), d.root, comm_, s));
        break;
      case OpKind::all_gather:
        if (n_in) QUILT_CHECK_NCCL(ncclAllGather(in, out, n_in, type, comm_, s));
        break;
      case OpKind::reduce_scatter:
        if (n_out) QUILT_CHECK_NCCL(ncclReduceScatter(in, out, n_out, type, nccl_op(d.dtype, *d.rop), comm_, s));
        break;
      case OpKind::all_gather_v: {
        // One broadcast per contributing rank, fused into a group.
        const std::vector<int64_t> at = offsets(c.in_counts);
        Group g;
        for (int q = 0; q < size(); ++q) {
          const size_t k = size_t(c.in_counts[size_t(q)]);
          if (!k) continue;
          char* dst = out + at[size_t(q)] * int64_t(es);
          QUILT_CHECK_NCCL(ncclBroadcast(q == rank() ? static_cast<const void*>(in) : dst, dst, k, type, q, comm_, s));
        }
        g.end();
        break;
      }
      case OpKind::reduce_scatter_v: {
        // One reduce per receiving rank, fused into a group.
        const std::vector<int64_t> at = offsets(c.in_counts);
        Group g;
        for (int q = 0; q < size(); ++q) {
          const size_t k = size_t(c.in_counts[size_t(q)]);
          if (!k) continue;
          QUILT_CHECK_NCCL(ncclReduce(in + at[size_t(q)] * int64_t(es), out, k, type, nccl_op(d.dtype, *d.rop), q,
                                      comm_, s));
        }
        g.end();
        break;
      }
      case OpKind::all_to_all: {
        const std::vector<int64_t> sat = offsets(c.in_counts), rat = offsets(c.out_counts);
        Group g;
        for (int q = 0; q < size(); ++q) {
          if (const size_t k = size_t(c.in_counts[size_t(q)]))
            QUILT_CHECK_NCCL(ncclSend(in + sat[size_t(q)] * int64_t(es), k, type, q, comm_, s));
          if (const size_t k = size_t(c.out_counts[size_t(q)]))
            QUILT_CHECK_NCCL(ncclRecv(out + rat[size_t(q)] * int64_t(es), k, type, q, comm_, s));
        }
        g.end();
        break;
      }
      case OpKind::barrier: {
        // NCCL has no barrier: a one-element all-reduce orders every rank's stream.
        Tensor one = Tensor::empty({1}, {.dtype = DType::f32, .device = device()});
        QUILT_CHECK_NCCL(ncclAllReduce(one.data_ptr(), one.data_ptr(), 1, ncclFloat32, ncclSum, comm_, s));
        w.keep.push_back(one);
        break;
      }
      case OpKind::send:
      case OpKind::recv:
      case OpKind::batch_p2p: {
        Group g;
        for (P2PItem& it : c.p2p) {
          const size_t k = size_t(it.tensor.numel());
          if (!k) continue;  // both sides skip: a transfer's size is part of its contract
          const ncclDataType_t t = nccl_type(it.tensor.dtype());
          if (it.is_send) QUILT_CHECK_NCCL(ncclSend(it.tensor.data_ptr(), k, t, it.peer, comm_, s));
          else QUILT_CHECK_NCCL(ncclRecv(it.tensor.data_ptr(), k, t, it.peer, comm_, s));
        }
        g.end();
        break;
      }
      default:
        fail("[nccl] unexpected op ", op_kind_name(d.kind));
    }
  }

  ncclComm_t comm_ = nullptr;
  CommOptions opts_;
  std::shared_ptr<Communicator> boot_;
  Stream stream_;
  std::shared_ptr<CommTrace> trace_;
  uint64_t abort_hook_ = 0;
};

}  // namespace
}  // namespace detail

bool nccl_available() { return cuda::is_available() && cuda::device_count() > 0; }

std::shared_ptr<Communicator> make_nccl_communicator(Communicator& bootstrap, Device device, const CommOptions& opts) {
  QUILT_CHECK(device.is_cuda(), "[nccl] a communicator needs a CUDA device, got ", device.str());
  QUILT_CHECK(nccl_available(), "[nccl] no usable CUDA device for ", device.str(), ": ", cuda::unavailable_reason());
  QUILT_CHECK(device.index < cuda::device_count(), "[nccl] ", device.str(), " does not exist (", cuda::device_count(),
              " devices)");
  cuda::set_device(device.index);
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (bootstrap.rank() == 0) QUILT_CHECK_NCCL(ncclGetUniqueId(&id));
  Tensor bytes = Tensor::empty({int64_t(sizeof(id))}, {.dtype = DType::b8});
  std::memcpy(bytes.data_ptr(), &id, sizeof(id));
  bootstrap.broadcast(bytes, 0);
  std::memcpy(&id, bytes.data_ptr(), sizeof(id));
  ncclComm_t comm = nullptr;
  QUILT_CHECK_NCCL(ncclCommInitRank(&comm, bootstrap.size(), id, bootstrap.rank()));
  std::vector<int> members = detail::world_ranks_of(bootstrap);
  const std::string name = "nccl." + bootstrap.name();
  return std::make_shared<detail::NcclCommunicator>(comm, name, bootstrap.rank(), bootstrap.size(), device, opts,
                                                    bootstrap.shared_from_this(), std::move(members));
}

}  // namespace quilt
