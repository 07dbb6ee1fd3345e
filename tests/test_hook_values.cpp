// Error feedback carried across layouts (train/hook_values.h): the per-parameter totals follow
// each parameter's copies (tensor-parallel shards and partial sums, context-parallel ranks, a
// tied embedding's pipeline stages), a new layout's copies add up to them again, each built-in
// hook turns its state into values and back, and a layout record that is malformed or
// incomplete is an error naming what.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "loom/core/rng.h"
#include "loom/core/safetensors.h"
#include "loom/dist/local_communicator.h"
#include "loom/parallel/data/comm_hook.h"
#include "loom/parallel/data/grad_bucket.h"
#include "loom/train/checkpoint.h"
#include "loom/train/hook_values.h"
#include "test_util.h"

using loom::testing::contains;
using loom::testing::error_of;
namespace pd = loom::parallel::data;
namespace train = loom::train;
using Spec = loom::parallel::tensor::ShardSpec;

namespace {

// The parameters of the test's model: "w" split along dim 0 (4 rows of 3), "kv" a single unit
// (a key/value head) that tp 2 replicates, with partial gradients, "ln" replicated with partial
// gradients (sequence parallelism), "bias" replicated, "wte" replicated and tied (on the first
// and last pipeline stages).
std::map<std::string, train::HookValueLayout::Param> model_params(int64_t pp_size) {
  std::map<std::string, train::HookValueLayout::Param> out;
  out["w"].spec = Spec{.dim = 0, .full = 4};
  out["kv"].spec = Spec{.dim = 0, .full = 2, .units = 1};
  out["ln"].spec = Spec{.grad_partial = true};
  out["bias"].spec = Spec{};
  out["wte"].spec = Spec{};
  out["wte"].stages = pp_size > 1 ? 2 : 1;
  return out;
}

// One bucket holding `names` back to back, with their shapes at tp `tp_size`.
pd::BucketShape bucket_of(const std::vector<std::string>& names, int64_t tp_size) {
  const std::map<std::string, std::vector<int64_t>> full = {
      {"w", {4, 3}}, {"kv", {2, 3}}, {"ln", {3}}, {"bias", {3}}, {"wte", {5, 2}}};
  pd::BucketShape b;
  for (const auto& name : names) {
    auto shape = full.at(name);
    if (name == "w") shape[0] /= tp_size;
    b.names.push_back(name);
    b.shapes.push_back(shape);
    b.offsets.push_back(b.numel);
    int64_t n = 1;
    for (auto s : shape) n *= s;
    b.numel += n;
  }
  return b;
}

// A layout of tp x cp x pp (dp 1): stage 0 holds w, kv and wte; the last stage ln, bias and wte
// (with pp 1, one stage holds them all, in one bucket).
train::HookValueLayout layout_at(int64_t tp, int64_t tp_size, int64_t cp, int64_t cp_size,
                                 int64_t pp, int64_t pp_size) {
  train::HookValueLayout l;
  l.owner = "data-parallel";
  l.hook = "int8";
  l.tp = tp;
  l.tp_size = tp_size;
  l.cp = cp;
  l.cp_size = cp_size;
  l.pp = pp;
  l.pp_size = pp_size;
  l.params = model_params(pp_size);
  std::vector<std::string> names;
  if (pp_size == 1) {
    names = {"w", "kv", "wte", "ln", "bias"};
  } else {
    names = pp == 0 ? std::vector<std::string>{"w", "kv", "wte"}
                    : std::vector<std::string>{"ln", "bias", "wte"};
  }
  l.chunks = {{bucket_of(names, tp_size)}};
  return l;
}

at::Tensor piece_of(const at::Tensor& values, const pd::BucketShape& b, const std::string& name) {
  for (size_t k = 0; k < b.names.size(); ++k)
    if (b.names[k] == name) {
      int64_t n = 1;
      for (auto s : b.shapes[k]) n *= s;
      return values.narrow(0, b.offsets[k], n).view(b.shapes[k]).to(at::kDouble);
    }
  ADD_FAILURE() << "no " << name;
  return {};
}

}  // namespace

