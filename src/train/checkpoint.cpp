#include "loom/train/checkpoint.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>

#include "loom/core/error.h"
#include "loom/core/files.h"
#include "loom/core/json.h"
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

// "step-" and digits: nothing else is a checkpoint (not step-N.tmp, and no name read from a
// hostile `latest` that holds a '/', a '.' or a NUL).
bool is_checkpoint_name(const std::string& name) {
  return name.size() > 5 && name.size() < 32 && name.rfind("step-", 0) == 0 &&
         name.find_first_not_of("0123456789", 5) == std::string::npos;
}
}  // namespace

namespace {

// A decimal integer in [lo, hi] from a checkpoint's own text (metadata, file names), or a
// loom::Error naming `what` and `where`: the file may come from anyone.
int64_t parse_int(const std::string& text, int64_t lo, int64_t hi, const std::string& what,
                  const std::string& where) {
  size_t used = 0;
  int64_t value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::logic_error&) {
    used = 0;
  }
  LOOM_CHECK(used == text.size() && used > 0 && value >= lo && value <= hi,
             "{}: {} '{}' is not an integer in [{}, {}]", where, what, text, lo, hi);
  return value;
}

// A file's metadata value `key` as an integer in [lo, hi]; a missing key is an error too.
int64_t metadata_int(const std::map<std::string, std::string>& meta, const std::string& key,
                     int64_t lo, int64_t hi, const std::filesystem::path& file) {
  const auto it = meta.find(key);
  LOOM_CHECK(it != meta.end(), "checkpoint shard '{}' lacks '{}' in its metadata", file.string(),
             key);
  return parse_int(it->second, lo, hi, "metadata '" + key + "'", file.string());
}

// JSON text in a file's metadata, or a loom::Error naming the file and key.
nlohmann::json metadata_json(const std::map<std::string, std::string>& meta, const std::string& key,
                             const std::filesystem::path& file) {
  try {
    return nlohmann::json::parse(meta.at(key));
  } catch (const nlohmann::json::exception& e) {
    fail("checkpoint shard '{}': metadata '{}' is not valid JSON: {}", file.string(), key,
         e.what());
  }
}

// A file of checkpoint `dir` that its state.json names (in `list`): a plain file name, so a
// hostile state.json cannot point loom at files elsewhere.
fs::path checkpoint_file(const fs::path& dir, const std::string& name, const char* list) {
  LOOM_CHECK(!name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
                 name.find('\0') == std::string::npos,
             "checkpoint '{}': {} lists '{}', which is not a file name in the checkpoint",
             dir.string(), list, name);
  return dir / name;
}
fs::path checkpoint_file(const fs::path& dir, const nlohmann::json& name, const char* list) {
  LOOM_CHECK(name.is_string(), "checkpoint '{}': {} lists {}, which is not a file name",
             dir.string(), list, name.dump());
  return checkpoint_file(dir, name.get<std::string>(), list);
}

// No checkpoint holds more shards than this along one mesh dimension (a bound, so that a
// corrupt count is refused instead of allocated).
constexpr int64_t kMaxShards = int64_t{1} << 20;
// Nor a parameter more elements than this (2^48: far past any model, far below overflow).
constexpr int64_t kMaxElements = int64_t{1} << 48;

// "dim,full,padded,parts,units" (what the writer recorded) back into a ShardSpec, checked for
// what unshard() relies on.
parallel::tensor::ShardSpec parse_spec(const std::string& text, const std::string& where) {
  parallel::tensor::ShardSpec spec;
  int64_t* fields[] = {&spec.dim, &spec.full, &spec.padded, &spec.parts, &spec.units};
  const char* names[] = {"dim", "full", "padded", "parts", "units"};
  size_t pos = 0;
  for (size_t i = 0; i < 5; ++i) {
    const auto comma = text.find(',', pos);
    LOOM_CHECK(i == 4 ? comma == std::string::npos : comma != std::string::npos,
               "{}: malformed shard spec '{}' (dim,full,padded,parts,units)", where, text);
    *fields[i] = parse_int(text.substr(pos, comma - pos), i == 0 ? -1 : 0,
                           std::numeric_limits<int32_t>::max(),
                           fmt::format("shard spec '{}' field {}", text, names[i]), where);
    pos = comma + 1;
  }
  LOOM_CHECK(spec.parts >= 1 && (spec.padded == 0 || spec.padded >= spec.full),
             "{}: shard spec '{}' has {} parts and padded size {} for size {}", where, text,
             spec.parts, spec.padded, spec.full);
  return spec;
}

}  // namespace

