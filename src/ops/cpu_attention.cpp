#include "loom/ops/cpu_attention.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>

#include <array>
#include <vector>

#include "autograd_args.h"
#include "cpu_attention_kernel.h"
#include "loom/core/error.h"
#include "loom/core/format.h"
#include "loom/ops/attention.h"

namespace loom::ops {

namespace {

namespace kernel = cpu::attention;

// A [B, H, rows, D] tensor's data and strides (its last dimension contiguous).
struct Strided {
  float* data;
  int64_t batch, head, row;
  float* at(int64_t b, int64_t h) const { return data + b * batch + h * head; }
};
Strided strided(const at::Tensor& x) {
  return {x.data_ptr<float>(), x.stride(0), x.stride(1), x.stride(2)};
}

struct Problem {
  int64_t batch, heads, kv_heads;
  kernel::Head head;
  int64_t group() const { return heads / kv_heads; }
};

// A bias added to q, k and v as they are packed: [H * D] for q, [Hkv * D] for k and v (null:
// none), and where backward writes its gradient: per batch row, [B, (H + 2 Hkv) D] partial sums
// summed over the batch afterwards in order (the same bits at any thread count).
struct Bias {
  const float *q = nullptr, *k = nullptr, *v = nullptr;
  float* grad_partial = nullptr;
  bool defined() const { return q != nullptr; }
  static const float* head(const float* b, int64_t h, int64_t d) {
    return b == nullptr ? nullptr : b + h * d;
  }
};

// Row tiles have at most this many rows (the entry points below).
constexpr int64_t kMaxRows = 8;

// Floats of scratch one thread needs (the kernel's buffers, ForwardScratch / BackwardScratch).
int64_t forward_scratch(const kernel::Head& h) {
  return h.tp * h.d + 2 * h.sp * h.d + kMaxRows * (h.sp + h.d);
}
int64_t backward_scratch(const kernel::Head& h) {
  return 2 * h.tp * h.d + 5 * h.sp * h.d + 2 * kernel::kBlock * h.sp + kMaxRows * h.d + h.tp;
}

struct ForwardArgs {
  Problem p;
  Strided q, k, v, o;
  float* lse;  // [B, H, T]
  Bias bias;
  const int32_t* first_key = nullptr;  // [B, T] document mask, or null
};

struct BackwardArgs {
  Problem p;
  Strided q, k, v, o, d_o, dq, dk, dv;
  const float* lse;
  Bias bias;
  const int32_t* first_key = nullptr;
};

// The head sizes with batch row b's first keys of a document mask.
kernel::Head head_of_row(const kernel::Head& h, const int32_t* first_key, int64_t b) {
  kernel::Head row = h;
  row.first_key = first_key == nullptr ? nullptr : first_key + b * h.t;
  return row;
}

// Over (batch, query head) indices [begin, end): one thread's share, with its own buffers.
template <int R, int NVMax>
LOOM_FORCE_INLINE void run_range(const ForwardArgs& a, int64_t begin, int64_t end, float* scratch) {
  static_assert(R <= kMaxRows);
  const auto& h = a.p.head;
  const int64_t d = h.d;
  float* next = scratch;
  auto take = [&next](int64_t n) { return std::exchange(next, next + n); };
  const kernel::ForwardScratch w{take(h.tp * d), take(d * h.sp), take(h.sp * d), take(R * h.sp),
                                 take(R * d)};
  for (int64_t index = begin; index < end; ++index) {
    const int64_t b = index / a.p.heads, hq = index % a.p.heads, hk = hq / a.p.group();
    kernel::forward_head<R, NVMax>(head_of_row(h, a.first_key, b),
                                   {a.q.at(b, hq), a.q.row, Bias::head(a.bias.q, hq, d)},
                                   {a.k.at(b, hk), a.k.row, Bias::head(a.bias.k, hk, d)},
                                   {a.v.at(b, hk), a.v.row, Bias::head(a.bias.v, hk, d)},
                                   a.o.at(b, hq), a.o.row, a.lse + index * h.t, w);
  }
}

// Over (batch, key/value head) indices: the group's query heads one after another, so dk and dv
// are summed in one thread's buffers.
template <int R, int NVMax>
LOOM_FORCE_INLINE void run_range(const BackwardArgs& a, int64_t begin, int64_t end,
                                 float* scratch) {
  static_assert(R <= kMaxRows);
  const auto& h = a.p.head;
  const int64_t d = h.d, sp = h.sp, tp = h.tp;
  float* next = scratch;
  auto take = [&next](int64_t n) { return std::exchange(next, next + n); };
  const kernel::BackwardScratch w{take(tp * d),
                                  take(tp * d),
                                  take(sp * d),
                                  take(d * sp),
                                  take(d * sp),
                                  take(sp * d),
                                  take(sp * d),
                                  take(kernel::kBlock * sp),
                                  take(kernel::kBlock * sp),
                                  take(R * d),
                                  take(tp)};
  // This batch row's bias gradient: q heads, then k heads, then v heads (zeroed by the caller).
  const int64_t bias_width = (a.p.heads + 2 * a.p.kv_heads) * d;
  for (int64_t index = begin; index < end; ++index) {
    const int64_t b = index / a.p.kv_heads, hk = index % a.p.kv_heads;
    const kernel::Head row_head = head_of_row(h, a.first_key, b);
    float* grad = a.bias.grad_partial == nullptr ? nullptr : a.bias.grad_partial + b * bias_width;
    kernel::begin_kv_head(h, {a.k.at(b, hk), a.k.row, Bias::head(a.bias.k, hk, d)},
                          {a.v.at(b, hk), a.v.row, Bias::head(a.bias.v, hk, d)}, w);
    for (int64_t hq = hk * a.p.group(); hq < (hk + 1) * a.p.group(); ++hq)
      kernel::backward_query_head<R, NVMax>(
          row_head, {a.q.at(b, hq), a.q.row, Bias::head(a.bias.q, hq, d)}, a.o.at(b, hq), a.o.row,
          {a.d_o.at(b, hq), a.d_o.row}, a.lse + (b * a.p.heads + hq) * h.t, a.dq.at(b, hq),
          a.dq.row, grad == nullptr ? nullptr : grad + hq * d, w);
    kernel::copy_rows(a.dk.at(b, hk), a.dk.row, w.dk, d, h.s, d);
    kernel::copy_rows(a.dv.at(b, hk), a.dv.row, w.dv, d, h.s, d);
    if (grad != nullptr) {
      kernel::add_column_sums(w.dk, h.s, d, grad + (a.p.heads + hk) * d);
      kernel::add_column_sums(w.dv, h.s, d, grad + (a.p.heads + a.p.kv_heads + hk) * d);
    }
  }
}

// One entry point per level: the force-inlined kernels take the instructions of the function
// they land in. Register tiles: R rows x NVMax 16-float vectors of accumulators, sized to the
// level's register file (32 zmm; 16 ymm holding a 16-float vector in two; 16 xmm in four), with
// more rows when the head is too narrow (head_dim < 16 NVMax) to fill the vectors.
#if defined(__x86_64__) && defined(__GNUC__)
#define LOOM_HAS_X86_LEVELS 1
template <typename Args>
__attribute__((target("avx512f,fma"))) void run_avx512(const Args& a, int64_t b, int64_t e,
                                                       float* w) {
  if (a.p.head.d >= 64)
    run_range<4, 4>(a, b, e, w);
  else
    run_range<8, 2>(a, b, e, w);
}
template <typename Args>
__attribute__((target("avx2,fma"))) void run_avx2(const Args& a, int64_t b, int64_t e, float* w) {
  if (a.p.head.d >= 32)
    run_range<2, 2>(a, b, e, w);
  else
    run_range<4, 1>(a, b, e, w);
}
#endif
template <typename Args>
void run_baseline(const Args& a, int64_t b, int64_t e, float* w) {
  run_range<2, 1>(a, b, e, w);
}

void check_supported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const auto why = cpu_attention_unsupported(q, k, v, 0.0);
  LOOM_CHECK(!why, "CPU attention kernel cannot take these inputs: {}", *why);
}

Problem problem_of(const at::Tensor& q, const at::Tensor& k, bool causal, double scale) {
  const int64_t t = q.size(2), s = k.size(2), d = q.size(3);
  return {q.size(0), q.size(1), k.size(1),
          kernel::Head{t, s, d, kernel::round_up(t, kernel::kLanes),
                       kernel::round_up(s, kernel::kLanes), causal, static_cast<float>(scale)}};
}

// [B, H, rows, D] as a transposed view of fresh [B, rows, H, D] storage.
at::Tensor empty_bthd(const at::Tensor& like) {
  return at::empty({like.size(0), like.size(2), like.size(1), like.size(3)}, like.options())
      .transpose(1, 2);
}
// Rows contiguous in their last dimension, which is all the kernel asks.
at::Tensor unit_stride(const at::Tensor& x) {
  return x.stride(3) == 1 ? x : x.contiguous();
}

// Heads per parallel_for chunk: one is already ~10^5 multiply-adds at T = 64.
constexpr int64_t kGrain = 1;

// Runs the kernel of level `isa` over heads [0, n) of `args` on ATen's threads, each with its
// slice of one scratch buffer allocated here, on the calling thread (so the memory comes from,
// and returns to, its heap).
template <typename Args>
void run_heads(CpuIsa isa, const Args& args, int64_t n, int64_t scratch_per_thread) {
  auto run = run_baseline<Args>;
#ifdef LOOM_HAS_X86_LEVELS
  if (isa == CpuIsa::kAvx512) run = run_avx512<Args>;
  if (isa == CpuIsa::kAvx2) run = run_avx2<Args>;
#endif
  if (n == 0) return;
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  auto scratch = at::empty({threads * scratch_per_thread}, at::kFloat);
  float* base = scratch.data_ptr<float>();
  if (threads == 1) return run(args, 0, n, base);
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    run(args, begin, end, base + at::get_thread_num() * scratch_per_thread);
  });
}

