// The Trainer's checkpoints: saving the run (each layout's files), resuming it (in any layout),
// gathering the whole model and exporting it.
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <cstring>
#include <mutex>
#include <set>
#include <tuple>

#include "loom/core/error.h"
#include "loom/core/files.h"
#include "loom/core/format.h"
#include "loom/core/json.h"
#include "loom/core/rng.h"
#include "loom/dist/gather_tensors.h"
#include "loom/models/hf.h"
#include "loom/parallel/zero/zero_optimizer.h"
#include "loom/train/hf_export.h"
#include "loom/train/trainer.h"

namespace loom::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// The cp ranks of a replica hold the same parameters and optimizer state (only the sequences
// are split): the first of them writes what they share, so no two ranks write one file.
bool first_of_context_group(const dist::Mesh& mesh) {
  return mesh.coord(dist::Dim::cp) == 0;
}

// The checkpoint entry holding data-parallel rank r's dropout generator (a custom model's: loom's
// own models key their masks by position and save nothing); with a pipeline, each stage has its
// own (stage 0's under the plain name, so a run resumed without a pipeline continues stage 0's
// stream).
std::string rng_key(int64_t dp_rank, int64_t pp_rank = 0) {
  const auto base = dp_rank == 0 ? std::string("rng.cpu") : fmt::format("rng.cpu.dp{}", dp_rank);
  return pp_rank > 0 ? fmt::format("{}.pp{}", base, pp_rank) : base;
}

// The parameter an optimizer-state entry ("<param>.exp_avg", ...) belongs to; empty for the
// step count and RNG states.
std::string param_of_state_key(const std::string& key, const models::CausalLM& model) {
  for (const char* suffix : {".exp_avg_sq", ".exp_avg", ".master"}) {
    if (!key.ends_with(suffix)) continue;
    auto name = key.substr(0, key.size() - std::string(suffix).size());
    if (model.shard_specs().count(name)) return name;
  }
  return {};
}

// The file holding the model shards (and AdamW moments) of pipeline rank p, tensor-parallel
// rank t (written by data-parallel replica 0).
std::string model_shard_name(int64_t pp_rank, int64_t tp_rank) {
  return fmt::format("model-pp{:03d}-tp{:03d}.safetensors", pp_rank, tp_rank);
}

// Where a rank's coordinates put it, for ZeRO shard file names.
struct ShardCoords {
  int64_t dp_rank = 0, dp = 1, tp_rank = 0, tp = 1, pp_rank = 0, pp = 1, chunk = 0;
};

ShardCoords coords_of(const dist::Mesh& mesh, int64_t chunk) {
  return {mesh.coord(dist::Dim::dp),
          mesh.size(dist::Dim::dp),
          mesh.coord(dist::Dim::tp),
          mesh.size(dist::Dim::tp),
          mesh.coord(dist::Dim::pp),
          mesh.size(dist::Dim::pp),
          chunk};
}

// The file holding one ZeRO optimizer shard inside a checkpoint: dp rank r's (of chunk c of
// pipeline rank p, tensor-parallel rank t, when those exist).
std::string zero_shard_name(const ShardCoords& c) {
  if (c.tp == 1 && c.pp == 1)
    return fmt::format("zero-dp{:05d}-of-{:05d}.safetensors", c.dp_rank, c.dp);
  return fmt::format("zero-pp{:03d}-c{}-tp{:03d}-dp{:05d}-of-pp{}-tp{}-dp{}.safetensors", c.pp_rank,
                     c.chunk, c.tp_rank, c.dp_rank, c.pp, c.tp, c.dp);
}

}  // namespace

std::shared_ptr<models::CausalLM> load_model_from_checkpoint(const fs::path& path) {
  return load_model_from_checkpoint(load_checkpoint(path, model_parameters_only()));
}

std::shared_ptr<models::CausalLM> load_model_from_checkpoint(const CheckpointContents& ckpt) {
  auto config = models::ModelConfig::from_json(ckpt.state.value("model_config", json()));
  auto model = models::make_model(config);
  // An fp64 run's checkpoint loads as an fp64 model (not rounded to fp32 on the way in).
  const auto train_config = ckpt.state.value("train_config", json());
  if (train_config.value("precision", std::string("fp32")) == "fp64") model->to(at::kDouble);
  models::load_parameters(*model, ckpt.model, ckpt.dir.string());
  return model;
}