// Old layout tp 2 x cp 2 x pp 2 with random "owed" values (kSum) and "variance" (kRms) per
// group: the totals are, by plain sums over the pieces, w's tp halves (each the sum over cp)
// stacked, kv and ln summed over tp and cp, bias summed over cp and averaged over tp, wte summed
// over cp and the two stages and averaged over tp (the variance: the same on square roots). A
// new layout takes them back: at tp 1 x cp 1 x pp 1 the totals themselves; at tp 2 x cp 2 x pp 2
// each copy a share that adds up to them again.
TEST(HookValues, TotalsFollowEachParametersCopies) {
  const auto hook = pd::make_comm_hook("onebit:momentum=0.9");  // owed kSum, variance kRms
  train::HookValueTotals totals(*hook, {});
  auto gen = at::make_generator<at::CPUGeneratorImpl>(81);
  std::map<std::string, std::map<std::vector<int64_t>, at::Tensor>> owed, root;  // by (tp, cp, pp)
  for (int64_t tp = 0; tp < 2; ++tp)
    for (int64_t cp = 0; cp < 2; ++cp)
      for (int64_t pp = 0; pp < 2; ++pp) {
        const auto l = layout_at(tp, 2, cp, 2, pp, 2);
        const auto& b = l.chunks[0][0];
        const auto o = at::randn({b.numel}, gen);
        const auto v = at::rand({b.numel}, gen);
        totals.add_group(l, {{{"b0/owed", o},
                              {"b0/variance", v},
                              {"variance_steps", at::full({1}, 7, at::kLong)}}});
        for (const auto& name : b.names) {
          owed[name][{tp, cp, pp}] = piece_of(o, b, name);
          root[name][{tp, cp, pp}] = piece_of(v, b, name).sqrt();
        }
      }
  // The expected totals, by hand.
  std::map<std::string, std::map<std::string, at::Tensor>> want;
  for (const auto& [what, pieces] : {std::pair{"owed", &owed}, std::pair{"variance", &root}}) {
    auto& p = *pieces;
    const auto over_cp = [&](const std::string& name, int64_t tp, int64_t pp) {
      return p[name][{tp, 0, pp}] + p[name][{tp, 1, pp}];
    };
    want[what]["w"] = at::cat({over_cp("w", 0, 0), over_cp("w", 1, 0)}, 0);
    want[what]["kv"] = over_cp("kv", 0, 0) + over_cp("kv", 1, 0);
    want[what]["ln"] = over_cp("ln", 0, 1) + over_cp("ln", 1, 1);
    want[what]["bias"] = (over_cp("bias", 0, 1) + over_cp("bias", 1, 1)) / 2;
    want[what]["wte"] = (over_cp("wte", 0, 0) + over_cp("wte", 0, 1) + over_cp("wte", 1, 0) +
                         over_cp("wte", 1, 1)) /
                        2;
  }
  const auto got = totals.totals();
  for (const auto& [what, by_name] : want)
    for (const auto& [name, t] : by_name) {
      SCOPED_TRACE(std::string(what) + " of " + name);
      ASSERT_TRUE(got.at(what).count(name));
      EXPECT_TRUE(at::allclose(got.at(what).at(name), t, 1e-12, 1e-12));
    }

  // One process: the totals (the variance squared back).
  const auto single = layout_at(0, 1, 0, 1, 0, 1);
  const auto values = totals.values_for(single);
  ASSERT_EQ(values.size(), 1u);
  EXPECT_EQ(values[0].at("variance_steps").item<int64_t>(), 7);
  for (const auto& name : single.chunks[0][0].names) {
    SCOPED_TRACE(name);
    const auto& b = single.chunks[0][0];
    EXPECT_TRUE(
        at::allclose(piece_of(values[0].at("b0/owed"), b, name), want["owed"][name], 1e-6, 1e-6));
    EXPECT_TRUE(at::allclose(piece_of(values[0].at("b0/variance"), b, name),
                             want["variance"][name].square(), 1e-6, 1e-6));
  }

  // tp 2 x cp 2 x pp 2 again: every copy's share, summed as the old layout's were, gives the
  // totals back (a fresh HookValueTotals over the new values).
  train::HookValueTotals again(*hook, {});
  for (int64_t tp = 0; tp < 2; ++tp)
    for (int64_t cp = 0; cp < 2; ++cp)
      for (int64_t pp = 0; pp < 2; ++pp) {
        const auto l = layout_at(tp, 2, cp, 2, pp, 2);
        again.add_group(l, totals.values_for(l));
        // A partial replicated parameter's share: a quarter (2 tp x 2 cp copies).
        if (pp == 1) {
          EXPECT_TRUE(
              at::allclose(piece_of(totals.values_for(l)[0].at("b0/owed"), l.chunks[0][0], "ln"),
                           want["owed"]["ln"] / 4, 1e-6, 1e-6));
        }
      }
  const auto back = again.totals();
  for (const auto& [what, by_name] : want)
    for (const auto& [name, t] : by_name) {
      SCOPED_TRACE(std::string(what) + " of " + name + " carried twice");
      EXPECT_TRUE(at::allclose(back.at(what).at(name), t, 1e-5, 1e-6));
    }
}

