#include "crash_report.h"

#include <dlfcn.h>
#include <execinfo.h>
#include <gtest/gtest.h>
#include <ucontext.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace loom::testing {

namespace {

// Only write(2) from here on: the process may be anywhere, malloc's lock included.
void put(const char* s) {
  const ssize_t ignored = ::write(STDERR_FILENO, s, std::strlen(s));
  (void)ignored;
}

void put_hex(uintptr_t v) {
  char buf[2 + 16 + 1];
  char* p = buf + sizeof(buf) - 1;
  *p = '\0';
  do {
    *--p = "0123456789abcdef"[v & 15];
    v >>= 4;
  } while (v != 0);
  *--p = 'x';
  *--p = '0';
  put(p);
}

void put_frame(const char* what, uintptr_t address) {
  put("  ");
  put(what);
  put(" ");
  Dl_info info{};
  if (address != 0 && dladdr(reinterpret_cast<void*>(address), &info) != 0 &&
      info.dli_fname != nullptr) {
    put(info.dli_fname);
    put("+");
    put_hex(address - reinterpret_cast<uintptr_t>(info.dli_fbase));
    if (info.dli_sname != nullptr) {
      put(" ");
      put(info.dli_sname);
    }
  } else {
    put_hex(address);
  }
  put("\n");
}

void on_fatal_signal(int sig, siginfo_t* info, void* context) {
  // Not async-signal-safe, but what the test printed before the crash is worth the risk: the
  // process ends here either way.
  std::fflush(stdout);
  put("loom: fatal signal ");
  char num[8];
  std::snprintf(num, sizeof(num), "%d", sig);
  put(num);
  put(" (");
  put(strsignal(sig));
  put("), fault address ");
  put_hex(reinterpret_cast<uintptr_t>(info->si_addr));
  put("\n");
#if defined(__x86_64__)
  const auto* uc = static_cast<const ucontext_t*>(context);
  const auto pc = static_cast<uintptr_t>(uc->uc_mcontext.gregs[REG_RIP]);
  const auto sp = static_cast<uintptr_t>(uc->uc_mcontext.gregs[REG_RSP]);
  put_frame("pc", pc);
  // A call to address 0 pushed its return address and jumped: it is at the top of the stack.
  if (pc < 4096 && sp != 0) put_frame("return address", *reinterpret_cast<const uintptr_t*>(sp));
#else
  (void)context;
#endif
  void* frames[64];
  const int n = backtrace(frames, 64);
  for (int i = 0; i < n; ++i) put_frame("at", reinterpret_cast<uintptr_t>(frames[i]));
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

// Installed when the tests start (after main() initialized MPI, which sets handlers of its own).
class CrashReportEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { install_crash_report(); }
};

[[maybe_unused]] const auto* const kEnvironment =
    ::testing::AddGlobalTestEnvironment(new CrashReportEnvironment);

}  // namespace

void install_crash_report() {
#if defined(__SANITIZE_ADDRESS__)
  return;  // AddressSanitizer's own report says more
#endif
  // backtrace() loads libgcc_s on its first call, which allocates: do it now, not in the handler.
  void* warm[1];
  backtrace(warm, 1);
  struct sigaction action {};
  action.sa_sigaction = on_fatal_signal;
  action.sa_flags = SA_SIGINFO | SA_RESETHAND;
  sigemptyset(&action.sa_mask);
  for (const int sig : {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT}) sigaction(sig, &action, nullptr);
}

}  // namespace loom::testing
