#pragma once
// The emulation of kernels/common/ptx.h (the PTX wrappers loom's tensor-core kernels share):
// transform.py puts this include where a kernel includes "common/ptx.h". The instructions are in
// emulated_ptx_memory.h (cp.async, ldmatrix) and emulated_ptx_mma.h (mma.sync, mma.sp), which
// rely on emulated_cuda_runtime.h having been included first (it is, in place of
// <cuda_runtime.h>). Written by the loom authors for this test.
#include "emulated_ptx_memory.h"
#include "emulated_ptx_mma.h"
