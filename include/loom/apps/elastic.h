#pragma once
// loom-elastic: training that survives a lost rank (docs/reliability.md, "Elastic restarts").
//
//   loom-elastic --np 4 --min-np 2 -- loom-pretrain --save-dir ckpt ... (the run's flags)
//
// MPI ends the whole job when one rank dies. The supervisor launches the job (mpirun -np N, each
// rank under a small wrapper, `loom-elastic --rank-wrapper`, which records how its rank ended),
// and when the job fails it counts the ranks that were lost, and relaunches the same command on
// the survivors from the save directory's last complete checkpoint: the old layout when it still
// fits the smaller world (fewer data-parallel replicas), otherwise the planner's (--plan auto),
// the checkpoint resharded on load. It gives up, with a report, after --max-restarts restarts,
// when fewer than --min-np ranks remain, or when a run fails without losing a rank and without
// writing a new checkpoint (an error that would only repeat).
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace loom::apps {

// The command line of loom-elastic. Returns the process exit code: 0 when the training finished,
// the training's code when the supervisor stopped it (75 after a preemption signal), 1 when it
// gave up, 2 for bad input.
int elastic_main(int argc, char** argv);

namespace elastic {

// How one rank of an attempt ended, from the status file its wrapper keeps
// (ATTEMPT_DIR/rank-R.json): "running" until the process ends, then "exited" (with `code`) or
// "signalled" (with `signal`); `asked_to_stop` once the launcher has sent the wrapper a signal
// (which it passes on), so that a rank ended by the launcher's clean-up is not counted as lost.
struct RankStatus {
  int64_t rank = -1;
  std::string state;  // running | exited | signalled
  int code = 0;
  int signal = 0;
  bool asked_to_stop = false;
};

// Reads ATTEMPT_DIR/rank-R.json; nullopt when the wrapper never wrote it. Throws loom::Error
// naming the file when it is not a status file.
std::optional<RankStatus> read_rank_status(const std::filesystem::path& attempt_dir, int64_t rank);

// The ranks of a `world`-rank attempt that were lost: killed by a signal the launcher did not
// send, or whose wrapper vanished (no status, or "running" without a stop request). A rank that
// exited with a status code of its own, whatever the code, was not lost.
std::vector<int64_t> lost_ranks(const std::filesystem::path& attempt_dir, int64_t world);

// `args` (the training command's flags, program name excluded) without `flag` ("--dp": both
// "--dp 4" and "--dp=4"; a flag without a value when `takes_value` is false).
std::vector<std::string> without_flag(const std::vector<std::string>& args, const std::string& flag,
                                      bool takes_value);

// The training flags for a relaunch on `world` ranks, resuming from `save_dir` when it holds a
// checkpoint. `how` says which layout and why, for the log and the report.
struct Relaunch {
  std::vector<std::string> args;
  std::string how;
};
Relaunch relaunch_args(const std::vector<std::string>& args, int64_t world,
                       const std::filesystem::path& save_dir);

}  // namespace elastic
}  // namespace loom::apps
