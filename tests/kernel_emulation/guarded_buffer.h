#pragma once
// Test buffers for the kernel-emulation tests (tests/kernel_emulation): an access past either end
// of a buffer faults, so a kernel that reads or writes outside its tensors is caught at once.
#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <utility>

// `bytes` of memory whose end (rounded up to 16 bytes) touches a PROT_NONE page, with another
// PROT_NONE page before its start: an access past either end faults.
class GuardedBuffer {
 public:
  static constexpr size_t kPage = 4096;

  GuardedBuffer() = default;
  explicit GuardedBuffer(size_t bytes) {
    const size_t padded = std::max<size_t>((bytes + 15) / 16 * 16, 16);
    region_ = (padded + kPage - 1) / kPage * kPage;
    void* map = mmap(nullptr, region_ + 2 * kPage, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) {
      std::perror("mmap");
      std::exit(2);
    }
    map_ = static_cast<unsigned char*>(map);
    mprotect(map_, kPage, PROT_NONE);
    mprotect(map_ + kPage + region_, kPage, PROT_NONE);
    data_ = map_ + kPage + region_ - padded;
  }
  GuardedBuffer(GuardedBuffer&& other) noexcept { *this = std::move(other); }
  GuardedBuffer& operator=(GuardedBuffer&& other) noexcept {
    std::swap(map_, other.map_);
    std::swap(region_, other.region_);
    std::swap(data_, other.data_);
    return *this;
  }
  ~GuardedBuffer() {
    if (map_ != nullptr) munmap(map_, region_ + 2 * kPage);
  }

  void* data() const { return data_; }

 private:
  unsigned char* map_ = nullptr;
  size_t region_ = 0;
  unsigned char* data_ = nullptr;
};