// A group missing from the old layout (one cp rank's files lost) is an error naming the
// parameter and the pieces; a layout record that is malformed names what is wrong.
TEST(HookValues, AnIncompleteOrMalformedLayoutIsAnError) {
  const auto hook = pd::make_comm_hook("int8");
  train::HookValueTotals totals(*hook, {});
  const auto l = layout_at(0, 1, 0, 2, 0, 1);
  totals.add_group(l, {{{"b0/owed", at::ones({l.chunks[0][0].numel})}}});
  const auto msg = error_of([&] { (void)totals.values_for(layout_at(0, 1, 0, 1, 0, 1)); });
  EXPECT_TRUE(contains(msg, "of parameter")) << msg;
  EXPECT_TRUE(contains(msg, "holds 1 pieces")) << msg;

  const auto text = l.to_json();
  const auto back = train::HookValueLayout::from_json(text, "f");
  EXPECT_EQ(back.to_json(), text);
  EXPECT_EQ(back.params.at("kv").spec.units, 1);
  EXPECT_TRUE(back.params.at("ln").spec.grad_partial);
  // A block shared by layers on several pipeline stages: held by more than two of them.
  auto shared = l;
  shared.params.at("w").stages = 4;
  EXPECT_EQ(train::HookValueLayout::from_json(shared.to_json(), "s").params.at("w").stages, 4);

  auto wrong = text;
  wrong.replace(wrong.find("\"cp\":0"), 6, "\"cp\":5");
  auto m = error_of([&] { train::HookValueLayout::from_json(wrong, "f.safetensors"); });
  EXPECT_TRUE(contains(m, "f.safetensors") && contains(m, "cp")) << m;
  m = error_of([&] { train::HookValueLayout::from_json("{\"owner\":", "g"); });
  EXPECT_TRUE(contains(m, "not valid JSON")) << m;
  auto unspecified = l;
  unspecified.params.erase("ln");
  m = error_of([&] { train::HookValueLayout::from_json(unspecified.to_json(), "h"); });
  EXPECT_TRUE(contains(m, "no spec for 'ln'")) << m;
  // A value that does not fit its bucket.
  train::HookValueTotals short_values(*hook, {});
  m = error_of([&] { short_values.add_group(l, {{{"b0/owed", at::ones({3})}}}); });
  EXPECT_TRUE(contains(m, "b0/owed")) << m;
}

