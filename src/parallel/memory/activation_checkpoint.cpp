#include "loom/parallel/memory/activation_checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/ivalue.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>

#include <array>
#include <mutex>

#include "loom/core/error.h"

namespace loom::parallel::memory {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The devices whose autocast state is carried from forward to the recompute.
constexpr std::array<at::DeviceType, 2> kAutocastDevices{at::kCPU, at::kCUDA};

struct AutocastState {
  std::array<bool, kAutocastDevices.size()> enabled{};
  std::array<at::ScalarType, kAutocastDevices.size()> dtype{};
  bool cache_enabled = true;

  static AutocastState current() {
    AutocastState s;
    for (size_t i = 0; i < kAutocastDevices.size(); ++i) {
      s.enabled[i] = at::autocast::is_autocast_enabled(kAutocastDevices[i]);
      s.dtype[i] = at::autocast::get_autocast_dtype(kAutocastDevices[i]);
    }
    s.cache_enabled = at::autocast::is_autocast_cache_enabled();
    return s;
  }
  void make_current() const {
    for (size_t i = 0; i < kAutocastDevices.size(); ++i) {
      at::autocast::set_autocast_dtype(kAutocastDevices[i], dtype[i]);
      at::autocast::set_autocast_enabled(kAutocastDevices[i], enabled[i]);
    }
    at::autocast::set_autocast_cache_enabled(cache_enabled);
  }
};

// Runs its scope under `state`'s autocast settings, then restores what was there.
class AutocastScope {
 public:
  explicit AutocastScope(const AutocastState& state) : previous_(AutocastState::current()) {
    state.make_current();
  }
  ~AutocastScope() { previous_.make_current(); }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  AutocastState previous_;
};

at::Tensor get_rng_state(at::Generator& generator) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void set_rng_state(at::Generator& generator, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

// Sets each handle (a generator, a dropout stream) to the state it had at forward for its scope,
// then puts back the state it had on entry (draws made since forward by code outside fn are not
// replayed or lost; positions set since forward are kept).
template <typename Handle, typename State, typename Get, typename Set>
class StateReplay {
 public:
  StateReplay(std::vector<Handle>& handles, const std::vector<State>& replay, Get get, Set set)
      : handles_(handles), set_(set) {
    for (size_t i = 0; i < handles_.size(); ++i) {
      entry_states_.push_back(get(handles_[i]));
      set_(handles_[i], replay[i]);
    }
  }
  ~StateReplay() {
    for (size_t i = 0; i < entry_states_.size(); ++i) set_(handles_[i], entry_states_[i]);
  }
  StateReplay(const StateReplay&) = delete;
  StateReplay& operator=(const StateReplay&) = delete;

 private:
  std::vector<Handle>& handles_;
  Set set_;
  std::vector<State> entry_states_;
};

template <typename Handle, typename State, typename Get, typename Set>
StateReplay<Handle, State, Get, Set> replay_states(std::vector<Handle>& handles,
                                                   const std::vector<State>& replay, Get get,
                                                   Set set) {
  return {handles, replay, get, set};
}

ops::DropoutPosition position_of(std::shared_ptr<ops::DropoutStream>& stream) {
  return stream->position();
}

void restore_position(std::shared_ptr<ops::DropoutStream>& stream,
                      const ops::DropoutPosition& position) {
  stream->restore(position);
}

// What backward needs besides the saved inputs. It travels in the autograd context as a capsule
// (the context's saved data holds IValues only), owned by the node.
struct CheckpointState : torch::CustomClassHolder {
  std::vector<CheckpointFn> fns;  // summed
  // fn's argument list: slot i is the tensor the node received at slots[i], or undefined (-1).
  std::vector<int64_t> slots;
  // The node's inputs are the saved ones (fn's defined inputs, maybe a placeholder), then these
  // parameters, whose gradients backward returns (CheckpointOptions::parameters).
  std::vector<at::Tensor> parameters;
  std::vector<at::Generator> generators;
  std::vector<at::Tensor> rng_states;  // the generators' states when forward ran fn
  std::vector<std::shared_ptr<ops::DropoutStream>> dropout_streams;
  std::vector<ops::DropoutPosition> dropout_positions;  // theirs when forward ran fn
  AutocastState autocast;
  // With offload: per node input, its ticket (-1: kept as a saved tensor) and whether it needed
  // a gradient.
  std::shared_ptr<ActivationOffloader> offload;
  std::vector<int64_t> tickets;
  std::vector<bool> requires_grad;

  std::vector<at::Tensor> arguments(const std::vector<at::Tensor>& node_inputs) const {
    std::vector<at::Tensor> args;
    args.reserve(slots.size());
    for (const int64_t slot : slots)
      args.push_back(slot < 0 ? at::Tensor() : node_inputs.at(static_cast<size_t>(slot)));
    return args;
  }
};

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  // `inputs` holds the defined tensors only (autograd's bookkeeping cannot describe an undefined
  // one), plus a placeholder that needs a gradient when none of them does.
  static at::Tensor forward(AutogradContext* ctx, at::TensorList inputs,
                            const c10::intrusive_ptr<CheckpointState>& state) {
    for (auto& generator : state->generators) state->rng_states.push_back(get_rng_state(generator));
    for (const auto& stream : state->dropout_streams)
      state->dropout_positions.push_back(stream->position());
    state->autocast = AutocastState::current();
    std::vector<at::Tensor> saved(inputs.begin(),
                                  inputs.end() - static_cast<int64_t>(state->parameters.size()));
    at::Tensor out;
    {
      // Grad mode is off here (Function::apply). Autocast's cast cache stays off around fn: a
      // cast cached now would have no gradient history for a later use of the same weight.
      auto no_cache = state->autocast;
      no_cache.cache_enabled = false;
      AutocastScope autocast(no_cache);
      const auto args = state->arguments(saved);
      for (const auto& fn : state->fns) {
        auto term = fn(args);
        LOOM_CHECK(term.defined(),
                   "checkpoint: the checkpointed function returned an undefined tensor");
        out = out.defined() ? out + term : term;
      }
    }
    if (state->offload) {
      // Floating-point inputs leave the device; the rest (ids, the placeholder) stay saved.
      std::vector<at::Tensor> kept;
      for (const auto& t : saved) {
        const bool moves = t.is_floating_point() && t.numel() > 0;
        state->tickets.push_back(moves ? state->offload->offload(t) : -1);
        state->requires_grad.push_back(t.requires_grad());
        kept.push_back(moves ? at::Tensor() : t);
      }
      saved = std::move(kept);
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["state"] = at::IValue::make_capsule(state);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto capsule = ctx->saved_data.at("state").toCapsule();
    auto& state = dynamic_cast<CheckpointState&>(*capsule);
    // With listed parameters every gradient comes back through this node (autograd::grad below).
    LOOM_CHECK(!state.parameters.empty() ||
                   torch::autograd::Engine::get_default_engine().is_checkpoint_valid(),
               "activation checkpointing supports .backward() only: torch::autograd::grad (or "
               "backward with explicit inputs) cannot see the gradients the recompute "
               "accumulates into parameters");
    // Fresh leaves for the recompute, so its graph ends here and their .grad is the answer.
    std::vector<at::Tensor> leaves;
    const auto saved = ctx->get_saved_variables();
    if (state.offload) {
      int64_t first = -1;
      for (size_t i = 0; i < saved.size(); ++i) {
        const int64_t ticket = state.tickets[i];
        if (ticket < 0) {
          leaves.push_back(saved[i].detach().requires_grad_(saved[i].requires_grad()));
          continue;
        }
        if (first < 0 || ticket < first) first = ticket;
        leaves.push_back(state.offload->fetch(ticket).requires_grad_(state.requires_grad[i]));
      }
      // The previous checkpoint's inputs start coming back while this one recomputes.
      if (first > 0) state.offload->prefetch(first - 1);
    } else {
      for (const auto& t : saved) leaves.push_back(t.detach().requires_grad_(t.requires_grad()));
    }
    // With listed parameters: the leaves and parameters needing gradients, and their sums.
    std::vector<at::Tensor> targets;
    std::vector<size_t> target_slot;  // index into `grads` below
    variable_list grads(leaves.size() + state.parameters.size());
    if (!state.parameters.empty()) {
      for (size_t i = 0; i < leaves.size(); ++i)
        if (leaves[i].requires_grad()) {
          targets.push_back(leaves[i]);
          target_slot.push_back(i);
        }
      for (size_t i = 0; i < state.parameters.size(); ++i)
        if (state.parameters[i].requires_grad()) {
          targets.push_back(state.parameters[i]);
          target_slot.push_back(leaves.size() + i);
        }
    }
    {
      const auto rng = replay_states(state.generators, state.rng_states, get_rng_state,
                                     set_rng_state);
      const auto dropout = replay_states(state.dropout_streams, state.dropout_positions,
                                         position_of, restore_position);
      // Without the cast cache: backward runs outside the caller's autocast region, so nothing
      // would clear casts cached here, and the next forward would read this step's bf16 copies
      // of weights the optimizer has changed since.
      auto no_cache = state.autocast;
      no_cache.cache_enabled = false;
      const auto args = state.arguments(leaves);
      // One function's graph at a time: recomputed, differentiated, released.
      for (const auto& fn : state.fns) {
        at::Tensor out;
        {
          // The recompute under the forward's autocast; its differentiation (below) outside it,
          // as any backward runs: autocast would change the dtypes of backward formulas' ops.
          AutocastScope autocast(no_cache);
          at::AutoGradMode grad_mode(true);
          out = fn(args);
        }
        // Nothing in fn needs a gradient (no input or parameter does): nothing to propagate.
        if (!out.requires_grad()) continue;
        if (state.parameters.empty()) {
          torch::autograd::backward({out}, {grad_outputs.at(0)});
          continue;
        }
        const auto got = torch::autograd::grad({out}, targets, {grad_outputs.at(0)},
                                               /*retain_graph=*/false, /*create_graph=*/false,
                                               /*allow_unused=*/true);
        for (size_t t = 0; t < targets.size(); ++t) {
          if (!got[t].defined()) continue;
          auto& sum = grads[target_slot[t]];
          sum = sum.defined() ? sum + got[t] : got[t];
        }
      }
    }
    if (state.parameters.empty())
      for (size_t i = 0; i < leaves.size(); ++i)
        grads[i] = leaves[i].requires_grad() ? leaves[i].grad() : at::Tensor();
    grads.emplace_back();  // for `state`, not a tensor
    return grads;
  }
};

}  // namespace

at::Tensor checkpoint(const CheckpointFn& fn, const std::vector<at::Tensor>& inputs,
                      const CheckpointOptions& options) {
  return checkpoint_sum({fn}, inputs, options);
}

at::Tensor checkpoint_sum(const std::vector<CheckpointFn>& fns,
                          const std::vector<at::Tensor>& inputs, const CheckpointOptions& options) {
  LOOM_CHECK(!fns.empty(), "checkpoint_sum: no functions to sum");
  for (const auto& fn : fns) LOOM_CHECK(fn, "checkpoint_sum: a function is empty");
  // No graph will be recorded: there is nothing to save or recompute.
  if (!at::GradMode::is_enabled()) {
    at::Tensor out;
    for (const auto& fn : fns) {
      auto term = fn(inputs);
      out = out.defined() ? out + term : term;
    }
    return out;
  }
  auto state = c10::make_intrusive<CheckpointState>();
  state->fns = fns;
  state->generators = options.generators;
  state->dropout_streams = options.dropout_streams;
  state->offload = options.offload;
  std::vector<at::Tensor> node_inputs;
  bool any_requires_grad = false;
  for (const auto& x : inputs) {
    if (!x.defined()) {
      state->slots.push_back(-1);
      continue;
    }
    state->slots.push_back(static_cast<int64_t>(node_inputs.size()));
    node_inputs.push_back(x);
    any_requires_grad = any_requires_grad || x.requires_grad();
  }
  // Autograd records a node only when some input needs a gradient; parameters used inside fn
  // still need it (a frozen embedding feeding checkpointed blocks, say), so give it one. Its
  // gradient is never computed.
  for (const auto& p : options.parameters) {
    LOOM_CHECK(p.defined() && p.is_leaf(),
               "checkpoint: CheckpointOptions::parameters holds leaves (parameters) only");
    any_requires_grad = any_requires_grad || p.requires_grad();
  }
  if (!any_requires_grad) node_inputs.push_back(at::empty({0}).requires_grad_());
  state->parameters = options.parameters;
  node_inputs.insert(node_inputs.end(), options.parameters.begin(), options.parameters.end());
  return CheckpointFunction::apply(at::TensorList(node_inputs), state);
}

}  // namespace loom::parallel::memory
