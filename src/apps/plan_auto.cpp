#include "plan_auto.h"

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <filesystem>

#include "loom/core/error.h"
#include "loom/core/files.h"
#include "loom/data/mixture.h"
#include "loom/data/tokenizer.h"
#include "loom/dist/backend_plan.h"
#include "loom/ops/cuda.h"
#include "loom/plan/measure.h"
#include "loom/plan/planner.h"
#include "loom/train/checkpoint.h"
#include "loom/train/config.h"

namespace loom::apps {

namespace {

const std::vector<std::string> kSchedules{"1f1b", "gpipe", "interleaved"};
const std::vector<std::string> kCheckpointing{"none", "selective", "full"};

int64_t index_of(const std::vector<std::string>& names, const std::string& name) {
  const auto it = std::find(names.begin(), names.end(), name);
  LOOM_CHECK(it != names.end(), "plan: '{}' is not one of the planner's choices", name);
  return it - names.begin();
}

// The layout flags given on the command line (or in --config), as constraints.
plan::LayoutConstraints constraints_of(const PretrainCommandLine& cli) {
  const auto& c = cli.config;
  auto given = [&](const char* flag) { return cli.app.count(flag) > 0; };
  plan::LayoutConstraints f;
  if (given("--dp") && c.dp > 0) f.dp = c.dp;
  if (given("--tp")) f.tp = c.tp;
  if (given("--pp")) f.pp = c.pp;
  if (given("--cp")) f.cp = c.cp;
  if (given("--micro-batches") || given("--grad-accum")) f.micro_batches = c.grad_accum;
  if (given("--virtual-stages")) f.virtual_stages = c.virtual_stages;
  if (given("--zero")) f.zero = c.zero;
  if (given("--schedule")) f.schedule = c.schedule;
  if (given("--activation-checkpointing")) f.checkpointing = c.activation_checkpointing;
  if (given("--sequence-parallel")) f.sequence_parallel = c.sequence_parallel;
  return f;
}

plan::MachineProfile profile_for(const PretrainCommandLine& cli, dist::Runtime& runtime) {
  if (cli.plan_profile != "measure") return plan::MachineProfile::named(cli.plan_profile);
  at::Device device = at::kCPU;
  const int gpu = dist::rank_cuda_device(cli.config.device, runtime.local_rank(),
                                         ops::cuda_device_count(), ops::built_with_cuda());
  if (gpu >= 0) {
    ops::set_current_cuda_device(gpu);
    device = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(gpu));
  }
  return plan::measure_machine(*runtime.world(),
                               plan::MeasureOptions::for_device(device, cli.config.precision));
}

models::ModelConfig checkpoint_model_config(const std::string& resume) {
  const auto state_file = train::resolve_checkpoint(resume) / "state.json";
  try {
    return models::ModelConfig::from_json(
        nlohmann::json::parse(core::read_file(state_file)).at("model_config"));
  } catch (const nlohmann::json::exception& e) {
    throw Error(
        fmt::format("--plan auto: '{}' holds no model config: {}", state_file.string(), e.what()));
  }
}

// `layout` written into the run's flags. A pipeline planned on a profile the trainer can read
// again (a file or a built-in one) is split by the cost model as the plan was, unless
// --pp-partition was given.
void apply(const plan::Layout& l, const PretrainCommandLine& cli, train::TrainConfig& c) {
  c.dp = l.dp, c.tp = l.tp, c.pp = l.pp, c.cp = l.cp;
  c.zero = l.zero;
  c.grad_accum = l.micro_batches;
  c.virtual_stages = l.virtual_stages;
  if (l.pp > 1) c.schedule = l.schedule;
  c.activation_checkpointing = l.checkpointing;
  c.sequence_parallel = l.sequence_parallel;
  if (l.pp > 1 && cli.plan_profile != "measure" && cli.app.count("--pp-partition") == 0) {
    c.pp_partition = "model";
    c.pp_devices = cli.plan_profile;
  }
}

}  // namespace

void plan_layout_if_asked(PretrainCommandLine& cli, dist::Runtime& runtime) {
  if (cli.plan == "none") return;
  LOOM_CHECK(cli.plan == "auto",
             "--plan '{}' is not valid: none (the layout flags as given) or "
             "auto (the cost model's best layout)",
             cli.plan);
  auto& c = cli.config;
  LOOM_CHECK(c.pp_devices.empty(),
             "--plan auto with --pp-devices '{}': put the pipeline ranks' devices in the machine "
             "profile (stage_devices, docs/planner.md) and pass it as --plan-profile",
             c.pp_devices);
  // A resumed run plans for the checkpoint's model (its state.json; the tensors are read, and
  // resharded to the layout chosen here, by the Trainer).
  const auto model =
      c.resume.empty()
          ? c.new_model_config(
                data::load_tokenizer(std::filesystem::absolute(
                                         data::parse_data_sources(c.data).front().paths.front())
                                         .parent_path())
                    ->vocab_size())
          : checkpoint_model_config(c.resume);
  plan::PlanRequest request;
  request.workload = {model, c.batch_size, c.seq_len, c.precision};
  request.world = runtime.size();
  request.machine = profile_for(cli, runtime);
  const auto fixed = constraints_of(cli);
  // Only layouts the run's other flags go with (--offload-optimizer needs ZeRO, ...).
  const auto runnable = [&](const plan::Layout& l) {
    auto trial = c;
    apply(l, cli, trial);
    try {
      trial.validate();
      return true;
    } catch (const Error&) {
      return false;
    }
  };
  const auto choice = plan::choose_layout(request, fixed, runnable);
  // Every rank plans from the same profile; rank 0's choice is the one taken all the same, so
  // that no difference in floating point can split the mesh.
  const auto& best = choice.best.layout;
  auto packed = at::tensor(
      {best.dp, best.tp, best.pp, best.cp, static_cast<int64_t>(best.zero), best.micro_batches,
       best.virtual_stages, index_of(kSchedules, best.schedule),
       index_of(kCheckpointing, best.checkpointing), static_cast<int64_t>(best.sequence_parallel)},
      at::kLong);
  runtime.world()->broadcast(packed, 0);
  auto v = [&](int i) { return packed[i].item<int64_t>(); };
  plan::Layout taken;
  taken.dp = v(0), taken.tp = v(1), taken.pp = v(2), taken.cp = v(3);
  taken.zero = static_cast<int>(v(4));
  taken.micro_batches = v(5);
  taken.virtual_stages = v(6);
  taken.schedule = kSchedules.at(static_cast<size_t>(v(7)));
  taken.checkpointing = kCheckpointing.at(static_cast<size_t>(v(8)));
  taken.sequence_parallel = v(9) != 0;
  apply(taken, cli, c);
  spdlog::info("--plan auto {}", plan::explain_choice(choice, fixed, request.machine.name));
}

}  // namespace loom::apps
