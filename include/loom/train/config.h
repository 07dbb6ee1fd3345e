#pragma once
// Everything one training run needs, in one struct: what loom-pretrain's flags fill in and what a
// checkpoint records.
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <utility>
#include <vector>

#include "loom/models/config.h"

namespace loom::train {

// Gradual magnitude pruning (Zhu & Gupta's cubic schedule; ops/sparsity.h), the --prune-* flags.
// On when `to` > 0 or the pattern is N:M.
struct PruneConfig {
  double to = 0;                          // --prune-to: the final sparsity, in [0, 1)
  std::string pattern = "unstructured";   // --prune-pattern: unstructured | N:M | block:B
  int64_t start = 0;                      // --prune-start: first mask update (steps completed)
  int64_t end = 0;                        // --prune-end: the final sparsity from here; 0: --steps
  int64_t every = 10;                     // --prune-every: steps between mask updates
  std::string scope = "layer";            // --prune-scope: layer | global threshold
  std::string targets = "mlp,attention";  // --prune-targets: which linears (comma-separated)
  std::string kernels = "auto";           // --prune-kernels: auto (sparse kernels) | off

  bool enabled() const;
  // The schedule's last step for a run of `steps` steps.
  int64_t end_step(int64_t steps) const { return end > 0 ? end : steps; }
  // loom::Error naming the flag, its value and what is valid.
  void validate(int64_t steps) const;
  bool operator==(const PruneConfig&) const = default;
};

struct TrainConfig {
  // Model: a preset of a family, or a Hugging Face directory (its config.json gives the shape).
  std::string model = "gpt2";  // gpt2 | llama
  std::string preset = "gpt2-tiny";
  std::string init_from_hf;  // directory; overrides model/preset when set
  int64_t vocab_size = 0;    // 0: the data's tokenizer vocabulary (meta.json), else 256
  uint64_t seed = 1337;
  double dropout = 0.0;    // overrides the preset's (0 by default)
  int64_t layers = 0;      // transformer blocks; 0: the preset's
  int64_t d_ff = 0;        // the MLP's width; 0: the preset's
  int64_t ffn_blocks = 1;  // the MLP as this many block-diagonal blocks (ModelConfig::ffn_blocks)
  int64_t ffn_rank = 0;    // the MLP's linears as rank-r factor products (ModelConfig::ffn_rank)
  int64_t mtp = 0;         // extra multi-token prediction heads (ModelConfig::mtp_heads)
  std::vector<double> mtp_weights;  // their loss weights, one per head (empty: 1 each)
  // Cross-layer parameter sharing (ModelConfig::share_layers; "" or "none": none).
  std::string share_layers;

  // Data.
  std::string data;      // training token file (llm.c .bin or *.u16)
  std::string val_data;  // optional validation token file
  int64_t seq_len = 128;

  // Optimization. batch_size is sequences per optimizer step; grad_accum splits it into
  // micro-batches of batch_size / grad_accum.
  int64_t steps = 100;
  int64_t batch_size = 16;
  int64_t grad_accum = 1;
  double lr = 1e-3;
  double min_lr = 1e-4;
  int64_t warmup_steps = 10;
  int64_t lr_decay_steps = 0;  // cosine reaches min_lr here; 0 = steps
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  // AdamW's second moment stops changing after this many steps (0: never; ops/adamw.h): what
  // lets a compressing --comm-hook with error feedback train like the uncompressed run
  // (docs/compression.md).
  int64_t freeze_variance_after = 0;
  double grad_clip = 1.0;  // 0 disables clipping
  // fp32 | bf16 | fp64. fp64 is a correctness instrument, not a training mode: parameters,
  // activations, gradients, collectives and optimizer state all in fp64, so that layouts can be
  // compared with bounds far below what any bug produces (docs/testing.md).
  std::string precision = "fp32";

