// loom-elastic (apps/elastic.h): the supervisor's decisions (which ranks were lost, which layout
// the survivors take) and its loop; the processes themselves are elastic_process.cpp's.
#include "loom/apps/elastic.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <csignal>
#include <nlohmann/json.hpp>
#include <sstream>

#include "elastic_process.h"
#include "loom/apps/cli.h"
#include "loom/core/error.h"
#include "loom/core/files.h"
#include "loom/core/logging.h"
#include "loom/core/preemption.h"
#include "loom/train/checkpoint.h"
#include "loom/train/trainer.h"
#include "pretrain_cli.h"

namespace loom::apps {

namespace elastic {

namespace fs = std::filesystem;
using nlohmann::json;

std::optional<RankStatus> read_rank_status(const fs::path& attempt_dir, int64_t rank) {
  const auto file = attempt_dir / fmt::format("rank-{}.json", rank);
  if (!fs::exists(file)) return std::nullopt;
  try {
    const auto j = json::parse(core::read_file(file));
    RankStatus s;
    s.rank = j.at("rank").get<int64_t>();
    s.state = j.at("state").get<std::string>();
    s.code = j.value("code", 0);
    s.signal = j.value("signal", 0);
    s.asked_to_stop = j.value("asked_to_stop", false);
    LOOM_CHECK(
        s.rank == rank && (s.state == "running" || s.state == "exited" || s.state == "signalled"),
        "rank {} or state '{}' is not what a rank-{} status holds", s.rank, s.state, rank);
    return s;
  } catch (const json::exception& e) {
    throw Error(fmt::format("'{}' is not a rank status file: {}", file.string(), e.what()));
  } catch (const Error& e) {
    throw Error(fmt::format("'{}' is not a rank status file: {}", file.string(), e.what()));
  }
}

std::vector<int64_t> lost_ranks(const fs::path& attempt_dir, int64_t world) {
  std::vector<int64_t> lost;
  for (int64_t r = 0; r < world; ++r) {
    const auto s = read_rank_status(attempt_dir, r);
    const bool vanished = !s || (s->state == "running" && !s->asked_to_stop);
    // SIGKILL that the launcher did not send: kill -9, the kernel's out-of-memory killer. Other
    // signals (SIGSEGV, SIGABRT) are crashes of a rank that is still there: a deterministic bug
    // would only crash the smaller world again.
    const bool killed = s && s->state == "signalled" && s->signal == SIGKILL && !s->asked_to_stop;
    if (vanished || killed) lost.push_back(r);
  }
  return lost;
}

std::vector<std::string> without_flag(const std::vector<std::string>& args, const std::string& flag,
                                      bool takes_value) {
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == flag) {
      if (takes_value) ++i;  // its value
      continue;
    }
    if (args[i].rfind(flag + "=", 0) == 0) continue;
    out.push_back(args[i]);
  }
  return out;
}

