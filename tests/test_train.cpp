#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "loom/core/files.h"
#include "loom/core/memory.h"
#include "loom/core/rng.h"
#include "loom/core/safetensors.h"
#include "loom/data/sampler.h"
#include "loom/data/token_shard.h"
#include "loom/data/tokenizer.h"
#include "loom/dist/local_communicator.h"
#include "loom/dist/watchdog.h"
#include "loom/models/causal_lm.h"
#include "loom/ops/cuda.h"
#include "loom/parallel/zero/zero_optimizer.h"
#include "loom/train/checkpoint.h"
#include "loom/train/grad_clip.h"
#include "loom/train/lr_schedule.h"
#include "loom/train/optimizer.h"
#include "loom/train/trainer.h"
#include "test_util.h"

using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::TempDir;
using loom::testing::write_corpus_data;
namespace train = loom::train;
namespace fs = std::filesystem;

namespace {

train::TrainConfig small_config(const fs::path& data_dir) {
  train::TrainConfig c;
  c.model = "gpt2";
  c.preset = "gpt2-tiny";
  c.data = (data_dir / "train.bin").string();
  c.val_data = (data_dir / "val.bin").string();
  c.seq_len = 32;
  c.batch_size = 8;
  c.steps = 6;
  c.lr = 3e-3;
  c.warmup_steps = 2;
  c.log_every = 1000;
  c.eval_batches = 2;
  return c;
}

std::map<std::string, at::Tensor> params_of(train::Trainer& t) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : t.model().named_parameters())
    out[item.key()] = item.value().detach().clone();
  return out;
}

std::vector<nlohmann::json> read_metrics(const fs::path& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

}  // namespace

TEST(LrSchedule, WarmsUpLinearlyThenFollowsCosineToMinimum) {
  train::LrSchedule s{.max_lr = 1.0, .min_lr = 0.1, .warmup_steps = 4, .total_steps = 14};
  EXPECT_DOUBLE_EQ(s.at(0), 0.25);
  EXPECT_DOUBLE_EQ(s.at(3), 1.0);
  EXPECT_DOUBLE_EQ(s.at(4), 1.0);
  EXPECT_NEAR(s.at(9), 0.55, 1e-12);  // halfway through the decay
  EXPECT_DOUBLE_EQ(s.at(14), 0.1);
  EXPECT_DOUBLE_EQ(s.at(100), 0.1);
  train::LrSchedule bad{.max_lr = 1.0, .min_lr = 2.0};
  EXPECT_TRUE(contains(error_of([&] { bad.validate(); }), "min lr 2"));
}

TEST(TrainConfig, JsonRoundTripsAndOlderFilesKeepDefaults) {
  train::TrainConfig c;
  c.seed = 7;
  c.lr_decay_steps = 123;
  c.precision = "bf16";
  c.data = "x.bin";
  const auto j = c.to_json();
  EXPECT_EQ(train::TrainConfig::from_json(j).to_json(), j);
  auto older = j;
  older.erase("lr_decay_steps");
  EXPECT_EQ(train::TrainConfig::from_json(older).lr_decay_steps, 0);
  older["seed"] = "seven";
  EXPECT_TRUE(contains(error_of([&] { train::TrainConfig::from_json(older); }),
                       "training config.seed is \"seven\": it must be a non-negative integer"));
}

// A float, or an integer out of the field's range, in an integer field is refused by name: the
// plain conversion would be undefined behaviour (1e300 to int64) or a silent truncation.
TEST(TrainConfig, JsonIntegerFieldsTakeOnlyIntegers) {
  const auto j = train::TrainConfig{}.to_json();
  const std::pair<const char*, nlohmann::json> bad[] = {
      {"steps", 1e300},     {"steps", 2.5},          {"seed", -1}, {"tp", 9223372036854775808ULL},
      {"batch_size", "16"}, {"sequence_parallel", 1}};
  for (const auto& [key, value] : bad) {
    auto k = j;
    k[key] = value;
    const auto msg = error_of([&] { train::TrainConfig::from_json(k); });
    EXPECT_TRUE(contains(msg, std::string("training config.") + key) && contains(msg, value.dump()))
        << key << " = " << value.dump() << ": " << msg;
  }
  auto k = j;
  k["lr"] = 1;  // an integer is a fine float
  EXPECT_DOUBLE_EQ(train::TrainConfig::from_json(k).lr, 1.0);
}

