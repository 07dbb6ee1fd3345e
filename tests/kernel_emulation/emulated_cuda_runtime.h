#pragma once
// The CUDA execution model, emulated on the CPU, for the kernel-emulation test
// (tests/kernel_emulation, docs/gpu.md). transform.py rewrites kernels/attention/flash_attention.cu
// to include this header in place of <cuda_runtime.h>; the host compiler then builds the kernel
// as written, and it runs on a machine without a GPU. Written by the loom authors for this test.
//
// Execution. A launch runs its blocks one after another. Every CUDA thread of a block is a fiber
// (ucontext, with its own stack): a scheduler resumes the block's threads round-robin, each
// running until it waits at a barrier, and skips those whose barrier is still incomplete. The
// barriers are the block's (__syncthreads) and one per warp, which __syncwarp and the warp-wide
// instructions use (shuffles here; ldmatrix and mma.sync in emulated_ptx_*.h): a warp-wide
// instruction completes when all 32 lanes have arrived, and the last lane to arrive executes it
// for the whole warp at once. A round in which every live thread waits is a deadlock.
//
// What it checks (each failure prints "EMULATION ERROR" and counts in emulation::error_count):
//  - launches: grid and block limits; dynamic shared memory above 48 KiB only after
//    cudaFuncSetAttribute, and at most the sm_80 limit;
//  - shared memory: starts as 0xFF bytes (NaN in bf16 and fp16) in every block and ends at a
//    PROT_NONE guard page; cp.async and ldmatrix addresses in range and 16-byte aligned;
//  - races on shared memory, per 16-byte chunk and per barrier epoch (the stretch between two
//    __syncthreads): a read of a chunk whose cp.async has not been waited for (missing
//    cp.async.wait_group), a read by one warp of a chunk that another warp's cp.async landed in
//    during the same epoch (missing __syncthreads), a cp.async over a chunk that another warp
//    read in the same epoch (write after read). Only cp.async writes and ldmatrix reads are
//    tracked; plain loads and stores to shared memory are not;
//  - warp-wide instructions executed by all 32 lanes, with the full mask, and the same
//    instruction in every lane; no lane exits while the others wait in one;
//  - every thread waits for all of its cp.async groups before it exits;
//  - a fault (an access beyond a guard page, a fiber stack overflow) names the block and thread.
// Not emulated: timing, the hardware's warp scheduling and memory ordering beyond the barriers,
// registers and occupancy. Fibers run one at a time, so global-memory atomics are plain adds
// (and plain minima).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <driver_types.h>
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
#include <vector_types.h>

#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <type_traits>  // for emulated_ptx_mma.h, which includes nothing itself
#include <vector>

// cuda_bf16.h already defines __global__, __device__ and __shared__ as nothing for a host
// compiler (transform.py rejects any __shared__ variable it does not rewrite).
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif

