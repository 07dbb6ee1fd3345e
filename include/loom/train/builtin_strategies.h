#pragma once
// Registers loom's built-in strategies (pipeline, tensor-parallel, activation-checkpointing,
// activation-offload, data-parallel, zero, optimizer-offload) in the strategy registry. The
// Trainer calls it; calling it again does nothing. Explicit rather than static registration, so
// that no linker can drop them.
namespace loom::train {
void register_builtin_strategies();
}