TEST(AdamW, MatchesTheAlgorithmStepByStep) {
  auto w = at::tensor({1.0f, -2.0f, 0.5f, 3.0f}).view({2, 2}).requires_grad_();
  auto bias = at::tensor({0.3f, -0.1f}).requires_grad_();
  train::AdamWOptions o{.beta1 = 0.8, .beta2 = 0.9, .eps = 1e-8, .weight_decay = 0.5};
  train::AdamW opt({{"layer.weight", w}, {"layer.bias", bias}}, o);
  EXPECT_EQ(opt.num_decayed(), 1);
  EXPECT_EQ(opt.num_not_decayed(), 1);
  std::vector<double> p{1.0, -2.0, 0.5, 3.0}, m(4, 0), v(4, 0);
  const std::vector<std::vector<double>> grads{{0.1, -0.2, 0.3, 0.0}, {-0.5, 0.25, 1.0, 2.0}};
  const double lr = 0.01;
  for (int step = 1; step <= 2; ++step) {
    w.mutable_grad() =
        at::tensor(std::vector<float>(grads[step - 1].begin(), grads[step - 1].end())).view({2, 2});
    opt.step(lr);
    for (int i = 0; i < 4; ++i) {
      const double g = grads[step - 1][i];
      p[i] *= 1 - lr * 0.5;
      m[i] = 0.8 * m[i] + 0.2 * g;
      v[i] = 0.9 * v[i] + 0.1 * g * g;
      const double mh = m[i] / (1 - std::pow(0.8, step)), vh = v[i] / (1 - std::pow(0.9, step));
      p[i] -= lr * mh / (std::sqrt(vh) + 1e-8);
    }
    auto flat = w.detach().view({-1});
    for (int i = 0; i < 4; ++i) EXPECT_NEAR(flat[i].item<double>(), p[i], 1e-6) << step << " " << i;
  }
  EXPECT_TRUE(at::equal(bias, at::tensor({0.3f, -0.1f})));  // no gradient: untouched
}

TEST(AdamW, DefaultGroupsSkipNormsBiasesAndEmbeddings) {
  EXPECT_TRUE(train::default_decays("transformer.h.0.attn.c_attn.weight", at::zeros({4, 4})));
  EXPECT_TRUE(train::default_decays("lm_head.weight", at::zeros({4, 4})));
  EXPECT_FALSE(train::default_decays("transformer.wte.weight", at::zeros({4, 4})));
  EXPECT_FALSE(train::default_decays("model.embed_tokens.weight", at::zeros({4, 4})));
  EXPECT_FALSE(train::default_decays("transformer.h.0.ln_1.weight", at::zeros({4})));
  EXPECT_FALSE(train::default_decays("transformer.h.0.attn.c_attn.bias", at::zeros({4})));
}

TEST(AdamW, Bf16ParametersKeepFp32MasterWeights) {
  // 1 + 1e-3 is not representable in bf16 (spacing 2^-7 near 1): without a master copy, each
  // small update would round away and the parameter would never move.
  auto p = at::ones({8}, at::kBFloat16).requires_grad_();
  train::AdamW opt({{"w", p}}, {.weight_decay = 0});
  for (int i = 0; i < 20; ++i) {
    p.mutable_grad() = at::full({8}, -1.0, at::kBFloat16);
    opt.step(1e-3);
  }
  auto state = opt.state();
  const auto master =
      std::find_if(state.begin(), state.end(), [](auto& kv) { return kv.first == "w.master"; });
  ASSERT_NE(master, state.end());
  EXPECT_EQ(master->second.scalar_type(), at::kFloat);
  EXPECT_NEAR(master->second[0].item<double>(), 1.02, 1e-4);
  EXPECT_TRUE(at::equal(p.detach(), master->second.to(at::kBFloat16)));
}

TEST(GradClip, ComputesGlobalNormAndScales) {
  auto a = at::zeros({2}).requires_grad_(), b = at::zeros({1}).requires_grad_();
  a.mutable_grad() = at::tensor({3.0f, 0.0f});
  b.mutable_grad() = at::tensor({4.0f});
  EXPECT_NEAR(train::clip_grad_norm({a, b}, 0), 5.0, 1e-6);  // 0: report only
  EXPECT_FLOAT_EQ(a.grad()[0].item<float>(), 3.0f);
  EXPECT_NEAR(train::clip_grad_norm({a, b}, 1.0), 5.0, 1e-6);
  EXPECT_NEAR(a.grad()[0].item<float>(), 0.6, 1e-6);
  EXPECT_NEAR(b.grad()[0].item<float>(), 0.8, 1e-6);
}

