#pragma once
// Which implementation computes an op that loom has fused kernels for (the cross-entropy, the
// residual add + norm): the flags --loss and --norm take these names.
//   kAuto   the fused kernels on CUDA tensors they take, the math path elsewhere (its CPU speed
//           is what the CPU benchmarks measure);
//   kFused  the fused algorithm everywhere: the kernels on CUDA, their host reference on the CPU
//           (fp64 included; what fp64 equivalence tests run);
//   kMath   ATen operations, as an unfused model computes it.
#include <string>
#include <vector>

namespace loom::ops {

enum class FusedChoice { kAuto, kFused, kMath };

std::string to_string(FusedChoice choice);
std::vector<std::string> fused_choice_names();  // "auto", "fused", "math"
// `name` as a choice; anything else is a loom::Error naming `what` (e.g. "loss backend"), the
// name and the valid names.
FusedChoice parse_fused_choice(const std::string& name, const std::string& what);

}  // namespace loom::ops
