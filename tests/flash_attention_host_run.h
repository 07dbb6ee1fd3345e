#pragma once
// The fused attention kernel's host reference (kernels/attention/flash_attention_host.h) run on
// LibTorch tensors: what the CPU tests of the reference (test_kernels.cpp) and the GPU tests of
// the kernel (test_gpu.cpp) both call.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <limits>

#include "attention/flash_attention_host.h"

namespace loom::testing {

struct FlashAttentionHostRun {
  at::Tensor o, lse, dq, dk, dv;
  loom::kernels::FlashAttentionHostStats forward, backward;
};

inline loom::kernels::AttentionStrides attention_strides_of(const at::Tensor& t) {
  EXPECT_EQ(t.dim(), 4);
  EXPECT_EQ(t.stride(3), 1) << "head_dim must be contiguous";
  return {t.stride(0), t.stride(1), t.stride(2)};
}

// Forward and backward of the host reference on fp32 CPU tensors q, k, v, d_o ([B, H, T, D],
// last dimension contiguous). Outputs go into `out`'s tensors where defined (any strides with a
// contiguous last dimension), else into new NaN-filled ones, so that an element the reference
// never writes shows. `first_key`: a document mask ([B, T] int32, contiguous) or none.
inline FlashAttentionHostRun run_flash_attention_host(const at::Tensor& q, const at::Tensor& k,
                                                      const at::Tensor& v, const at::Tensor& d_o,
                                                      bool causal, float scale,
                                                      FlashAttentionHostRun out = {},
                                                      const at::Tensor& first_key = {}) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  if (!out.o.defined()) out.o = at::full_like(q, nan);
  if (!out.lse.defined()) out.lse = at::full({q.size(0), q.size(1), q.size(2)}, nan);
  if (!out.dq.defined()) out.dq = at::full_like(q, nan);
  if (!out.dk.defined()) out.dk = at::full_like(k, nan);
  if (!out.dv.defined()) out.dv = at::full_like(v, nan);
  loom::kernels::FlashAttentionHostParams p;
  p.batch = static_cast<int>(q.size(0));
  p.q_heads = static_cast<int>(q.size(1));
  p.kv_heads = static_cast<int>(k.size(1));
  p.q_len = static_cast<int>(q.size(2));
  p.kv_len = static_cast<int>(k.size(2));
  p.head_dim = static_cast<int>(q.size(3));
  p.scale = scale;
  p.causal = causal;
  p.first_key = first_key.defined() ? first_key.data_ptr<int32_t>() : nullptr;
  p.q_strides = attention_strides_of(q);
  p.k_strides = attention_strides_of(k);
  p.v_strides = attention_strides_of(v);
  p.o_strides = attention_strides_of(out.o);
  p.d_o_strides = attention_strides_of(d_o);
  p.dq_strides = attention_strides_of(out.dq);
  p.dk_strides = attention_strides_of(out.dk);
  p.dv_strides = attention_strides_of(out.dv);
  p.q = q.data_ptr<float>();
  p.k = k.data_ptr<float>();
  p.v = v.data_ptr<float>();
  p.o = out.o.data_ptr<float>();
  p.lse = out.lse.data_ptr<float>();
  p.d_o = d_o.data_ptr<float>();
  p.dq = out.dq.data_ptr<float>();
  p.dk = out.dk.data_ptr<float>();
  p.dv = out.dv.data_ptr<float>();
  auto s = loom::kernels::flash_attention_forward_host(p, &out.forward);
  EXPECT_TRUE(s.ok()) << s.message;
  s = loom::kernels::flash_attention_backward_host(p, &out.backward);
  EXPECT_TRUE(s.ok()) << s.message;
  return out;
}

}  // namespace loom::testing