TEST(Training, OverfitsASingleBatchToNearZeroLoss) {
  auto c = loom::models::ModelConfig::preset("llama-tiny");
  c.vocab_size = 64;
  c.d_model = 64;
  c.n_layers = 2;
  auto m = loom::models::make_model(c);
  loom::models::init_parameters(*m, 3);
  loom::core::NamedTensors named;
  for (const auto& item : m->named_parameters()) named.emplace_back(item.key(), item.value());
  train::AdamW opt(named, {.weight_decay = 0});
  auto tokens = at::randint(0, 64, {4, 33}, loom::core::make_generator(1));
  auto inputs = tokens.slice(1, 0, 32);
  auto targets = tokens.slice(1, 1);
  double loss = 0;
  for (int step = 0; step < 200; ++step) {
    auto l = loom::models::next_token_loss(m->forward(inputs), targets);
    l.backward();
    opt.step(3e-3);
    opt.zero_grad();
    loss = l.item<double>();
  }
  EXPECT_LT(loss, 0.05) << "random tokens start at ln(64) = 4.16";
}

// A vocabulary past uint16 (Llama 3's kind): the data as llm.c version 2 shards of uint32 ids,
// which the Trainer reads and checks against the model's vocabulary. Tokens repeat a short
// cycle of ids above 65,535, so a model that reads them right learns it within a few steps; one
// that read them as uint16 would see other ids. A vocabulary below the largest id is refused.
TEST(Training, TrainsOnVersion2ShardsOfIdsAboveUint16) {
  TempDir dir;
  constexpr int64_t kVocab = 70000;
  std::vector<int32_t> ids(4000);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(65530 + (i % 7) * 700);
  loom::data::write_llmc_shard(dir / "train.bin", ids, kVocab);
  loom::data::write_llmc_shard(dir / "val.bin", std::span(ids).first(600), kVocab);
  ASSERT_EQ(loom::data::TokenShard(dir / "train.bin").version(), 2);
  auto c = small_config(dir.path());
  c.vocab_size = kVocab;
  c.steps = 20;
  c.lr = 1e-2;
  train::Trainer t(c);
  const double initial = t.evaluate(2);
  EXPECT_NEAR(initial, std::log(double(kVocab)), 0.5);
  t.fit();
  const double final_val = t.evaluate(2);
  std::printf("version 2 shard, vocab %lld: validation loss %.3f -> %.3f\n",
              static_cast<long long>(kVocab), initial, final_val);
  // Knowing only which 7 ids occur gives ln 7 = 1.95; below it the model predicts each id from
  // the one before, which it can only do if it reads them right (measured 1.29 after 20 steps).
  EXPECT_LT(final_val, 0.8 * std::log(7.0)) << "initial " << initial;
  c.vocab_size = 65536;  // ids from 65530 + 700 = 66230 on are outside
  const auto msg = loom::testing::error_of([&] { train::Trainer bad(c); });
  EXPECT_TRUE(loom::testing::contains(msg, "holds token id 66230 at position 1")) << msg;
}

// Learning on real text: after a bounded number of steps the validation loss (held-out text)
// must be below the conditional entropy of a byte given the previous byte, measured on the
// training text itself. A model can only get there by using more context than one byte.
TEST(Training, LossOnShippedCorpusFallsBelowBigramEntropy) {
  TempDir dir;
  write_corpus_data(dir.path(), 1 << 20, 1 << 16);
  loom::data::TokenShard shard(dir / "train.bin");
  std::vector<double> uni(256, 0), bi(256 * 256, 0);
  for (int64_t i = 0; i + 1 < shard.size(); ++i) {
    uni[shard.token(i)] += 1;
    bi[shard.token(i) * 256 + shard.token(i + 1)] += 1;
  }
  double bigram_entropy = 0;
  const double n = static_cast<double>(shard.size() - 1);
  for (int a = 0; a < 256; ++a)
    for (int b = 0; b < 256; ++b)
      if (bi[a * 256 + b] > 0)
        bigram_entropy -= bi[a * 256 + b] / n * std::log(bi[a * 256 + b] / uni[a]);
  ASSERT_NEAR(bigram_entropy, 2.3, 0.1);  // English bytes: about 2.3 nats

  auto c = small_config(dir.path());
  c.seq_len = 64;
  c.batch_size = 16;
  c.steps = 300;
  c.lr = 3e-3;
  c.min_lr = 3e-4;
  c.warmup_steps = 20;
  c.eval_batches = 16;
  train::Trainer t(c);
  const double initial = t.evaluate(c.eval_batches);
  EXPECT_NEAR(initial, std::log(256.0), 0.1);
  t.fit();
  const double final_val = t.evaluate(c.eval_batches);
  EXPECT_LT(final_val, bigram_entropy) << "initial " << initial;
}