inline dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace emulation {

// ---- Errors and counters ------------------------------------------------------------------------

inline int error_count = 0;
inline long blocks_run = 0;
inline long async_copies = 0;
inline long warp_instructions = 0;

inline void describe_current_thread(char* out, size_t size);

[[gnu::format(printf, 1, 2)]] inline void error(const char* format, ...) {
  constexpr int kMaxErrors = 20;  // then stop: one bug usually repeats in every block
  char where[96];
  describe_current_thread(where, sizeof where);
  std::fflush(stdout);
  std::fprintf(stderr, "EMULATION ERROR%s: ", where);
  va_list args;
  va_start(args, format);
  std::vfprintf(stderr, format, args);
  va_end(args);
  std::fputc('\n', stderr);
  if (++error_count >= kMaxErrors) {
    std::fprintf(stderr, "EMULATION ERROR: %d errors, stopping\n", error_count);
    std::exit(3);
  }
}

// ---- Blocks, threads, barriers ------------------------------------------------------------------

struct Barrier {
  int expected = 0;  // threads taking part; drops as threads exit
  int arrived = 0;
  long phase = 0;  // times completed
};

// A 16-byte cp.async: the source bytes are read when it is issued and land in shared memory
// when the thread waits for its group (the latest moment the hardware may land them).
struct AsyncCopy {
  size_t offset;  // in shared memory
  unsigned char bytes[16];
};

struct Thread {
  ucontext_t context;
  int tid = 0;
  bool exited = false;
  const Barrier* waiting_on = nullptr;  // with the phase it waits to end
  long waiting_phase = 0;
  std::vector<AsyncCopy> uncommitted;
  std::deque<std::vector<AsyncCopy>> committed;  // groups, oldest first
};

// Operands and results of one warp-wide instruction, per lane.
struct WarpExchange {
  const char* instruction[32];
  int variant[32];  // e.g. the shuffle's lane mask: must match too
  float value[32];
  size_t address[32];
  uint32_t registers[32][12];  // mma.sp: a[4], b[4], e
  float accumulator[32][4];
};

struct Warp {
  Barrier barrier;
  // Two, used alternately: a lane may go on to its next warp-wide instruction while others still
  // read this one's results, but none can reach the one after that before all have.
  WarpExchange exchange[2];
};

// What the race checks know about one 16-byte chunk of shared memory.
struct ChunkHistory {
  static constexpr int kInFlight = -2;
  int landed_epoch = -1;      // when the last cp.async to it landed, or kInFlight
  int writer = -1;            // the thread that issued it
  int read_epoch = -1;        // when reader_warps was recorded
  uint32_t reader_warps = 0;  // bit w: warp w read the chunk (ldmatrix) in read_epoch
};

struct Block {
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  Barrier barrier;  // __syncthreads
  int epoch = 0;    // __syncthreads completed so far
  unsigned char* shared = nullptr;
  size_t shared_bytes = 0;
  std::vector<ChunkHistory> history;  // one per 16 bytes of shared memory
  ucontext_t scheduler;
  int current = -1;  // the running thread
};

inline Block* current_block = nullptr;

inline Thread& current_thread() {
  return current_block->threads[current_block->current];
}
inline int lane() {
  return current_thread().tid % 32;
}
inline int warp_index() {
  return current_thread().tid / 32;
}
inline Warp& current_warp() {
  return current_block->warps[warp_index()];
}

inline void describe_current_thread(char* out, size_t size) {
  if (current_block == nullptr || current_block->current < 0) {
    out[0] = '\0';
    return;
  }
  std::snprintf(out, size, " in block (%u,%u,%u) thread %d", blockIdx.x, blockIdx.y, blockIdx.z,
                current_block->current);
}

inline void complete(Barrier& barrier) {
  barrier.arrived = 0;
  ++barrier.phase;
  if (&barrier == &current_block->barrier) ++current_block->epoch;
}

// Arrives at `barrier` and returns once every thread taking part has. True in the thread that
// arrived last, which goes on before any of the others runs again.
inline bool arrive_and_wait(Barrier& barrier) {
  if (++barrier.arrived == barrier.expected) {
    complete(barrier);
    return true;
  }
  Thread& thread = current_thread();
  thread.waiting_on = &barrier;
  thread.waiting_phase = barrier.phase;
  swapcontext(&thread.context, &current_block->scheduler);  // back when the phase has ended
  return false;
}

// A thread exits: the barriers stop waiting for it.
inline void leave(Barrier& barrier) {
  --barrier.expected;
  if (barrier.arrived > 0 && barrier.arrived == barrier.expected) complete(barrier);
}

// A warp-wide instruction. `deposit(exchange)` stores this lane's operands; once all 32 lanes
// have, the last one runs `execute(exchange)` for the whole warp. Returns the exchange, from
// which each lane then reads its result.
template <typename Deposit, typename Execute>
WarpExchange& warp_instruction(const char* instruction, int variant, Deposit&& deposit,
                               Execute&& execute) {
  Warp& warp = current_warp();
  WarpExchange& exchange = warp.exchange[warp.barrier.phase % 2];
  if (warp.barrier.expected != 32)
    error("%s with %d live lanes in warp %d (all 32 must take part)", instruction,
          warp.barrier.expected, warp_index());
  const int me = lane();
  exchange.instruction[me] = instruction;
  exchange.variant[me] = variant;
  deposit(exchange);
  if (arrive_and_wait(warp.barrier)) {
    ++warp_instructions;
    for (int l = 0; l < 32; ++l)
      if (std::strcmp(exchange.instruction[l], instruction) != 0 ||
          exchange.variant[l] != variant) {
        error("warp %d: lane %d executes %s (%d) while lane %d executes %s (%d)", warp_index(), l,
              exchange.instruction[l], exchange.variant[l], me, instruction, variant);
        break;
      }
    execute(exchange);
  }
  return exchange;
}

// ---- Shared memory and its race checks ----------------------------------------------------------

inline unsigned char* dynamic_shared_memory() {
  return current_block->shared;
}

// The chunk index of a 16-byte shared-memory access at `p`.
inline size_t shared_chunk(const void* p, const char* what) {
  const auto* c = static_cast<const unsigned char*>(p);
  const unsigned char* base = current_block->shared;
  if (c < base || c + 16 > base + current_block->shared_bytes) {
    error("%s: shared address out of range (offset %ld of %zu bytes)", what, long(c - base),
          current_block->shared_bytes);
    return 0;
  }
  if ((c - base) % 16 != 0) error("%s: shared address not 16-byte aligned", what);
  return size_t(c - base) / 16;
}

// Warp `warp` reads a chunk (ldmatrix).
inline void check_read(size_t chunk, int warp, const char* what) {
  Block& b = *current_block;
  ChunkHistory& h = b.history[chunk];
  if (h.landed_epoch == ChunkHistory::kInFlight)
    error(
        "%s: warp %d reads shared bytes %zu-%zu while thread %d's cp.async to them is in "
        "flight (no cp.async.wait_group for it)",
        what, warp, chunk * 16, chunk * 16 + 15, h.writer);
  else if (h.writer >= 0 && h.writer / 32 != warp && h.landed_epoch == b.epoch)
    error(
        "%s: warp %d reads shared bytes %zu-%zu that thread %d's cp.async landed in with no "
        "__syncthreads in between",
        what, warp, chunk * 16, chunk * 16 + 15, h.writer);
  if (h.read_epoch != b.epoch) {
    h.read_epoch = b.epoch;
    h.reader_warps = 0;
  }
  h.reader_warps |= 1u << warp;
}

// The current thread issues a cp.async to a chunk.
inline void check_async_write(size_t chunk) {
  Block& b = *current_block;
  ChunkHistory& h = b.history[chunk];
  const int tid = current_thread().tid;
  if (h.read_epoch == b.epoch && (h.reader_warps & ~(1u << (tid / 32))))
    error(
        "cp.async overwrites shared bytes %zu-%zu that another warp read since the last "
        "__syncthreads (write after read)",
        chunk * 16, chunk * 16 + 15);
  if (h.landed_epoch == ChunkHistory::kInFlight)
    error("cp.async to shared bytes %zu-%zu while thread %d's cp.async to them is in flight",
          chunk * 16, chunk * 16 + 15, h.writer);
  h.landed_epoch = ChunkHistory::kInFlight;
  h.writer = tid;
}

inline void land(const std::vector<AsyncCopy>& group) {
  Block& b = *current_block;
  for (const AsyncCopy& copy : group) {
    std::memcpy(b.shared + copy.offset, copy.bytes, 16);
    b.history[copy.offset / 16].landed_epoch = b.epoch;
  }
}

// ---- Launch -------------------------------------------------------------------------------------

inline cudaError_t last_error = cudaSuccess;
inline std::map<const void*, int> max_dynamic_shared;  // cudaFuncSetAttribute, per kernel

inline void on_fault(int signal_number, siginfo_t* info, void*) {
  char where[96];
  describe_current_thread(where, sizeof where);
  char message[320];
  const int n =
      std::snprintf(message, sizeof message,
                    "\nEMULATION ERROR%s: %s at address %p: an access beyond a "
                    "buffer or shared memory (both end at guard pages), or a fiber "
                    "stack overflow\n",
                    where, signal_number == SIGSEGV ? "SIGSEGV" : "SIGBUS", info->si_addr);
  if (n > 0) (void)!write(STDERR_FILENO, message, size_t(n));
  signal(signal_number, SIG_DFL);
  raise(signal_number);
}

// Faults in a fiber whose stack overflowed need a stack of their own to be reported.
inline void install_fault_handler() {
  static bool installed = false;
  if (installed) return;
  installed = true;
  static std::vector<char> alternate_stack(1 << 16);
  stack_t stack{};
  stack.ss_sp = alternate_stack.data();
  stack.ss_size = alternate_stack.size();
  sigaltstack(&stack, nullptr);
  struct sigaction action {};
  action.sa_sigaction = on_fault;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &action, nullptr);
  sigaction(SIGBUS, &action, nullptr);
}

