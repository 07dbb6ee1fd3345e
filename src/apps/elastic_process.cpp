#include "elastic_process.h"

#include <fmt/format.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/core/files.h"

namespace loom::apps::elastic {

namespace {

constexpr std::array<int, 5> kForwarded = {SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2};

// A signal handler can reach only what is global: the child to pass signals to, and the first
// signal received. One supervisor or wrapper per process, so one of each.
volatile sig_atomic_t child_pid = 0;
volatile sig_atomic_t first_signal = 0;

extern "C" void forward_signal(int sig) {
  const int saved_errno = errno;  // kill may set it under the interrupted code's feet
  if (first_signal == 0) first_signal = sig;
  if (child_pid > 0) kill(static_cast<pid_t>(child_pid), sig);
  errno = saved_errno;
}

sigset_t forwarded_set() {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : kForwarded) sigaddset(&set, sig);
  return set;
}

std::vector<char*> c_argv(const std::vector<std::string>& command) {
  std::vector<char*> argv;
  for (const auto& a : command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  return argv;
}

// fork + execvp, and child_pid set; the child dies with this process when `die_with_parent`.
// The forwarded signals are blocked across the fork, so that none arrives after the child
// exists but before child_pid names it (the parent would not pass it on) or before the child
// has dropped the inherited handler (the child would swallow it); one that arrived before the
// fork is passed on as soon as they are unblocked. A failed exec exits 127, as a shell's would.
pid_t spawn(const std::vector<std::string>& command, bool die_with_parent) {
  LOOM_CHECK(!command.empty(), "loom-elastic: no command to run");
  auto argv = c_argv(command);
  const pid_t parent = getpid();
  const sigset_t blocked = forwarded_set();
  sigset_t previous;
  sigprocmask(SIG_BLOCK, &blocked, &previous);
  const pid_t pid = fork();
  if (pid == 0) {
    if (die_with_parent) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);  // the parent died before prctl took effect
    }
    for (int sig : kForwarded) signal(sig, SIG_DFL);
    sigprocmask(SIG_SETMASK, &previous, nullptr);
    execvp(argv[0], argv.data());
    std::fprintf(stderr, "loom-elastic: cannot run '%s': %s\n", argv[0], std::strerror(errno));
    _exit(127);
  }
  const int fork_errno = errno;
  if (pid > 0) {
    child_pid = pid;
    // A stop requested before the launch reaches the command at once.
    if (first_signal != 0) kill(pid, first_signal);
  }
  sigprocmask(SIG_SETMASK, &previous, nullptr);
  LOOM_CHECK(pid >= 0, "loom-elastic: fork failed: {}", std::strerror(fork_errno));
  return pid;
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

int rank_from_environment() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"})
    if (const char* v = std::getenv(name)) return std::atoi(v);
  throw Error(
      "loom-elastic --rank-wrapper: no rank in the environment (OMPI_COMM_WORLD_RANK, PMIX_RANK, "
      "PMI_RANK or SLURM_PROCID): it runs under the launcher loom-elastic starts");
}

}  // namespace

void forward_stop_signals() {
  // Without SA_RESTART, so that waitpid returns EINTR and the caller sees the signal at once.
  struct sigaction action {};
  action.sa_handler = forward_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = 0;
  for (int sig : kForwarded) sigaction(sig, &action, nullptr);
}

int received_stop_signal() {
  return first_signal;
}

int run_forwarding_signals(const std::vector<std::string>& command) {
  const pid_t pid = spawn(command, /*die_with_parent=*/false);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    const int wait_errno = errno;
    if (wait_errno != EINTR) {
      child_pid = 0;
      throw Error(fmt::format("loom-elastic: waiting for '{}' failed: {}", command.front(),
                              std::strerror(wait_errno)));
    }
  }
  child_pid = 0;
  return exit_code_of(status);
}

int rank_wrapper_main(const std::filesystem::path& attempt_dir,
                      const std::vector<std::string>& command) {
  const int rank = rank_from_environment();
  const auto file = attempt_dir / fmt::format("rank-{}.json", rank);
  nlohmann::json status = {{"rank", rank}, {"state", "running"}, {"asked_to_stop", false}};
  // Written before the command starts: a wrapper that vanishes leaves "running" behind.
  core::write_file_atomic(file, status.dump());
  forward_stop_signals();
  const pid_t pid = spawn(command, /*die_with_parent=*/true);
  status["pid"] = pid;
  core::write_file_atomic(file, status.dump());
  int wait_status = 0;
  bool recorded_stop = false;
  for (;;) {
    const pid_t done = waitpid(pid, &wait_status, 0);
    const int wait_errno = errno;  // before the status write below can change it
    if (first_signal != 0 && !recorded_stop) {
      // The launcher is ending this rank: recorded at once, since it may kill this wrapper
      // (and with it the command) before the command has finished.
      status["asked_to_stop"] = true;
      status["stop_signal"] = static_cast<int>(first_signal);
      core::write_file_atomic(file, status.dump());
      recorded_stop = true;
    }
    if (done == pid) break;
    if (done < 0 && wait_errno != EINTR) {
      std::fprintf(stderr, "loom-elastic: rank %d: waiting for the command failed: %s\n", rank,
                   std::strerror(wait_errno));
      return 1;
    }
  }
  if (WIFSIGNALED(wait_status)) {
    status["state"] = "signalled";
    status["signal"] = WTERMSIG(wait_status);
  } else {
    status["state"] = "exited";
    status["code"] = WIFEXITED(wait_status) ? WEXITSTATUS(wait_status) : 1;
  }
  core::write_file_atomic(file, status.dump());
  return exit_code_of(wait_status);
}

std::string self_executable() {
  std::error_code ec;
  const auto path = std::filesystem::read_symlink("/proc/self/exe", ec);
  LOOM_CHECK(!ec, "loom-elastic: cannot find its own executable (/proc/self/exe): {}",
             ec.message());
  return path.string();
}

}  // namespace loom::apps::elastic