// Splitting a batch into micro-batches gives the full batch's gradient: each sample sees the
// same window, and each micro-batch's loss is weighted by its share.
TEST(Training, GradientAccumulationEqualsTheFullBatch) {
  TempDir dir;
  write_corpus_data(dir.path(), 50000, 5000);
  auto shard = std::make_shared<loom::data::TokenShard>(dir / "train.bin");
  loom::data::WindowSampler sampler(shard, 32, 7);
  auto c = loom::models::ModelConfig::preset("gpt2-tiny");
  c.vocab_size = 256;
  auto m = loom::models::make_model(c);
  m->to(at::kDouble);  // fp64: the accumulated sum differs from the batch's by ~1e-15
  loom::models::init_parameters(*m, 1);
  auto full = sampler.training_batch(0, 0, 8);
  loom::models::next_token_loss(m->forward(full.inputs), full.targets).backward();
  std::map<std::string, at::Tensor> full_grads;
  for (auto& p : m->named_parameters()) {
    full_grads[p.key()] = p.value().grad().clone();
    p.value().mutable_grad() = at::Tensor();
  }
  for (int k = 0; k < 4; ++k) {
    auto micro = sampler.training_batch(0, 2 * k, 2);
    (loom::models::next_token_loss(m->forward(micro.inputs), micro.targets) / 4.0).backward();
  }
  for (auto& p : m->named_parameters()) {
    const auto& g = full_grads[p.key()];
    const double rel = ((p.value().grad() - g).abs().max() / g.abs().max()).item<double>();
    EXPECT_LT(rel, 1e-12) << p.key();
  }

  // Through the Trainer in fp64: the loss of every step and every parameter match to 1e-9
  // relative (the bound of the multi-rank equivalence tests, derived in docs/testing.md; in
  // fp32, Adam's steps of about lr * sign(g) let gradients that are zero up to rounding move
  // either way, which is why these comparisons run in fp64).
  auto tc = small_config(dir.path());
  tc.precision = "fp64";
  tc.steps = 4;
  train::Trainer whole(tc);
  tc.grad_accum = 4;
  train::Trainer accumulated(tc);
  for (int step = 0; step < 4; ++step) {
    const double a = whole.train_step().loss, b = accumulated.train_step().loss;
    EXPECT_NEAR(a, b, 1e-9 * a) << "step " << step;
  }
  const auto want = whole.gather_parameters(), got = accumulated.gather_parameters();
  for (const auto& [name, p] : want) {
    EXPECT_EQ(p.scalar_type(), at::kDouble) << name;
    auto want_p = p, got_p = got.at(name);
    if (name.ends_with("attn.c_attn.bias")) {
      // Its key third has a true gradient of zero and gets pure rounding noise (docs/testing.md):
      // held to an absolute bound; the query and value thirds are compared like the rest.
      const auto third = p.size(0) / 3;
      EXPECT_LE((got_p - want_p).narrow(0, third, third).abs().max().item<double>(), 1e-6) << name;
      want_p = at::cat({p.narrow(0, 0, third), p.narrow(0, 2 * third, third)});
      got_p = at::cat({got_p.narrow(0, 0, third), got_p.narrow(0, 2 * third, third)});
    }
    const double rel = ((got_p - want_p).norm() / want_p.norm()).item<double>();
    EXPECT_LE(rel, 1e-9) << name;
  }
}

// --precision fp64 is fp64 end to end: a rounding to fp32 that a layout and one process both
// made would be invisible to the equivalence tests, so the dtypes themselves are checked: every
// parameter, the loss, and every floating tensor of the checkpoint (parameters, AdamW moments)
// are fp64, and a model loaded from that checkpoint is fp64 too.
TEST(Training, Fp64RunsAreFp64EndToEnd) {
  TempDir dir;
  write_corpus_data(dir.path(), 50000, 5000);
  auto c = small_config(dir.path());
  c.precision = "fp64";
  c.steps = 2;
  c.save_dir = (dir / "ckpt").string();
  train::Trainer t(c);
  const auto first = t.train_step();
  EXPECT_TRUE(std::isfinite(first.loss));
  t.fit();
  for (const auto& item : t.model().named_parameters())
    EXPECT_EQ(item.value().scalar_type(), at::kDouble) << item.key();
  int64_t checked = 0;
  for (const auto& file : fs::directory_iterator(dir / "ckpt" / "step-00000002")) {
    if (file.path().extension() != ".safetensors") continue;
    for (const auto& [name, tensor] : loom::core::load_safetensors(file.path()).tensors) {
      if (!at::isFloatingType(tensor.scalar_type())) continue;
      EXPECT_EQ(tensor.scalar_type(), at::kDouble) << file.path().filename() << ": " << name;
      ++checked;
    }
  }
  EXPECT_GT(checked, 3 * 40);  // parameters and both moments of each
  const auto loaded = train::load_model_from_checkpoint(dir / "ckpt");
  for (const auto& item : loaded->named_parameters())
    EXPECT_EQ(item.value().scalar_type(), at::kDouble) << item.key();
}