void check_isa(CpuIsa isa) {
  LOOM_CHECK(cpu_isa_available(isa), "this CPU cannot run the {} kernel", to_string(isa));
}

// Forward into o ([B, H, T, D], unit last stride) and lse ([B, H, T], contiguous).
void forward_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                  double scale, CpuIsa isa, const at::Tensor& o, const at::Tensor& lse,
                  const Bias& bias, const at::Tensor& first_key) {
  RECORD_FUNCTION("loom::cpu_attention", std::vector<c10::IValue>({q}));
  const ForwardArgs args{problem_of(q, k, causal, scale),
                         strided(q),
                         strided(k),
                         strided(v),
                         strided(o),
                         lse.data_ptr<float>(),
                         bias,
                         first_key.defined() ? first_key.data_ptr<int32_t>() : nullptr};
  if (q.size(2) > 0)
    run_heads(isa, args, args.p.batch * args.p.heads, forward_scratch(args.p.head));
}

// Backward into dq, dk, dv (unit last stride; every element written).
void backward_into(const at::Tensor& d_o, const at::Tensor& q, const at::Tensor& k,
                   const at::Tensor& v, const at::Tensor& o, const at::Tensor& lse, bool causal,
                   double scale, CpuIsa isa, const at::Tensor& dq, const at::Tensor& dk,
                   const at::Tensor& dv, const Bias& bias, const at::Tensor& first_key) {
  RECORD_FUNCTION("loom::cpu_attention_backward", std::vector<c10::IValue>({d_o}));
  if (q.size(2) == 0) {
    dk.zero_(), dv.zero_();
    return;
  }
  const BackwardArgs args{problem_of(q, k, causal, scale),
                          strided(q),
                          strided(k),
                          strided(v),
                          strided(o),
                          strided(d_o),
                          strided(dq),
                          strided(dk),
                          strided(dv),
                          lse.data_ptr<float>(),
                          bias,
                          first_key.defined() ? first_key.data_ptr<int32_t>() : nullptr};
  run_heads(isa, args, args.p.batch * args.p.kv_heads, backward_scratch(args.p.head));
}