// ZeRO-3 gathers the parameters as this rank's model holds them: tp shards, the vocabulary
// padded (to --pad-vocab-multiple, even at tp 1): joined over tp (collective over tp) and cut
// back to the single-process shapes every checkpoint and export holds.
namespace {
std::map<std::string, at::Tensor> unpadded(const models::CausalLM& model,
                                           std::map<std::string, at::Tensor> params) {
  for (auto& [name, t] : params) t = models::gather_shard(model, name, t);
  return params;
}
}  // namespace

std::map<std::string, at::Tensor> Trainer::gather_parameters() {
  if (mesh_->size(dist::Dim::pp) == 1) {
    if (config_.zero == 3)
      return unpadded(model(), run().optimizer->sharded_state().front()->gather_parameters());
    return models::gather_parameters(model());
  }
  std::map<std::string, at::Tensor> out;
  // The tied embedding's two copies are equal: the first one received is kept.
  for (auto& [name, t] :
       dist::all_gather_named_tensors(mesh_->comm(dist::Dim::pp), local_full_state(false)))
    out.emplace(name, t);
  return out;
}

core::NamedTensors Trainer::local_full_state(bool optimizer) const {
  core::NamedTensors out;
  const auto zero = run().optimizer->sharded_state();
  for (size_t c = 0; c < run().chunks.size(); ++c) {
    const auto& chunk = *run().chunks[c];
    // Stage 3 holds 1/dp of each parameter: gathered over dp (collective) first.
    auto params = config_.zero == 3 ? unpadded(chunk, zero[c]->gather_parameters())
                                    : models::gather_parameters(chunk);
    for (auto& kv : params) out.push_back(std::move(kv));
  }
  if (!optimizer) return out;
  for (auto [key, tensor] : run().optimizer->per_parameter_state()) {
    for (const auto& chunk : run().chunks) {
      const auto param = param_of_state_key(key, *chunk);
      if (param.empty()) continue;
      tensor = models::gather_shard(*chunk, param, tensor);
      break;
    }
    out.emplace_back("optimizer/" + key, tensor);
  }
  return out;
}

