#include "loom/train/metrics.h"

#include <cerrno>
#include <cstring>

#include "loom/core/error.h"

namespace loom::train {

MetricsWriter::MetricsWriter(const std::filesystem::path& path, int64_t keep_through_step) {
  if (path.has_parent_path()) {
    std::error_code ec;
    std::filesystem::create_directories(path.parent_path(), ec);
    LOOM_CHECK(!ec, "cannot create the directory of metrics file '{}': {}", path.string(),
               ec.message());
  }
  std::string kept;
  if (keep_through_step >= 0 && std::filesystem::exists(path)) {
    std::ifstream in(path);
    for (std::string line; std::getline(in, line);) {
      const auto record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      // A record whose step is not an integer (a cut or foreign line) is not kept.
      if (record.is_object() && record.contains("step") && record["step"].is_number_integer() &&
          record["step"].get<int64_t>() <= keep_through_step)
        kept += line + "\n";
    }
  }
  out_.open(path, std::ios::trunc);
  LOOM_CHECK(out_.is_open(), "cannot open metrics file '{}': {}", path.string(),
             std::strerror(errno));
  out_ << kept;
  out_.flush();
}

void MetricsWriter::write(const nlohmann::json& record) {
  if (!out_.is_open()) return;
  out_ << record.dump() << '\n';
  out_.flush();
}

}  // namespace loom::train
