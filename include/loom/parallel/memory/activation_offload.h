#pragma once
// Activation offload (the "Large Model Support" idea): the inputs activation checkpointing keeps
// for each block are moved to host memory during forward and brought back for the block's
// recompute in backward, so device memory holds no per-block activations at all between the two.
// On a GPU the copies run on a side stream into pinned memory and overlap compute: offload
// starts as soon as a block's input is saved, and while block i is recomputed in backward the
// input of block i - 1 (the next one backward reaches) is already coming back (prefetch).
// On the CPU "host" and "device" are the same memory: the same logic runs (copies, tickets,
// prefetch order), which is what the CPU tests check; the memory it saves is measured on a GPU.
//
//   auto offload = std::make_shared<ActivationOffloader>();
//   checkpoint(fn, {x}, {.generators = ..., .offload = offload});   // per block, in forward
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

namespace loom::parallel::memory {

struct OffloadStats {
  int64_t offloaded = 0;        // tensors sent to the host
  int64_t fetched = 0;          // tensors brought back
  int64_t prefetched = 0;       // of which the copy back started before it was needed
  int64_t host_bytes = 0;       // held on the host now
  int64_t peak_host_bytes = 0;  // most held at once
  int64_t bytes_to_host = 0;    // copied to the host so far
};

class ActivationOffloader {
 public:
  ActivationOffloader();
  ~ActivationOffloader();
  ActivationOffloader(const ActivationOffloader&) = delete;
  ActivationOffloader& operator=(const ActivationOffloader&) = delete;

  // Starts copying t to the host and returns its ticket (increasing in call order). The caller
  // drops its own reference to t, so the device memory can be reused once the copy is done.
  int64_t offload(const at::Tensor& t);
  // Starts copying the tensor back (no-op for an unknown or already fetched ticket).
  void prefetch(int64_t ticket);
  // The tensor on its original device, with its original values; the host copy is freed.
  // Throws loom::Error for a ticket that was never issued or was fetched already.
  at::Tensor fetch(int64_t ticket);
  // Tickets issued and not fetched (e.g. a forward without backward): their host memory.
  void clear();

  OffloadStats stats() const;

 private:
  struct Entry;
  mutable std::mutex mutex_;
  std::map<int64_t, std::unique_ptr<Entry>> entries_;
  int64_t next_ticket_ = 0;
  OffloadStats stats_;
};

}  // namespace loom::parallel::memory
