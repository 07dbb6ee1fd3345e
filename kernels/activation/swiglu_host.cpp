// The host references of the fused SwiGLU (swiglu.h): the kernels' per-element arithmetic
// (swiglu_math.h), one element at a time, in plain C++.
#include <cstdint>
#include <string>

#include "activation/swiglu.h"
#include "activation/swiglu_math.h"
#include "common/host_elements.h"

namespace loom::kernels {

namespace {

Status bad(const std::string& message) {
  return Status::invalid_argument("swiglu: " + message);
}

Status check_shape(const SwigluShape& s) {
  if (element_size(s.io) == 0) return bad("unknown io dtype " + std::to_string(int(s.io)));
  if (s.n < 0) return bad("n " + std::to_string(s.n) + " must be >= 0");
  return Status::success();
}

Status check_range(const SwigluShape& s, int64_t begin, int64_t end) {
  if (begin < 0 || end < begin || end > s.n)
    return bad("range [" + std::to_string(begin) + ", " + std::to_string(end) +
               ") must lie within [0, " + std::to_string(s.n) + "]");
  return Status::success();
}

template <typename Acc>
void forward(const SwigluShape& s, const SwigluForwardArgs& a, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i)
    store_element<Acc>(
        s.io, a.out, i,
        swiglu_forward_value(load_element<Acc>(s.io, a.gate, i), load_element<Acc>(s.io, a.up, i)));
}

template <typename Acc>
void backward(const SwigluShape& s, const SwigluBackwardArgs& a, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    Acc grad_gate, grad_up;
    swiglu_backward_value(load_element<Acc>(s.io, a.gate, i), load_element<Acc>(s.io, a.up, i),
                          load_element<Acc>(s.io, a.grad_out, i), &grad_gate, &grad_up);
    store_element<Acc>(s.io, a.grad_gate, i, grad_gate);
    store_element<Acc>(s.io, a.grad_up, i, grad_up);
  }
}

}  // namespace

Status swiglu_forward_check(const SwigluShape& s, const SwigluForwardArgs& a) {
  if (Status st = check_shape(s); !st.ok()) return st;
  if (s.n > 0 && (!a.gate || !a.up || !a.out))
    return bad("forward: gate, up and out must not be null");
  return Status::success();
}

Status swiglu_backward_check(const SwigluShape& s, const SwigluBackwardArgs& a) {
  if (Status st = check_shape(s); !st.ok()) return st;
  if (s.n > 0 && (!a.gate || !a.up || !a.grad_out || !a.grad_gate || !a.grad_up))
    return bad("backward: gate, up, grad_out, grad_gate and grad_up must not be null");
  if (s.n > 0 && a.grad_up == a.grad_out)
    return bad("backward: grad_up must not alias grad_out (grad_gate may)");
  return Status::success();
}

Status swiglu_forward_host(const SwigluShape& s, const SwigluForwardArgs& a, int64_t begin,
                           int64_t end) {
  if (Status st = swiglu_forward_check(s, a); !st.ok()) return st;
  if (Status st = check_range(s, begin, end); !st.ok()) return st;
  if (s.io == ElementDtype::kFloat64)
    forward<double>(s, a, begin, end);
  else
    forward<float>(s, a, begin, end);
  return Status::success();
}

Status swiglu_backward_host(const SwigluShape& s, const SwigluBackwardArgs& a, int64_t begin,
                            int64_t end) {
  if (Status st = swiglu_backward_check(s, a); !st.ok()) return st;
  if (Status st = check_range(s, begin, end); !st.ok()) return st;
  if (s.io == ElementDtype::kFloat64)
    backward<double>(s, a, begin, end);
  else
    backward<float>(s, a, begin, end);
  return Status::success();
}

}  // namespace loom::kernels