// bf16: parameters stay fp32 (the master weights), the computation runs in bf16 (so the loss
// differs from the fp32 run's in the low digits), and the model learns.
TEST(Training, Bf16TrainingLearnsWithFp32Masters) {
  TempDir dir;
  write_corpus_data(dir.path(), 50000, 5000);
  auto c = small_config(dir.path());
  c.steps = 30;
  train::Trainer fp32(c);
  c.precision = "bf16";
  train::Trainer t(c);
  EXPECT_EQ(t.model().parameters().front().scalar_type(), at::kFloat);
  const double before = t.evaluate(2), reference_before = fp32.evaluate(2);
  EXPECT_NE(before, reference_before);
  EXPECT_NEAR(before, reference_before, 0.05);
  const double first = t.train_step().loss, reference = fp32.train_step().loss;
  EXPECT_NE(first, reference);
  EXPECT_NEAR(first, reference, 0.05);
  t.fit();
  EXPECT_LT(t.evaluate(2), before - 1.0);
}

struct ResumeCase {
  std::string name, model, preset, precision;
  int64_t grad_accum;
  double dropout;  // > 0: a resume must apply the same dropout masks
};

class Resume : public ::testing::TestWithParam<ResumeCase> {};

// A run interrupted after a checkpoint (and after more steps that are lost, as in a crash) and
// resumed ends with the same parameters, bit for bit, and the same metrics file, as a run that
// never stopped.
TEST_P(Resume, ContinuesTheLossCurveBitForBit) {
  const auto& rc = GetParam();
  TempDir dir;
  write_corpus_data(dir.path(), 50000, 5000);
  auto c = small_config(dir.path());
  c.model = rc.model;
  c.preset = rc.preset;
  c.precision = rc.precision;
  c.grad_accum = rc.grad_accum;
  c.dropout = rc.dropout;
  c.steps = 8;
  c.eval_every = 3;
  c.metrics_out = (dir / "straight.jsonl").string();
  train::Trainer straight(c);
  straight.fit();
  const auto expected = params_of(straight);

  c.metrics_out = (dir / "resumed.jsonl").string();
  c.save_dir = (dir / "ckpt").string();
  c.save_every = 5;
  c.lr_decay_steps = 8;
  c.steps = 6;  // the "crash": one step after the checkpoint at 5, then the process is gone
  { train::Trainer(c).fit(); }
  EXPECT_EQ(read_metrics(dir / "resumed.jsonl").size(), 6u);
  c.steps = 8;
  c.resume = c.save_dir;
  // The crashed run saved step 6 at its end; resume from the checkpoint at 5 explicitly.
  c.resume = (dir / "ckpt" / "step-00000005").string();
  train::Trainer resumed(c);
  EXPECT_EQ(resumed.step(), 5);
  resumed.fit();
  const auto got = params_of(resumed);
  for (const auto& [name, p] : expected) EXPECT_TRUE(at::equal(p, got.at(name))) << name;

  const auto a = read_metrics(dir / "straight.jsonl");
  const auto b = read_metrics(dir / "resumed.jsonl");
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u);  // step 6 of the first run was dropped, then written again
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(b[i]["step"], a[i]["step"]);
    EXPECT_EQ(b[i]["loss"].get<double>(), a[i]["loss"].get<double>()) << "step " << i + 1;
    EXPECT_EQ(b[i].contains("val_loss"), a[i].contains("val_loss"));
    if (a[i].contains("val_loss")) {
      EXPECT_EQ(b[i]["val_loss"], a[i]["val_loss"]);
    }
  }
  for (const char* key : {"step", "loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s"})
    EXPECT_TRUE(a[0].contains(key)) << key;
  // elapsed_s counts the whole run's time: it keeps growing across the resume.
  for (size_t i = 1; i < b.size(); ++i)
    EXPECT_GE(b[i]["elapsed_s"].get<double>(), b[i - 1]["elapsed_s"].get<double>()) << i;
}

