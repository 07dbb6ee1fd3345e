// loom-pretrain (apps/pretrain.h): the flags (pretrain_cli.h) become a TrainConfig; the Trainer
// does the rest.
#include "loom/apps/pretrain.h"

#include <c10/core/Device.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <filesystem>
#include <memory>
#include <optional>

#include "loom/apps/cli.h"
#include "loom/core/error.h"
#include "loom/core/logging.h"
#include "loom/dist/backend_plan.h"
#include "loom/dist/runtime.h"
#include "loom/ops/cuda.h"
#include "loom/train/builtin_strategies.h"
#include "loom/train/runtime.h"
#include "loom/train/trainer.h"
#include "plan_auto.h"
#include "pretrain_cli.h"

namespace loom::apps {

int pretrain_main(int argc, char** argv) {
  loom::train::register_builtin_strategies();  // listed in --help with the user's
  // Named as invoked: a user's binary running this command line reports errors under its name.
  const std::string name =
      argc > 0 ? std::filesystem::path(argv[0]).filename().string() : "loom-pretrain";
  PretrainCommandLine cli(name);
  // Both outlive run_app's error handling, which aborts the whole job when one rank fails:
  // destroying the trainer first could wait for collectives the other ranks never issue.
  std::optional<loom::dist::Runtime> runtime;
  std::unique_ptr<loom::train::Trainer> trainer;
  int preempted = 0;
  const int code = run_app(cli.app, argc, argv, [&] {
    cli.finish();
    runtime.emplace(loom::dist::RuntimeOptions{loom::dist::Seconds(cli.comm_timeout), cli.threads});
    // Rank 0 tells the story; the others only warn.
    const bool quiet = runtime->rank() != 0 && cli.log_level != "error" && cli.log_level != "off";
    loom::core::setup_logging(quiet ? "warn" : cli.log_level);
    plan_layout_if_asked(cli, *runtime);
    // The flags are checked before the mesh is built: its backends depend on --device.
    cli.config.validate();
    // Each rank's GPU (the Trainer picks the same one): the plan needs every rank's.
    const int cuda_index =
        loom::dist::rank_cuda_device(cli.config.device, runtime->local_rank(),
                                     loom::ops::cuda_device_count(), loom::ops::built_with_cuda());
    trainer = std::make_unique<loom::train::Trainer>(
        cli.config,
        runtime->mesh(
            {.dp = cli.config.dp, .tp = cli.config.tp, .pp = cli.config.pp, .cp = cli.config.cp},
            loom::dist::parse_backend_choice(cli.config.dist_backend), cuda_index));
    trainer->fit();
    preempted = trainer->preempted_by();
  });
  return code == 0 && preempted != 0 ? loom::train::kPreemptedExitCode : code;
}

}  // namespace loom::apps
