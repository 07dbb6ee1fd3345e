#pragma once
// The built-in strategies' registrations, one per file of src/train/strategies/ (called by
// register_builtin_strategies, builtins.cpp).
namespace loom::train::strategies {
void register_pipeline();
void register_tensor_parallel();
void register_context_parallel();
void register_memory_strategies();  // activation-checkpointing, activation-offload,
                                    // optimizer-offload
void register_data_parallel();
void register_zero();
void register_prune();    // prune (gradual magnitude pruning)
void register_profile();  // profile (--profile-steps: Kineto trace and kernel table)
}  // namespace loom::train::strategies