using FirstKey = detail::NoGradTensor;

struct AttentionFunction : torch::autograd::Function<AttentionFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                            const FirstKey& first_key) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [o, lse] = cpu_attention_forward(q, k, v, causal, scale, best_cpu_isa(), first_key.value);
    ctx->save_for_backward({q, k, v, o, lse});
    ctx->saved_data["first_key"] = first_key.to_ivalue();
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    return o;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dq, dk, dv] = cpu_attention_backward(grads[0], saved[0], saved[1], saved[2], saved[3],
                                               saved[4], ctx->saved_data["causal"].toBool(),
                                               ctx->saved_data["scale"].toDouble(), best_cpu_isa(),
                                               FirstKey::from(ctx->saved_data["first_key"]));
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// q, k, v heads of a packed [B, T, 3, H, D] tensor, each [B, H, T, D].
std::array<at::Tensor, 3> unpack(const at::Tensor& qkv) {
  const auto heads = qkv.permute({2, 0, 3, 1, 4});
  return {heads[0], heads[1], heads[2]};
}

// A packed projection's bias [3 H D] (q heads, k heads, v heads), or none.
Bias packed_bias(const at::Tensor& bias, int64_t heads, int64_t d) {
  if (!bias.defined()) return {};
  const float* b = bias.data_ptr<float>();
  return {b, b + heads * d, b + 2 * heads * d};
}