namespace {

// The layout flags a relaunch leaves to the planner (those --plan auto reads as constraints,
// plan_auto.cpp, and the pipeline's device split), and whether each takes a value. Not the
// micro-batches: a resume must keep them (TrainConfig::check_resumable_from).
const std::vector<std::pair<std::string, bool>> kLayoutFlags = {
    {"--dp", true},
    {"--tp", true},
    {"--pp", true},
    {"--cp", true},
    {"--zero", true},
    {"--virtual-stages", true},
    {"--schedule", true},
    {"--activation-checkpointing", true},
    {"--sequence-parallel", false},
    {"--pp-partition", true},
    {"--pp-devices", true}};

// Parses the training flags as loom-pretrain does (without running anything).
void parse_training_flags(PretrainCommandLine& cli, const std::vector<std::string>& args) {
  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 parses from the back
  try {
    cli.app.parse(reversed);
  } catch (const CLI::ParseError& e) {
    throw Error(
        fmt::format("the training command's flags do not parse as loom-pretrain's: {}", e.what()));
  }
  cli.finish();
}

// Why the run's own layout, with fewer data-parallel replicas, does not fit `world` ranks; empty
// when it does (dp is then world / (tp x pp x cp)).
std::string why_layout_does_not_fit(const train::TrainConfig& c, int64_t world) {
  const int64_t model_ranks = c.tp * c.pp * c.cp;
  if (world % model_ranks != 0)
    return fmt::format("tp {} x pp {} x cp {} = {} ranks per replica do not divide {} ranks", c.tp,
                       c.pp, c.cp, model_ranks, world);
  const int64_t dp = world / model_ranks;
  if (c.batch_size % (dp * c.grad_accum) != 0)
    return fmt::format("--batch-size {} does not split over dp {} x {} micro-batches", c.batch_size,
                       dp, c.grad_accum);
  auto trial = c;
  trial.dp = dp;
  try {
    trial.validate();
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

}  // namespace

Relaunch relaunch_args(const std::vector<std::string>& args, int64_t world,
                       const fs::path& save_dir) {
  LOOM_CHECK(world >= 1, "a relaunch needs at least one rank, not {}", world);
  // From the save directory's last checkpoint; before the run has written one, from where it
  // started (its own --resume, if any).
  const auto latest = train::latest_checkpoint(save_dir);
  auto base = args;
  if (latest) {
    base = without_flag(args, "--resume", true);
    base.insert(base.end(), {"--resume", save_dir.string()});
  }
  const std::string from =
      latest ? fmt::format("from checkpoint {}", latest->filename().string()) : "from the start";
  PretrainCommandLine cli("loom-pretrain");
  parse_training_flags(cli, base);
  if (cli.plan == "auto")  // its --dp, if any, was for the old world
    return {without_flag(base, "--dp", true),
            fmt::format("{} ranks, {}; --plan auto plans the layout again", world, from)};
  const auto& c = cli.config;
  const auto why = why_layout_does_not_fit(c, world);
  if (why.empty()) {
    const int64_t dp = world / (c.tp * c.pp * c.cp);
    auto kept = without_flag(base, "--dp", true);
    kept.insert(kept.end(), {"--dp", std::to_string(dp)});
    return {kept, fmt::format("{} ranks, {}; the run's layout with dp {} (tp {}, pp {}, cp {})",
                              world, from, dp, c.tp, c.pp, c.cp)};
  }
  auto planned = base;
  for (const auto& [flag, takes_value] : kLayoutFlags)
    planned = without_flag(planned, flag, takes_value);
  planned.insert(planned.end(), {"--plan", "auto"});
  return {planned, fmt::format("{} ranks, {}; the run's layout does not fit ({}): --plan auto "
                               "chooses one",
                               world, from, why)};
}

namespace {

struct Options {
  int64_t np = 0, min_np = 1, max_restarts = 3;
  std::string launcher = "mpirun", launcher_args, np_flag = "-np";
  std::string work_dir, report;
  std::vector<std::string> command;  // the training program and its flags
};

std::vector<std::string> split_words(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> words;
  for (std::string w; in >> w;) words.push_back(w);
  return words;
}

// The step of the checkpoint `latest` names (DIR/step-NNNNNNNN), -1 when there is none; its
// files are not read (the relaunch verifies them as it loads).
int64_t latest_step(const fs::path& save_dir) {
  const auto latest = train::latest_checkpoint(save_dir);
  if (!latest) return -1;
  const auto name = latest->filename().string();
  return std::stoll(name.substr(name.find('-') + 1));
}

int supervise(const Options& o) {
  LOOM_CHECK(o.np >= 1, "--np {} must be at least 1", o.np);
  LOOM_CHECK(o.min_np >= 1 && o.min_np <= o.np, "--min-np {} must be in [1, --np {}]", o.min_np,
             o.np);
  LOOM_CHECK(o.max_restarts >= 0, "--max-restarts {} must be at least 0", o.max_restarts);
  LOOM_CHECK(!o.command.empty(),
             "no training command: loom-elastic [options] -- loom-pretrain ...");
  const std::vector<std::string> flags(o.command.begin() + 1, o.command.end());
  PretrainCommandLine cli("loom-pretrain");
  parse_training_flags(cli, flags);
  LOOM_CHECK(!cli.config.save_dir.empty(),
             "the training command has no --save-dir: a restart resumes from its last complete "
             "checkpoint, so loom-elastic needs one (with --save-every N to bound the steps lost)");
  const fs::path save_dir = fs::absolute(cli.config.save_dir);
  // A relaunch rewrites the layout flags on the command line: in a --config file it could not.
  if (cli.app.count("--config") > 0) {
    PretrainCommandLine bare("loom-pretrain");
    parse_training_flags(bare, without_flag(flags, "--config", true));
    const auto& a = cli.config;
    const auto& b = bare.config;
    LOOM_CHECK(a.dp == b.dp && a.tp == b.tp && a.pp == b.pp && a.cp == b.cp && a.zero == b.zero &&
                   a.schedule == b.schedule && a.virtual_stages == b.virtual_stages &&
                   a.activation_checkpointing == b.activation_checkpointing &&
                   a.sequence_parallel == b.sequence_parallel && a.pp_partition == b.pp_partition &&
                   a.pp_devices == b.pp_devices && cli.plan == bare.plan,
               "the training command's --config file sets layout flags (dp, tp, pp, cp, zero, "
               "schedule, virtual_stages, activation_checkpointing, sequence_parallel, "
               "pp_partition, pp_devices or plan): give them on the command line instead, where "
               "loom-elastic can change them for a smaller world");
  }
  const fs::path work =
      o.work_dir.empty() ? fs::path(save_dir.string() + ".elastic") : fs::absolute(o.work_dir);
  const fs::path report_file = o.report.empty() ? work / "report.json" : fs::path(o.report);
  core::ensure_writable_dir(work);
  const auto self = self_executable();

  json report = {{"command", o.command}, {"np", o.np},
                 {"min_np", o.min_np},   {"max_restarts", o.max_restarts},
                 {"save_dir", save_dir}, {"attempts", json::array()}};
  auto finish = [&](const std::string& outcome, const std::string& reason, int code) {
    report["outcome"] = outcome;
    report["reason"] = reason;
    report["exit_code"] = code;
    core::write_file_atomic(report_file, report.dump(1));
    (code == 0
         ? spdlog::info("loom-elastic: {}: {} (report: {})", outcome, reason, report_file.string())
         : spdlog::error("loom-elastic: {}: {} (report: {})", outcome, reason,
                         report_file.string()));
    return code;
  };

  int64_t world = o.np;
  Relaunch run{flags, fmt::format("{} ranks, the command as given", o.np)};
  forward_stop_signals();  // from here on: a stop between two attempts is seen too
  for (int64_t attempt = 0;; ++attempt) {
    if (const int sig = received_stop_signal(); sig != 0 && attempt > 0)
      return finish("stopped",
                    fmt::format("{} reached loom-elastic between two attempts: not restarting",
                                core::signal_name(sig)),
                    1);
    const auto dir = work / fmt::format("attempt-{}", attempt);
    std::error_code ec;
    core::remove_tree(dir, ec);
    fs::create_directories(dir);
    std::vector<std::string> command = {o.launcher};
    for (auto& w : split_words(o.launcher_args)) command.push_back(w);
    command.insert(command.end(), {o.np_flag, std::to_string(world), self, "--rank-wrapper",
                                   dir.string(), "--", o.command.front()});
    command.insert(command.end(), run.args.begin(), run.args.end());
    const int64_t before = latest_step(save_dir);
    spdlog::info("loom-elastic: attempt {}: {}", attempt, run.how);
    const auto t0 = std::chrono::steady_clock::now();
    const int code = run_forwarding_signals(command);
    const int stop_signal = received_stop_signal();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const int64_t after = latest_step(save_dir);
    const auto lost = code == 0 ? std::vector<int64_t>{} : lost_ranks(dir, world);
    json ranks = json::array();
    for (int64_t r = 0; r < world; ++r) {
      const auto s = read_rank_status(dir, r);
      ranks.push_back(s ? json{{"rank", r},
                               {"state", s->state},
                               {"code", s->code},
                               {"signal", s->signal},
                               {"asked_to_stop", s->asked_to_stop}}
                        : json{{"rank", r}, {"state", "no status"}});
    }
    report["attempts"].push_back({{"world", world},
                                  {"how", run.how},
                                  {"flags", run.args},
                                  {"exit_code", code},
                                  {"seconds", seconds},
                                  {"checkpoint_step_before", before},
                                  {"checkpoint_step_after", after},
                                  {"lost_ranks", lost},
                                  {"ranks", ranks}});
    if (code == 0)
      return finish("finished", fmt::format("the training ended after {} restart(s)", attempt), 0);
    if (stop_signal != 0)
      return finish("stopped",
                    fmt::format("{} reached loom-elastic, which passed it on and does not restart",
                                core::signal_name(stop_signal)),
                    code);
    if (ranks.size() == static_cast<size_t>(world) &&
        std::all_of(ranks.begin(), ranks.end(),
                    [](const json& r) { return r["state"] == "no status"; }))
      return finish("gave up",
                    fmt::format("the launcher '{}' failed (status {}) before any rank started "
                                "(its output says why)",
                                o.launcher, code),
                    1);
    if (lost.empty() && code == train::kPreemptedExitCode)
      return finish("stopped", "the ranks were preempted (status 75): not restarting", code);
    if (lost.empty() && after <= before)
      return finish("gave up",
                    fmt::format("the training failed (status {}) without losing a rank and "
                                "without writing a new checkpoint: a restart would repeat it "
                                "(its log says why)",
                                code),
                    1);
    const int64_t survivors = world - static_cast<int64_t>(lost.size());
    if (!lost.empty())
      spdlog::warn("loom-elastic: attempt {} lost rank(s) {} of {}; {} remain", attempt,
                   fmt::join(lost, ", "), world, survivors);
    if (survivors < o.min_np)
      return finish("gave up",
                    fmt::format("{} rank(s) remain after losing {} of {}, below --min-np {}",
                                survivors, fmt::join(lost, ", "), world, o.min_np),
                    1);
    if (attempt >= o.max_restarts)
      return finish("gave up",
                    fmt::format("attempt {} failed (status {}) and --max-restarts {} are spent",
                                attempt, code, o.max_restarts),
                    1);
    world = survivors;
    run = relaunch_args(flags, world, save_dir);
  }
}

}  // namespace
}  // namespace elastic

int elastic_main(int argc, char** argv) {
  CLI::App app{
      "Run a training command under mpirun and, when a rank is lost, run it again on the "
      "survivors from the last complete checkpoint (docs/reliability.md).\n"
      "  loom-elastic --np 4 --min-np 2 -- loom-pretrain --save-dir DIR --save-every 50 ...",
      "loom-elastic"};
  elastic::Options o;
  std::string wrapper_dir;
  app.add_option("--np", o.np, "Ranks to start with");
  app.add_option("--min-np", o.min_np, "Fewest ranks worth training on")->capture_default_str();
  app.add_option("--max-restarts", o.max_restarts, "Restarts before giving up")
      ->capture_default_str();
  app.add_option("--launcher", o.launcher, "The MPI launcher")->capture_default_str();
  app.add_option("--launcher-args", o.launcher_args,
                 "More of the launcher's flags, as one string (e.g. '--oversubscribe -x "
                 "OMP_NUM_THREADS=1')");
  app.add_option("--np-flag", o.np_flag, "The launcher's flag for the number of ranks")
      ->capture_default_str();
  app.add_option("--work-dir", o.work_dir,
                 "Where each attempt's rank status files and the report go (default: the save "
                 "directory's path + '.elastic')");
  app.add_option("--report", o.report, "The report's path (default: WORK_DIR/report.json)");
  app.add_option("--rank-wrapper", wrapper_dir,
                 "(internal) run COMMAND as one rank, recording how it ended in this directory");
  app.add_option("command", o.command, "The training command, after --")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (!wrapper_dir.empty()) {
    try {
      return elastic::rank_wrapper_main(wrapper_dir, o.command);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "loom-elastic --rank-wrapper: error: %s\n", e.what());
      return 2;
    }
  }
  core::setup_logging("info");
  int code = 0;
  const int failed = run_tool("loom-elastic", [&] {
    LOOM_CHECK(app.count("--np") > 0, "--np is required: how many ranks to start");
    code = elastic::supervise(o);
  });
  return failed != 0 ? failed : code;
}

}  // namespace loom::apps
