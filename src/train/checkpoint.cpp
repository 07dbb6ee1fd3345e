#include "loom/train/checkpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <optional>

#include "loom/core/error.h"
#include "loom/core/files.h"
#include "loom/parallel/tensor/shard_spec.h"
#include "loom/parallel/zero/flat_layout.h"

namespace loom::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {
constexpr int kFormatVersion = 1;
const char* kModelFile = "model.safetensors";
const char* kOptimizerFile = "optimizer.safetensors";
const char* kStateFile = "state.json";

bool is_checkpoint_name(const std::string& name) {
  return name.rfind("step-", 0) == 0 && name.find('.') == std::string::npos;
}
}  // namespace

namespace {

// "dim,full,padded,parts,units" (what the writer recorded) back into a ShardSpec.
parallel::tensor::ShardSpec parse_spec(const std::string& text, const std::string& where) {
  parallel::tensor::ShardSpec spec;
  int64_t* fields[] = {&spec.dim, &spec.full, &spec.padded, &spec.parts, &spec.units};
  size_t pos = 0;
  for (size_t i = 0; i < 5; ++i) {
    const auto comma = text.find(',', pos);
    LOOM_CHECK(i == 4 ? comma == std::string::npos : comma != std::string::npos,
               "{}: malformed shard spec '{}'", where, text);
    *fields[i] = std::stoll(text.substr(pos, comma - pos));
    pos = comma + 1;
  }
  return spec;
}

}  // namespace

void assemble_shards(const fs::path& ckpt, CheckpointContents& out,
                     std::map<std::string, parallel::tensor::ShardSpec>* specs) {
  // Every writer's pieces, by tensor, indexed by the writer's tp rank; then each tensor whole.
  struct Pieces {
    std::vector<at::Tensor> by_rank;
    std::optional<parallel::tensor::ShardSpec> spec;
    std::string file;
  };
  std::map<std::string, Pieces> tensors;
  for (const auto& name : out.state.at("model_shards")) {
    const auto file = ckpt / name.get<std::string>();
    auto contents = core::load_safetensors(file);
    const auto& meta = contents.metadata;
    LOOM_CHECK(meta.count("loom.tp_rank") && meta.count("loom.tp_size"),
               "checkpoint shard '{}' lacks its tensor-parallel coordinates", file.string());
    const auto rank = std::stoll(meta.at("loom.tp_rank"));
    const auto size = std::stoll(meta.at("loom.tp_size"));
    for (auto& [key, t] : contents.tensors) {
      auto& p = tensors[key];
      p.by_rank.resize(static_cast<size_t>(size));
      p.file = file.string();
      if (meta.count(key)) {
        p.spec = parse_spec(meta.at(key), file.string());
        if (specs && key.starts_with("model/")) (*specs)[key.substr(6)] = *p.spec;
      }
      // Stages share the tied embedding, tp ranks the replicated tensors: equal copies.
      if (!p.by_rank[static_cast<size_t>(rank)].defined())
        p.by_rank[static_cast<size_t>(rank)] = std::move(t);
    }
  }
  for (auto& [key, p] : tensors) {
    at::Tensor whole;
    if (p.spec) {
      for (size_t r = 0; r < p.by_rank.size(); ++r)
        LOOM_CHECK(p.by_rank[r].defined(),
                   "checkpoint '{}': tensor '{}' lacks the shard of tp rank {} (its other shards "
                   "are in '{}')",
                   ckpt.string(), key, r, p.file);
      whole = p.spec->unshard(p.by_rank);
    } else {
      for (auto& t : p.by_rank)
        if (t.defined()) whole = t;
    }
    if (key.starts_with("model/"))
      out.model.emplace(key.substr(6), whole);
    else if (key.starts_with("optimizer/"))
      out.optimizer.emplace(key.substr(10), whole);
  }
}

fs::path checkpoint_dir(const fs::path& dir, int64_t step) {
  return dir / fmt::format("step-{:08d}", step);
}