// Attention of a packed projection output, whose gradient is written straight into one packed
// [B, T, 3, H, D] tensor: no stacking of three gradients, no copy back to the projection's
// layout (what q, k, v taken apart by unbind cost in backward). With a bias, the projection's
// GEMM left it out: it is added as the kernel packs q, k, v, and its gradient summed there.
struct PackedAttention {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& qkv_in,
                            const at::Tensor& bias_in, bool causal, double scale,
                            const FirstKey& first_key) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const auto qkv = qkv_in.stride(4) == 1 ? qkv_in : qkv_in.contiguous();
    const auto bias = bias_in.defined() ? bias_in.contiguous() : bias_in;
    const auto [q, k, v] = unpack(qkv);
    auto o = empty_bthd(q);
    auto lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
    forward_into(q, k, v, causal, scale, best_cpu_isa(), o, lse,
                 packed_bias(bias, q.size(1), q.size(3)), first_key.value);
    ctx->save_for_backward({qkv, bias, o, lse});
    ctx->saved_data["first_key"] = first_key.to_ivalue();
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    return o;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &qkv = saved[0], &bias = saved[1];
    const auto [q, k, v] = unpack(qkv);
    const int64_t batch = q.size(0), heads = q.size(1), d = q.size(3);
    auto grad = at::empty(qkv.sizes(), qkv.options());
    const auto [dq, dk, dv] = unpack(grad);
    Bias b = packed_bias(bias, heads, d);
    at::Tensor partial, grad_bias;
    if (b.defined()) {
      partial = at::zeros({batch, 3 * heads * d}, qkv.options());
      b.grad_partial = partial.data_ptr<float>();
    }
    backward_into(unit_stride(grads[0]), q, k, v, saved[2], saved[3],
                  ctx->saved_data["causal"].toBool(), ctx->saved_data["scale"].toDouble(),
                  best_cpu_isa(), dq, dk, dv, b, FirstKey::from(ctx->saved_data["first_key"]));
    if (b.defined()) {
      // Over the batch in order: the same bits at any thread count.
      grad_bias = partial[0].clone();
      for (int64_t i = 1; i < batch; ++i) grad_bias.add_(partial[i]);
    }
    return {grad, grad_bias};
  }
};

// The autograd functions, without and with the bias (autograd takes no undefined input).
struct PackedAttentionFunction : torch::autograd::Function<PackedAttentionFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& qkv,
                            bool causal, double scale, const FirstKey& first_key) {
    return PackedAttention::forward(ctx, qkv, at::Tensor(), causal, scale, first_key);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {PackedAttention::backward(ctx, std::move(grads))[0], at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};
struct PackedBiasedAttentionFunction : torch::autograd::Function<PackedBiasedAttentionFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& qkv,
                            const at::Tensor& bias, bool causal, double scale,
                            const FirstKey& first_key) {
    return PackedAttention::forward(ctx, qkv, bias, causal, scale, first_key);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto g = PackedAttention::backward(ctx, std::move(grads));
    return {g[0], g[1], at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

std::string to_string(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kBaseline:
      return "baseline";
  }
  return "?";
}

bool cpu_isa_available(CpuIsa isa) {
#ifdef LOOM_HAS_X86_LEVELS
  switch (isa) {
    case CpuIsa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
    case CpuIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case CpuIsa::kBaseline:
      return true;
  }
  return false;
#else
  return isa == CpuIsa::kBaseline;
#endif
}

std::vector<CpuIsa> available_cpu_isas() {
  std::vector<CpuIsa> out;
  for (auto isa : {CpuIsa::kAvx512, CpuIsa::kAvx2, CpuIsa::kBaseline})
    if (cpu_isa_available(isa)) out.push_back(isa);
  return out;
}

CpuIsa best_cpu_isa() {
  static const CpuIsa best = available_cpu_isas().front();
  return best;
}

std::optional<std::string> cpu_attention_unsupported(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v, double dropout) {
  for (const auto* x : {&q, &k, &v}) {
    if (!x->defined() || x->dim() != 4)
      return "q, k and v must be defined [batch, heads, seq, head_dim] tensors";
    if (!x->device().is_cpu())
      return fmt::format("it takes CPU tensors, not {}", x->device().str());
    if (x->scalar_type() != at::kFloat)
      return fmt::format("it takes fp32 tensors, not {}", c10::toString(x->scalar_type()));
  }
  if (k.sizes() != v.sizes())
    return fmt::format("k {} and v {} differ in shape", k.sizes(), v.sizes());
  if (q.size(0) != k.size(0) || q.size(3) != k.size(3))
    return fmt::format("q {} and k {} differ in batch or head_dim", q.sizes(), k.sizes());
  if (k.size(1) == 0 || q.size(1) % k.size(1) != 0)
    return fmt::format("{} query heads are not a multiple of {} key/value heads", q.size(1),
                       k.size(1));
  if (q.size(3) == 0 || q.size(3) % kernel::kLanes != 0)
    return fmt::format("head_dim {} is not a positive multiple of {}", q.size(3), kernel::kLanes);
  if (k.size(2) == 0) return std::string("there are no keys");
  if (dropout != 0) return fmt::format("it has no attention dropout (asked for {})", dropout);
  return std::nullopt;
}

at::Tensor cpu_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                         double scale, const at::Tensor& first_key) {
  check_supported(q, k, v);
  return AttentionFunction::apply(q, k, v, causal, scale,
                                  FirstKey{checked_first_keys(first_key, q, causal)});
}

