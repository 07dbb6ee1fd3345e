#pragma once
// One JSON object per line, flushed as written, so a crash loses at most the current line.
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

namespace loom::train {

class MetricsWriter {
 public:
  MetricsWriter() = default;  // writes nothing
  // Starts the file afresh when keep_through_step < 0. On resume, pass the step resumed from:
  // records of later steps (written after that checkpoint) are dropped, so every step appears
  // once, as in an uninterrupted run.
  MetricsWriter(const std::filesystem::path& path, int64_t keep_through_step);
  void write(const nlohmann::json& record);
  bool enabled() const { return out_.is_open(); }

 private:
  std::ofstream out_;
};

}  // namespace loom::train
