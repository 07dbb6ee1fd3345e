// A downstream program: writes a small token file, trains a tiny Llama on it with loom's
// Trainer, exports it in Hugging Face format and reloads it.
#include <loom/loom.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  const fs::path dir = argc > 1 ? fs::path(argv[1]) : fs::temp_directory_path() / "loom-downstream";
  fs::create_directories(dir);

  // Token data: a repeating pattern a model can learn quickly.
  std::vector<uint16_t> tokens(20000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>((i * 7) % 31);
  loom::data::write_llmc_shard(dir / "train.bin", tokens);

  loom::train::TrainConfig config;
  config.model = "llama";
  config.preset = "llama-tiny";
  config.vocab_size = 32;
  config.data = (dir / "train.bin").string();
  config.seq_len = 32;
  config.batch_size = 8;
  config.steps = 20;
  config.lr = 3e-3;
  config.log_every = 10;
  config.export_hf = (dir / "hf").string();
  loom::train::Trainer trainer(config);
  const auto last = trainer.fit();

  auto reloaded = loom::models::load_hf(dir / "hf");
  std::printf("downstream: trained %lld steps, final loss %.4f, reloaded %lld parameters\n",
              static_cast<long long>(last.step), last.loss,
              static_cast<long long>(reloaded->config().num_parameters()));
  return last.loss < 3.0 ? 0 : 1;  // started at ln(32) = 3.47
}
