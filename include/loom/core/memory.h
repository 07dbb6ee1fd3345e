#pragma once
// Memory accounting: how many bytes each device holds now and at its peak, what the parameters,
// gradients and optimizer state take (counted from their tensors), and an optional cap that makes
// the CPU behave like a device with little memory, so memory-saving strategies can be tested
// without a GPU.
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace loom::core {

struct MemoryCounters {
  int64_t current_bytes = 0;  // allocated and not yet freed (bytes requested, in this process)
  int64_t peak_bytes = 0;     // most held at once since the last reset_peak_memory()
  int64_t allocations = 0;    // allocations made (CPU: since install; CUDA: as LibTorch counts)
};

// Wraps LibTorch's CPU allocator with one that counts the bytes of every CPU allocation made
// from now on. Allocations made before the call are not counted, and freeing them does not
// disturb the counts. Idempotent and thread-safe; throws loom::Error if another allocator has
// since replaced the wrapper.
void install_memory_tracking();
bool memory_tracking_installed();

// CPU: the tracker's counts (throws loom::Error unless install_memory_tracking() ran).
// CUDA: LibTorch's caching allocator's allocated-bytes statistics for that device (the current
// device without an index); loom::Error in a build without CUDA. Other devices: loom::Error.
MemoryCounters memory_counters(const at::Device& device = at::kCPU);
// Starts a new peak: peak := current.
void reset_peak_memory(const at::Device& device = at::kCPU);

// Keeps freed host memory for reuse instead of returning it to the OS after every step: glibc
// trims the top of the heap (and unmaps large blocks) as soon as they are free, so a training loop
// that frees and reallocates its activations each step takes thousands of page faults per step,
// each page zeroed by the kernel again (docs/benchmarks.md: 3500-9200 faults per step down to 0,
// about 4% of a small CPU step; peak RSS unchanged, since the memory is reused, not added).
// Sets glibc's trim threshold to the maximum and its mmap threshold to 32 MiB, glibc's largest
// (both fixed, no longer adapted): blocks above 32 MiB are still mapped and unmapped per
// allocation. Every loom tool calls it at start (apps::run_tool); a program linking loom may.
// No-op where the C library is not glibc, or when LOOM_HOST_MALLOC_TUNING=0. Returns whether it
// applied.
bool keep_freed_host_memory();

// Caps the tracked CPU bytes (0 = no cap; installs tracking when a cap is set). An allocation
// that would hold more throws loom::Error naming the cap and leaves the counts unchanged.
// `set_by` names where the cap came from (e.g. a command-line flag) for that message.
void set_memory_cap(int64_t bytes, std::string_view set_by = "");
int64_t memory_cap();

// Bytes of the distinct storages these tensors use: views of one storage count once; undefined
// tensors and tensors without storage count 0.
int64_t storage_bytes(const std::vector<at::Tensor>& tensors);

// One rank's memory at a point in training, in bytes.
struct MemoryReport {
  int64_t parameters = 0;  // storage_bytes of the parameters
  int64_t gradients = 0;   // storage_bytes of their gradients
  int64_t optimizer = 0;   // storage_bytes of the optimizer state (moments, fp32 masters)
  // Activations are not held in named tensors, so they are measured from the allocator: the
  // peak of allocated bytes during forward + backward minus what was allocated when forward
  // began (the persistent state). Filled by the caller.
  int64_t peak_activations = 0;
  int64_t current_total = 0;  // allocated on the device now
  int64_t peak_total = 0;     // allocated at the peak
  std::string device;

  // {"device", "parameters_bytes", "gradients_bytes", "optimizer_bytes",
  //  "peak_activations_bytes", "current_bytes", "peak_bytes"}
  nlohmann::json to_json() const;
  // One line in MiB, e.g. "memory (cpu): parameters 12.3 MiB | gradients 12.3 MiB | ...".
  std::string describe() const;
};

}  // namespace loom::core
