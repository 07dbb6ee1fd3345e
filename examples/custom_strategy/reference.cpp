// Local SGD recomputed without the strategy, in one process, for the tests:
//   local-sgd-reference replay CHECKPOINT_DIR TOLERANCE
// reads the run's configs from the checkpoint a `custom-pretrain --strategy local-sgd:every=H`
// run wrote, trains its dp ranks' replicas here (plain LibTorch autograd and loom's AdamW, each
// replica on the samples its rank drew), and compares the final parameters with the checkpoint's;
//   local-sgd-reference compare DIR_A DIR_B TOLERANCE
// compares two checkpoints' parameters. Exit 0 when the worst relative difference
// (max |a - b| / max |b| per tensor) is within TOLERANCE, 1 otherwise.
#include <loom/loom.h>
#include <torch/torch.h>

#include <cstdio>
#include <string>

namespace {

namespace lt = loom::train;

double worst_difference(const std::map<std::string, at::Tensor>& a,
                        const std::map<std::string, at::Tensor>& b) {
  LOOM_CHECK(a.size() == b.size(), "{} tensors against {}", a.size(), b.size());
  double worst = -1;
  std::string where;
  for (const auto& [name, t] : b) {
    auto it = a.find(name);
    LOOM_CHECK(it != a.end(), "no tensor '{}'", name);
    const auto x = it->second.to(at::kDouble), y = t.to(at::kDouble);
    const double scale = std::max(y.abs().max().item<double>(), 1e-30);
    const double d = (x - y).abs().max().item<double>() / scale;
    if (d > worst) {
      worst = d;
      where = name;
    }
  }
  std::printf("worst relative difference %.3g (%s)\n", worst, where.c_str());
  return worst;
}

std::map<std::string, at::Tensor> parameters_of(const torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : m.named_parameters()) out.emplace(item.key(), item.value().detach());
  return out;
}

int replay(const std::string& dir, double tolerance) {
  const auto ckpt = lt::load_checkpoint(dir, lt::model_parameters_only());
  const auto model_config = loom::models::ModelConfig::from_json(ckpt.state.at("model_config"));
  const auto c = lt::TrainConfig::from_json(ckpt.state.at("train_config"));
  LOOM_CHECK(c.strategies.size() == 1, "expected one --strategy, got {}", c.strategies.size());
  const auto spec = lt::StrategySpec::parse(c.strategies.front());
  const int64_t every = spec.get_int("every", 1), ranks = c.dp;
  const double outer_lr = spec.get_double("outer_lr", 1.0);
  const double outer_momentum = spec.get_double("outer_momentum", 0.0);
  LOOM_CHECK(c.grad_accum == 1 && c.dropout == 0 && c.tp == 1 && c.pp == 1 && c.zero == 0,
             "the reference replays dp-only runs without accumulation or dropout");
  auto shard = std::make_shared<loom::data::TokenShard>(c.data);
  // The Trainer's sampler: the same windows in the same order.
  const loom::data::WindowSampler sampler(shard, c.seq_len, c.seed,
                                          loom::data::parse_sampling(c.sampling), c.batch_size);
  const lt::LrSchedule schedule{c.lr, c.min_lr, c.warmup_steps, c.schedule_steps()};
  const loom::ops::AdamWOptions adamw{c.beta1, c.beta2, 1e-8, c.weight_decay};
  std::vector<std::shared_ptr<loom::models::CausalLM>> replicas;
  std::vector<std::unique_ptr<lt::AdamW>> optimizers;
  for (int64_t r = 0; r < ranks; ++r) {
    auto model = loom::models::make_model(model_config);
    if (c.precision == "fp64") model->to(at::kDouble);
    loom::models::init_parameters(*model, c.seed);
    model->train();
    loom::core::NamedTensors named;
    for (const auto& item : model->named_parameters()) named.emplace_back(item.key(), item.value());
    optimizers.push_back(std::make_unique<lt::AdamW>(named, adamw));
    replicas.push_back(model);
  }
  const int64_t per_rank = c.batch_size / ranks;
  // Mean over the replicas of the tensors `pick` returns, written into each.
  auto average = [&](const std::function<std::vector<at::Tensor>(int64_t)>& pick) {
    torch::NoGradGuard no_grad;
    auto first = pick(0);
    for (size_t i = 0; i < first.size(); ++i) {
      auto mean = first[i].clone();
      for (int64_t r = 1; r < ranks; ++r) mean += pick(r)[i];
      mean /= static_cast<double>(ranks);
      for (int64_t r = 0; r < ranks; ++r) pick(r)[i].copy_(mean);
    }
  };
  // The outer optimizer (DiLoCo): the period's starting point and the velocity, per parameter.
  std::vector<at::Tensor> start, velocity;
  for (const auto& p : replicas[0]->parameters()) {
    start.push_back(p.detach().clone());
    velocity.push_back(torch::zeros_like(p));
  }
  const bool outer = outer_lr != 1.0 || outer_momentum != 0.0;
  for (int64_t s = 0; s < ckpt.step; ++s) {
    const bool synchronous = (s + 1) % every == 0;
    for (int64_t r = 0; r < ranks; ++r) {
      const auto batch = sampler.training_batch(s, r * per_rank, per_rank);
      replicas[r]->loss(batch.inputs, batch.targets).backward();
    }
    if (synchronous)
      average([&](int64_t r) {
        std::vector<at::Tensor> g;
        for (const auto& p : replicas[r]->parameters()) g.push_back(p.grad());
        return g;
      });
    for (int64_t r = 0; r < ranks; ++r) {
      lt::clip_grad_norm(replicas[r]->parameters(), c.grad_clip);
      optimizers[r]->step(schedule.at(s));
      optimizers[r]->zero_grad();
    }
    if (synchronous) {
      average([&](int64_t r) { return replicas[r]->parameters(); });
      average([&](int64_t r) {
        std::vector<at::Tensor> m;
        for (const auto& [key, t] : optimizers[r]->state())
          if (key != "step") m.push_back(t);
        return m;
      });
      if (outer) {
        torch::NoGradGuard no_grad;
        auto params = replicas[0]->parameters();
        for (size_t i = 0; i < params.size(); ++i) {
          const auto delta = start[i] - params[i];
          velocity[i] = outer_momentum * velocity[i] + delta;
          start[i] = start[i] - outer_lr * (delta + outer_momentum * velocity[i]);
        }
        for (int64_t r = 0; r < ranks; ++r) {
          auto rp = replicas[r]->parameters();
          for (size_t i = 0; i < rp.size(); ++i) rp[i].copy_(start[i]);
        }
      }
    }
  }
  return worst_difference(parameters_of(*replicas[0]), ckpt.model) <= tolerance ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "replay" && argc == 4) return replay(argv[2], std::stod(argv[3]));
    if (mode == "compare" && argc == 5) {
      const auto a = lt::load_checkpoint(argv[2], lt::model_parameters_only());
      const auto b = lt::load_checkpoint(argv[3], lt::model_parameters_only());
      return worst_difference(a.model, b.model) <= std::stod(argv[4]) ? 0 : 1;
    }
    std::fprintf(stderr, "usage: local-sgd-reference replay DIR TOL | compare DIR_A DIR_B TOL\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "local-sgd-reference: %s\n", e.what());
    return 2;
  }
}