// Memory for one launch: the block's shared memory, ending at a guard page, and one stack per
// thread, each above a guard page (stacks grow down).
class LaunchMemory {
 public:
  static constexpr size_t kPage = 4096;
  static constexpr size_t kStackBytes = 256 * 1024;

  LaunchMemory(size_t shared_bytes, int threads) {
    shared_region_ = round_up(shared_bytes, kPage);
    bytes_ = shared_region_ + kPage + size_t(threads) * (kPage + kStackBytes);
    void* map = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) {
      std::perror("mmap");
      std::exit(3);
    }
    map_ = static_cast<unsigned char*>(map);
    mprotect(map_ + shared_region_, kPage, PROT_NONE);
    for (int t = 0; t < threads; ++t) mprotect(stack_guard(t), kPage, PROT_NONE);
    shared_ = map_ + shared_region_ - round_up(shared_bytes, 16);
  }
  LaunchMemory(const LaunchMemory&) = delete;
  LaunchMemory& operator=(const LaunchMemory&) = delete;
  ~LaunchMemory() { munmap(map_, bytes_); }

  unsigned char* shared() const { return shared_; }
  void* stack(int t) const { return stack_guard(t) + kPage; }

 private:
  static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }
  unsigned char* stack_guard(int t) const {
    return map_ + shared_region_ + kPage + size_t(t) * (kPage + kStackBytes);
  }

  unsigned char* map_ = nullptr;
  size_t bytes_ = 0;
  size_t shared_region_ = 0;
  unsigned char* shared_ = nullptr;
};