  // Data parallelism. batch_size stays the global batch whatever dp is: each of the dp ranks
  // trains on batch_size / dp sequences per step, in grad_accum micro-batches.
  int64_t dp = 0;                 // 0: the world size divided by the other mesh dimensions
  double bucket_mb = 25.0;        // gradient bucket capacity (MiB)
  std::string comm_hook = "avg";  // avg | bf16 | int8: how gradient buckets are reduced
  // auto | nccl | mpi: the transport of the mesh's groups (dist/backend_plan.h)
  std::string dist_backend = "auto";

  // Tensor parallelism: layers split across tp ranks (Megatron-style); every tp rank of a
  // data-parallel replica trains on the same samples.
  int64_t tp = 1;
  bool sequence_parallel = false;  // norms/dropout/residuals on 1/tp of the sequence
  // Vocabulary padded to a multiple of this times tp; 0: auto (vocab_padding_multiple()).
  int64_t pad_vocab_multiple = 0;

  // Context parallelism: each sequence cut into 2 x cp chunks, rank i of a cp group holding
  // chunks i and 2 cp - 1 - i, attention as ring attention over the group (the
  // "context-parallel" strategy; docs/context-parallel.md).
  int64_t cp = 1;

  // Pipeline parallelism: the model's layers split into pp stages (virtual_stages chunks per
  // rank with the interleaved schedule); each data-parallel rank's batch runs through the
  // pipeline in grad_accum micro-batches (--micro-batches).
  int64_t pp = 1;
  std::string schedule = "1f1b";       // gpipe | 1f1b | interleaved | a registered schedule
  int64_t virtual_stages = 1;          // model chunks per pipeline rank (interleaved)
  std::string pp_partition = "flops";  // uniform | params | flops | measured: layer cost
  std::string pp_devices;              // JSON device file: relative speed and memory per pp rank
  // What crosses the stage boundaries: none | bf16 | int8 (parallel/pipeline/activation_codec.h).
  std::string compress_activations = "none";

  // Memory. ZeRO shards the training state across the dp ranks: 1 optimizer state, 2 plus
  // gradients, 3 plus parameters (0: plain replicated data parallelism).
  int64_t zero = 0;
  // ZeRO-3: release a block's gathered parameters after its forward and its backward (true:
  // least memory), or keep them gathered until the step's last backward (false: one all-gather
  // per block per step).
  bool zero3_reshard_after_forward = true;
  std::string activation_checkpointing = "none";  // none | full | selective
  bool offload_optimizer = false;    // with --zero: optimizer state and step on the host
  bool offload_activations = false;  // with full checkpointing: block inputs wait on the host
  double memory_cap_mb = 0;  // refuse allocations above this per rank (CUDA: the device; 0: none)

  // Sparsity: weights pruned during training (the "prune" strategy).
  PruneConfig prune;

  // Device and kernels. --device cuda puts each rank on its node's GPU by local rank (cuda:N on
  // GPU N); the mesh's groups go over NCCL or staged MPI (dist/backend_plan.h).
  std::string device = "cpu";      // cpu | cuda | cuda:N
  std::string attention = "auto";  // auto | fused | sdpa | math (ops::AttentionBackend)
  std::string loss = "auto";       // auto | fused | math (ops::LossBackend)
  // auto | off | ROWS: the head and the loss in chunks of rows (CausalLM::set_loss_chunk_rows).
  std::string loss_chunk_rows = "auto";
  // How training windows are drawn: epoch (without replacement) or random (with replacement;
  // checkpoints written before 2026-12-07 drew so); auto, the default, is epoch for a new run and
  // the checkpoint's for a resume (the Trainer resolves it). data/sampler.h.
  std::string sampling = "auto";
  std::string norm = "auto";    // auto | fused | math (ops::NormBackend)
  std::string adamw = "auto";   // auto | fused | math (ops::AdamWBackend)
  std::string swiglu = "auto";  // auto | fused | math (ops::ActivationBackend)
  // --profile-steps A:B: steps A..B (1-based) under the Kineto profiler (the "profile"
  // strategy), its trace and kernel table written into --profile-out. Empty: no profile.
  std::string profile_steps;
  std::string profile_out = "loom-profile";
  double z_loss = 0;  // weight of PaLM's z-loss, mean(lse^2), in the loss (0: none)
  // --doc-mask: attention does not cross the document boundaries inside a window (the data's
  // tokenizer's document-start token begins each document; CausalLM::set_document_mask).
  bool doc_mask = false;
  double peak_tflops = 0;  // the device's dense bf16 peak for MFU; 0: from its name (mfu.h)