INSTANTIATE_TEST_SUITE_P(
    Training, Resume,
    ::testing::Values(ResumeCase{"llama_fp32", "llama", "llama-tiny", "fp32", 1, 0.0},
                      ResumeCase{"gpt2_bf16_accum2_dropout", "gpt2", "gpt2-tiny", "bf16", 2, 0.1},
                      ResumeCase{"gpt2_fp64", "gpt2", "gpt2-tiny", "fp64", 1, 0.0}),
    [](const auto& info) { return info.param.name; });

// --async-save: the files come from copies taken when the save began, so every checkpoint
// equals the one a synchronous save writes at that step, although training went on while it was
// written; fit() returns with the last one complete. A save while a background write is in
// flight waits for it (save_checkpoint after fit, the every-step saves here).
TEST(Training, AsyncSavesWriteWhatSyncSavesWrite) {
  TempDir dir;
  write_corpus_data(dir.path(), 50000, 5000);
  auto c = small_config(dir.path());
  c.save_every = 1;  // each save finds the previous one's write in flight or just done
  c.keep_checkpoints = 0;
  c.save_dir = (dir / "sync").string();
  { train::Trainer(c).fit(); }
  c.save_dir = (dir / "async").string();
  c.async_save = true;
  {
    train::Trainer t(c);
    t.fit();
    // fit waited for the last write.
    EXPECT_EQ(train::latest_checkpoint(c.save_dir)->filename(), "step-00000006");
  }
  for (int step = 1; step <= c.steps; ++step) {
    const auto name = fmt::format("step-{:08d}", step);
    auto a = train::load_checkpoint(dir / "sync" / name);
    auto b = train::load_checkpoint(dir / "async" / name);
    EXPECT_EQ(a.step, step);
    EXPECT_EQ(b.step, step);
    ASSERT_EQ(a.model.size(), b.model.size()) << name;
    ASSERT_EQ(a.optimizer.size(), b.optimizer.size()) << name;
    for (const auto& [key, t] : a.model) EXPECT_TRUE(at::equal(t, b.model.at(key))) << name << key;
    for (const auto& [key, t] : a.optimizer)
      EXPECT_TRUE(at::equal(t, b.optimizer.at(key))) << name << key;
  }
  // The copies: parameters changed in place right after a background save began (while its
  // thread is starting to write) must not reach the file.
  auto one = c;
  one.save_dir = (dir / "changed").string();
  one.steps = 1;
  train::Trainer t(one);
  t.fit();
  const auto before = params_of(t);
  t.save_checkpoint(/*in_background=*/true);  // step 1 again: replaces fit's
  {
    torch::NoGradGuard no_grad;
    for (auto& item : t.model().named_parameters()) item.value().add_(1.0);
  }
  t.wait_for_checkpoint();
  const auto saved = train::load_checkpoint(dir / "changed" / "step-00000001");
  for (const auto& [name, p] : before)
    EXPECT_TRUE(at::equal(p, saved.model.at(name))) << name << " changed on its way to the file";
}

TEST(Training, ResumeRefusesChangesThatBreakExactness) {
  TempDir dir;
  write_corpus_data(dir.path(), 50000, 5000);
  auto c = small_config(dir.path());
  c.steps = 2;
  c.save_dir = (dir / "ckpt").string();
  { train::Trainer(c).fit(); }
  // Starting afresh into a directory with checkpoints would mix two runs.
  auto msg = error_of([&] { train::Trainer t(c); });
  EXPECT_TRUE(contains(msg, "already holds checkpoints")) << msg;
  c.resume = c.save_dir;
  auto changed = c;
  changed.lr = 1e-3;
  msg = error_of([&] { train::Trainer t(changed); });
  EXPECT_TRUE(contains(msg, "--lr was 0.003")) << msg;
  changed = c;
  changed.steps = 4;  // a longer cosine: a different schedule from step 0 on
  msg = error_of([&] { train::Trainer t(changed); });
  EXPECT_TRUE(contains(msg, "--lr-decay-steps 2")) << msg;
  changed.lr_decay_steps = 2;  // same schedule, extended run: allowed
  train::Trainer extended(changed);
  EXPECT_EQ(extended.step(), 2);
}