namespace {

// Puts `whole` (key "model/<name>" or "optimizer/<name>") into `out` as `select` keeps it.
void keep_tensor(CheckpointContents& out, const CheckpointSelection& select, const std::string& key,
                 at::Tensor whole) {
  auto kept = select.keep ? select.keep(key, std::move(whole)) : std::move(whole);
  if (key.starts_with("model/"))
    out.model.insert_or_assign(key.substr(6), std::move(kept));
  else if (key.starts_with("optimizer/"))
    out.optimizer.insert_or_assign(key.substr(10), std::move(kept));
}

bool wanted(const CheckpointSelection& select, const std::string& key) {
  return !select.wanted || select.wanted(key);
}

// The shard files state.json lists under "model_shards": every writer's pieces of each wanted
// tensor, joined into the single-process tensor one tensor at a time (sharded ones from every tp
// rank's piece, replicated ones from any copy) and handed to `select.keep` before the next is
// read. The shard specs of all the model's tensors go into `out.specs`.
void assemble_shards(CheckpointContents& out, const CheckpointSelection& select) {
  struct Source {
    const core::SafetensorsReader* file;
    int64_t rank, size;
  };
  struct Pieces {
    std::vector<Source> sources;
    std::optional<parallel::tensor::ShardSpec> spec;
  };
  std::vector<core::SafetensorsReader> files;
  for (const auto& name : out.state.at("model_shards"))
    files.emplace_back(checkpoint_file(out.dir, name, "model_shards"));
  LOOM_CHECK(!files.empty(), "checkpoint '{}': state.json lists no model shard files",
             out.dir.string());
  std::map<std::string, Pieces> tensors;
  for (const auto& file : files) {
    const auto& meta = file.metadata();
    const auto size = metadata_int(meta, "loom.tp_size", 1, kMaxShards, file.path());
    const auto rank = metadata_int(meta, "loom.tp_rank", 0, size - 1, file.path());
    const auto first_size =
        metadata_int(files.front().metadata(), "loom.tp_size", 1, kMaxShards, files.front().path());
    LOOM_CHECK(size == first_size,
               "checkpoint shard '{}' says it is tp rank {} of {}, but '{}' was written at tp {}",
               file.path().string(), rank, size, files.front().path().string(), first_size);
    for (const auto& key : file.names()) {
      auto& p = tensors[key];
      p.sources.push_back({&file, rank, size});
      if (meta.count(key) && !p.spec) {
        p.spec = parse_spec(meta.at(key), file.path().string());
        if (key.starts_with("model/")) out.specs[key.substr(6)] = *p.spec;
      }
    }
  }
  for (const auto& [key, p] : tensors) {
    if (!wanted(select, key)) continue;
    at::Tensor whole;
    if (p.spec) {
      // Stages share the tied embedding: equal copies of a piece, the first one read is used.
      std::vector<at::Tensor> by_rank(static_cast<size_t>(p.sources.front().size));
      for (const auto& source : p.sources)
        if (!by_rank[static_cast<size_t>(source.rank)].defined())
          by_rank[static_cast<size_t>(source.rank)] = source.file->read(key);
      for (size_t r = 0; r < by_rank.size(); ++r)
        LOOM_CHECK(by_rank[r].defined(),
                   "checkpoint '{}': tensor '{}' lacks the shard of tp rank {} (its other shards "
                   "are in '{}')",
                   out.dir.string(), key, r, p.sources.front().file->path().string());
      p.spec->check(static_cast<int64_t>(by_rank.size()),
                    fmt::format("checkpoint '{}': tensor '{}'", out.dir.string(), key));
      whole = p.spec->unshard(by_rank);
    } else {
      whole = p.sources.front().file->read(key);  // replicated: tp ranks hold equal copies
    }
    keep_tensor(out, select, key, std::move(whole));
  }
}

// The tensors of one of the checkpoint's own files, each under `prefix`.
void load_file(CheckpointContents& out, const CheckpointSelection& select, const char* file,
               const std::string& prefix) {
  const core::SafetensorsReader reader(out.dir / file);
  for (const auto& name : reader.names())
    if (wanted(select, prefix + name)) keep_tensor(out, select, prefix + name, reader.read(name));
}

}  // namespace

