#include "plan_auto.h"

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <filesystem>

#include "loom/core/error.h"
#include "loom/data/tokenizer.h"
#include "loom/dist/backend_plan.h"
#include "loom/ops/cuda.h"
#include "loom/plan/measure.h"
#include "loom/plan/planner.h"

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
  const auto& name = cli.plan_profile;
  if (name != "measure") {
    if (std::filesystem::exists(name)) return plan::MachineProfile::load(name);
    return plan::builtin_profile(name);
  }
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

}  // namespace

void plan_layout_if_asked(PretrainCommandLine& cli, dist::Runtime& runtime) {
  if (cli.plan == "none") return;
  LOOM_CHECK(cli.plan == "auto",
             "--plan '{}' is not valid: none (the layout flags as given) or "
             "auto (the cost model's best layout)",
             cli.plan);
  auto& c = cli.config;
  LOOM_CHECK(c.resume.empty(),
             "--plan auto with --resume: give the layout to resume at (loom-plan lists them); "
             "the plan is made before the checkpoint is read");
  LOOM_CHECK(c.pp_devices.empty(),
             "--plan auto with --pp-devices: put the pipeline ranks' devices in the machine "
             "profile (stage_devices, docs/planner.md) and pass it as --plan-profile");
  const auto tokenizer_dir = std::filesystem::absolute(c.data).parent_path();
  const auto model = c.new_model_config(data::load_tokenizer(tokenizer_dir)->vocab_size());
  plan::PlanRequest request;
  request.workload = {model, c.batch_size, c.seq_len, c.precision};
  request.world = runtime.size();
  request.machine = profile_for(cli, runtime);
  const auto fixed = constraints_of(cli);
  const auto choice = plan::choose_layout(request, fixed);
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
  c.dp = v(0), c.tp = v(1), c.pp = v(2), c.cp = v(3);
  c.zero = static_cast<int>(v(4));
  c.grad_accum = v(5);
  c.virtual_stages = v(6);
  c.schedule = kSchedules.at(static_cast<size_t>(v(7)));
  c.activation_checkpointing = kCheckpointing.at(static_cast<size_t>(v(8)));
  c.sequence_parallel = v(9) != 0;
  spdlog::info("--plan auto {}", plan::explain_choice(choice, fixed, request.machine.name));
}

}  // namespace loom::apps
