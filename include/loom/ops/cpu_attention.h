#pragma once
// loom's attention kernel for CPU tensors, as an autograd op: for each (batch, head), the
// scores of a few query rows at a time in registers, the whole softmax row at once (a head's
// keys and values stay in cache), and the products as register-tiled loops compiled once per
// x86 level (AVX-512, AVX2 + FMA, baseline) and picked at run time. Causal attention skips the
// tiles above the diagonal. Forward saves the log-sum-exp of each row (no attention matrix);
// backward recomputes the probabilities from it. Each head is computed by one thread in a fixed
// order: the result does not depend on the thread count.
//
// ops::attention (backend kAuto) uses it for the CPU inputs it takes; LOOM_CPU_KERNELS=0
// switches it off (PyTorch's SDPA then runs). tests/test_cpu_attention.cpp holds it to an fp64
// run of the plain math at every level this machine has.
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace loom::ops {

// The x86 level the kernel's instructions are compiled for.
enum class CpuIsa { kAvx512, kAvx2, kBaseline };
std::string to_string(CpuIsa isa);
// Whether this machine can run the level (kBaseline: always).
bool cpu_isa_available(CpuIsa isa);
// The best level this machine has: what cpu_attention runs.
CpuIsa best_cpu_isa();
// Every level this machine can run, best first.
std::vector<CpuIsa> available_cpu_isas();

// Why cpu_attention cannot take these inputs, or nullopt when it can: CPU fp32 tensors
// [B, H, T, D] of one layout family (k, v: [B, Hkv, S, D], Hkv dividing H), head_dim a multiple
// of 16, at least one key, no dropout.
std::optional<std::string> cpu_attention_unsupported(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v, double dropout);

// softmax(scale q k^T (+ causal mask)) v, differentiable in q, k, v. Any strides (rows are
// copied into the kernel's buffers). Returns [B, H, T, D]: a transposed view of [B, T, H, D]
// storage, as the models reshape it next. Throws loom::Error with cpu_attention_unsupported's
// reason when it cannot take the inputs. `first_key` (optional, causal only): a document mask,
// as AttentionOptions::first_key (ops/attention.h); each row tile starts at the key vector of
// its first row's first key, so keys of earlier documents cost little (their packing does not
// shrink).
at::Tensor cpu_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                         double scale, const at::Tensor& first_key = {});

// The same for q, k, v packed as one projection's output, qkv [B, T, 3, H, D] (GPT-2's c_attn
// viewed so): differentiable in qkv, its gradient written straight into one [B, T, 3, H, D]
// tensor (no stacking of three gradients and copy back, which q, k, v taken apart cost).
// `bias` (optional, [3 H D] in qkv's column order, differentiable): the projection's bias, left
// out of its GEMM (whose output at::linear would fill with it first) and added here as q, k, v
// are packed; its gradient is summed in the same pass.
std::optional<std::string> cpu_attention_packed_unsupported(const at::Tensor& qkv, double dropout,
                                                            const at::Tensor& bias = {});
at::Tensor cpu_attention_packed(const at::Tensor& qkv, bool causal, double scale,
                                const at::Tensor& bias = {}, const at::Tensor& first_key = {});

// The two passes, for tests and benchmarks, at a chosen level (an error if unavailable).
// Forward: the output and the log-sum-exp [B, H, T] (fp32, natural log) of the scaled scores.
std::pair<at::Tensor, at::Tensor> cpu_attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                        const at::Tensor& v, bool causal,
                                                        double scale, CpuIsa isa,
                                                        const at::Tensor& first_key = {});
// Backward: dq, dk, dv from the forward's output and log-sum-exp.
std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, bool causal, double scale, CpuIsa isa,
    const at::Tensor& first_key = {});

}  // namespace loom::ops