std::optional<std::string> cpu_attention_packed_unsupported(const at::Tensor& qkv, double dropout,
                                                            const at::Tensor& bias) {
  if (!qkv.defined() || qkv.dim() != 5 || qkv.size(2) != 3)
    return std::string("the packed projection must be a [batch, seq, 3, heads, head_dim] tensor");
  if (bias.defined() && (bias.dim() != 1 || bias.numel() != 3 * qkv.size(3) * qkv.size(4) ||
                         bias.scalar_type() != at::kFloat || !bias.device().is_cpu()))
    return fmt::format(
        "the bias must be an fp32 CPU vector of 3 * heads * head_dim = {} values; got {} {}",
        3 * qkv.size(3) * qkv.size(4), c10::toString(bias.scalar_type()), bias.sizes());
  const auto [q, k, v] = unpack(qkv);
  return cpu_attention_unsupported(q, k, v, dropout);
}

at::Tensor cpu_attention_packed(const at::Tensor& qkv, bool causal, double scale,
                                const at::Tensor& bias, const at::Tensor& first_key) {
  const auto why = cpu_attention_packed_unsupported(qkv, 0.0, bias);
  LOOM_CHECK(!why, "CPU attention kernel cannot take these inputs: {}", *why);
  const FirstKey fk{checked_first_keys(first_key, unpack(qkv)[0], causal)};
  return bias.defined() ? PackedBiasedAttentionFunction::apply(qkv, bias, causal, scale, fk)
                        : PackedAttentionFunction::apply(qkv, causal, scale, fk);
}

std::pair<at::Tensor, at::Tensor> cpu_attention_forward(const at::Tensor& q_in,
                                                        const at::Tensor& k_in,
                                                        const at::Tensor& v_in, bool causal,
                                                        double scale, CpuIsa isa,
                                                        const at::Tensor& first_key) {
  check_supported(q_in, k_in, v_in);
  LOOM_CHECK(!causal || q_in.size(2) == k_in.size(2),
             "causal attention needs as many keys as queries; got {} and {}", q_in.size(2),
             k_in.size(2));
  check_isa(isa);
  const auto q = unit_stride(q_in), k = unit_stride(k_in), v = unit_stride(v_in);
  auto o = empty_bthd(q);
  auto lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  forward_into(q, k, v, causal, scale, isa, o, lse, {}, checked_first_keys(first_key, q, causal));
  return {o, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out, const at::Tensor& lse, bool causal, double scale,
    CpuIsa isa, const at::Tensor& first_key) {
  check_supported(q_in, k_in, v_in);
  check_isa(isa);
  LOOM_CHECK(grad_out.sizes() == q_in.sizes() && out.sizes() == q_in.sizes() &&
                 grad_out.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
             "attention backward: grad {} and output {} must be fp32 of q's shape {}",
             grad_out.sizes(), out.sizes(), q_in.sizes());
  LOOM_CHECK(lse.is_contiguous() && lse.scalar_type() == at::kFloat &&
                 lse.sizes() == q_in.sizes().slice(0, 3),
             "attention backward: log-sum-exp {} must be contiguous fp32 [B, H, T] of q {}",
             lse.sizes(), q_in.sizes());
  const auto q = unit_stride(q_in), k = unit_stride(k_in), v = unit_stride(v_in);
  auto dq = empty_bthd(q), dk = empty_bthd(k), dv = empty_bthd(v);
  backward_into(unit_stride(grad_out), q, k, v, unit_stride(out), lse, causal, scale, isa, dq, dk,
                dv, {}, checked_first_keys(first_key, q, causal));
  return {dq, dk, dv};
}

}  // namespace loom::ops