inline std::function<void()> kernel_body;  // the kernel and its arguments, for every thread

inline void thread_main() {
  kernel_body();
  Block& b = *current_block;
  Thread& thread = current_thread();
  if (!thread.uncommitted.empty() || !thread.committed.empty())
    error("exits with cp.async copies it did not wait for");
  Warp& warp = b.warps[thread.tid / 32];
  if (warp.barrier.arrived > 0)
    error("exits while other lanes of warp %d wait in a warp-wide instruction or __syncwarp",
          thread.tid / 32);
  leave(b.barrier);
  leave(warp.barrier);
  thread.exited = true;
  swapcontext(&thread.context, &b.scheduler);  // never resumed
}

inline void report_deadlock(const Block& b) {
  int at_block_barrier = 0, at_warp_barrier = 0, exited = 0;
  for (const Thread& t : b.threads) {
    if (t.exited)
      ++exited;
    else if (t.waiting_on == &b.barrier)
      ++at_block_barrier;
    else
      ++at_warp_barrier;
  }
  error(
      "deadlock in block (%u,%u,%u): %d threads wait at __syncthreads, %d at a warp barrier, "
      "%d have exited (a barrier that some threads never reach)",
      blockIdx.x, blockIdx.y, blockIdx.z, at_block_barrier, at_warp_barrier, exited);
  std::exit(4);  // the fibers cannot be unwound
}