TEST(Training, NonFiniteGradientsStopBeforeTheUpdate) {
  TempDir dir;
  write_corpus_data(dir.path(), 50000, 5000);
  auto c = small_config(dir.path());
  c.lr = 1e30;  // the first update blows the weights up; the next gradients are not finite
  c.warmup_steps = 0;
  c.grad_clip = 0;
  train::Trainer t(c);
  t.train_step();
  const auto before = params_of(t);
  const auto msg = error_of([&] { t.train_step(); });
  EXPECT_TRUE(contains(msg, "gradient norm is")) << msg;
  const auto after = params_of(t);
  for (const auto& [name, p] : before) EXPECT_TRUE(at::equal(p, after.at(name))) << name;
}

TEST(Checkpoint, CorruptOrMissingFilesAreDetected) {
  TempDir dir;
  const auto model = loom::core::NamedTensors{{"w", at::randn({64})}};
  const auto opt = loom::core::NamedTensors{{"step", at::tensor(int64_t{3})}};
  auto ckpt = train::save_checkpoint(dir.path(), 3, model, opt, {{"k", 1}});
  EXPECT_EQ(train::load_checkpoint(dir.path()).step, 3);
  {
    std::fstream f(ckpt / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-3, std::ios::end);
    const char byte = static_cast<char>(f.get());
    f.seekp(-3, std::ios::end);
    f.put(static_cast<char>(~byte));  // always a different byte
  }
  auto msg = error_of([&] { train::load_checkpoint(dir.path()); });
  EXPECT_TRUE(contains(msg, "corrupt") && contains(msg, "model.safetensors")) << msg;
  fs::remove(ckpt / "model.safetensors");
  msg = error_of([&] { train::load_checkpoint(ckpt); });
  EXPECT_TRUE(contains(msg, "missing")) << msg;
  EXPECT_TRUE(contains(error_of([&] { train::load_checkpoint(dir / "nope"); }), "does not exist"));
}

TEST(Checkpoint, AnInterruptedSaveLeavesThePreviousCheckpointLoadable) {
  TempDir dir;
  const auto model = loom::core::NamedTensors{{"w", at::randn({64})}};
  const auto opt = loom::core::NamedTensors{{"step", at::tensor(int64_t{3})}};
  train::save_checkpoint(dir.path(), 3, model, opt, {});
  // A save of step 6 killed half-way: its temporary directory holds a partial file.
  fs::create_directories(dir / "step-00000006.tmp");
  std::ofstream(dir / "step-00000006.tmp" / "model.safetensors") << "partial";
  auto loaded = train::load_checkpoint(dir.path());
  EXPECT_EQ(loaded.step, 3);
  EXPECT_TRUE(at::equal(loaded.model.at("w"), model[0].second));
  // The next save replaces the leftovers; only the newest two checkpoints are kept.
  train::save_checkpoint(dir.path(), 6, model, opt, {});
  train::save_checkpoint(dir.path(), 9, model, opt, {});
  EXPECT_EQ(train::load_checkpoint(dir.path()).step, 9);
  EXPECT_FALSE(fs::exists(dir / "step-00000006.tmp"));
  EXPECT_FALSE(fs::exists(dir / "step-00000003"));
  EXPECT_TRUE(fs::exists(dir / "step-00000006"));
}

TEST(Trainer, BadInputIsReportedBeforeTraining) {
  TempDir dir;
  write_corpus_data(dir.path(), 20000, 2000);
  auto expect_error = [&](train::TrainConfig c, const std::string& part) {
    const auto msg = error_of([&] { train::Trainer t(c); });
    EXPECT_TRUE(contains(msg, part)) << "expected '" << part << "' in: " << msg;
  };
  auto c = small_config(dir.path());
  {
    auto bad = c;
    bad.data = (dir / "missing.bin").string();
    expect_error(bad, "missing.bin");
  }
  {
    auto bad = c;
    bad.preset = "gpt2-giant";
    expect_error(bad, "gpt2-giant");
  }
  {
    auto bad = c;
    bad.preset = "llama-tiny";
    expect_error(bad, "llama preset but --model is gpt2");
  }
  {
    auto bad = c;
    bad.grad_accum = 3;
    expect_error(bad, "--batch-size 8 is not divisible by --grad-accum 3");
  }
  {
    auto bad = c;
    bad.seq_len = 1000;
    expect_error(bad, "exceeds the model's max_seq_len 256");
  }
  {
    auto bad = c;
    bad.vocab_size = 100;  // the byte data holds ids up to 255
    expect_error(bad, "vocabulary has 100 ids");
  }
  {
    auto bad = c;
    bad.save_dir = "/proc/loom-unwritable";
    expect_error(bad, "/proc/loom-unwritable");
  }
  {
    auto bad = c;
    bad.precision = "fp8";
    expect_error(bad, "--precision 'fp8'");
  }
  {
    auto bad = c;
    bad.resume = (dir / "no-checkpoint-here").string();
    expect_error(bad, "no-checkpoint-here");
  }
}