fs::path save_checkpoint(const fs::path& dir, int64_t step, const core::NamedTensors& model,
                         const core::NamedTensors& optimizer, json state,
                         const std::vector<fs::path>& extra_files, int keep_last,
                         const std::vector<fs::path>& moved_files) {
  core::ensure_writable_dir(dir);
  const auto final_dir = checkpoint_dir(dir, step);
  const auto name = final_dir.filename().string();
  const auto tmp_dir = dir / (name + ".tmp");
  std::error_code ec;
  fs::remove_all(tmp_dir, ec);  // leftovers of an earlier interrupted save
  fs::create_directories(tmp_dir, ec);
  LOOM_CHECK(!ec, "cannot create '{}': {}", tmp_dir.string(), ec.message());

  core::save_safetensors(tmp_dir / kModelFile, model);
  core::save_safetensors(tmp_dir / kOptimizerFile, optimizer);
  json checksums = json::object();
  checksums[kModelFile] = core::file_crc32(tmp_dir / kModelFile);
  checksums[kOptimizerFile] = core::file_crc32(tmp_dir / kOptimizerFile);
  for (const auto& file : extra_files) {
    if (!fs::exists(file)) continue;
    const auto target = tmp_dir / file.filename();
    fs::copy_file(file, target, fs::copy_options::overwrite_existing, ec);
    LOOM_CHECK(!ec, "cannot copy '{}' into the checkpoint: {}", file.string(), ec.message());
    core::fsync_path(target);
    checksums[file.filename().string()] = core::file_crc32(target);
  }
  for (const auto& file : moved_files) {
    LOOM_CHECK(fs::exists(file), "cannot complete the checkpoint: '{}' was not written",
               file.string());
    const auto target = tmp_dir / file.filename();
    fs::rename(file, target, ec);
    LOOM_CHECK(!ec, "cannot move '{}' into the checkpoint: {}", file.string(), ec.message());
    checksums[file.filename().string()] = core::file_crc32(target);
  }
  state["format_version"] = kFormatVersion;
  state["step"] = step;
  state["checksums"] = checksums;
  core::write_file_atomic(tmp_dir / kStateFile, state.dump(2) + "\n");
  core::fsync_path(tmp_dir);

  // Re-saving a step that exists (a resumed run passing it again): move the old copy aside
  // first, so a valid checkpoint exists under one of the two names at every moment.
  const auto old_dir = dir / (name + ".old");
  fs::remove_all(old_dir, ec);
  if (fs::exists(final_dir)) {
    fs::rename(final_dir, old_dir, ec);
    LOOM_CHECK(!ec, "cannot move '{}' aside: {}", final_dir.string(), ec.message());
  }
  fs::rename(tmp_dir, final_dir, ec);
  LOOM_CHECK(!ec, "cannot rename '{}' to '{}': {}", tmp_dir.string(), final_dir.string(),
             ec.message());
  core::fsync_path(dir);
  core::write_file_atomic(dir / "latest", name + "\n");
  fs::remove_all(old_dir, ec);

  if (keep_last > 0) {
    // Older steps of this run only, by number; never the one just written.
    std::vector<std::pair<int64_t, fs::path>> older;
    for (const auto& entry : fs::directory_iterator(dir)) {
      const auto n = entry.path().filename().string();
      if (!entry.is_directory() || !is_checkpoint_name(n)) continue;
      const int64_t s = std::strtoll(n.c_str() + 5, nullptr, 10);
      if (s < step) older.emplace_back(s, entry.path());
    }
    std::sort(older.begin(), older.end());
    for (size_t i = 0; i + keep_last - 1 < older.size(); ++i) fs::remove_all(older[i].second, ec);
  }
  return final_dir;
}

std::optional<fs::path> latest_checkpoint(const fs::path& dir) {
  const auto pointer = dir / "latest";
  if (!fs::exists(pointer)) return std::nullopt;
  auto name = core::read_file(pointer);
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  return dir / name;
}