std::string rank_state_name(int64_t rank, int64_t world) {
  return fmt::format("rank-state-{}-of-{}.safetensors", rank, world);
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
  core::remove_tree(tmp_dir, ec);  // leftovers of an earlier interrupted save
  fs::create_directories(tmp_dir, ec);
  LOOM_CHECK(!ec, "cannot create '{}': {}", tmp_dir.string(), ec.message());

  // A failure anywhere below (a full or read-only disk) leaves what was there: no partial
  // step-N.tmp, the previous copy of step N back under its name, `latest` untouched.
  const auto old_dir = dir / (name + ".old");
  try {
    // A model file written elsewhere (ZeRO-3 writes it unit by unit) comes with the moved files.
    const bool model_moved =
        std::any_of(moved_files.begin(), moved_files.end(),
                    [](const fs::path& f) { return f.filename() == kModelFile; });
    if (!model_moved) core::save_safetensors(tmp_dir / kModelFile, model);
    core::save_safetensors(tmp_dir / kOptimizerFile, optimizer);
    json checksums = json::object();
    if (!model_moved) checksums[kModelFile] = core::file_crc32(tmp_dir / kModelFile);
    checksums[kOptimizerFile] = core::file_crc32(tmp_dir / kOptimizerFile);
    for (const auto& file : extra_files) {
      if (!fs::exists(file)) continue;
      const auto target = tmp_dir / file.filename();
      core::account_write(target, fs::file_size(file));
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
    core::remove_tree(old_dir, ec);
    if (fs::exists(final_dir)) {
      fs::rename(final_dir, old_dir, ec);
      LOOM_CHECK(!ec, "cannot move '{}' aside: {}", final_dir.string(), ec.message());
    }
    fs::rename(tmp_dir, final_dir, ec);
    LOOM_CHECK(!ec, "cannot rename '{}' to '{}': {}", tmp_dir.string(), final_dir.string(),
               ec.message());
    core::fsync_path(dir);
    core::write_file_atomic(dir / "latest", name + "\n");
    core::remove_tree(old_dir, ec);
  } catch (...) {
    if (!fs::exists(final_dir, ec) && fs::exists(old_dir, ec)) fs::rename(old_dir, final_dir, ec);
    core::remove_tree(tmp_dir, ec);
    throw;
  }

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
    for (size_t i = 0; i + keep_last - 1 < older.size(); ++i)
      core::remove_tree(older[i].second, ec);
  }
  return final_dir;
}

