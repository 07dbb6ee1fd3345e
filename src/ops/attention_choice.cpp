#include "loom/ops/attention_choice.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/autograd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "loom/core/error.h"
#include "loom/core/files.h"
#include "loom/ops/cpu_attention.h"
#include "loom/ops/cuda.h"
#include "loom/ops/flash_attention.h"

#ifdef LOOM_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace loom::ops {

namespace {

// Waits for `device` (the caller has made it current).
void synchronize(const at::Device& device) {
#ifdef LOOM_WITH_CUDA
  if (device.is_cuda()) c10::cuda::device_synchronize();
#else
  (void)device;
#endif
}

// Autocast off on one device type for a scope, restored however the scope ends.
class AutocastOff {
 public:
  explicit AutocastOff(at::DeviceType type)
      : type_(type), was_(at::autocast::is_autocast_enabled(type)) {
    at::autocast::set_autocast_enabled(type_, false);
  }
  ~AutocastOff() { at::autocast::set_autocast_enabled(type_, was_); }
  AutocastOff(const AutocastOff&) = delete;
  AutocastOff& operator=(const AutocastOff&) = delete;

 private:
  at::DeviceType type_;
  bool was_;
};

// One forward and backward of loom's kernel (kFused) or SDPA on fresh inputs like q, k, v.
double time_forward_backward(AttentionBackend backend, const at::Tensor& q, const at::Tensor& k,
                             const at::Tensor& v, bool causal, double scale) {
  // The timing is its own computation: autograd on whatever the caller's mode, no autocast, on
  // q's device, with random inputs from a generator of its own (the run's generators do not
  // move).
  const at::AutoGradMode grad(true);
  const AutocastOff no_autocast(q.device().type());
#ifdef LOOM_WITH_CUDA
  std::optional<c10::cuda::CUDAGuard> device_guard;
  if (q.is_cuda()) device_guard.emplace(q.device());
#endif
  auto gen = at::make_generator<at::CPUGeneratorImpl>(0x5eed);
  auto make = [&](const at::Tensor& like) {
    return at::randn(like.sizes(), gen, at::kFloat).to(like.options()).requires_grad_();
  };
  auto qq = make(q), kk = make(k), vv = make(v);
  const auto grad_out = at::randn(q.sizes(), gen, at::kFloat).to(q.options());
  const bool gqa = q.size(1) != k.size(1);
  auto once = [&] {
    at::Tensor out;
    if (backend == AttentionBackend::kSdpa)
      out = at::scaled_dot_product_attention(qq, kk, vv, std::nullopt, 0.0, causal, scale, gqa);
    else if (q.is_cuda())
      out = flash_attention(qq, kk, vv, causal, scale);
    else
      out = cpu_attention(qq, kk, vv, causal, scale);
    torch::autograd::backward({out}, {grad_out});
  };
  std::vector<double> ms;
  for (int i = 0; i < 7; ++i) {
    synchronize(q.device());
    const auto start = std::chrono::steady_clock::now();
    once();
    synchronize(q.device());
    if (i >= 2)
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

std::string device_name(const at::Device& device) {
  if (device.is_cuda()) return cuda_device_name(device.has_index() ? device.index() : 0);
  return device.str();
}

}  // namespace

AttentionChooser::AttentionChooser(std::string cache_path, Timer timer, bool read_existing)
    : cache_path_(std::move(cache_path)), timer_(timer ? std::move(timer) : time_forward_backward) {
  if (!read_existing || cache_path_.empty() || !std::filesystem::exists(cache_path_)) return;
  try {
    const auto j = nlohmann::json::parse(core::read_file(cache_path_));
    for (const auto& [key, e] : j.at("entries").items())
      entries_[key] = {parse_attention_backend(e.at("choice").get<std::string>()),
                       e.at("fused_ms").get<double>(), e.at("sdpa_ms").get<double>()};
  } catch (const std::exception& e) {
    entries_.clear();
    spdlog::warn("attention auto: cannot read the choices in {} ({}); measuring again", cache_path_,
                 e.what());
  }
}

std::string AttentionChooser::shape_class(const at::Tensor& q, const at::Tensor& k, bool causal) {
  return fmt::format("{} | {} | batch {} | heads {}/{} kv | seq {}x{} | head dim {}{}",
                     device_name(q.device()), c10::toString(q.scalar_type()), q.size(0), q.size(1),
                     k.size(1), q.size(2), k.size(2), q.size(3), causal ? " | causal" : "");
}

AttentionBackend AttentionChooser::choose(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, bool causal, double scale) {
  const auto key = shape_class(q, k, causal);
  {
    const std::lock_guard lock(mutex_);
    if (const auto it = entries_.find(key); it != entries_.end()) return it->second.choice;
  }
  // Timed without the lock: the timing runs autograd, whose threads may ask this chooser too.
  Entry e;
  e.fused_ms = timer_(AttentionBackend::kFused, q, k, v, causal, scale);
  e.sdpa_ms = timer_(AttentionBackend::kSdpa, q, k, v, causal, scale);
  e.choice = e.fused_ms <= e.sdpa_ms ? AttentionBackend::kFused : AttentionBackend::kSdpa;
  const std::lock_guard lock(mutex_);
  // Another thread timed the same class meanwhile: its choice stands.
  if (const auto it = entries_.find(key); it != entries_.end()) return it->second.choice;
  spdlog::info(
      "attention auto: {}: loom's kernel {:.3f} ms, SDPA {:.3f} ms (forward + backward) "
      "-> {}",
      key, e.fused_ms, e.sdpa_ms, e.choice == AttentionBackend::kFused ? "loom's kernel" : "SDPA");
  entries_[key] = e;
  save();
  return e.choice;
}

std::map<std::string, AttentionChooser::Entry> AttentionChooser::entries() const {
  const std::lock_guard lock(mutex_);
  return entries_;
}

void AttentionChooser::save() const {
  if (cache_path_.empty()) return;
  nlohmann::ordered_json j = {{"version", 1}};
  auto& list = j["entries"] = nlohmann::ordered_json::object();
  for (const auto& [key, e] : entries_)
    list[key] = {{"choice", to_string(e.choice)}, {"fused_ms", e.fused_ms}, {"sdpa_ms", e.sdpa_ms}};
  const auto parent = std::filesystem::path(cache_path_).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  core::write_file_atomic(cache_path_, j.dump(1) + "\n");
}

}  // namespace loom::ops