fs::path resolve_checkpoint(const fs::path& path) {
  LOOM_CHECK(fs::exists(path), "checkpoint path '{}' does not exist", path.string());
  if (fs::exists(path / kStateFile)) return path;
  auto latest = latest_checkpoint(path);
  LOOM_CHECK(latest.has_value(),
             "'{}' is neither a checkpoint (no {}) nor a save directory (no 'latest' file)",
             path.string(), kStateFile);
  return *latest;
}

CheckpointContents load_checkpoint(const fs::path& path) {
  const fs::path ckpt = resolve_checkpoint(path);
  CheckpointContents out;
  out.dir = ckpt;
  try {
    out.state = json::parse(core::read_file(ckpt / kStateFile));
  } catch (const json::exception& e) {
    fail("checkpoint '{}': {} is not valid JSON: {}", ckpt.string(), kStateFile, e.what());
  }
  LOOM_CHECK(out.state.value("format_version", 0) == kFormatVersion,
             "checkpoint '{}' has format_version {}; this loom reads version {}", ckpt.string(),
             out.state.value("format_version", 0), kFormatVersion);
  const auto& checksums = out.state.value("checksums", json::object());
  LOOM_CHECK(checksums.is_object() && checksums.contains(kModelFile) &&
                 checksums.contains(kOptimizerFile) && out.state.value("step", int64_t{-1}) >= 0,
             "checkpoint '{}': {} lacks its step or checksums", ckpt.string(), kStateFile);
  for (const auto& [file, crc] : checksums.items()) {
    LOOM_CHECK(fs::exists(ckpt / file), "checkpoint '{}' is incomplete: '{}' is missing",
               ckpt.string(), file);
    const auto actual = core::file_crc32(ckpt / file);
    const auto expected = crc.is_number_unsigned() ? crc.get<uint32_t>() : ~actual;
    LOOM_CHECK(actual == expected,
               "checkpoint file '{}' is corrupt: CRC-32 {:08x}, expected {:08x}",
               (ckpt / file).string(), actual, expected);
  }
  out.step = out.state.value("step", int64_t{0});
  out.model = core::load_safetensors(ckpt / kModelFile).tensors;
  out.optimizer = core::load_safetensors(ckpt / kOptimizerFile).tensors;
  if (out.state.contains("model_shards")) assemble_shards(ckpt, out, &out.specs);
  return out;
}

