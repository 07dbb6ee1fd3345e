#include "loom/ops/attention_partial.h"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <limits>

#include "loom/core/error.h"
#include "loom/core/format.h"
#include "loom/ops/flash_attention.h"
#include "loom/ops/precision.h"

namespace loom::ops {

namespace {

struct Shape {
  int64_t b, hq, hkv, tq, tk, d;
  int64_t group() const { return hq / hkv; }
};

Shape check_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, BlockMask mask) {
  LOOM_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
             "partial attention takes q [B, Hq, Tq, D] and k, v [B, Hkv, Tk, D]; got {}, {}, {}",
             q.sizes(), k.sizes(), v.sizes());
  const Shape s{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3)};
  LOOM_CHECK(k.sizes() == v.sizes() && k.size(0) == s.b && k.size(3) == s.d && s.hkv > 0 &&
                 s.hq % s.hkv == 0,
             "partial attention: k {} and v {} must match each other and q {} (batch, head "
             "size, and key/value heads dividing query heads)",
             k.sizes(), v.sizes(), q.sizes());
  LOOM_CHECK(mask == BlockMask::kFull || s.tq == s.tk,
             "partial attention: a causal (diagonal) block needs as many queries as keys; got {} "
             "and {}",
             s.tq, s.tk);
  return s;
}

// Query heads grouped by the key/value head they read: [B, Hkv, g * Tq, D], so that one batched
// product covers a group without copying k and v per query head.
at::Tensor grouped(const at::Tensor& x, const Shape& s, at::ScalarType dtype) {
  return x.to(dtype).reshape({s.b, s.hkv, s.group() * s.tq, x.size(-1)});
}

// Scores [B, Hkv, g * Tq, Tk] with the causal mask applied as -inf.
at::Tensor block_scores(const at::Tensor& qg, const at::Tensor& k, const Shape& s, BlockMask mask,
                        double scale) {
  auto scores = at::matmul(qg, k.transpose(-1, -2)) * scale;
  if (mask == BlockMask::kCausal) {
    const auto above = at::ones({s.tq, s.tk}, qg.options().dtype(at::kBool)).triu(1);
    scores = scores.view({s.b, s.hkv, s.group(), s.tq, s.tk})
                 .masked_fill(above, -std::numeric_limits<double>::infinity())
                 .view({s.b, s.hkv, s.group() * s.tq, s.tk});
  }
  return scores;
}

}  // namespace

PartialAttention attention_partial_forward(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, BlockMask mask, double scale) {
  const auto s = check_shapes(q, k, v, mask);
  const auto acc = accumulation_dtype(q.scalar_type());
  if (!flash_attention_unsupported(q, k, v, 0.0)) {
    auto [out, lse] = flash_attention_forward(q, k, v, mask == BlockMask::kCausal, scale);
    return {out.to(acc), lse.to(acc)};
  }
  // In the accumulation dtype even under bf16 autocast: the backward (which runs outside it)
  // recomputes these scores and must see the same ones.
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const auto qg = grouped(q, s, acc);
  const auto scores = block_scores(qg, k.to(acc), s, mask, scale);
  // Every row holds at least one unmasked score (a causal block keeps its diagonal), so the
  // log-sum-exp is finite.
  auto lse = at::logsumexp(scores, -1, /*keepdim=*/true);
  auto out = at::matmul(at::exp(scores - lse), v.to(acc));
  return {out.view({s.b, s.hq, s.tq, s.d}), lse.view({s.b, s.hq, s.tq})};
}

PartialAttention empty_partial_attention(const at::Tensor& q) {
  const auto options = q.options().dtype(accumulation_dtype(q.scalar_type()));
  return {at::zeros(q.sizes(), options),
          at::full({q.size(0), q.size(1), q.size(2)}, -std::numeric_limits<double>::infinity(),
                   options)};
}

void merge_partial_attention(PartialAttention& acc, const PartialAttention& part) {
  LOOM_CHECK(acc.out.sizes() == part.out.sizes() && acc.lse.sizes() == part.lse.sizes(),
             "merging partial attention of different shapes: {} and {}", acc.out.sizes(),
             part.out.sizes());
  // logaddexp(-inf, x) = x: an empty accumulator takes the part as it is.
  const auto lse = at::logaddexp(acc.lse, part.lse);
  acc.out = acc.out * at::exp(acc.lse - lse).unsqueeze(-1) +
            part.out * at::exp(part.lse - lse).unsqueeze(-1);
  acc.lse = lse;
}

PartialAttentionGrads attention_partial_backward(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v, const at::Tensor& out,
                                                 const at::Tensor& lse, const at::Tensor& dout,
                                                 BlockMask mask, double scale) {
  const auto s = check_shapes(q, k, v, mask);
  LOOM_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes() && lse.dim() == 3 &&
                 lse.size(0) == s.b && lse.size(1) == s.hq && lse.size(2) == s.tq,
             "partial attention backward: out {} and dout {} must match q {}, lse {} be [B, Hq, "
             "Tq]",
             out.sizes(), dout.sizes(), q.sizes(), lse.sizes());
  const auto acc = accumulation_dtype(q.scalar_type());
  if (!flash_attention_unsupported(q, k, v, 0.0)) {
    // The kernel forms rowsum(dout * out) from the whole output it is given.
    auto [dq, dk, dv] =
        flash_attention_backward(q, k, v, out.to(q.scalar_type()), lse.to(at::kFloat),
                                 dout.to(q.scalar_type()), mask == BlockMask::kCausal, scale);
    return {dq.to(acc), dk.to(acc), dv.to(acc)};
  }
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const auto delta = (dout.to(acc) * out.to(acc)).sum(-1);
  const auto qg = grouped(q, s, acc);
  const auto kf = k.to(acc);
  const auto vf = v.to(acc);
  const auto dg = grouped(dout, s, acc);
  const auto rows = [&](const at::Tensor& x) {
    return x.to(acc).reshape({s.b, s.hkv, s.group() * s.tq, 1});
  };
  // The probabilities of the whole softmax restricted to this block: exp(score - whole lse).
  const auto p = at::exp(block_scores(qg, kf, s, mask, scale) - rows(lse));
  const auto ds = p * (at::matmul(dg, vf.transpose(-1, -2)) - rows(delta));
  // Products over the grouped rows sum each key/value head's gradient over its query heads.
  return {(at::matmul(ds, kf) * scale).view({s.b, s.hq, s.tq, s.d}),
          at::matmul(ds.transpose(-1, -2), qg) * scale, at::matmul(p.transpose(-1, -2), dg)};
}

}  // namespace loom::ops
