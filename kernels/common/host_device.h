#pragma once
// LOOM_HOST_DEVICE: a function that nvcc compiles for the host and the device, and a plain C++
// compiler (host references, the kernel emulation) as an ordinary inline function.
#if defined(__CUDACC__)
#define LOOM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LOOM_HOST_DEVICE inline
#endif
