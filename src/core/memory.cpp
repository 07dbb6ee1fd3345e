#include "loom/core/memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <unordered_map>
#include <utility>

#ifdef LOOM_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "loom/core/error.h"
#include "loom/core/format.h"

namespace loom::core {

namespace {

// Highest priority: SetAllocator only lets an equal or higher priority replace an allocator.
constexpr uint8_t kTrackingAllocatorPriority = std::numeric_limits<uint8_t>::max();

void free_tracked(void* data);

// Wraps the CPU allocator that was current at install time. Each allocation is recorded by its
// data pointer together with the wrapped allocator's DataPtr; the DataPtr handed out has
// context == data, so LibTorch still treats it as simple: raw_allocate (used by oneDNN's
// scratchpads) and copy-on-write clones work as with the default allocator.
class TrackingAllocator final : public c10::Allocator {
 public:
  explicit TrackingAllocator(c10::Allocator* wrapped)
      : wrapped_(wrapped), wrapped_raw_deleter_(wrapped->raw_deleter()) {}

  c10::DataPtr allocate(size_t n) override {
    // Empty storages hold no memory (the default allocator returns null): nothing to count.
    if (n == 0) return wrapped_->allocate(0);
    const auto bytes = static_cast<int64_t>(n);
    const int64_t held = reserve(bytes);
    try {
      c10::DataPtr original = wrapped_->allocate(n);
      void* data = original.get();
      const c10::Device device = original.device();
      {
        std::lock_guard lock(mutex_);
        live_.emplace(data, Allocation{bytes, std::move(original)});
      }
      update_peak(held);
      allocations_.fetch_add(1, std::memory_order_relaxed);
      return {data, data, &free_tracked, device};
    } catch (...) {
      current_.fetch_sub(bytes, std::memory_order_relaxed);
      throw;
    }
  }

  // Data pointers are the wrapped allocator's own, so it can copy them.
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    wrapped_->copy_data(dest, src, count);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &free_tracked; }

  void free(void* data) {
    std::unordered_map<void*, Allocation>::node_type node;
    {
      std::lock_guard lock(mutex_);
      node = live_.extract(data);
    }
    if (node.empty()) {
      // Not ours: raw-allocated by the wrapped allocator before install and freed through the
      // current allocator afterwards (oneDNN does this). It was never counted.
      if (wrapped_raw_deleter_ != nullptr) wrapped_raw_deleter_(data);
      return;
    }
    current_.fetch_sub(node.mapped().bytes, std::memory_order_relaxed);
    // `node` goes out of scope here, outside the lock: its DataPtr frees through the wrapped
    // allocator's deleter.
  }

  MemoryCounters counters() const {
    return {current_.load(std::memory_order_relaxed), peak_.load(std::memory_order_relaxed),
            allocations_.load(std::memory_order_relaxed)};
  }
  void reset_peak() { peak_.store(current_.load(std::memory_order_relaxed)); }

  void set_cap(int64_t bytes, std::string_view set_by) {
    {
      std::lock_guard lock(mutex_);
      cap_set_by_ = set_by;
    }
    cap_.store(bytes);
  }
  int64_t cap() const { return cap_.load(); }

 private:
  struct Allocation {
    int64_t bytes;
    c10::DataPtr original;
  };

  // Adds `bytes` to the current count unless that would exceed the cap; returns the new count.
  int64_t reserve(int64_t bytes) {
    int64_t current = current_.load(std::memory_order_relaxed);
    while (true) {
      const int64_t cap = cap_.load(std::memory_order_relaxed);
      if (cap > 0 && current + bytes > cap) throw_over_cap(bytes, current, cap);
      if (current_.compare_exchange_weak(current, current + bytes, std::memory_order_relaxed))
        return current + bytes;
    }
  }

  [[noreturn]] void throw_over_cap(int64_t bytes, int64_t current, int64_t cap) {
    std::string set_by;
    {
      std::lock_guard lock(mutex_);
      set_by = cap_set_by_;
    }
    fail(
        "loom memory cap: allocating {} with {} already allocated would hold {}, over the cap "
        "of {}{}",
        format_bytes(bytes), format_bytes(current), format_bytes(current + bytes),
        format_bytes(cap), set_by.empty() ? "" : fmt::format(" ({})", set_by));
  }

  void update_peak(int64_t held) {
    int64_t peak = peak_.load(std::memory_order_relaxed);
    while (held > peak && !peak_.compare_exchange_weak(peak, held, std::memory_order_relaxed)) {
    }
  }

