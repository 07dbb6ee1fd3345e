#pragma once
// The process side of loom-elastic (elastic_process.cpp): running the launcher with the
// supervisor's signals passed on, and the per-rank wrapper that records how its rank ended.
#include <filesystem>
#include <string>
#include <vector>

namespace loom::apps::elastic {

// From now on TERM, INT, HUP, USR1 and USR2 are passed on to the command running (if any) and
// the first one is remembered: a supervisor calls this once, before its first launch, so that
// a signal between two launches is not lost.
void forward_stop_signals();
// The first of those signals this process received (0: none).
int received_stop_signal();

// Runs `command` (argv[0] looked up on PATH) and waits for it, passing those signals on to it
// (forward_stop_signals first). Returns its exit code, or 128 + the signal that ended it.
int run_forwarding_signals(const std::vector<std::string>& command);

// `loom-elastic --rank-wrapper DIR -- COMMAND...`, which mpirun starts as each rank: runs COMMAND
// (which dies with the wrapper: PR_SET_PDEATHSIG), passes the launcher's signals on to it, and
// keeps DIR/rank-R.json (elastic.h's RankStatus; R from the launcher's environment) up to date.
// Exits as COMMAND did (its code, or 128 + its signal).
int rank_wrapper_main(const std::filesystem::path& attempt_dir,
                      const std::vector<std::string>& command);

// This executable's own path (/proc/self/exe), for launching the wrappers.
std::string self_executable();

}  // namespace loom::apps::elastic
