#include "loom/parallel/memory/activation_offload.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "loom/core/error.h"

#ifdef LOOM_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace loom::parallel::memory {

struct ActivationOffloader::Entry {
  at::Tensor host;    // the copy on the host
  at::Tensor device;  // back on the device once prefetched or fetched
  at::Device origin{at::kCPU};
  bool prefetched = false;
#ifdef LOOM_WITH_CUDA
  std::optional<at::cuda::CUDAEvent> copied;  // the side-stream copy (either way) is done
#endif
};

ActivationOffloader::ActivationOffloader() = default;
ActivationOffloader::~ActivationOffloader() = default;

namespace {

#ifdef LOOM_WITH_CUDA
// A side stream from the pool (which cycles through several per device): copies there overlap
// compute on the current stream; events order the two.
c10::cuda::CUDAStream side_stream(at::Device device) {
  return c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index());
}
#endif

int64_t nbytes(const at::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

}  // namespace

int64_t ActivationOffloader::offload(const at::Tensor& t) {
  LOOM_CHECK(t.defined(), "ActivationOffloader: cannot offload an undefined tensor");
  auto entry = std::make_unique<Entry>();
  entry->origin = t.device();
  const auto source = t.detach();
#ifdef LOOM_WITH_CUDA
  if (source.is_cuda()) {
    // The side stream must see the producer's writes, and the caching allocator must not hand
    // the source's memory out again until the copy has read it.
    auto compute = c10::cuda::getCurrentCUDAStream(source.device().index());
    auto side = side_stream(source.device());
    at::cuda::CUDAEvent ready;
    ready.record(compute);
    ready.block(side);
    c10::cuda::CUDAStreamGuard guard(side);
    entry->host = at::empty(source.sizes(), source.options().device(at::kCPU).pinned_memory(true));
    entry->host.copy_(source, /*non_blocking=*/true);
    c10::cuda::CUDACachingAllocator::recordStream(source.storage().data_ptr(), side);
    entry->copied.emplace();
    entry->copied->record(side);
  } else
#endif
  {
    entry->host = source.clone();  // same memory kind: the logic runs, nothing is saved
  }
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t ticket = next_ticket_++;
  stats_.offloaded += 1;
  stats_.bytes_to_host += nbytes(entry->host);
  stats_.host_bytes += nbytes(entry->host);
  stats_.peak_host_bytes = std::max(stats_.peak_host_bytes, stats_.host_bytes);
  entries_.emplace(ticket, std::move(entry));
  return ticket;
}

void ActivationOffloader::prefetch(int64_t ticket) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(ticket);
  if (it == entries_.end() || it->second->device.defined()) return;
  auto& e = *it->second;
#ifdef LOOM_WITH_CUDA
  if (e.origin.is_cuda()) {
    // The compute stream, taken before the guard below makes the side stream current.
    auto compute = c10::cuda::getCurrentCUDAStream(e.origin.index());
    auto side = side_stream(e.origin);
    if (e.copied) e.copied->block(side);  // the copy to the host is complete
    c10::cuda::CUDAStreamGuard guard(side);
    e.device = at::empty(e.host.sizes(), e.host.options().device(e.origin).pinned_memory(false));
    e.device.copy_(e.host, /*non_blocking=*/true);
    // Allocated on the side stream, read on the compute stream after fetch: the allocator must
    // not hand the block out again until the compute stream's work on it is done.
    c10::cuda::CUDACachingAllocator::recordStream(e.device.storage().data_ptr(), compute);
    e.copied.emplace();
    e.copied->record(side);
  } else
#endif
  {
    e.device = e.host.clone();
  }
  e.prefetched = true;
  stats_.prefetched += 1;
}

at::Tensor ActivationOffloader::fetch(int64_t ticket) {
  std::unique_ptr<Entry> entry;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(ticket);
    LOOM_CHECK(it != entries_.end(),
               "ActivationOffloader: ticket {} was never issued or was fetched already", ticket);
    entry = std::move(it->second);
    entries_.erase(it);
    stats_.fetched += 1;
    stats_.host_bytes -= nbytes(entry->host);
  }
  auto& e = *entry;
  if (!e.device.defined()) {  // not prefetched: bring it back now, on the compute stream
#ifdef LOOM_WITH_CUDA
    if (e.origin.is_cuda()) {
      if (e.copied) e.copied->block(c10::cuda::getCurrentCUDAStream(e.origin.index()));
      return e.host.to(e.origin, /*non_blocking=*/false);
    }
#endif
    return e.host.clone();
  }
#ifdef LOOM_WITH_CUDA
  // Prefetched on the side stream: the compute stream waits for that copy.
  if (e.origin.is_cuda() && e.copied)
    e.copied->block(c10::cuda::getCurrentCUDAStream(e.origin.index()));
#endif
  return e.device;
}

void ActivationOffloader::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [ticket, e] : entries_) stats_.host_bytes -= nbytes(e->host);
  entries_.clear();
}

OffloadStats ActivationOffloader::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

}  // namespace loom::parallel::memory
