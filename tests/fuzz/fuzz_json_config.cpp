// The JSON configs loom reads from files it did not write: a Hugging Face config.json, the
// --pp-devices file, a data directory's tokenizer meta.json (byte tokenizer: no vocabulary
// files), and the model and training configs a checkpoint's state.json carries. The first byte
// picks the reader.
#include <nlohmann/json.hpp>

#include "fuzz_util.h"
#include "loom/data/tokenizer.h"
#include "loom/models/hf_config.h"
#include "loom/parallel/pipeline/partition.h"
#include "loom/train/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace loom;
  if (size == 0) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  const auto dir = fuzz::scratch_dir();
  switch (data[0] % 5) {
    case 0: {
      fuzz::write_bytes(dir / "config.json", text);
      models::ModelConfig c;
      if (fuzz::accepts([&] { c = models::read_hf_config(dir); }))
        fuzz::require(fuzz::accepts([&] { c.validate(); }),
                      "read_hf_config returned an invalid "
                      "config");
      break;
    }
    case 1:
      fuzz::write_bytes(dir / "devices.json", text);
      fuzz::accepts([&] {
        for (const int64_t pp : {1, 2, 4})
          parallel::pipeline::load_device_file((dir / "devices.json").string(), pp);
      });
      break;
    case 2: {
      fuzz::write_bytes(dir / "meta.json", text);
      std::unique_ptr<data::Tokenizer> tok;
      if (fuzz::accepts([&] { tok = data::load_tokenizer(dir); }))
        fuzz::require(tok->vocab_size() > 0, "a tokenizer without a vocabulary");
      break;
    }
    case 3:
    case 4: {
      // What a checkpoint's state.json holds: parsed by nlohmann (not loom), then loom's readers.
      const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded()) break;
      if (data[0] % 5 == 3)
        fuzz::accepts([&] { models::ModelConfig::from_json(j).validate(); });
      else
        fuzz::accepts([&] { train::TrainConfig::from_json(j).validate(); });
      break;
    }
  }
  return 0;
}
