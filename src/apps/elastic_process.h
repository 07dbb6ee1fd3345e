#pragma once
// The process side of loom-elastic (elastic_process.cpp): running the launcher with the
// supervisor's signals passed on, and the per-rank wrapper that records how its rank ended.
#include <filesystem>
#include <string>
#include <vector>

namespace loom::apps::elastic {

// Runs `command` (argv[0] looked up on PATH) and waits for it. TERM, INT, HUP, USR1 and USR2
// received meanwhile are passed on to it; the first one's number is stored in `stop_signal`.
// Returns its exit code, or 128 + the signal that ended it.
int run_and_forward_signals(const std::vector<std::string>& command, int& stop_signal);

// `loom-elastic --rank-wrapper DIR -- COMMAND...`, which mpirun starts as each rank: runs COMMAND
// (which dies with the wrapper: PR_SET_PDEATHSIG), passes the launcher's signals on to it, and
// keeps DIR/rank-R.json (elastic.h's RankStatus; R from the launcher's environment) up to date.
// Exits as COMMAND did (its code, or 128 + its signal).
int rank_wrapper_main(const std::filesystem::path& attempt_dir,
                      const std::vector<std::string>& command);

// This executable's own path (/proc/self/exe), for launching the wrappers.
std::string self_executable();

}  // namespace loom::apps::elastic