void assemble_zero_shards(const fs::path& ckpt, CheckpointContents& out) {
  LOOM_CHECK(out.state.contains("zero_shards"),
             "checkpoint '{}' lists no ZeRO shards it could reshard (written before loom could: "
             "resume it in the layout that wrote it)",
             ckpt.string());
  auto specs = out.specs;
  // Per optimizer entry ("<param>.exp_avg", ...): the tensor each tp rank's engines held,
  // rebuilt from the dp ranks' flat shards; then whole across tp.
  std::map<std::string, std::vector<at::Tensor>> by_tp;
  // Files of one engine (pipeline group and tp rank), indexed by dp rank.
  std::map<std::pair<std::string, int64_t>, std::vector<core::SafetensorsContents>> engines;
  for (const auto& name : out.state.at("zero_shards")) {
    const auto file = ckpt / name.get<std::string>();
    auto contents = core::load_safetensors(file);
    const auto& meta = contents.metadata;
    for (const char* key :
         {"loom.group", "loom.tp_rank", "loom.tp_size", "dp_rank", "dp_size", "bucket_params"})
      LOOM_CHECK(meta.count(key), "ZeRO shard '{}' lacks '{}' in its metadata", file.string(), key);
    // The specs of the engine's parameters (vocabulary padding exists even at tp 1).
    if (meta.count("loom.specs")) {
      const auto listed = nlohmann::json::parse(meta.at("loom.specs"));  // outlives the loop
      for (const auto& [param, text] : listed.items())
        specs.emplace(param, parse_spec(text.get<std::string>(), file.string()));
    }
    auto& files = engines[{meta.at("loom.group"), std::stoll(meta.at("loom.tp_rank"))}];
    files.resize(static_cast<size_t>(std::stoll(meta.at("dp_size"))));
    files[static_cast<size_t>(std::stoll(meta.at("dp_rank")))] = std::move(contents);
  }
  for (auto& [engine, files] : engines) {
    const auto tp_rank = engine.second;
    for (size_t r = 0; r < files.size(); ++r)
      LOOM_CHECK(!files[r].metadata.empty(),
                 "checkpoint '{}': the ZeRO shard of dp rank {} ({}, tp rank {}) is missing",
                 ckpt.string(), r, engine.first, tp_rank);
    const auto tp_size = std::stoll(files.front().metadata.at("loom.tp_size"));
    const auto buckets = nlohmann::json::parse(files.front().metadata.at("bucket_params"));
    std::map<std::string, at::Tensor> flat;  // "<param>.<kind>" -> its elements
    for (size_t bi = 0; bi < buckets.size(); ++bi) {
      std::vector<std::string> names;
      std::vector<std::vector<int64_t>> shapes;
      std::vector<int64_t> numels;
      for (const auto& entry : buckets[bi]) {
        names.push_back(entry.at(0).get<std::string>());
        shapes.push_back(entry.at(1).get<std::vector<int64_t>>());
        int64_t n = 1;
        for (auto d : shapes.back()) n *= d;
        numels.push_back(n);
      }
      const parallel::zero::FlatLayout layout(numels, static_cast<int64_t>(files.size()));
      for (const char* kind : {"exp_avg", "exp_avg_sq", "master"}) {
        const auto key = fmt::format("zero.bucket{}.{}", bi, kind);
        for (size_t r = 0; r < files.size(); ++r) {
          auto it = files[r].tensors.find(key);
          if (it == files[r].tensors.end()) {
            // Masters exist only in some runs; the moments always.
            LOOM_CHECK(std::string(kind) == "master",
                       "checkpoint '{}': the ZeRO shard of dp rank {} ({}, tp rank {}) has no '{}'",
                       ckpt.string(), r, engine.first, tp_rank, key);
            continue;
          }
          LOOM_CHECK(it->second.numel() == layout.shard_numel(),
                     "checkpoint '{}': '{}' of dp rank {} ({}, tp rank {}) holds {} elements; its "
                     "bucket's layout needs {}",
                     ckpt.string(), key, r, engine.first, tp_rank, it->second.numel(),
                     layout.shard_numel());
          for (const auto& seg : layout.segments(static_cast<int64_t>(r))) {
            const auto entry = fmt::format("{}.{}", names[seg.param], kind);
            auto& whole = flat[entry];
            if (!whole.defined()) whole = at::zeros({numels[seg.param]}, it->second.options());
            whole.narrow(0, seg.param_offset, seg.numel)
                .copy_(it->second.reshape({-1}).narrow(0, seg.shard_offset, seg.numel));
          }
        }
      }
      for (size_t k = 0; k < names.size(); ++k)
        for (const char* kind : {"exp_avg", "exp_avg_sq", "master"}) {
          auto it = flat.find(fmt::format("{}.{}", names[k], kind));
          if (it == flat.end()) continue;
          auto& pieces = by_tp[it->first];
          pieces.resize(static_cast<size_t>(tp_size));
          pieces[static_cast<size_t>(tp_rank)] = it->second.view(shapes[k]);
        }
    }
    files.clear();  // this engine's raw shards are no longer needed
  }
  for (auto& [entry, pieces] : by_tp) {
    const auto param = entry.substr(0, entry.rfind('.'));
    auto spec = specs.find(param);
    at::Tensor whole;
    if (spec != specs.end() && spec->second.sharded()) {
      for (size_t t = 0; t < pieces.size(); ++t)
        LOOM_CHECK(pieces[t].defined(), "checkpoint '{}': '{}' lacks the ZeRO shards of tp rank {}",
                   ckpt.string(), entry, t);
      whole = spec->second.unshard(pieces);
    } else {
      for (auto& t : pieces)
        if (t.defined()) whole = t;
    }
    out.optimizer.emplace(entry, whole);  // the tied embedding's second copy: equal, skipped
  }
}

}  // namespace loom::train
