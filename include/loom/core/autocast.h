#pragma once
// bf16 autocast for a scope, on one device type: matrix products and the like run in bf16 while
// the parameters (the fp32 master weights) and the reductions stay fp32. Restores the previous
// autocast state (and clears autocast's cast cache) when the scope ends.
#include <ATen/autocast_mode.h>

namespace loom::core {

class Bf16Autocast {
 public:
  // enabled false: does nothing (so callers need no branch for fp32 runs).
  Bf16Autocast(bool enabled, at::DeviceType device)
      : enabled_(enabled),
        device_(device),
        was_enabled_(at::autocast::is_autocast_enabled(device)) {
    if (!enabled_) return;
    previous_dtype_ = at::autocast::get_autocast_dtype(device_);
    at::autocast::set_autocast_dtype(device_, at::kBFloat16);
    at::autocast::set_autocast_enabled(device_, true);
  }
  ~Bf16Autocast() {
    if (!enabled_) return;
    at::autocast::set_autocast_enabled(device_, was_enabled_);
    at::autocast::set_autocast_dtype(device_, previous_dtype_);
    at::autocast::clear_cache();
  }
  Bf16Autocast(const Bf16Autocast&) = delete;
  Bf16Autocast& operator=(const Bf16Autocast&) = delete;

 private:
  bool enabled_;
  at::DeviceType device_;
  bool was_enabled_;
  at::ScalarType previous_dtype_ = at::kBFloat16;
};

}  // namespace loom::core
