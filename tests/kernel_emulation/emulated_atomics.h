#pragma once
// The kernel's atomic_add2 (two fp32 atomic adds, or one float2 atomic on sm_90), emulated for
// the kernel-emulation test (tests/kernel_emulation, docs/gpu.md). transform.py includes this
// file in place of the kernel's wrapper, inside the kernel's namespace. Written by the loom
// authors for this test.
//
// The emulation runs one thread at a time, so plain adds are atomic. The float2 form needs an
// 8-byte-aligned address on the hardware: checked, since the sm_90 build uses it.

__device__ __forceinline__ void atomic_add2(float* p, float x, float y) {
  if (reinterpret_cast<uintptr_t>(p) % 8 != 0)
    emulation::error("atomic_add2: float2 atomic on an address not 8-byte aligned");
  p[0] += x;
  p[1] += y;
}
