#pragma once
// Preemption signals: a cluster scheduler asks a job to stop with a signal (Slurm's
// `--signal=USR1@120`, Kubernetes' and most batch systems' SIGTERM) some time before it kills
// it. A PreemptionWatch catches the chosen signals for as long as it lives and only records that
// one came; the training loop polls it between steps (never inside a handler), agrees with the
// other ranks, checkpoints and exits (train::Trainer, docs/reliability.md).
//
// The arrival is kept in one process-wide flag: a signal handler can reach nothing else. One
// watch at a time.
#include <string>
#include <vector>

namespace loom::core {

// "TERM,USR1" (names with or without "SIG", any case, comma-separated) -> signal numbers;
// "none" or "" -> none. Throws loom::Error naming the value and the valid names.
std::vector<int> parse_preemption_signals(const std::string& spec);
// "SIGUSR1" for SIGUSR1.
std::string signal_name(int signal);

// The signal a live watch has recorded, or 0 (also when no watch is installed): for code that
// has no handle on the watch, such as the communication watchdog, which names the op a rank is
// stuck in when the launcher starts tearing the job down.
int preemption_signal_pending();

class PreemptionWatch {
 public:
  // Installs a handler for each signal (restoring the previous ones on destruction) and clears
  // the flag. Throws loom::Error when another watch is alive.
  explicit PreemptionWatch(std::vector<int> signals);
  ~PreemptionWatch();
  PreemptionWatch(const PreemptionWatch&) = delete;
  PreemptionWatch& operator=(const PreemptionWatch&) = delete;

  // The signal that arrived first since the watch started, or 0.
  int received() const;
  const std::vector<int>& signals() const { return signals_; }

 private:
  std::vector<int> signals_;
  std::vector<void*> previous_;  // the struct sigaction each signal had (opaque here)
};

}  // namespace loom::core
