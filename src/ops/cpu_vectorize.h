#pragma once
// LOOM_CPU_CLONES: compile a plain loop once per x86 level (AVX-512, AVX2, baseline) and pick
// the best at load time (GCC's function multi-versioning), so loom's CPU kernels vectorise on
// every machine CI and users run without -march flags. Elsewhere (ARM, Clang) the loop is
// compiled once for the baseline.
//
// Within one clone the vector body and the scalar tail round alike, so an element gets the same
// bits at any offset or thread count on one machine (tests/test_cpu_kernels.cpp). AdamW's file is
// also built with -ffp-contract=off (src/CMakeLists.txt): every product and sum rounded as
// written, the same in every clone. GELU's lets the compiler fuse multiply-adds (faster), so its
// last bits may differ between an AVX-512 and an AVX2 machine.
// GCC only: Clang rejects target_clones on function templates, which the kernels are.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__NVCC__)
#define LOOM_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define LOOM_CPU_CLONES
#endif

#include <cstdlib>
#include <cstring>

namespace loom::ops::cpu {

// LOOM_CPU_KERNELS=0 switches loom's CPU kernels off (ATen's ops run instead): to rule them out
// when a result looks wrong, and to measure what they buy (docs/benchmarks.md). Read once.
inline bool kernels_enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("LOOM_CPU_KERNELS");
    return value == nullptr || std::strcmp(value, "0") != 0;
  }();
  return enabled;
}

}  // namespace loom::ops::cpu
