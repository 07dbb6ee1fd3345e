#pragma once
// cp.async and ldmatrix, emulated for the kernel-emulation test (tests/kernel_emulation,
// docs/gpu.md): the wrappers cp_async_16, cp_async_commit, cp_async_wait and ldmatrix_x4(_trans)
// of kernels/common/ptx.h. emulated_ptx.h includes it where a kernel includes that header; it
// includes nothing itself: emulated_cuda_runtime.h (included earlier) provides the emulation.
// Written by the loom authors for this test.
//
// Semantics from the PTX ISA ("cp.async", "cp.async.commit_group", "cp.async.wait_group",
// "ldmatrix"):
//  - cp.async.cg.shared.global [dst], [src], 16, src_size: copies 16 bytes, or writes 16 zero
//    bytes and reads nothing when src_size is 0. The copy is asynchronous: its bytes land at the
//    issuing thread's cp.async.wait_group at the latest, which is when the emulation lands them,
//    and until then any read of them is a race (emulation::check_read).
//  - commit_group closes the thread's copies issued since the last commit into a group (possibly
//    empty); wait_group N waits until at most N of the thread's committed groups are pending.
//  - ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lane L gives the address of row L % 8 of
//    8x8 matrix j = L / 8 (16 contiguous bytes, 16-byte aligned); with g = L / 4, t = L % 4,
//    register j of lane L receives {M_j[g][2t], M_j[g][2t+1]}, or {M_j[2t][g], M_j[2t+1][g]}
//    with .trans (the lower element in the low 16 bits). The warp's last lane to arrive reads
//    all four matrices at once, after the race checks.

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool fill) {
  emulation::Thread& thread = emulation::current_thread();
  const size_t chunk = emulation::shared_chunk(smem, "cp.async destination");
  emulation::AsyncCopy copy{chunk * 16, {}};
  if (fill) {
    if (reinterpret_cast<uintptr_t>(gmem) % 16 != 0)
      emulation::error("cp.async: global source not 16-byte aligned");
    std::memcpy(copy.bytes, gmem, 16);  // faults here if the source is out of bounds
  }
  emulation::check_async_write(chunk);
  thread.uncommitted.push_back(copy);
  ++emulation::async_copies;
}

__device__ __forceinline__ void cp_async_commit() {
  emulation::Thread& thread = emulation::current_thread();
  thread.committed.push_back(std::move(thread.uncommitted));
  thread.uncommitted.clear();
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  emulation::Thread& thread = emulation::current_thread();
  while (thread.committed.size() > size_t(N)) {
    emulation::land(thread.committed.front());
    thread.committed.pop_front();
  }
}

inline void emulated_ldmatrix_x4(uint32_t (&r)[4], const void* smem, bool trans) {
  const char* instruction = trans ? "ldmatrix.x4.trans" : "ldmatrix.x4";
  const int lane = emulation::lane(), warp = emulation::warp_index();
  const size_t chunk = emulation::shared_chunk(smem, instruction);
  const emulation::WarpExchange& exchange = emulation::warp_instruction(
      instruction, 0, [&](emulation::WarpExchange& x) { x.address[lane] = chunk * 16; },
      [&](emulation::WarpExchange& x) {
        for (int l = 0; l < 32; ++l) emulation::check_read(x.address[l] / 16, warp, instruction);
        const unsigned char* shared = emulation::dynamic_shared_memory();
        auto element = [&](int matrix, int row, int col) {  // M_matrix[row][col]
          uint16_t e;
          std::memcpy(&e, shared + x.address[8 * matrix + row] + 2 * col, 2);
          return uint32_t(e);
        };
        for (int l = 0; l < 32; ++l) {
          const int g = l / 4, t = l % 4;
          for (int j = 0; j < 4; ++j)
            x.registers[l][j] = trans ? element(j, 2 * t, g) | element(j, 2 * t + 1, g) << 16
                                      : element(j, g, 2 * t) | element(j, g, 2 * t + 1) << 16;
        }
      });
  for (int j = 0; j < 4; ++j) r[j] = exchange.registers[lane][j];
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  emulated_ldmatrix_x4(r, smem, false);
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  emulated_ldmatrix_x4(r, smem, true);
}
