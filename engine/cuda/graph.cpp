// cuda::Graph (engine/device.h): stream capture into a graph whose memory is a private pool of
// the caching allocator. engine/cuda_stub/cuda_stub.cpp has the no-CUDA twin.
#include <cuda_runtime_api.h>

#include "engine/cuda/device_guard.h"
#include "engine/cuda_runtime.h"
#include "engine/device.h"
#include "engine/error.h"
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/kernels.h"

namespace quilt::cuda {

Graph::~Graph() {
  try {
    reset();
  } catch (const std::exception&) {  // a destructor must not throw; the memory stays cached
  }
}

void Graph::capture_begin(const Stream& s, const Graph* share_pool_with) {
  QUILT_CHECK(s.device.is_cuda(), "[cuda graph] capture_begin on a stream of ", s.device.str(),
              ": graphs capture CUDA streams");
  QUILT_CHECK(s.handle != nullptr, "[cuda graph] capture_begin on the default stream of ", s.device.str(),
              ": capture a non-default stream (new_stream)");
  QUILT_CHECK(!capturing_ && !exec_, "[cuda graph] capture_begin on a graph that is ",
              capturing_ ? "capturing" : "already captured (reset() it first)");
  int share = 0;
  if (share_pool_with) {
    QUILT_CHECK(share_pool_with->pool_ != 0 && share_pool_with->stream_.device == s.device,
                "[cuda graph] capture_begin: the graph to share a pool with has none on ", s.device.str());
    share = share_pool_with->pool_;
  }
  cuda_detail::DeviceGuard g(s.device.index);
  pool_ = detail::cuda_pool_begin_capture(s.device.index, s.handle, share);
  detail::note_capture(+1);
  const cudaError_t err = cudaStreamBeginCapture(static_cast<cudaStream_t>(s.handle), cudaStreamCaptureModeGlobal);
  if (err != cudaSuccess) {
    detail::note_capture(-1);
    detail::cuda_pool_end_capture(s.device.index, s.handle);
    detail::cuda_pool_release(s.device.index, pool_, s.handle);
    pool_ = 0;
    QUILT_CHECK_CUDA(err);
  }
  stream_ = s;
  last_replay_ = s;
  prev_ = current_stream(s.device);
  set_current_stream(s);
  capturing_ = true;
}

void Graph::capture_end() {
  QUILT_CHECK(capturing_, "[cuda graph] capture_end without capture_begin");
  cuda_detail::DeviceGuard g(stream_.device.index);
  cudaGraph_t graph = nullptr;
  const cudaError_t err = cudaStreamEndCapture(static_cast<cudaStream_t>(stream_.handle), &graph);
  capturing_ = false;
  set_current_stream(prev_);
  detail::note_capture(-1);
  detail::cuda_pool_end_capture(stream_.device.index, stream_.handle);
  QUILT_CHECK_CUDA(err);
  graph_ = graph;
  cudaGraphExec_t exec = nullptr;
  QUILT_CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  exec_ = exec;
}

void Graph::replay(const Stream& s) {
  QUILT_CHECK(exec_ != nullptr, "[cuda graph] replay of a graph that was not captured");
  QUILT_CHECK(s.device == stream_.device, "[cuda graph] replay on ", s.device.str(), " of a graph captured on ",
              stream_.device.str());
  cuda_detail::DeviceGuard g(s.device.index);
  // A replay launches no kernel from the host, so nothing else would tell the next
  // synchronisation to read the device's error slot (a bad index reported inside the graph).
  (void)kernels::cuda::device_error_slot();
  QUILT_CHECK_CUDA(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), static_cast<cudaStream_t>(s.handle)));
  last_replay_ = s;
}

void Graph::reset() {
  if (capturing_) {  // abandoned mid-capture: end it and drop what it captured
    cudaGraph_t graph = nullptr;
    cudaStreamEndCapture(static_cast<cudaStream_t>(stream_.handle), &graph);
    cudaGetLastError();
    if (graph) cudaGraphDestroy(graph);
    capturing_ = false;
    set_current_stream(prev_);
    detail::note_capture(-1);
    detail::cuda_pool_end_capture(stream_.device.index, stream_.handle);
  }
  if (exec_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
  if (graph_) cudaGraphDestroy(static_cast<cudaGraph_t>(graph_));
  exec_ = nullptr;
  graph_ = nullptr;
  if (pool_) detail::cuda_pool_release(stream_.device.index, pool_, last_replay_.handle);
  pool_ = 0;
}

}  // namespace quilt::cuda