std::optional<fs::path> latest_checkpoint(const fs::path& dir) {
  const auto pointer = dir / "latest";
  if (!fs::exists(pointer)) return std::nullopt;
  auto name = core::read_file(pointer);
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  // Only ever a checkpoint of this directory: `latest` is a file anyone could have edited.
  LOOM_CHECK(is_checkpoint_name(name),
             "'{}' names '{}', which is not a checkpoint of this directory (step-NNNNNNNN)",
             pointer.string(), name.substr(0, 64));
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

CheckpointContents open_checkpoint(const fs::path& path) {
  const fs::path ckpt = resolve_checkpoint(path);
  CheckpointContents out;
  out.dir = ckpt;
  try {
    out.state = json::parse(core::read_file(ckpt / kStateFile));
  } catch (const json::exception& e) {
    fail("checkpoint '{}': {} is not valid JSON: {}", ckpt.string(), kStateFile, e.what());
  }
  LOOM_CHECK(out.state.is_object(), "checkpoint '{}': {} holds JSON {}, not an object",
             ckpt.string(), kStateFile, out.state.type_name());
  const auto& version = out.state.value("format_version", json());
  LOOM_CHECK(version.is_number_integer() && version.get<int64_t>() == kFormatVersion,
             "checkpoint '{}' has format_version {}; this loom reads version {}", ckpt.string(),
             version.dump(), kFormatVersion);
  const auto& checksums = out.state.value("checksums", json::object());
  const auto& step = out.state.value("step", json());
  LOOM_CHECK(checksums.is_object() && checksums.contains(kModelFile) &&
                 checksums.contains(kOptimizerFile) && step.is_number_integer() &&
                 step.get<int64_t>() >= 0,
             "checkpoint '{}': {} lacks its step or checksums", ckpt.string(), kStateFile);
  for (const auto& [file, crc] : checksums.items()) {
    const auto path = checkpoint_file(ckpt, file, "checksums");
    LOOM_CHECK(fs::is_regular_file(path), "checkpoint '{}' is incomplete: '{}' is missing",
               ckpt.string(), file);
    const auto actual = core::file_crc32(path);
    LOOM_CHECK(crc.is_number_unsigned() && crc.get<uint64_t>() <= 0xFFFFFFFFu,
               "checkpoint '{}': the checksum of '{}' is {}, not a CRC-32", ckpt.string(), file,
               crc.dump());
    const auto expected = crc.get<uint32_t>();
    LOOM_CHECK(actual == expected,
               "checkpoint file '{}' is corrupt: CRC-32 {:08x}, expected {:08x}", path.string(),
               actual, expected);
  }
  for (const char* list : {"model_shards", "zero_shards"})
    LOOM_CHECK(!out.state.contains(list) || out.state[list].is_array(),
               "checkpoint '{}': {} '{}' is not a list of file names", ckpt.string(), kStateFile,
               list);
  out.step = step.get<int64_t>();
  return out;
}

void load_checkpoint_tensors(CheckpointContents& ckpt, const CheckpointSelection& select) {
  load_file(ckpt, select, kModelFile, "model/");
  load_file(ckpt, select, kOptimizerFile, "optimizer/");
  if (ckpt.state.contains("model_shards")) assemble_shards(ckpt, select);
}

CheckpointSelection model_parameters_only() {
  CheckpointSelection select;
  select.wanted = [](const std::string& key) { return key.starts_with("model/"); };
  return select;
}

CheckpointContents load_checkpoint(const fs::path& path, const CheckpointSelection& select) {
  auto out = open_checkpoint(path);
  load_checkpoint_tensors(out, select);
  return out;
}

void assemble_zero_shards(CheckpointContents& out, const CheckpointSelection& select) {
  const auto& ckpt = out.dir;
  LOOM_CHECK(out.state.contains("zero_shards"),
             "checkpoint '{}' lists no ZeRO shards it could reshard (written before loom could: "
             "resume it in the layout that wrote it)",
             ckpt.string());
  auto specs = out.specs;
  // Per optimizer entry ("<param>.exp_avg", ...): the tensor each tp rank's engines held,
  // rebuilt from the dp ranks' flat shards; then whole across tp.
  std::map<std::string, std::vector<at::Tensor>> by_tp;
  // Files of one engine (pipeline group and tp rank), indexed by dp rank; their tensors are read
  // one at a time, each dropped once its wanted segments are copied out.
  std::map<std::pair<std::string, int64_t>, std::vector<std::unique_ptr<core::SafetensorsReader>>>
      engines;
  for (const auto& name : out.state.at("zero_shards")) {
    const auto file = checkpoint_file(ckpt, name, "zero_shards");
    auto reader = std::make_unique<core::SafetensorsReader>(file);
    const auto& meta = reader->metadata();
    for (const char* key :
         {"loom.group", "loom.tp_rank", "loom.tp_size", "dp_rank", "dp_size", "bucket_params"})
      LOOM_CHECK(meta.count(key), "ZeRO shard '{}' lacks '{}' in its metadata", file.string(), key);
    // The specs of the engine's parameters (vocabulary padding exists even at tp 1).
    if (meta.count("loom.specs")) {
      const auto listed = metadata_json(meta, "loom.specs", file);  // outlives the loop
      LOOM_CHECK(listed.is_object(), "ZeRO shard '{}': 'loom.specs' is not a JSON object",
                 file.string());
      for (const auto& [param, text] : listed.items()) {
        LOOM_CHECK(text.is_string(), "ZeRO shard '{}': the spec of '{}' is not a string",
                   file.string(), param);
        specs.emplace(param, parse_spec(text.get<std::string>(), file.string()));
      }
    }
    const auto tp_size = metadata_int(meta, "loom.tp_size", 1, kMaxShards, file);
    const auto tp_rank = metadata_int(meta, "loom.tp_rank", 0, tp_size - 1, file);
    const auto dp_size = metadata_int(meta, "dp_size", 1, kMaxShards, file);
    const auto dp_rank = metadata_int(meta, "dp_rank", 0, dp_size - 1, file);
    auto& files = engines[{meta.at("loom.group"), tp_rank}];
    LOOM_CHECK(files.empty() || static_cast<int64_t>(files.size()) == dp_size,
               "ZeRO shard '{}' says dp size {}; another shard of its engine says {}",
               file.string(), dp_size, files.size());
    files.resize(static_cast<size_t>(dp_size));
    LOOM_CHECK(files[static_cast<size_t>(dp_rank)] == nullptr,
               "checkpoint '{}': two ZeRO shards claim dp rank {} of {} (tp rank {})",
               ckpt.string(), dp_rank, meta.at("loom.group"), tp_rank);
    files[static_cast<size_t>(dp_rank)] = std::move(reader);
  }
  for (auto& [engine, files] : engines) {
    const auto tp_rank = engine.second;
    for (size_t r = 0; r < files.size(); ++r)
      LOOM_CHECK(files[r] != nullptr,
                 "checkpoint '{}': the ZeRO shard of dp rank {} ({}, tp rank {}) is missing",
                 ckpt.string(), r, engine.first, tp_rank);
    const auto& first = *files.front();
    const auto tp_size =
        metadata_int(first.metadata(), "loom.tp_size", 1, kMaxShards, first.path());
    const auto buckets = metadata_json(first.metadata(), "bucket_params", first.path());
    LOOM_CHECK(buckets.is_array(), "ZeRO shard '{}': 'bucket_params' is not a JSON array",
               first.path().string());
    std::map<std::string, at::Tensor> flat;  // "<param>.<kind>" -> its elements
    for (size_t bi = 0; bi < buckets.size(); ++bi) {
      std::vector<std::string> names;
      std::vector<std::vector<int64_t>> shapes;
      std::vector<int64_t> numels;
      for (const auto& entry : buckets[bi]) {
        try {
          names.push_back(entry.at(0).get<std::string>());
          shapes.push_back(core::json_int64_list(
              entry.at(1),
              fmt::format("ZeRO shard '{}': bucket {} shape", first.path().string(), bi), 0));
        } catch (const nlohmann::json::exception& e) {
          fail("ZeRO shard '{}': bucket {} entry {} is not [name, shape]: {}",
               first.path().string(), bi, entry.dump(), e.what());
        }
        int64_t n = 1;
        for (auto d : shapes.back()) {
          LOOM_CHECK(d >= 0 && (d == 0 || n <= kMaxElements / d),
                     "ZeRO shard '{}': parameter '{}' has shape {}, not one loom writes",
                     first.path().string(), names.back(), entry.at(1).dump());
          n *= d;
        }
        numels.push_back(n);
      }
      const parallel::zero::FlatLayout layout(numels, static_cast<int64_t>(files.size()));
      for (const char* kind : {"exp_avg", "exp_avg_sq", "master"}) {
        const auto key = fmt::format("zero.bucket{}.{}", bi, kind);
        for (size_t r = 0; r < files.size(); ++r) {
          if (!files[r]->contains(key)) {
            // Masters exist only in some runs; the moments always.
            LOOM_CHECK(std::string(kind) == "master",
                       "checkpoint '{}': the ZeRO shard of dp rank {} ({}, tp rank {}) has no '{}'",
                       ckpt.string(), r, engine.first, tp_rank, key);
            continue;
          }
          const auto segments = layout.segments(static_cast<int64_t>(r));
          if (std::none_of(segments.begin(), segments.end(), [&](const auto& seg) {
                return wanted(select, fmt::format("optimizer/{}.{}", names[seg.param], kind));
              }))
            continue;  // none of this rank's parameters: not even read
          const auto shard = files[r]->read(key).reshape({-1});
          LOOM_CHECK(shard.numel() == layout.shard_numel(),
                     "checkpoint '{}': '{}' of dp rank {} ({}, tp rank {}) holds {} elements; its "
                     "bucket's layout needs {}",
                     ckpt.string(), key, r, engine.first, tp_rank, shard.numel(),
                     layout.shard_numel());
          for (const auto& seg : segments) {
            const auto entry = fmt::format("{}.{}", names[seg.param], kind);
            if (!wanted(select, "optimizer/" + entry)) continue;
            auto& whole = flat[entry];
            if (!whole.defined()) whole = at::zeros({numels[seg.param]}, shard.options());
            whole.narrow(0, seg.param_offset, seg.numel)
                .copy_(shard.narrow(0, seg.shard_offset, seg.numel));
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
  }
  for (auto& [entry, pieces] : by_tp) {
    const auto param = entry.substr(0, entry.rfind('.'));
    auto spec = specs.find(param);
    at::Tensor whole;
    if (spec != specs.end() && spec->second.sharded()) {
      for (size_t t = 0; t < pieces.size(); ++t)
        LOOM_CHECK(pieces[t].defined(), "checkpoint '{}': '{}' lacks the ZeRO shards of tp rank {}",
                   ckpt.string(), entry, t);
      spec->second.check(static_cast<int64_t>(pieces.size()),
                         fmt::format("checkpoint '{}': '{}'", ckpt.string(), entry));
      whole = spec->second.unshard(pieces);
    } else {
      for (auto& t : pieces)
        if (t.defined()) whole = t;
    }
    pieces.clear();
    keep_tensor(out, select, "optimizer/" + entry, std::move(whole));
  }
}

}  // namespace loom::train
