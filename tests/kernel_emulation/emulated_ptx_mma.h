#pragma once
// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 and (below) the sparse
// mma.sp m16n8k32, emulated for the kernel-emulation test (tests/kernel_emulation, docs/gpu.md).
// They replace the wrappers mma_16816 and mma_sp_16832 of kernels/common/ptx.h (emulated_ptx.h
// includes this file where a kernel includes that header), so it includes nothing itself:
// emulated_cuda_runtime.h (included earlier) provides the emulation. Written by the loom authors
// for this test.
//
// D[16x8] = A[16x16] B[16x8] + C, per warp. The fragment layouts are taken from the PTX ISA
// ("Matrix Fragments for mma.m16n8k16 with floating point type"), independently of the kernel's
// own description of them. With g = lane / 4 and t = lane % 4, each 32-bit register holding two
// 16-bit elements, the lower index in the low 16 bits:
//   A: a0,a1 = A[g][2t, 2t+1]    a2,a3 = A[g+8][2t, 2t+1]
//      a4,a5 = A[g][2t+8, 2t+9]  a6,a7 = A[g+8][2t+8, 2t+9]     (registers a[0..3] = pairs)
//   B: b0,b1 = B[2t, 2t+1][g]    b2,b3 = B[2t+8, 2t+9][g]       (registers b0, b1 = pairs)
//   C, D: c0,c1 = C[g][2t, 2t+1]  c2,c3 = C[g+8][2t, 2t+1]
// The warp's last lane to arrive gathers all fragments and computes the product in double
// precision (the hardware accumulates in at least fp32), rounded to fp32 once per element.

template <typename E>
float emulated_element_to_float(uint32_t bits) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    __nv_bfloat16_raw raw;
    raw.x = static_cast<unsigned short>(bits);
    return __bfloat162float(__nv_bfloat16(raw));
  } else {
    static_assert(std::is_same_v<E, __half>);
    __half_raw raw;
    raw.x = static_cast<unsigned short>(bits);
    return __half2float(__half(raw));
  }
}

template <typename E>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  const int lane = emulation::lane();
  const emulation::WarpExchange& exchange = emulation::warp_instruction(
      std::is_same_v<E, __nv_bfloat16> ? "mma.m16n8k16.bf16" : "mma.m16n8k16.f16", 0,
      [&](emulation::WarpExchange& x) {
        for (int i = 0; i < 4; ++i) {
          x.registers[lane][i] = a[i];
          x.accumulator[lane][i] = c[i];
        }
        x.registers[lane][4] = b0;
        x.registers[lane][5] = b1;
      },
      [](emulation::WarpExchange& x) {
        float A[16][16], B[16][8], C[16][8];
        auto half_of = [](uint32_t reg, int i) { return i % 2 ? reg >> 16 : reg & 0xffffu; };
        for (int l = 0; l < 32; ++l) {
          const int g = l / 4, t = l % 4;
          for (int i = 0; i < 8; ++i)  // a_i, in register a[i / 2]
            A[g + 8 * (i / 2 % 2)][2 * t + i % 2 + 8 * (i / 4)] =
                emulated_element_to_float<E>(half_of(x.registers[l][i / 2], i));
          for (int i = 0; i < 4; ++i)  // b_i, in register b[i / 2]
            B[2 * t + i % 2 + 8 * (i / 2)][g] =
                emulated_element_to_float<E>(half_of(x.registers[l][4 + i / 2], i));
          for (int i = 0; i < 4; ++i) C[g + 8 * (i / 2)][2 * t + i % 2] = x.accumulator[l][i];
        }
        for (int l = 0; l < 32; ++l) {
          const int g = l / 4, t = l % 4;
          for (int i = 0; i < 4; ++i) {
            const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
            double sum = C[row][col];
            for (int k = 0; k < 16; ++k) sum += double(A[row][k]) * double(B[k][col]);
            x.accumulator[l][i] = float(sum);
          }
        }
      });
  for (int i = 0; i < 4; ++i) c[i] = exchange.accumulator[lane][i];
}

// mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32.{bf16,f16}.{bf16,f16}.f32 with
// sparsity selector 0: D[16x8] = A[16x32] B[32x8] + C, A 2:4 sparse. Semantics from the PTX ISA
// ("Sparse matrix storage" and "Matrix Fragments for sparse mma.m16n8k32 with .f16 and .bf16
// types"), with g = lane / 4, t = lane % 4:
//   A: each 4-wide chunk of a row keeps two elements. Register a[i] holds the kept pair of one
//      chunk, the lower column in the low 16 bits: a[0] row g, chunk t; a[1] row g + 8, chunk t;
//      a[2] row g, chunk t + 4; a[3] row g + 8, chunk t + 4 (chunk c = columns 4c .. 4c + 3).
//   B: b_i (i = 0..7, in register b[i / 2], i odd in the high half) = B[2t + i % 2 + 8 (i / 2)][g].
//   Metadata: with selector 0, lanes t = 0 and t = 1 of each group of four supply it (the other
//      lanes' e is ignored). Lane t holds columns 16t .. 16t + 15 of row g in bits 0-15 and of row
//      g + 8 in bits 16-31, one nibble per chunk in column order; a nibble's low 2 bits give the
//      column of the first kept element in its chunk, its high 2 bits that of the second. With
//      ::ordered_metadata only first < second is meaningful (0b0100, 0b1000, 0b1001, 0b1100,
//      0b1101, 0b1110); anything else is undefined behaviour, reported here as an error.
//   C, D: as for mma.m16n8k16 above.
// The dense A is rebuilt from the values and the metadata (unkept columns +0) and the product is
// taken as for the dense instruction: per element C + the 32 products in column order, in double,
// rounded to fp32 once.
template <typename E>
__device__ __forceinline__ void mma_sp_16832(float (&c)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[4], uint32_t e) {
  const int lane = emulation::lane();
  const emulation::WarpExchange& exchange = emulation::warp_instruction(
      std::is_same_v<E, __nv_bfloat16> ? "mma.sp.m16n8k32.bf16" : "mma.sp.m16n8k32.f16", 0,
      [&](emulation::WarpExchange& x) {
        for (int i = 0; i < 4; ++i) {
          x.registers[lane][i] = a[i];
          x.registers[lane][4 + i] = b[i];
          x.accumulator[lane][i] = c[i];
        }
        x.registers[lane][8] = e;
      },
      [](emulation::WarpExchange& x) {
        float A[16][32] = {}, B[32][8], C[16][8];
        auto half_of = [](uint32_t reg, int i) { return i % 2 ? reg >> 16 : reg & 0xffffu; };
        for (int l = 0; l < 32; ++l) {
          const int g = l / 4, t = l % 4;
          for (int i = 0; i < 8; ++i)
            B[2 * t + i % 2 + 8 * (i / 2)][g] =
                emulated_element_to_float<E>(half_of(x.registers[l][4 + i / 2], i));
          for (int i = 0; i < 4; ++i) C[g + 8 * (i / 2)][2 * t + i % 2] = x.accumulator[l][i];
        }
        for (int g = 0; g < 8; ++g)
          for (int half = 0; half < 2; ++half) {  // the metadata lane 4g + half
            const uint32_t word = x.registers[4 * g + half][8];
            for (int upper = 0; upper < 2; ++upper) {  // row g, then row g + 8
              const int row = g + 8 * upper;
              for (int q = 0; q < 4; ++q) {
                const int chunk = 4 * half + q;
                const uint32_t nibble = word >> (16 * upper + 4 * q) & 0xfu;
                const int first = int(nibble & 3u), second = int(nibble >> 2);
                if (first >= second) {
                  emulation::error(
                      "mma.sp: lane %d's metadata 0x%08x has nibble 0x%x for row %d, columns "
                      "%d-%d: not an ordered pair of columns (undefined behaviour)",
                      4 * g + half, word, nibble, row, 4 * chunk, 4 * chunk + 3);
                  continue;
                }
                // The kept pair sits with lane 4g + chunk % 4, register upper + 2 (chunk / 4).
                const uint32_t kept = x.registers[4 * g + chunk % 4][upper + 2 * (chunk / 4)];
                A[row][4 * chunk + first] = emulated_element_to_float<E>(half_of(kept, 0));
                A[row][4 * chunk + second] = emulated_element_to_float<E>(half_of(kept, 1));
              }
            }
          }
        for (int l = 0; l < 32; ++l) {
          const int g = l / 4, t = l % 4;
          for (int i = 0; i < 4; ++i) {
            const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
            double sum = C[row][col];
            for (int k = 0; k < 32; ++k) sum += double(A[row][k]) * double(B[k][col]);
            x.accumulator[l][i] = float(sum);
          }
        }
      });
  for (int i = 0; i < 4; ++i) c[i] = exchange.accumulator[lane][i];
}
