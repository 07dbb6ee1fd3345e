// A model of the user's own in plain LibTorch (models/custom_model.h) trained by the Trainer:
// what works in one process (training, evaluation, ZeRO-3 units, checkpointing and an exact
// resume) and what is refused with a message saying why.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "custom_model_util.h"
#include "loom/parallel/zero/zero_optimizer.h"
#include "loom/train/trainer.h"
#include "test_util.h"

namespace {

namespace train = loom::train;
using loom::testing::contains;
using loom::testing::error_of;

train::TrainConfig custom_config(const std::filesystem::path& dir) {
  loom::testing::write_corpus_data(dir, 20000, 4000);
  train::TrainConfig c;
  c.data = (dir / "train.bin").string();
  c.val_data = (dir / "val.bin").string();
  c.seq_len = 16;
  c.batch_size = 8;
  c.grad_accum = 2;
  c.steps = 6;
  c.lr = 1e-2;
  c.warmup_steps = 1;
  c.eval_batches = 1;
  return c;
}

TEST(CustomModel, TrainsChecksAndResumesExactly) {
  loom::testing::TempDir dir;
  auto c = custom_config(dir.path());
  c.activation_checkpointing = "full";
  c.zero = 3;  // one rank: each declared block is a unit of its own
  c.save_dir = (dir.path() / "ckpt").string();
  c.save_every = 3;
  std::vector<double> losses;
  {
    train::Trainer t(c, nullptr, loom::testing::plain_lm());
    EXPECT_EQ(t.model_config().family, loom::models::Family::kCustom);
    EXPECT_EQ(t.model().blocks().size(), 2u);
    EXPECT_EQ(t.model().blocks().front().first, "net.layers.0");
    ASSERT_NE(t.zero(), nullptr);
    EXPECT_EQ(t.zero()->num_buckets(), 3u);  // two blocks and the root
    while (t.step() < c.steps) {
      losses.push_back(t.train_step().loss);
      if (t.step() % c.save_every == 0) t.save_checkpoint();
    }
    EXPECT_LT(losses.back(), losses.front() - 0.3) << "it learns the corpus";
    EXPECT_TRUE(std::isfinite(t.evaluate(1)));
  }
  auto resumed = c;
  resumed.resume = (dir.path() / "ckpt" / "step-00000003").string();
  resumed.save_dir.clear();
  train::Trainer r(resumed, nullptr, loom::testing::plain_lm());
  for (size_t i = 3; i < losses.size(); ++i) EXPECT_EQ(r.train_step().loss, losses[i]) << i;
  // loom-eval and loom-generate rebuild loom's models only: a custom checkpoint says so.
  const auto e = error_of([&] { train::load_model_from_checkpoint(c.save_dir); });
  EXPECT_TRUE(contains(e, "a custom model is built by its own code")) << e;
}

// The module's own dropout draws from LibTorch's default generator: activation checkpointing
// replays it, so recomputed blocks drop the same units and training is unchanged.
TEST(CustomModel, ItsOwnDropoutIsReplayedByCheckpointing) {
  loom::testing::TempDir dir;
  auto c = custom_config(dir.path());
  c.steps = 3;
  std::vector<double> kept, recomputed;
  for (const char* mode : {"none", "full"}) {
    auto m = c;
    m.activation_checkpointing = mode;
    train::Trainer t(m, nullptr, loom::testing::plain_lm(true, 2, /*dropout=*/0.2));
    auto& losses = std::string(mode) == "none" ? kept : recomputed;
    while (t.step() < m.steps) losses.push_back(t.train_step().loss);
  }
  for (size_t i = 0; i < kept.size(); ++i)
    EXPECT_NEAR(recomputed[i], kept[i], 1e-12 * std::abs(kept[i])) << "step " << i + 1;
}

TEST(CustomModel, WhatItCannotDoIsAClearError) {
  loom::testing::TempDir dir;
  const auto base = custom_config(dir.path());
  auto with = [&](auto change, loom::models::CustomModelFactory factory) {
    auto c = base;
    change(c);
    return error_of([&] { train::Trainer t(c, nullptr, factory); });
  };
  auto e = with([](train::TrainConfig& c) { c.activation_checkpointing = "full"; },
                loom::testing::plain_lm(/*declare_blocks=*/false));
  EXPECT_TRUE(contains(e, "recomputes the blocks it declares") && contains(e, "declares none"))
      << e;
  e = with([](train::TrainConfig& c) { c.activation_checkpointing = "selective"; },
           loom::testing::plain_lm());
  EXPECT_TRUE(contains(e, "a custom model is recomputed block by block")) << e;
  e = with([](train::TrainConfig& c) { c.dropout = 0.1; }, loom::testing::plain_lm());
  EXPECT_TRUE(contains(e, "--dropout 0.1 applies to loom's models")) << e;
  e = with([&](train::TrainConfig& c) { c.export_hf = (dir.path() / "hf").string(); },
           loom::testing::plain_lm());
  EXPECT_TRUE(contains(e, "this run trains a custom model")) << e;
  // A block that is not the module's own, and logits of the wrong shape.
  e = error_of([] {
    auto net = std::make_shared<loom::testing::PlainLmImpl>(256, 16, 2);
    loom::models::CustomModelSpec spec;
    spec.module = net;
    spec.forward = [](const at::Tensor& ids, const auto&) { return ids; };
    spec.blocks = {std::make_shared<torch::nn::LinearImpl>(16, 16), net->layers->ptr(1)};
    spec.blocks_path = "layers";
    spec.vocab_size = 256;
    spec.max_seq_len = 64;
    spec.d_model = 16;
    loom::models::make_custom_model(spec);
  });
  EXPECT_TRUE(contains(e, "block 0 is not the module registered at 'layers.0'")) << e;
  e = error_of([] {
    loom::models::CustomModelSpec spec;
    spec.module = std::make_shared<loom::testing::PlainLmImpl>(256, 16, 1);
    spec.forward = [](const at::Tensor& ids, const auto&) { return ids.to(at::kFloat); };
    spec.vocab_size = 256;
    spec.max_seq_len = 64;
    spec.d_model = 16;
    auto m = loom::models::make_custom_model(spec);
    m->loss(at::zeros({2, 4}, at::kLong), at::zeros({2, 4}, at::kLong));
  });
  EXPECT_TRUE(contains(e, "forward returned shape [2, 4]; logits are [batch 2, seq 4, vocab 256]"))
      << e;
}

}  // namespace