  c10::Allocator* wrapped_;
  c10::DeleterFnPtr wrapped_raw_deleter_;
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
  std::atomic<int64_t> allocations_{0};
  std::atomic<int64_t> cap_{0};
  std::mutex mutex_;  // guards live_ and cap_set_by_
  std::unordered_map<void*, Allocation> live_;
  std::string cap_set_by_;
};

std::mutex install_mutex;
// Never destroyed: storages freed during static destruction still call into it.
std::atomic<TrackingAllocator*> tracker{nullptr};

void free_tracked(void* data) {
  tracker.load(std::memory_order_acquire)->free(data);
}

TrackingAllocator& installed_tracker(const at::Device& device) {
  TrackingAllocator* installed = tracker.load(std::memory_order_acquire);
  LOOM_CHECK(installed != nullptr,
             "memory counters for {}: CPU memory tracking is not installed (call "
             "loom::core::install_memory_tracking() before allocating what should be counted)",
             device.str());
  return *installed;
}

#ifdef LOOM_WITH_CUDA
c10::DeviceIndex cuda_index(const at::Device& device) {
  return device.has_index() ? device.index() : c10::cuda::current_device();
}
#endif

[[noreturn]] void unsupported_device(const at::Device& device) {
#ifdef LOOM_WITH_CUDA
  fail("memory counters: device {} is not supported (cpu and cuda are)", device.str());
#else
  fail("memory counters: device {} is not supported (cpu is; this loom was built without CUDA)",
       device.str());
#endif
}

}  // namespace

void install_memory_tracking() {
  std::lock_guard lock(install_mutex);
  TrackingAllocator* installed = tracker.load(std::memory_order_acquire);
  if (installed == nullptr) {
    installed = new TrackingAllocator(c10::GetCPUAllocator());
    tracker.store(installed, std::memory_order_release);
    c10::SetCPUAllocator(installed, kTrackingAllocatorPriority);
  }
  LOOM_CHECK(c10::GetCPUAllocator() == installed,
             "loom memory tracking: another CPU allocator has replaced loom's counting allocator, "
             "so CPU memory is no longer counted");
}

bool memory_tracking_installed() {
  return tracker.load(std::memory_order_acquire) != nullptr;
}

MemoryCounters memory_counters(const at::Device& device) {
  if (device.is_cpu()) return installed_tracker(device).counters();
#ifdef LOOM_WITH_CUDA
  if (device.is_cuda()) {
    using c10::CachingAllocator::StatType;
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(cuda_index(device));
    const auto aggregate = static_cast<size_t>(StatType::AGGREGATE);
    return {stats.allocated_bytes[aggregate].current, stats.allocated_bytes[aggregate].peak,
            stats.allocation[aggregate].allocated};
  }
#endif
  unsupported_device(device);
}

void reset_peak_memory(const at::Device& device) {
  if (device.is_cpu()) {
    if (TrackingAllocator* installed = tracker.load(std::memory_order_acquire))
      installed->reset_peak();
    return;
  }
#ifdef LOOM_WITH_CUDA
  if (device.is_cuda()) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(cuda_index(device));
    return;
  }
#endif
  unsupported_device(device);
}

void set_memory_cap(int64_t bytes, std::string_view set_by) {
  LOOM_CHECK(bytes >= 0, "memory cap: {} bytes is negative (0 means no cap)", bytes);
  if (bytes > 0) install_memory_tracking();
  if (TrackingAllocator* installed = tracker.load(std::memory_order_acquire))
    installed->set_cap(bytes, set_by);
}

int64_t memory_cap() {
  const TrackingAllocator* installed = tracker.load(std::memory_order_acquire);
  return installed == nullptr ? 0 : installed->cap();
}

int64_t storage_bytes(const std::vector<at::Tensor>& tensors) {
  // Keyed by data pointer, so two storages over one buffer count once; storages without data
  // (meta tensors) fall back to their StorageImpl.
  std::unordered_map<const void*, int64_t> bytes_by_buffer;
  for (const auto& tensor : tensors) {
    if (!tensor.defined() || !tensor.has_storage()) continue;
    const auto& storage = tensor.storage();
    const auto bytes = static_cast<int64_t>(storage.nbytes());
    if (bytes == 0) continue;
    const void* key = storage.data() != nullptr
                          ? storage.data()
                          : static_cast<const void*>(storage.unsafeGetStorageImpl());
    auto& counted = bytes_by_buffer[key];
    counted = std::max(counted, bytes);
  }
  int64_t total = 0;
  for (const auto& [key, bytes] : bytes_by_buffer) total += bytes;
  return total;
}

nlohmann::json MemoryReport::to_json() const {
  return {{"device", device},
          {"parameters_bytes", parameters},
          {"gradients_bytes", gradients},
          {"optimizer_bytes", optimizer},
          {"peak_activations_bytes", peak_activations},
          {"current_bytes", current_total},
          {"peak_bytes", peak_total}};
}

std::string MemoryReport::describe() const {
  return fmt::format(
      "memory ({}): parameters {} | gradients {} | optimizer {} | peak activations {} | "
      "allocated now {} (peak {})",
      device, format_bytes(parameters), format_bytes(gradients), format_bytes(optimizer),
      format_bytes(peak_activations), format_bytes(current_total), format_bytes(peak_total));
}

bool keep_freed_host_memory() {
  const char* opt_out = std::getenv("LOOM_HOST_MALLOC_TUNING");
  if (opt_out && std::strcmp(opt_out, "0") == 0) return false;
#if defined(__GLIBC__)
  // mallopt returns 1 on success. 32 MiB is glibc's largest mmap threshold on 64-bit systems.
  const bool trim = mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max()) == 1;
  const bool mmap = mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1;
  return trim && mmap;
#else
  return false;
#endif
}

}  // namespace loom::core
