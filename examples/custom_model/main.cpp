// loom-example-custom-model: a language model written in plain LibTorch — no loom layers —
// trained by loom's Trainer under data parallelism with ZeRO-3 and activation checkpointing,
// checkpointed and resumed.
//
//   mpirun -np 2 build/examples/loom-example-custom-model --dir /tmp/custom-model
//
// What the model gives loom (models/custom_model.h): its module, a forward from token ids to
// logits that runs each block through `run_block` (so ZeRO-3 gathers one block at a time and
// checkpointing recomputes each), the list of its blocks, and, here, its own loss. On every rank
// it checks, in fp64 (docs/testing.md), that the run equals the same model trained in one
// process, and that a run resumed from its step-3 checkpoint continues it bit for bit; exit
// status 1 if not.
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <optional>

#include "loom/apps/cli.h"
#include "loom/core/files.h"
#include "loom/loom.h"

namespace {

namespace F = torch::nn::functional;

// A residual block: causal self-attention through loom's attention entry point (q, k, v packed
// as one projection writes them: ops::attention_packed), then an MLP that also mixes in the
// previous position (causal token shift).
struct BlockImpl : torch::nn::Module {
  static constexpr int64_t kHeads = 2;
  torch::nn::LayerNorm attn_norm{nullptr}, norm{nullptr};
  torch::nn::Linear qkv{nullptr}, attn_out{nullptr}, shift{nullptr}, up{nullptr}, down{nullptr};
  explicit BlockImpl(int64_t d) {
    attn_norm =
        register_module("attn_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    qkv = register_module("qkv", torch::nn::Linear(d, 3 * d));
    attn_out = register_module("attn_out", torch::nn::Linear(d, d));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    shift = register_module("shift", torch::nn::Linear(d, d));
    up = register_module("up", torch::nn::Linear(d, 4 * d));
    down = register_module("down", torch::nn::Linear(4 * d, d));
  }
  torch::Tensor forward(torch::Tensor x) {
    const int64_t b = x.size(0), t = x.size(1), d = x.size(2);
    // [B, T, 3d] -> [B, T, 3, heads, d / heads] -> attention [B, heads, T, d / heads]
    auto y = loom::ops::attention_packed(qkv(attn_norm(x)).view({b, t, 3, kHeads, d / kHeads}),
                                         {.causal = true});
    x = x + attn_out(y.transpose(1, 2).reshape({b, t, d}));
    auto h = norm(x);
    // Position t sees position t - 1 (zeros before the first): nothing from the future.
    auto previous = F::pad(h, F::PadFuncOptions({0, 0, 1, 0})).slice(1, 0, h.size(1));
    return x + down(torch::gelu(up(h + shift(previous))));
  }
};
TORCH_MODULE(Block);

struct TinyLmImpl : torch::nn::Module {
  torch::nn::Embedding tokens{nullptr}, positions{nullptr};
  torch::nn::ModuleList layers;
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
  TinyLmImpl(int64_t vocab, int64_t max_seq, int64_t d, int64_t n_layers) {
    tokens = register_module("tokens", torch::nn::Embedding(vocab, d));
    positions = register_module("positions", torch::nn::Embedding(max_seq, d));
    layers = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < n_layers; ++i) layers->push_back(Block(d));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    head = register_module("head", torch::nn::Linear(d, vocab));
  }
  // The one line loom asks of the forward: each block runs through run_block.
  torch::Tensor forward(const torch::Tensor& ids,
                        const loom::models::CustomModelSpec::BlockRunner& run_block) {
    auto x = tokens(ids) + positions(torch::arange(ids.size(1)));
    for (size_t i = 0; i < layers->size(); ++i)
      x = run_block(static_cast<int64_t>(i), x,
                    [block = layers[i]->as<BlockImpl>()](const torch::Tensor& in) {
                      return block->forward(in);
                    });
    return head(norm(x));
  }
};

constexpr int64_t kVocab = 256, kMaxSeq = 64, kWidth = 32, kLayers = 3;

loom::models::CustomModelFactory tiny_lm() {
  return [](const loom::parallel::tensor::TpGroupPtr& tp) {
    auto net = std::make_shared<TinyLmImpl>(kVocab, kMaxSeq, kWidth, kLayers);
    loom::models::CustomModelSpec spec;
    spec.module = net;
    spec.forward = [net](const torch::Tensor& ids, const auto& run_block) {
      return net->forward(ids, run_block);
    };
    for (size_t i = 0; i < net->layers->size(); ++i) spec.blocks.push_back(net->layers->ptr(i));
    spec.blocks_path = "layers";
    // Its own loss: cross-entropy in fp32 at least (fp64 when the run is fp64).
    spec.loss = [](const torch::Tensor& logits, const torch::Tensor& targets) {
      auto l = logits.scalar_type() == torch::kDouble ? logits : logits.to(torch::kFloat);
      return F::cross_entropy(l.flatten(0, 1), targets.flatten());
    };
    spec.vocab_size = kVocab;
    spec.max_seq_len = kMaxSeq;
    spec.d_model = kWidth;
    return loom::models::make_custom_model(spec, tp);
  };
}

std::vector<double> train(loom::train::Trainer& t, int64_t until, int64_t save_at = -1) {
  std::vector<double> losses;
  while (t.step() < until) {
    losses.push_back(t.train_step().loss);
    if (t.step() == save_at) t.save_checkpoint();
  }
  return losses;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Train a plain LibTorch model with loom's Trainer.", "loom-example-custom-model"};
  std::string dir = "custom-model-run";
  app.add_option("--dir", dir, "Working directory (data and checkpoints)")->capture_default_str();
  std::optional<loom::dist::Runtime> runtime;
  return loom::apps::run_app(app, argc, argv, [&] {
    runtime.emplace();
    auto world = runtime->world();
    const int64_t ranks = world->size(), rank = world->rank();
    const std::filesystem::path root = dir;
    if (rank == 0) {
      std::error_code ec;
      loom::core::remove_tree(root, ec);  // a leftover of an earlier run
      LOOM_CHECK(!ec, "cannot remove '{}': {}", root.string(), ec.message());
      std::filesystem::create_directories(root);
      std::string text;
      for (int i = 0; i < 300; ++i)
        text += "a small corpus for a model of your own, trained by loom. ";
      std::vector<uint16_t> ids(text.begin(), text.end());
      loom::data::write_llmc_shard(root / "train.bin", ids);
    }
    world->barrier();

    loom::train::TrainConfig c;
    c.data = (root / "train.bin").string();
    c.seq_len = 32;
    c.batch_size = 8;
    c.grad_accum = 2;
    c.steps = 6;
    c.lr = 3e-3;
    c.warmup_steps = 1;
    c.precision = "fp64";  // layouts compared far below any bug's size (docs/testing.md)
    auto sharded = c;
    sharded.zero = 3;
    sharded.activation_checkpointing = "full";
    sharded.save_dir = (root / "checkpoints").string();
    auto mesh = runtime->mesh({.dp = ranks});

    loom::train::Trainer run(sharded, mesh, tiny_lm());
    const auto losses = train(run, c.steps, /*save_at=*/3);
    const auto params = run.gather_parameters();  // from the ZeRO-3 shards (collective)
    const auto memory = run.memory_report();

    auto resumed_config = sharded;
    resumed_config.resume = (root / "checkpoints" / "step-00000003").string();
    resumed_config.save_dir.clear();
    loom::train::Trainer resumed(resumed_config, mesh, tiny_lm());
    const auto rest = train(resumed, c.steps);
    bool resumes = rest.size() == 3;
    for (size_t i = 0; resumes && i < rest.size(); ++i) resumes = rest[i] == losses[3 + i];

    loom::train::Trainer one(c, nullptr, tiny_lm());  // one process, no ZeRO, no checkpointing
    const auto want = train(one, c.steps);
    double worst = 0;
    for (size_t i = 0; i < want.size(); ++i)
      worst = std::max(worst, std::abs(losses[i] - want[i]) / std::abs(want[i]));
    for (const auto& [name, p] : one.gather_parameters()) {
      const auto got = params.at(name);
      worst = std::max(worst, ((got - p).abs().max() / p.abs().max()).item<double>());
    }
    int64_t total = 0;
    for (const auto& [name, p] : params)
      total += p.numel() * static_cast<int64_t>(p.element_size());
    const bool same = worst <= 1e-9;
    if (rank == 0)
      std::printf("loss %.4f -> %.4f over %lld steps; rank 0 holds %lld of %lld parameter bytes\n",
                  losses.front(), losses.back(), static_cast<long long>(c.steps),
                  static_cast<long long>(memory.parameters), static_cast<long long>(total));
    std::printf(
        "rank %lld: custom model under dp %lld + ZeRO-3 + checkpointing %s one process (worst "
        "relative difference %.2g) and %s from its checkpoint\n",
        static_cast<long long>(rank), static_cast<long long>(ranks),
        same ? "matches" : "DIFFERS FROM", worst, resumes ? "resumes exactly" : "DOES NOT RESUME");
    if (!same || !resumes) throw std::runtime_error("the custom model's checks failed");
  });
}