// Each built-in hook's state as values and back: int8 (an error and the server segments joined,
// over 2 ranks; the reduce-scatter's error with each shard's block padding), topk (its error),
// powersgd (the matrices' errors at their places in the bucket), the momentum compression
// (momentum and variance beside the named hook's). Taken back, the owed value is each rank's
// error (the server error zero), laid out for the new buckets.
TEST(HookValues, EachHookTurnsItsStateIntoValuesAndBack) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(82);
  {
    const auto int8 = pd::make_comm_hook("int8");
    pd::BucketShape b;
    b.names = {"p"};
    b.shapes = {{300}};
    b.offsets = {0};
    b.numel = 300;
    const auto error = at::randn({512}, gen), server = at::randn({512}, gen);
    auto v = int8->group_values({{"b0/error", error}, {"b0/server_error", server}}, {{0, b}});
    EXPECT_TRUE(at::allclose(v.at("b0/owed"), (error + server).narrow(0, 0, 300)));
    const auto scattered = at::randn({512}, gen);
    v = int8->group_values(
        {{"b0/scatter_error", scattered}, {"b0/scatter_shard", at::scalar_tensor(150, at::kLong)}},
        {{0, b}});
    EXPECT_TRUE(at::allclose(
        v.at("b0/owed"), at::cat({scattered.narrow(0, 0, 150), scattered.narrow(0, 256, 150)})));
    // Back, for a bucket of 300 at rank 1 of 2 (segments of 256) and as ZeRO shards of 150.
    int8->load_group_values(v, false);
    int8->lay_out_resharded(0, 300, 1, 2);
    auto state = int8->state();
    EXPECT_TRUE(at::allclose(state.at("b0/error").narrow(0, 0, 300), v.at("b0/owed")));
    EXPECT_EQ(state.at("b0/error").narrow(0, 300, 212).abs().max().item<float>(), 0.0f);
    EXPECT_EQ(state.at("b0/server_error").abs().max().item<float>(), 0.0f);
    int8->load_group_values(v, true);
    int8->lay_out_resharded(0, 300, 0, 2);
    state = int8->state();
    ASSERT_TRUE(state.count("b0/scatter_error"));
    EXPECT_FALSE(state.count("b0/error"));
  }
  {
    const auto topk = pd::make_comm_hook("topk:ratio=0.1");
    pd::BucketShape b;
    b.names = {"p"};
    b.shapes = {{100}};
    b.offsets = {0};
    b.numel = 100;
    const auto error = at::randn({100}, gen);
    const auto v = topk->group_values({{"b0/error", error},
                                       {"b0/steps", at::scalar_tensor(3, at::kLong)},
                                       {"b0/threshold", at::scalar_tensor(0.5, at::kDouble)}},
                                      {{0, b}});
    EXPECT_TRUE(at::allclose(v.at("b0/owed"), error));
    topk->load_group_values(v, false);
    topk->lay_out_resharded(0, 128, 0, 1);  // a padded whole bucket
    const auto state = topk->state();
    EXPECT_TRUE(at::allclose(state.at("b0/error").narrow(0, 0, 100), error));
    EXPECT_EQ(state.at("b0/steps").item<int64_t>(), 0);  // thresholds found afresh
  }
  {
    const auto powersgd = pd::make_comm_hook("powersgd:rank=2");
    pd::BucketShape b;
    b.names = {"m", "v"};
    b.shapes = {{60, 40}, {600}};
    b.offsets = {0, 2400};
    b.numel = 3000;
    const auto error = at::randn({2400}, gen);
    const auto v =
        powersgd->group_values({{"b0/error", error}, {"b0/q", at::randn({200}, gen)}}, {{0, b}});
    EXPECT_TRUE(at::allclose(v.at("b0/owed").narrow(0, 0, 2400), error));
    EXPECT_EQ(v.at("b0/owed").narrow(0, 2400, 600).abs().max().item<float>(), 0.0f);
    powersgd->load_group_values(v, false);
    EXPECT_TRUE(at::allclose(powersgd->state().at("b0/pending_owed"), v.at("b0/owed")));
  }
  {
    const auto momentum = pd::make_comm_hook("int8:momentum=0.9");
    EXPECT_EQ(momentum->value_rule("variance"), pd::CommHook::ValueRule::kRms);
    EXPECT_EQ(momentum->value_rule("owed"), pd::CommHook::ValueRule::kSum);
    pd::BucketShape b;
    b.names = {"p"};
    b.shapes = {{300}};
    b.offsets = {0};
    b.numel = 300;
    const auto m = at::randn({512}, gen), var = at::rand({512}, gen);
    const auto v = momentum->group_values({{"b0/error", at::zeros({512})},
                                           {"b0/server_error", at::zeros({512})},
                                           {"b0/momentum", m},
                                           {"b0/variance", var},
                                           {"b0/variance_steps", at::full({1}, 9, at::kLong)}},
                                          {{0, b}});
    EXPECT_TRUE(at::allclose(v.at("b0/momentum"), m.narrow(0, 0, 300)));
    EXPECT_TRUE(at::allclose(v.at("b0/variance"), var.narrow(0, 0, 300)));
    EXPECT_EQ(v.at("variance_steps").item<int64_t>(), 9);
    momentum->load_group_values(v, true);
    momentum->lay_out_resharded(0, 320, 0, 2);
    const auto state = momentum->state();
    EXPECT_TRUE(at::allclose(state.at("b0/momentum").narrow(0, 0, 300), m.narrow(0, 0, 300)));
    EXPECT_EQ(state.at("b0/variance_steps").item<int64_t>(), 9);
    EXPECT_TRUE(state.count("b0/error"));  // the named hook's, whole-bucket under ZeRO too
  }
}