  // Registered strategies (train/strategy.h), each "NAME[:key=value,...]" (--strategy,
  // repeatable); the built-in ones are turned on by the flags above.
  std::vector<std::string> strategies;

  // Output.
  std::string metrics_out;       // JSON lines; empty = none
  std::string save_dir;          // checkpoints; empty = none
  int64_t save_every = 0;        // 0 = only at the end
  double save_every_s = 0;       // also (or only) once this many seconds have passed since the last
  int64_t keep_checkpoints = 2;  // the newest this many stay in save_dir (0 = all)
  bool async_save = false;  // rank 0 writes the files on a background thread (checkpoint_writer.h)
  std::string resume;       // save directory or checkpoint directory
  std::string export_hf;    // write a Hugging Face directory at the end
  double export_hf_shard_mb = 5000;  // its weight files hold at most this many MB (10^6 bytes)
  int64_t log_every = 10;
  int64_t eval_every = 0;    // 0 = only at the end
  int64_t eval_batches = 8;  // validation batches of batch_size sequences
  // Signals that ask for a checkpoint and a clean exit (core::parse_preemption_signals).
  std::string preempt_signals = "TERM,USR1";

  // Throws loom::Error naming the field, its value and what would be valid.
  void validate() const;
  // --pad-vocab-multiple as a run uses it: the value given, or for 0 (auto) 128 on a CUDA device
  // (rows of 16-byte-aligned width for the head's matrix products and the loss's vector loads:
  // GPT-2's 50257 becomes 50304) and 1 on the CPU (no padding).
  int64_t vocab_padding_multiple() const;
  // Sequences per micro-batch on one rank, for a data-parallel size of `dp_size`.
  int64_t micro_batch_size(int64_t dp_size = 1) const {
    return batch_size / (grad_accum * dp_size);
  }
  // The index, in the step's global batch, of the first sample of micro-batch k on data-parallel
  // rank `dp_rank` of `dp_size`: what the sampler draws, and what dropout masks are keyed by.
  int64_t first_sample(int64_t dp_rank, int64_t dp_size, int64_t k) const;
  int64_t schedule_steps() const { return lr_decay_steps > 0 ? lr_decay_steps : steps; }

  // The shape of a model these flags start from nothing (not resumed, not a custom model):
  // --init-from-hf's config.json, or --preset with --layers, --d-ff and --vocab-size
  // (`tokenizer_vocab`, the data's, when that is 0), and --dropout, --ffn-blocks, --ffn-rank,
  // --mtp, --share-layers. Throws loom::Error for flags the Hugging Face directory cannot take,
  // and for a shape that does not validate. What the Trainer builds, and what --plan auto plans.
  models::ModelConfig new_model_config(int64_t tokenizer_vocab) const;

  // Resuming is bit-exact only when everything that shapes the computation is unchanged.
  // Throws loom::Error naming the first flag whose value differs from `saved`'s.
  void check_resumable_from(const TrainConfig& saved) const;

  nlohmann::json to_json() const;
  static TrainConfig from_json(const nlohmann::json& j);
};

// --profile-steps "A:B" or "A" as the 1-based steps [A, B]; loom::Error naming the text and what
// is valid unless 1 <= A <= B <= steps.
std::pair<int64_t, int64_t> parse_profile_steps(const std::string& text, int64_t steps);

}  // namespace loom::train