// GPU-only (skipped with a message where no CUDA device exists): ZeRO-Offload keeps the AdamW
// state off the device. One rank (a local communicator), parameters on the GPU: with
// offload_optimizer the moments and masters live in pinned host memory, so the device holds
// about 8 bytes per parameter less, and the updates are the same.
TEST(Cuda, ZeroOffloadKeepsTheOptimizerStateOffTheDevice) {
  if (!loom::ops::built_with_cuda()) GTEST_SKIP() << "built without LOOM_WITH_CUDA";
  if (loom::ops::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  namespace zero = loom::parallel::zero;
  const at::Device cuda(at::kCUDA, 0);
  struct Outcome {
    int64_t device_bytes;
    at::Tensor weight;
  };
  auto run = [&](bool offload) {
    torch::manual_seed(3);
    torch::nn::Linear net(1024, 1024);
    net->to(cuda);
    zero::ZeroOptimizer::NamedParams params;
    for (const auto& item : net->named_parameters()) params.emplace_back(item.key(), item.value());
    zero::ZeroOptions options;
    options.stage = 2;
    options.offload_optimizer = offload;
    torch::cuda::synchronize();
    const int64_t before = loom::core::memory_counters(cuda).current_bytes;
    zero::ZeroOptimizer engine(params, std::make_shared<loom::dist::LocalCommunicator>(), options);
    for (int step = 0; step < 3; ++step) {
      engine.prepare_forward();
      net->forward(at::randn({16, 1024}, at::TensorOptions(cuda))).pow(2).mean().backward();
      engine.finish_gradient_sync();
      engine.step(1e-3);
      engine.zero_grad();
    }
    torch::cuda::synchronize();
    return Outcome{loom::core::memory_counters(cuda).current_bytes - before,
                   net->weight.detach().cpu()};
  };
  const auto on_device = run(false), offloaded = run(true);
  const int64_t psi = 1024 * 1024 + 1024;
  EXPECT_LT(offloaded.device_bytes, on_device.device_bytes - 7 * psi)
      << "on device " << on_device.device_bytes << " B, offloaded " << offloaded.device_bytes
      << " B";
  EXPECT_TRUE(at::allclose(offloaded.weight, on_device.weight, 1e-5, 1e-7));
}

// An op that never completes (or has failed fatally) and says when its communicator is torn down.
class StuckWork : public loom::dist::Work {
 public:
  StuckWork(loom::dist::OpInfo info, bool fatal) : Work(std::move(info)), fatal_(fatal) {}
  bool has_fatal_error() const override { return fatal_; }
  void abort_communicator() override {
    std::fprintf(stderr, "[stuck work] communicator aborted\n");
    std::fflush(stderr);
  }

 protected:
  bool wait_until(std::optional<loom::dist::Clock::time_point>) override { return test(); }
  // The failing op fails a little after the watchdog starts watching it.
  bool test() override { return fatal_ && loom::dist::Clock::now() - created_ > kFailAfter; }
  std::exception_ptr error() const override {
    return fatal_ ? std::make_exception_ptr(loom::Error("NCCL reported a remote error")) : nullptr;
  }

 private:
  static constexpr std::chrono::milliseconds kFailAfter{100};
  bool fatal_;
  loom::dist::Clock::time_point created_ = loom::dist::Clock::now();
};

// The watchdog tears down an expired or failed op's communicator (ncclCommAbort for NCCL) before
// it ends the job, so that no thread stays blocked in it; the job still ends naming the op.
TEST(WatchdogDeathTest, ATimedOutOrFailedOpAbortsItsCommunicatorThenEndsTheJob) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto stuck = [](bool fatal) {
    loom::dist::OpInfo info;
    info.group = "dp";
    info.timeout = loom::dist::Seconds(0.2);
    auto work = std::make_shared<StuckWork>(info, fatal);
    work->mark_started();
    loom::dist::Watchdog::instance().track(work);
    std::this_thread::sleep_for(std::chrono::seconds(20));
  };
  EXPECT_DEATH(stuck(false),
               "communicator aborted.*loom watchdog: .*group 'dp'.* has not completed after");
  EXPECT_DEATH(stuck(true),
               "communicator aborted.*loom watchdog: .*group 'dp'.* failed and left its "
               "communicator unusable: NCCL reported a remote error");
}