inline void run_block(Block& b, const LaunchMemory& memory, dim3 block_dim) {
  const int threads = int(b.threads.size());
  for (int t = 0; t < threads; ++t) {
    Thread& thread = b.threads[t];
    thread.tid = t;
    getcontext(&thread.context);
    thread.context.uc_stack.ss_sp = memory.stack(t);
    thread.context.uc_stack.ss_size = LaunchMemory::kStackBytes;
    thread.context.uc_link = nullptr;
    makecontext(&thread.context, thread_main, 0);
  }
  for (;;) {
    bool live = false, resumed = false;
    for (Thread& thread : b.threads) {
      if (thread.exited) continue;
      live = true;
      if (thread.waiting_on != nullptr && thread.waiting_on->phase == thread.waiting_phase)
        continue;
      thread.waiting_on = nullptr;
      b.current = thread.tid;
      threadIdx = dim3(thread.tid % block_dim.x, thread.tid / block_dim.x % block_dim.y,
                       thread.tid / (block_dim.x * block_dim.y));
      swapcontext(&b.scheduler, &thread.context);
      resumed = true;
    }
    b.current = -1;
    if (!live) return;
    if (!resumed) report_deadlock(b);
  }
}

// Records why a launch fails (as CUDA would, for cudaGetLastError) and reports it.
inline void launch_failure(cudaError_t code, const char* reason) {
  last_error = code;
  error("launch refused: %s", reason);
}

template <typename Args>
void launch(void (*kernel)(Args), dim3 grid, dim3 block_dim, size_t shared_bytes,
            const Args& args) {
  constexpr size_t kDefaultSharedLimit = 48 * 1024;
  // The smallest opt-in limit of the architectures the kernel is built for (sm_80: 163 KiB).
  constexpr size_t kSharedLimit = 163 * 1024;
  const long threads = long(block_dim.x) * block_dim.y * block_dim.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 ||
      grid.z > 65535)
    return launch_failure(cudaErrorInvalidConfiguration, "grid dimensions out of range");
  if (threads == 0 || threads > 1024 || block_dim.z > 64)
    return launch_failure(cudaErrorInvalidConfiguration, "block dimensions out of range");
  if (threads % 32 != 0)
    return launch_failure(cudaErrorInvalidConfiguration,
                          "the emulation runs whole warps only (threads a block % 32 != 0)");
  if (shared_bytes > kDefaultSharedLimit) {
    const auto allowed = max_dynamic_shared.find(reinterpret_cast<const void*>(kernel));
    if (allowed == max_dynamic_shared.end() || size_t(allowed->second) < shared_bytes)
      return launch_failure(cudaErrorInvalidValue,
                            "dynamic shared memory above 48 KiB without cudaFuncSetAttribute");
  }
  if (shared_bytes > kSharedLimit)
    return launch_failure(cudaErrorInvalidValue, "dynamic shared memory above 163 KiB");

  install_fault_handler();
  const LaunchMemory memory(shared_bytes, int(threads));
  kernel_body = [&] { kernel(args); };
  gridDim = grid;
  blockDim = block_dim;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        Block b;
        b.threads.resize(size_t(threads));
        b.warps.resize(size_t(threads / 32));
        for (Warp& w : b.warps) w.barrier.expected = 32;
        b.barrier.expected = int(threads);
        b.shared = memory.shared();
        b.shared_bytes = shared_bytes;
        std::memset(b.shared, 0xFF, shared_bytes);
        b.history.assign((shared_bytes + 15) / 16, ChunkHistory{});
        blockIdx = dim3(x, y, z);
        current_block = &b;
        run_block(b, memory, block_dim);
        current_block = nullptr;
        ++blocks_run;
      }
  kernel_body = nullptr;
}

}  // namespace emulation

// ---- CUDA built-ins the kernel calls ------------------------------------------------------------

// One fiber runs at a time: a plain read-modify-write is atomic.
inline long long atomicMin(long long* address, long long value) {
  const long long old = *address;
  if (value < old) *address = value;
  return old;
}

