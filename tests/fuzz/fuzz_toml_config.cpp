// loom-pretrain's --config file (TOML/INI, read by CLI11) through the same flags and checks as
// the tool: parsed, micro-batches folded in, the TrainConfig validated. CLI11's parse errors are
// the clear refusal of a malformed file, as loom::Error is of a bad value.
#include "apps/pretrain_cli.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace loom;
  const auto path = fuzz::scratch_dir() / "train.toml";
  fuzz::write_bytes(path, {reinterpret_cast<const char*>(data), size});
  apps::PretrainCommandLine cli("loom-pretrain");
  const std::string config = path.string();
  const char* argv[] = {"loom-pretrain", "--config", config.c_str()};
  fuzz::accepts<CLI::Error>([&] {
    cli.app.parse(3, const_cast<char**>(argv));
    cli.finish();
    cli.config.validate();
  });
  return 0;
}
