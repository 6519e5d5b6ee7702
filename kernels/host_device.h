// QUILT_HD marks a function that the CPU kernels and the CUDA kernels both call: a
// force-inlined __host__ __device__ function under nvcc, a plain inline one under g++.
//
//   QUILT_HD float twice(float x) { return 2 * x; }
#pragma once

#if defined(__CUDACC__)
#define QUILT_HD __host__ __device__ __forceinline__
#else
#define QUILT_HD inline
#endif