inline void __syncthreads() {
  emulation::arrive_and_wait(emulation::current_block->barrier);
}

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  if (mask != 0xffffffffu) emulation::error("__syncwarp with a partial mask");
  emulation::arrive_and_wait(emulation::current_warp().barrier);
}

// The round-to-nearest fp32 intrinsics a kernel uses to keep nvcc from fusing a product and a
// sum into an FMA: one IEEE operation each, as the host computes them (the emulated kernels
// build with -ffp-contract=off, so g++ does not fuse them either). isnan and isfinite, which
// CUDA device code calls unqualified.
inline float __fadd_rn(float a, float b) {
  return a + b;
}
inline float __fsub_rn(float a, float b) {
  return a - b;
}
inline float __fmul_rn(float a, float b) {
  return a * b;
}
inline float __fdiv_rn(float a, float b) {
  return a / b;
}
// fma.rn.f32 (PTX ISA, "fma"): a * b + c in infinite precision, rounded once to nearest even;
// sqrt.rn.f32: the IEEE square root, rounded to nearest. std::fma and std::sqrt are the same
// operations (no subnormal flushing: loom's kernels build without -ftz).
inline float __fmaf_rn(float a, float b, float c) {
  return std::fma(a, b, c);
}
inline float __fsqrt_rn(float a) {
  return std::sqrt(a);
}
using std::isfinite;
using std::isnan;

inline float __shfl_xor_sync(unsigned mask, float value, int lane_mask) {
  if (mask != 0xffffffffu) emulation::error("__shfl_xor_sync with a partial mask");
  const int lane = emulation::lane();
  const emulation::WarpExchange& exchange = emulation::warp_instruction(
      "shfl.sync.bfly", lane_mask, [&](emulation::WarpExchange& x) { x.value[lane] = value; },
      [](emulation::WarpExchange&) {});
  const int source = lane ^ lane_mask;
  return source < 32 ? exchange.value[source] : value;  // beyond the warp: one's own value
}

// vote.sync.ballot.b32 (PTX ISA, "vote.sync"): bit l of the result is lane l's predicate, the same
// word for every lane of the mask. Full warps only, like the shuffle above.
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  if (mask != 0xffffffffu) emulation::error("__ballot_sync with a partial mask");
  const int lane = emulation::lane();
  const emulation::WarpExchange& exchange = emulation::warp_instruction(
      "vote.sync.ballot.b32", 0,
      [&](emulation::WarpExchange& x) { x.value[lane] = predicate != 0 ? 1.0f : 0.0f; },
      [](emulation::WarpExchange&) {});
  unsigned ballot = 0;
  for (int l = 0; l < 32; ++l)
    if (exchange.value[l] != 0.0f) ballot |= 1u << l;
  return ballot;
}

// popc.b32: the number of set bits.
inline int __popc(unsigned x) {
  return __builtin_popcount(x);
}

// ---- The CUDA runtime API the kernel's host code calls ------------------------------------------

// Launches run synchronously, in order, whatever the stream.
template <typename Args>
void emulated_launch(void (*kernel)(Args), dim3 grid, dim3 block, size_t shared_bytes,
                     cudaStream_t /*stream*/, const Args& args) {
  emulation::launch(kernel, grid, block, shared_bytes, args);
}

inline unsigned char* emulated_dynamic_shared_memory() {
  return emulation::dynamic_shared_memory();
}

template <typename Kernel>
cudaError_t cudaFuncSetAttribute(Kernel kernel, cudaFuncAttribute attribute, int value) {
  if (attribute == cudaFuncAttributeMaxDynamicSharedMemorySize)
    emulation::max_dynamic_shared[reinterpret_cast<const void*>(kernel)] = value;
  return cudaSuccess;
}

template <typename Kernel>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attributes, Kernel) {
  *attributes = cudaFuncAttributes{};
  return cudaSuccess;
}

inline cudaError_t cudaGetLastError() {
  const cudaError_t e = emulation::last_error;
  emulation::last_error = cudaSuccess;
  return e;
}

inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    default:
      return "unknown error";
  }
}

inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

inline cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : cudaErrorInvalidDevice;
}