std::string Trainer::write_stage3_parameters(const fs::path& file, const std::string& prefix,
                                             const core::NamedTensors& extra,
                                             const std::map<std::string, std::string>& metadata) {
  // Single-process shapes (no prefix) exist only at tp 1, where cutting the padded vocabulary
  // back needs no collective.
  const bool whole = prefix.empty();
  LOOM_CHECK(!whole || mesh_->size(dist::Dim::tp) == 1,
             "stage 3 writes single-process tensors at tp 1 only");
  const bool writes = data_rank() == 0 && first_of_context_group(*mesh_);
  std::unique_ptr<core::SafetensorsWriter> writer;
  std::string error;
  if (writes) {
    try {
      std::vector<core::SafetensorsWriter::Entry> entries;
      std::set<std::string> listed;  // a rank's chunks may hold equal copies: listed once
      for (const auto& chunk : run().chunks)
        for (const auto& item : chunk->named_parameters()) {
          if (!listed.insert(item.key()).second) continue;
          auto shape = item.value().sizes().vec();
          if (whole) shape = chunk->shard_spec(item.key()).full_shape(shape);
          entries.push_back({prefix + item.key(), item.value().scalar_type(), shape});
        }
      for (const auto& [key, t] : extra) entries.push_back({key, t.scalar_type(), t.sizes().vec()});
      writer = std::make_unique<core::SafetensorsWriter>(file, entries, metadata);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  // Each chunk's engine gathers its units in turn. A failed write stops the writing, not the
  // gathers the other ranks wait in.
  const auto zero = run().optimizer->sharded_state();
  std::set<std::string> written;
  for (size_t c = 0; c < zero.size(); ++c) {
    const auto& chunk = *run().chunks[c];
    zero[c]->for_each_gathered_parameter(
        /*only_rank=*/0, [&](const std::string& name, const at::Tensor& value) {
          if (!error.empty() || !writes || !written.insert(name).second) return;
          try {
            writer->write(prefix + name, whole ? models::gather_shard(chunk, name, value) : value);
          } catch (const std::exception& e) {
            error = e.what();
          }
        });
  }
  if (writes && error.empty()) {
    try {
      for (const auto& [key, t] : extra) writer->write(key, t);
      writer->finish();
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  return error;
}

CheckpointSelection Trainer::rank_selection(const fs::path& dir) const {
  // This rank's parameters: the chunk holding each and its local shape.
  struct Held {
    const models::CausalLM* chunk;
    std::vector<int64_t> local_shape;
  };
  auto held = std::make_shared<std::map<std::string, Held>>();
  for (const auto& chunk : run().chunks)
    for (const auto& item : chunk->named_parameters())
      held->emplace(item.key(), Held{chunk.get(), item.value().sizes().vec()});
  // The parameter a checkpoint key belongs to ("" for entries of none: step counts, RNG states).
  auto param_of = [](const std::string& key) -> std::string {
    if (key.starts_with("model/")) return key.substr(6);
    if (!key.starts_with("optimizer/")) return {};
    for (const char* suffix : {".exp_avg_sq", ".exp_avg", ".master"})
      if (key.ends_with(suffix)) return key.substr(10, key.size() - 10 - std::strlen(suffix));
    return {};
  };
  CheckpointSelection select;
  select.wanted = [held, param_of](const std::string& key) {
    const auto param = param_of(key);
    return param.empty() || held->count(param) > 0;  // not another stage's parameter's
  };
  select.keep = [held, param_of, dir](const std::string& key, at::Tensor whole) {
    const auto param = param_of(key);
    auto it = held->find(param);
    if (it == held->end()) return whole;
    const auto& [chunk, local_shape] = it->second;
    const auto& spec = chunk->shard_spec(param);
    const auto full_shape = spec.full_shape(local_shape);
    LOOM_CHECK(whole.sizes() == at::IntArrayRef(full_shape),
               "'{}': tensor '{}' has shape {} but the model needs {}", dir.string(),
               key.substr(key.find('/') + 1), whole.sizes(), at::IntArrayRef(full_shape));
    if (!spec.sharded()) return whole;
    // A tensor of its own (a piece of a view would keep the whole one alive until the end).
    auto piece = spec.shard(whole, chunk->tp().rank(), chunk->tp().size());
    return piece.is_alias_of(whole) && piece.numel() < whole.numel() ? piece.clone() : piece;
  };
  return select;
}

std::pair<std::map<std::string, at::Tensor>, core::NamedTensors> Trainer::collect_for_rank0(
    bool optimizer, const core::NamedTensors& extra_optimizer) {
  std::pair<std::map<std::string, at::Tensor>, core::NamedTensors> out;
  // Replica 0's tp ranks assemble single-process tensors (the other replicas hold the same).
  if (data_rank() != 0) return out;
  auto mine = local_full_state(optimizer);
  for (const auto& [key, t] : extra_optimizer) mine.emplace_back("optimizer/" + key, t);
  if (mesh_->size(dist::Dim::pp) > 1) {
    // Every stage's tp rank 0 sends rank 0 its stages (the other tp ranks hold copies).
    if (mesh_->coord(dist::Dim::tp) != 0) mine.clear();
    mine = dist::gather_named_tensors(mesh_->comm(dist::Dim::pp), 0, mine);
  }
  if (!is_rank0()) return out;
  std::set<std::string> seen;  // the tied embedding (and its moments) come twice, equal
  for (auto& [name, t] : mine) {
    if (!seen.insert(name).second) continue;
    if (name.starts_with("optimizer/"))
      out.second.emplace_back(name.substr(std::string("optimizer/").size()), std::move(t));
    else
      out.first.emplace(name, std::move(t));
  }
  return out;
}

void Trainer::wait_for_checkpoint() {
  if (!save_in_flight_) return;
  save_in_flight_ = false;
  std::exception_ptr failure;
  if (is_rank0()) failure = writer_.wait();
  if (failure) {  // rank 0's error, saying which checkpoint it was writing
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& e) {
      failure = std::make_exception_ptr(Error(fmt::format(
          "checkpoint '{}' (written in the background): {}", in_flight_dir_.string(), e.what())));
    }
  }
  share_rank0_outcome(
      failure, fmt::format("write checkpoint '{}' in the background", in_flight_dir_.string()));
}

fs::path Trainer::save_checkpoint(bool background) {
  wait_for_checkpoint();
  const auto zero = run().optimizer->sharded_state();
  LOOM_CHECK(!config_.save_dir.empty(), "saving a checkpoint needs --save-dir");
  // Data-parallel replicas hold the same state, except each rank's dropout generator (custom
  // models): those are gathered, then rank 0 writes everything while the others wait for the
  // outcome.
  core::NamedTensors rng_states;
  if (custom_model_) {
    auto gen = dropout_generator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng_states.emplace_back(rng_key(0, mesh_->coord(dist::Dim::pp)), gen.get_state());
  }
  if (custom_model_ && data_ranks() > 1) {
    auto& dp = mesh_->comm(dist::Dim::dp);
    const auto mine = dist::on_comm_device(dp, rng_states.front().second).contiguous();
    auto all = at::empty({data_ranks(), mine.numel()}, mine.options());
    dp.all_gather(all, mine);
    all = all.cpu();  // generator states are host tensors
    for (int64_t r = 1; r < data_ranks(); ++r)
      rng_states.emplace_back(rng_key(r, mesh_->coord(dist::Dim::pp)), all[r].clone());
  }
  // Checkpoints hold single-process tensors, whatever tp is: the tp ranks of replica 0 assemble
  // them (the other replicas hold the same values and skip the work and the memory). With ZeRO
  // the parameters are assembled from the dp ranks (stage 3) and each rank writes its own
  // optimizer shard, which rank 0 moves into the checkpoint with the rest.
  std::map<std::string, at::Tensor> params;
  core::NamedTensors opt_state;
  // A model split over tp or pp is written as one file per (pp, tp) rank of replica 0, each
  // holding that rank's shards (parameters, AdamW moments, RNG states) with their shard specs:
  // no rank ever holds the whole model to save it, and a loader reassembles any layout.
  const bool sharded_files = mesh_->size(dist::Dim::tp) * mesh_->size(dist::Dim::pp) > 1;
  core::NamedTensors my_shard;
  std::map<std::string, std::string> my_specs;
  if (sharded_files) {
    opt_state.emplace_back("step", at::tensor(run().optimizer->steps_taken(), at::kLong));
    if (data_rank() == 0) {
      my_specs["loom.tp_rank"] = std::to_string(mesh_->coord(dist::Dim::tp));
      my_specs["loom.tp_size"] = std::to_string(mesh_->size(dist::Dim::tp));
      auto add_spec = [&](const std::string& key, const models::CausalLM& part,
                          const std::string& param) {
        const auto& spec = part.shard_spec(param);
        if (spec.sharded())
          my_specs[key] = fmt::format("{},{},{},{},{}", spec.dim, spec.full, spec.padded,
                                      spec.parts, spec.units);
      };
      std::set<std::string> added;
      auto add = [&](const std::string& key, const models::CausalLM& part, const std::string& param,
                     const at::Tensor& t) {
        // A rank's chunks may hold equal copies of one parameter (a block shared by layers on
        // two of its stages): written once.
        if (!added.insert(key).second) return;
        my_shard.emplace_back(key, t.detach());
        add_spec(key, part, param);
      };
      // Stage 3 holds 1/dp of each parameter: write_stage3_parameters gathers them below.
      for (const auto& chunk : run().chunks)
        for (const auto& item : chunk->named_parameters()) {
          if (config_.zero == 3)
            add_spec("model/" + item.key(), *chunk, item.key());
          else
            add("model/" + item.key(), *chunk, item.key(), item.value());
        }
      if (zero.empty())
        for (const auto& [key, t] : run().optimizer->per_parameter_state())
          for (const auto& chunk : run().chunks) {
            const auto param = param_of_state_key(key, *chunk);
            if (param.empty()) continue;
            add("optimizer/" + key, *chunk, param, t);
            break;
          }
      for (const auto& [key, t] : rng_states) my_shard.emplace_back("optimizer/" + key, t);
    }
    rng_states.clear();
  } else if (config_.zero == 3) {
    // model.safetensors is written unit by unit below (write_stage3_parameters).
    opt_state.emplace_back("step", at::tensor(zero.front()->steps_taken(), at::kLong));
  } else if (!zero.empty()) {
    // Stages 1-2 hold whole parameters (tp shards): collected like plain data parallelism's;
    // the optimizer state stays in the per-rank shards.
    std::tie(params, opt_state) = collect_for_rank0(false, rng_states);
    rng_states.clear();
    opt_state.emplace_back("step", at::tensor(zero.front()->steps_taken(), at::kLong));
  } else {
    // With a pipeline every stage's state (its RNG states included) travels to rank 0.
    std::tie(params, opt_state) = collect_for_rank0(true, rng_states);
    rng_states.clear();
  }
  const auto dir = checkpoint_dir(config_.save_dir, run().step);
  std::vector<fs::path> shard_files;
  std::vector<std::string> model_files, zero_files, rank_state_files;
  // What only this rank holds (error feedback): a file per rank when any rank has some.
  core::NamedTensors rank_state;
  std::map<std::string, std::string> rank_state_meta;
  runtime_->save_rank_state(rank_state, rank_state_meta);
  const bool rank_files = reduce_over_world(rank_state.empty() ? 0 : 1, dist::ReduceOp::Max) != 0;
  if (!zero.empty() || sharded_files || rank_files) {
    const auto staging = fs::path(config_.save_dir) / (dir.filename().string() + ".zero-staging");
    std::exception_ptr failure;
    if (is_rank0()) {
      try {
        std::error_code ec;
        core::remove_tree(staging, ec);  // leftovers of an interrupted save
        fs::create_directories(staging, ec);
        LOOM_CHECK(!ec, "cannot create '{}': {}", staging.string(), ec.message());
      } catch (...) {
        failure = std::current_exception();
      }
    }
    share_rank0_outcome(failure, fmt::format("prepare '{}'", staging.string()));
    std::string error;
    try {
      for (size_t c = 0; c < zero.size() && first_of_context_group(*mesh_); ++c) {
        // Where the engine sits, so a loader can cut its shards back into parameters.
        auto meta = zero[c]->state_metadata();
        meta["loom.group"] = fmt::format("pp{}-c{}", mesh_->coord(dist::Dim::pp), c);
        meta["loom.tp_rank"] = std::to_string(mesh_->coord(dist::Dim::tp));
        meta["loom.tp_size"] = std::to_string(mesh_->size(dist::Dim::tp));
        json specs = json::object();  // how each split (or padded) parameter maps to the whole
        for (const auto& item : run().chunks[c]->named_parameters()) {
          const auto& spec = run().chunks[c]->shard_spec(item.key());
          if (spec.sharded())
            specs[item.key()] = fmt::format("{},{},{},{},{}", spec.dim, spec.full, spec.padded,
                                            spec.parts, spec.units);
        }
        meta["loom.specs"] = specs.dump();
        core::save_safetensors(
            staging / zero_shard_name(coords_of(*mesh_, static_cast<int64_t>(c))), zero[c]->state(),
            meta);
      }
      if (rank_files)
        core::save_safetensors(staging / rank_state_name(mesh_->rank(), mesh_->world_size()),
                               rank_state, rank_state_meta);
      if (sharded_files && data_rank() == 0 && first_of_context_group(*mesh_) && config_.zero != 3)
        core::save_safetensors(
            staging / model_shard_name(mesh_->coord(dist::Dim::pp), mesh_->coord(dist::Dim::tp)),
            my_shard, my_specs);
    } catch (const std::exception& e) {
      error = e.what();
    }
    // Every rank takes part in stage 3's gathers, whatever happened above.
    if (config_.zero == 3) {
      const auto stage3_error =
          sharded_files
              ? write_stage3_parameters(staging / model_shard_name(mesh_->coord(dist::Dim::pp),
                                                                   mesh_->coord(dist::Dim::tp)),
                                        "model/", my_shard, my_specs)
              : write_stage3_parameters(staging / "model.safetensors", "", {}, {});
      if (error.empty()) error = stage3_error;
      if (!sharded_files) shard_files.push_back(staging / "model.safetensors");
    }
    try {
      share_outcome(error, fmt::format("write their checkpoint shards for step {} into '{}'",
                                       run().step, staging.string()));
    } catch (...) {
      std::error_code ec;
      if (is_rank0()) core::remove_tree(staging, ec);  // a full disk keeps no partial shards
      throw;
    }
    for (int64_t p = 0; p < mesh_->size(dist::Dim::pp); ++p)
      for (int64_t c = 0; c < static_cast<int64_t>(zero.size()); ++c)
        for (int64_t t = 0; t < mesh_->size(dist::Dim::tp); ++t)
          for (int64_t r = 0; r < data_ranks(); ++r) {
            zero_files.push_back(zero_shard_name({r, data_ranks(), t, mesh_->size(dist::Dim::tp), p,
                                                  mesh_->size(dist::Dim::pp), c}));
            shard_files.push_back(staging / zero_files.back());
          }
    if (rank_files)
      for (int64_t r = 0; r < mesh_->world_size(); ++r) {
        rank_state_files.push_back(rank_state_name(r, mesh_->world_size()));
        shard_files.push_back(staging / rank_state_files.back());
      }
    if (sharded_files)
      for (int64_t p = 0; p < mesh_->size(dist::Dim::pp); ++p)
        for (int64_t t = 0; t < mesh_->size(dist::Dim::tp); ++t) {
          model_files.push_back(model_shard_name(p, t));
          shard_files.push_back(staging / model_files.back());
        }
  }
  // What the strategies own: state.json entries and tensors (rank 0's are written).
  json strategy_state = json::object();
  core::NamedTensors strategy_tensors;
  runtime_->save_state(strategy_state, strategy_tensors);
  std::exception_ptr failure;
  if (is_rank0()) {
    try {
      for (auto& kv : rng_states) opt_state.push_back(std::move(kv));
      for (auto& kv : strategy_tensors) opt_state.push_back(std::move(kv));
      json state = {{"model_config", model().config().to_json()},
                    {"train_config", config_.to_json()},
                    {"data_tokens", train_sampler_->tokens()},
                    {"elapsed_s", elapsed_s()},
                    {"tokenizer", tokenizer_->kind()}};
      state.update(strategy_state);
      if (!model_files.empty()) state["model_shards"] = model_files;
      if (!zero_files.empty()) state["zero_shards"] = zero_files;
      if (!rank_state_files.empty()) state["rank_state_files"] = rank_state_files;
      std::vector<fs::path> extras;
      for (const std::string& f : data::tokenizer_file_names())
        extras.push_back(tokenizer_dir_ / f);
      core::NamedTensors named(params.begin(), params.end());
      auto write = [save_dir = fs::path(config_.save_dir), step = run().step, dir,
                    keep = static_cast<int>(config_.keep_checkpoints), shard_files, extras,
                    state = std::move(state), background](const core::NamedTensors& model,
                                                          const core::NamedTensors& optimizer) {
        try {
          train::save_checkpoint(save_dir, step, model, optimizer, state, extras, keep,
                                 shard_files);
        } catch (...) {
          std::error_code ec;
          if (!shard_files.empty()) core::remove_tree(shard_files.front().parent_path(), ec);
          throw;
        }
        if (!shard_files.empty()) {
          std::error_code ec;
          core::remove_tree(shard_files.front().parent_path(), ec);
        }
        spdlog::info("saved checkpoint {}{}", dir.string(),
                     background ? " (written in the background)" : "");
      };
      if (background) {
        // Copies: from the next step on, training changes the live tensors.
        auto copy = [](core::NamedTensors& tensors) {
          for (auto& [key, t] : tensors)
            t = t.device().is_cpu() ? t.detach().clone() : t.detach().to(at::kCPU);
        };
        copy(named);
        copy(opt_state);
        writer_.start([write = std::move(write), named = std::move(named),
                       opt_state = std::move(opt_state)] { write(named, opt_state); },
                      fmt::format("checkpoint {}", dir.string()));
      } else {
        write(named, opt_state);
      }
    } catch (...) {
      failure = std::current_exception();
      std::error_code ec;
      if (!shard_files.empty()) core::remove_tree(shard_files.front().parent_path(), ec);
    }
  }
  share_rank0_outcome(
      failure, fmt::format("write checkpoint step {} into '{}'", run().step, config_.save_dir));
  save_in_flight_ = background;
  in_flight_dir_ = dir;
  return dir;
}

void Trainer::share_outcome(const std::string& error, const std::string& what) {
  const int failed = reduce_over_world(error.empty() ? 0 : 1, dist::ReduceOp::Sum);
  LOOM_CHECK(error.empty(), "{}", error);
  LOOM_CHECK(failed == 0, "{} rank(s) could not {} (their errors say why)", failed, what);
}

void Trainer::share_rank0_outcome(const std::exception_ptr& failure, const std::string& what) {
  if (mesh_->world_size() > 1) {
    // However long the write takes, the others wait for it (not the watchdog's limit), and they
    // learn whether it failed rather than hanging in the next collective.
    auto outcome = at::full({1}, failure ? 1 : 0, at::kInt);
    dist::ScopedTimeout patient(mesh_->world(), dist::Seconds(24 * 3600.0));
    mesh_->world().broadcast(outcome, 0);
    LOOM_CHECK(is_rank0() || outcome.item<int>() == 0, "rank 0 failed to {} (its error says why)",
               what);
  }
  if (failure) std::rethrow_exception(failure);
}

void Trainer::load_checkpoint_parameters(CheckpointContents& resume) {
  // This rank's part of the checkpoint, tensor by tensor: its chunks' parameters and their
  // optimizer state as its tp shards, the step counts and RNG states. Ranks read different
  // tensors, so one may fail alone: all learn of it here (before ZeRO takes the parameters
  // over, and before any collective).
  std::string error;
  try {
    load_checkpoint_tensors(resume, rank_selection(resume.dir));
    for (auto& chunk : run().chunks)
      models::load_parameter_shards(*chunk, resume.model, resume.dir.string());
  } catch (const std::exception& e) {
    error = e.what();
  }
  resume.model.clear();  // copied into the parameters
  share_outcome(error, fmt::format("load their part of checkpoint '{}'", resume.dir.string()));
}

void Trainer::load_checkpoint_state(CheckpointContents& resume) {
  const auto zero = run().optimizer->sharded_state();
  const auto& model_config = run().model_config;
  const auto saved = TrainConfig::from_json(resume.state.value("train_config", json()));
  // The optimizer state: ZeRO shards of the same layout load rank by rank, exactly; anything
  // else (another layout, ZeRO to replicated or back) goes through the whole per-parameter
  // state the rank's selection kept (its tp shards; ZeRO then takes its segments).
  const auto saved_bounds =
      resume.state.contains("pipeline_bounds")
          ? core::json_int64_list(resume.state["pipeline_bounds"], "state.json pipeline_bounds")
          : std::vector<int64_t>{0, model_config.n_layers};
  const auto& bounds = run().plan.stage_bounds;
  const bool same_zero_layout =
      !zero.empty() && saved.zero == config_.zero && saved.dp == data_ranks() &&
      saved.tp == mesh_->size(dist::Dim::tp) && saved.pp == mesh_->size(dist::Dim::pp) &&
      saved.virtual_stages == config_.virtual_stages && saved_bounds == bounds &&
      saved.bucket_mb == config_.bucket_mb &&
      saved.vocab_padding_multiple() == config_.vocab_padding_multiple();
  if (saved.zero != config_.zero || (saved.zero > 0 && !same_zero_layout))
    spdlog::info(
        "checkpoint '{}' holds {} optimizer state of dp {} x tp {} x pp {}; resharding it for "
        "{} at dp {} x tp {} x pp {}",
        resume.dir.string(), saved.zero > 0 ? fmt::format("ZeRO-{}", saved.zero) : "replicated",
        saved.dp, saved.tp, saved.pp,
        config_.zero > 0 ? fmt::format("ZeRO-{}", config_.zero) : "replicated AdamW", data_ranks(),
        mesh_->size(dist::Dim::tp), mesh_->size(dist::Dim::pp));
  // A rank that cannot load its state tells the others, which would otherwise wait for it in
  // the first collective.
  std::string error;
  try {
    if (same_zero_layout) {
      for (size_t c = 0; c < zero.size(); ++c) {
        const auto shard_file =
            resume.dir / zero_shard_name(coords_of(*mesh_, static_cast<int64_t>(c)));
        LOOM_CHECK(std::filesystem::exists(shard_file),
                   "checkpoint '{}' has no ZeRO optimizer shard for dp rank {} of {}: '{}' is "
                   "missing",
                   resume.dir.string(), data_rank(), data_ranks(), shard_file.string());
        auto shard = core::load_safetensors(shard_file);
        zero[c]->load_state(shard.tensors, shard.metadata, shard_file.string());
      }
    } else {
      // ZeRO shards of another layout: cut back into per-parameter state first (this rank's
      // parameters' only, as its tp shards).
      if (saved.zero > 0) assemble_zero_shards(resume, rank_selection(resume.dir));
      const auto& opt_state = resume.optimizer;
      const auto source =
          fmt::format("checkpoint '{}'{}", resume.dir.string(),
                      saved.zero > 0 && !resume.state.contains("zero_shards")
                          ? " (its ZeRO shards predate resharding: resume it in the layout "
                            "that wrote it)"
                          : "");
      run().optimizer->load_per_parameter_state(opt_state, source);
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  share_outcome(error, fmt::format("load their optimizer state from '{}'", resume.dir.string()));
  run().step = resume.step;
  runtime_->load_state(resume);
  // loom's own models' dropout needs nothing restored (seed_dropout gave it the run's seed, and
  // masks are keyed by step); a custom model's generator continues where it was.
  if (custom_model_) {
    auto gen = dropout_generator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    auto rng = resume.optimizer.find(rng_key(data_rank(), mesh_->coord(dist::Dim::pp)));
    if (rng != resume.optimizer.end()) {
      gen.set_state(rng->second);
    } else {
      const auto saved = TrainConfig::from_json(resume.state.value("train_config", json()));
      LOOM_CHECK(data_rank() > 0 || saved.pp != mesh_->size(dist::Dim::pp),
                 "checkpoint '{}' has no RNG state", resume.dir.string());
      // Resuming at more data-parallel ranks, or another pipeline split, than the checkpoint
      // was written with: this rank had no generator then. Dropout masks differ from any
      // earlier run from here on.
      spdlog::warn(
          "checkpoint '{}' has no RNG state for dp rank {} (pp rank {}); seeding it afresh",
          resume.dir.string(), data_rank(), mesh_->coord(dist::Dim::pp));
      gen.set_current_seed(core::mix_seed(
          {config_.seed, core::stable_hash("dropout"), static_cast<uint64_t>(data_rank()),
           static_cast<uint64_t>(mesh_->coord(dist::Dim::pp)), static_cast<uint64_t>(run().step)}));
    }
  }
  elapsed_before_ = resume.state.value("elapsed_s", 0.0);
  LOOM_CHECK(run().step <= config_.steps, "checkpoint '{}' is at step {}, past --steps {}",
             resume.dir.string(), run().step, config_.steps);
  spdlog::info("resumed from {} at step {}", resume.dir.string(), run().step);
}

void Trainer::export_hf() {
  // Assembled from the shards by replica 0's tp ranks, written by rank 0 as the
  // single-process model.
  std::map<std::string, at::Tensor> params;
  if (config_.zero == 3 && mesh_->size(dist::Dim::pp) == 1)
    params = unpadded(model(), run().optimizer->sharded_state().front()->gather_parameters(
                                   /*only_rank=*/0));  // collective over dp
  else if (config_.zero == 3)
    params = gather_parameters();  // stage 3's gathers are collective over dp: every rank joins
  else
    params = collect_for_rank0(false, {}).first;
  std::exception_ptr failure;
  if (is_rank0()) {
    try {
      auto whole = models::make_model(model().config());
      models::load_parameters(*whole, params, "the trained model");
      write_hf_export(*whole, *tokenizer_, config_.export_hf, config_.export_hf_shard_mb);
      spdlog::info("exported Hugging Face model to {}{}", config_.export_hf,
                   config_.precision == "fp64"
                       ? " (the fp64 parameters rounded to float32: Hugging Face models are "
                         "float32 or narrower)"
                       : "");
    } catch (...) {
      failure = std::current_exception();
    }
  }
  share_rank0_outcome(failure,
                      fmt::format("export the Hugging Face model to '{}'", config_.export_hf));
}

}  // namespace loom::train