namespace {

// A user's hook that carries state without saying how it maps onto parameter values.
class KeepsItsOwnState : public pd::CommHook {
 public:
  std::string name() const override { return "kept"; }
  loom::dist::WorkPtr start(pd::GradBucket&, loom::dist::Communicator&) override { return {}; }
  bool carries_state() const override { return true; }
  std::map<std::string, at::Tensor> state() const override { return {{"b0/mine", at::ones({3})}}; }
};

}  // namespace

// Reading a checkpoint's hook state for another layout: a file saved for another --comm-hook, and
// a hook whose state has no per-value form (the default group_values), are errors naming them,
// not a silent restart reported as carried.
TEST(HookValues, AHookThatCannotCarryItsStateSaysSo) {
  loom::testing::TempDir dir;
  const KeepsItsOwnState hook;
  auto layout = layout_at(0, 1, 0, 1, 0, 1);
  layout.hook = "kept";
  loom::core::save_safetensors(dir.path() / "rank-state-0-of-1.safetensors",
                               {{"data-parallel/c0/b0/mine", at::ones({3})}},
                               {{train::kHookValueLayoutKey, layout.to_json()}});
  train::CheckpointContents checkpoint;
  checkpoint.dir = dir.path();
  checkpoint.state["rank_state_files"] = {"rank-state-0-of-1.safetensors"};
  auto m = error_of([&] { (void)train::read_hook_values(checkpoint, hook, "int8"); });
  EXPECT_TRUE(contains(m, "--comm-hook kept") && contains(m, "this run uses int8")) << m;
  m = error_of([&] { (void)train::read_hook_values(checkpoint, hook, "kept"); });
  EXPECT_TRUE(contains(m, "does not say how its state maps")) << m;
}

// PowerSGD's owed value from another layout waits as pending_owed (saved and restored as such)
// and joins the next reduction once: on one rank the first reduction of a zero gradient delivers
// the owed values sent as they are (the vector) exactly and leaves the matrix's owed in its error
// (what it did not deliver of it), and the second delivers nothing more of the vector.
TEST(HookValues, PowerSgdAddsWhatIsOwedToTheNextReductionOnce) {
  auto gen = loom::core::make_generator(83);
  const auto hook = pd::make_comm_hook("powersgd:rank=2");
  pd::GradBucket bucket;
  bucket.index = 0;
  bucket.params = {at::zeros({60, 40}), at::zeros({600})};
  bucket.names = {"m", "v"};
  bucket.offsets = {0, 2400};
  bucket.buffer = at::zeros({3000});
  const auto owed = at::randn({3000}, gen);
  hook->load_group_values({{"b0/owed", owed}}, false);
  // Through a checkpoint before the reduction.
  const auto saved = hook->state();
  ASSERT_TRUE(saved.count("b0/pending_owed"));
  hook->load_state(saved);
  loom::dist::LocalCommunicator one;
  auto reduce = [&] {
    bucket.buffer.zero_();
    hook->start(bucket, one)->wait();
    hook->finish(bucket, one);
    return bucket.buffer.clone();
  };
  const auto first = reduce();
  EXPECT_TRUE(at::allclose(first.narrow(0, 2400, 600), owed.narrow(0, 2400, 600), 0, 0));
  const auto state = hook->state();
  EXPECT_FALSE(state.count("b0/pending_owed"));
  // The matrix: what was delivered plus what is still carried is what was owed.
  EXPECT_TRUE(at::allclose(first.narrow(0, 0, 2400) + state.at("b0/error"), owed.narrow(0, 0, 2400),
                           1e-5, 1e-5));
  const auto second = reduce();
  EXPECT_EQ(second.narrow(0, 2400, 600).abs().max().item<float>(), 0.0f);
}
