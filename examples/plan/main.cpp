// loom-plan: the parallel layouts that can train a model on a world of ranks, ranked by the
// cost model's predicted tokens per second (docs/planner.md).
#include <cstdio>
#include <filesystem>
#include <optional>

#include "loom/apps/cli.h"
#include "loom/loom.h"

int main(int argc, char** argv) {
  CLI::App app{
      "List the layouts (dp x tp x pp x cp, ZeRO stage, micro-batches, schedule, activation "
      "checkpointing) that fit in memory on a world of ranks, best predicted tokens/s first.",
      "loom-plan"};
  std::string model = "gpt2", preset = "gpt2-mini", profile = "h100-node", precision = "bf16";
  std::string share_layers;
  int64_t world = 1, batch_size = 8, seq_len = 128, layers = 0, vocab_size = 0, top = 10;
  bool as_json = false, measure = false;
  std::string out, device = "cpu", measure_mesh;
  app.add_option("--model", model, "Model family: gpt2 | llama")->capture_default_str();
  app.add_option("--preset", preset,
                 "Model shape: gpt2-tiny, gpt2-mini, gpt2-124m, gpt2-350m, llama-tiny, llama-mini, "
                 "llama-1b, llama-8b")
      ->capture_default_str();
  app.add_option("--layers", layers, "Transformer blocks (0: the preset's)");
  app.add_option("--vocab-size", vocab_size, "Vocabulary size (0: the preset's)");
  app.add_option("--share-layers", share_layers, "Cross-layer parameter sharing pattern");
  app.add_option("--world", world, "Ranks (processes, one device each)")->capture_default_str();
  app.add_option("--batch-size", batch_size, "Global batch: sequences per optimizer step")
      ->capture_default_str();
  app.add_option("--seq-len", seq_len, "Tokens per sequence")->capture_default_str();
  app.add_option("--precision", precision, "fp32 | bf16 | fp64")->capture_default_str();
  app.add_option("--profile", profile,
                 "Machine profile: a JSON file, or a built-in one (h100-node, h200-node)")
      ->capture_default_str();
  app.add_option("--top", top, "How many layouts to list")->capture_default_str();
  app.add_flag("--json", as_json,
               "Print a JSON array (best first) of objects with dp, tp, pp, zero, micro_batches, "
               "schedule, step_s, memory_bytes, ...");
  app.add_flag("--measure", measure,
               "Measure this machine instead (run under mpirun with one rank per device): "
               "matmul, attention and AdamW rates, and all-reduces within and between nodes; "
               "rank 0 writes the profile to --out");
  app.add_option("--out", out, "Where --measure writes the profile (JSON)");
  app.add_option("--device", device, "What --measure times: cpu | cuda (this rank's GPU)")
      ->capture_default_str();
  app.add_option("--measure-mesh", measure_mesh,
                 "With --measure: also time all-reduces over each dimension's groups of this "
                 "layout's mesh, e.g. 'tp=2,pp=2' (dp: what the others leave of the world), and "
                 "write them as the profile's per-dimension links");
  std::optional<loom::dist::Runtime> runtime;
  return loom::apps::run_app(app, argc, argv, [&] {
    LOOM_CHECK(top >= 1, "--top {} must be at least 1", top);
    LOOM_CHECK(measure || measure_mesh.empty(),
               "--measure-mesh '{}' says which groups --measure times: give --measure too",
               measure_mesh);
    if (measure) {
      LOOM_CHECK(!out.empty(), "--measure writes a profile: give it --out FILE");
      LOOM_CHECK(device == "cpu" || device == "cuda", "--device '{}' is not valid: cpu or cuda",
                 device);
      // The layout is checked before the (longer) measurement.
      std::optional<loom::dist::MeshShape> mesh_shape;
      if (!measure_mesh.empty()) mesh_shape = loom::dist::MeshShape::parse(measure_mesh);
      runtime.emplace();
      if (mesh_shape) mesh_shape->resolve(runtime->size(), runtime->size());
      at::Device where = at::kCPU;
      if (device == "cuda") {
        const int gpu = runtime->local_rank() % std::max(1, loom::ops::cuda_device_count());
        loom::ops::set_current_cuda_device(gpu);
        where = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(gpu));
      }
      const auto options = loom::plan::MeasureOptions::for_device(where, precision);
      auto profile = loom::plan::measure_machine(*runtime->world(), options);
      if (mesh_shape)
        profile.links = loom::plan::measure_mesh_links(runtime->world(), *mesh_shape, options);
      if (runtime->rank() == 0) {
        loom::core::write_file_atomic(out, profile.to_json() + "\n");
        std::printf("%s\nwrote %s\n", profile.to_json().c_str(), out.c_str());
      }
      return;
    }
    loom::plan::PlanRequest request;
    auto config = loom::models::ModelConfig::preset(preset);
    LOOM_CHECK(loom::models::to_string(config.family) == model,
               "--preset {} is a {} preset but --model is {}", preset,
               loom::models::to_string(config.family), model);
    LOOM_CHECK(layers >= 0 && vocab_size >= 0, "--layers {} and --vocab-size {} must be >= 0",
               layers, vocab_size);
    if (layers > 0) config.n_layers = layers;
    if (vocab_size > 0) config.vocab_size = vocab_size;
    config.share_layers = share_layers == "none" ? std::string() : share_layers;
    config.validate();
    request.workload = {config, batch_size, seq_len, precision};
    request.world = world;
    request.machine = loom::plan::MachineProfile::named(profile);
    const auto plans = loom::plan::plan_layouts(request);
    if (as_json) {
      std::printf("%s\n", loom::plan::plan_json(plans, static_cast<size_t>(top)).c_str());
      return;
    }
    std::printf(
        "%s %s (%.1fM parameters), %ld x %ld tokens per step, %s, on %ld ranks of %s: "
        "%zu layouts fit\n",
        model.c_str(), preset.c_str(), static_cast<double>(config.num_parameters()) / 1e6,
        static_cast<long>(batch_size), static_cast<long>(seq_len), precision.c_str(),
        static_cast<long>(world), request.machine.name.c_str(), plans.size());
    std::printf("%s", loom::plan::format_plan(plans, static_cast<size_t>(top)).c_str());
  });
}
