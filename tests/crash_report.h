#pragma once

// A report of a fatal signal on stderr, for test processes: the signal, the faulting address,
// the program counter, and each frame as "  at MODULE+0xOFFSET [symbol]", which
// `addr2line -C -f -e MODULE 0xOFFSET` turns into a function and line (scripts/gpu-check does it).
// A call through a null pointer leaves the program counter at 0, where an unwinder stops at once
// (Open MPI's own report then shows a single libc frame): the report then also gives the return
// address the call left on the stack, which names the caller.

namespace loom::testing {

// Installs the handler for SIGSEGV, SIGBUS, SIGILL, SIGFPE and SIGABRT (replacing Open MPI's:
// call it after MPI is initialized). The handler reports, then re-raises with the default action.
void install_crash_report();

}  // namespace loom::testing
