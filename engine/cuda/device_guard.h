// Internal to engine/cuda: makes a CUDA device current for a scope and restores the previous
// one, so allocations, events and streams land on the device they are meant for.
//
//   { DeviceGuard g(1); cudaMalloc(&p, n); }   // on cuda:1 whatever the thread's device
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/cuda/check.cuh"

namespace quilt::cuda_detail {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    QUILT_CHECK_CUDA(cudaGetDevice(&prev_));
    if (prev_ != device) {
      QUILT_CHECK_CUDA(cudaSetDevice(device));
      switched_ = true;
    }
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(prev_);  // a destructor must not throw; a failure here shows up on the next call
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool switched_ = false;
};

}  // namespace quilt::cuda_detail
