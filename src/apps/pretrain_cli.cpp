// loom-pretrain's flags (pretrain_cli.h): every flag maps to a TrainConfig field.
#include "pretrain_cli.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "loom/core/error.h"
#include "loom/models/config.h"
#include "loom/train/runtime.h"

namespace loom::apps {

PretrainCommandLine::PretrainCommandLine(const std::string& name)
    : app("Pretrain a GPT-2 or Llama model with loom.", name) {
  auto& c = config;
  app.set_config("--config", "", "Read flags from a TOML/INI file (keys are flag names)");
  app.add_option("--model", c.model, "Model family: gpt2 | llama")->capture_default_str();
  app.add_option("--preset", c.preset,
                 "Model shape: gpt2-tiny, gpt2-mini, gpt2-124m, gpt2-350m, llama-tiny, llama-mini, "
                 "llama-1b, llama-8b")
      ->capture_default_str();
  app.add_option("--init-from-hf", c.init_from_hf,
                 "Start from a Hugging Face directory (config.json + model.safetensors); its "
                 "config gives the model shape");
  app.add_option("--d-ff", c.d_ff,
                 "The MLP's width (0: the preset's); with --ffn-blocks B, B times the preset's "
                 "gives as many weights as its dense MLP")
      ->capture_default_str();
  app.add_option("--layers", c.layers, "Transformer blocks (0: the preset's)")
      ->capture_default_str();
  app.add_option("--vocab-size", c.vocab_size,
                 "Vocabulary size (0: from the data directory's meta.json, else 256)")
      ->capture_default_str();
  app.add_option("--data", c.data,
                 "Training tokens: a token shard (llm.c .bin, raw *.u16 / *.u32), or a mixture of "
                 "sources [NAME=]PATH[:WEIGHT],... where PATH may be a glob of shards "
                 "('web/*.bin'), e.g. web=web/*.bin:0.7,code=code.bin:0.3")
      ->required();
  app.add_option("--val-data", c.val_data,
                 "Validation tokens (the same forms; each source is scored apart and reported "
                 "by name)");
  app.add_option("--steps", c.steps, "Optimizer steps to train to")->capture_default_str();
  app.add_option("--batch-size", c.batch_size,
                 "Global batch: sequences per optimizer step (before --grad-accum splits it)")
      ->capture_default_str();
  app.add_option("--seq-len", c.seq_len, "Tokens per sequence")->capture_default_str();
  app.add_option("--grad-accum", c.grad_accum, "Micro-batches per optimizer step")
      ->capture_default_str();
  app.add_option("--lr", c.lr, "Peak learning rate")->capture_default_str();
  app.add_option("--min-lr", c.min_lr, "Learning rate at the end of the cosine decay")
      ->capture_default_str();
  app.add_option("--warmup-steps", c.warmup_steps, "Linear warmup steps")->capture_default_str();
  app.add_option("--lr-decay-steps", c.lr_decay_steps,
                 "Step at which the cosine decay reaches --min-lr (0: --steps); keep it fixed "
                 "when a resumed run extends --steps")
      ->capture_default_str();
  app.add_option("--dropout", c.dropout, "Dropout probability (attention and residual)")
      ->capture_default_str();
  app.add_option("--ffn-blocks", c.ffn_blocks,
                 "The MLP's linears as B independent block-diagonal blocks (1: dense); B divides "
                 "d_model and the MLP width, and under --tp is a multiple of it (each rank holds "
                 "whole blocks: no MLP all-reduce)")
      ->capture_default_str();
  app.add_option("--ffn-rank", c.ffn_rank,
                 "The MLP's linears as products of two rank-r factors (0: dense); r below d_model "
                 "and the MLP width; under --tp the MLP's forward all-reduce carries r values per "
                 "token")
      ->capture_default_str();
  app.add_option("--mtp", c.mtp,
                 "Multi-token prediction: N extra heads (each a transformer block on the last "
                 "block's input, its own norm and the shared unembedding) predicting 2 .. N+1 "
                 "tokens ahead, their losses added while training");
  app.add_option("--mtp-weights", c.mtp_weights,
                 "Loss weight of each --mtp head, comma-separated (default: 1 each)")
      ->delimiter(',');
  app.add_option("--share-layers", c.share_layers,
                 "Cross-layer parameter sharing: none, all (every layer layer 0's weights), "
                 "cycle:K (layer i uses layer i mod K's), repeat:K (each block K layers in a "
                 "row), or L=O,... (layer L uses layer O's)")
      ->capture_default_str();
  app.add_option("--weight-decay", c.weight_decay,
                 "AdamW weight decay (matrices only; not norms, biases, embeddings)")
      ->capture_default_str();
  app.add_option("--beta1", c.beta1, "AdamW beta1")->capture_default_str();
  app.add_option("--beta2", c.beta2, "AdamW beta2")->capture_default_str();
  app.add_option("--freeze-variance-after", c.freeze_variance_after,
                 "AdamW's second moment stops changing after this many steps, as in 1-bit Adam "
                 "(0: never); pair it with a compressing --comm-hook (docs/compression.md)")
      ->capture_default_str();
  app.add_option("--grad-clip", c.grad_clip, "Global gradient-norm clip (0: off)")
      ->capture_default_str();
  app.add_option(
         "--precision", c.precision,
         "fp32 | bf16 | fp64 (bf16: compute under autocast, fp32 master weights and gradients; "
         "fp64: everything in fp64, for checking layouts against each other)")
      ->capture_default_str();
  app.add_option("--device", c.device,
                 "cpu | cuda | cuda:N: where the model trains (CUDA: one process, one GPU)")
      ->capture_default_str();
  app.add_option("--attention", c.attention,
                 "auto | fused | sdpa | math: auto runs loom's fused FlashAttention-2 kernel on "
                 "CUDA (bf16/fp16, head dim 64 or 128, no attention dropout), loom's CPU kernel "
                 "on fp32 CPU tensors (head dim a multiple of 16, no attention dropout), else "
                 "PyTorch's SDPA")
      ->capture_default_str();
  app.add_option("--loss", c.loss,
                 "auto | fused | math: how the cross-entropy is computed. fused: loom's kernels "
                 "(CUDA; on the CPU their host reference) read the logits once forward and once "
                 "backward, writing the gradient over them in their own dtype; math: ATen's "
                 "log-softmax in fp32; auto: fused on CUDA, math on the CPU")
      ->capture_default_str();
  app.add_option("--loss-chunk-rows", c.loss_chunk_rows,
                 "auto | off | ROWS: run the output head together with the loss, ROWS rows of "
                 "logits at a time, so that a batch's whole logits never exist (the gradients "
                 "are made in the forward; the head weight's is held in fp32 until backward). "
                 "off: whole logits; auto: chunks only where one forward's logits would pass "
                 "2 GiB, each chunk's at most 1 GiB")
      ->capture_default_str();
  app.add_option("--norm", c.norm,
                 "auto | fused | math: how the norms (and the residual add before each block's "
                 "second norm) are computed. fused: loom's kernels (CUDA; on the CPU their host "
                 "reference) read the residual stream once and write the normed activation in "
                 "the dtype the next matrix product reads; math: ATen's add and layer norm; "
                 "auto: fused on CUDA, math on the CPU")
      ->capture_default_str();
  app.add_option("--swiglu", c.swiglu,
                 "auto | fused | math: how Llama's SwiGLU, silu(gate) * up, is computed. fused: "
                 "loom's kernels (CUDA; on the CPU their host reference) read gate and up once "
                 "forward and write both gradients in one pass backward; math: ATen's silu and "
                 "product; auto: fused on CUDA, math on the CPU (GPT-2's GELU does not ask)")
      ->capture_default_str();
  app.add_option("--adamw", c.adamw,
                 "auto | fused | math: how the replicated optimizer updates the weights (ZeRO's "
                 "sharded engines keep loom's own pass). fused: "
                 "PyTorch's fused AdamW kernel (one pass over each list, the gradient clip's "
                 "factor applied inside it); math: the formulas as multi-tensor ATen ops (on the "
                 "CPU loom's vectorised pass, equal to them bit for bit); auto: fused on CUDA, "
                 "math on the CPU and when a hook freezes the second moment")
      ->capture_default_str();
  app.add_option("--profile-steps", c.profile_steps,
                 "A:B: record steps A through B (1-based) under PyTorch's Kineto profiler and "
                 "write a Chrome trace and the top kernels by device time (with the op that "
                 "launched each and its input shapes; on the CPU the top ops) into --profile-out");
  app.add_option("--profile-out", c.profile_out,
                 "Where --profile-steps writes trace.rank<R>.json and kernels.rank<R>.json/.txt")
      ->capture_default_str();
  app.add_option("--z-loss", c.z_loss,
                 "Weight of the z-loss, mean(logsumexp(logits)^2), added to the training loss "
                 "(PaLM; keeps the softmax normaliser near 1 in low precision; the validation "
                 "loss stays the cross-entropy alone); 0: none")
      ->capture_default_str();
  app.add_flag("--doc-mask", c.doc_mask,
               "Attention stays within each document of a window: a document begins at each "
               "document-start token the tokenizer put before it (BOS, GPT-2's <|endoftext|>); "
               "positions still count from the window's start. Not with --cp > 1 yet");
  app.add_option("--peak-tflops", c.peak_tflops,
                 "The device's dense bf16 peak (TFLOP/s) for the MFU metric; 0: from the GPU's "
                 "name (H100/H200 989, A100 312, ...)")
      ->capture_default_str();
  app.add_option("--seed", c.seed, "Seed for initialization and data order")->capture_default_str();
  app.add_option("--sampling", c.sampling,
                 "auto | epoch | random: how training windows are drawn. epoch: without "
                 "replacement, each window of the data once per epoch in a seeded order (the cut "
                 "shifted each epoch); random: each window's start hashed from the seed, step and "
                 "sample (with replacement, as checkpoints written before --sampling drew); auto: "
                 "epoch for a new run, the checkpoint's for a resume")
      ->capture_default_str();
  app.add_option("--metrics-out", c.metrics_out, "Write one JSON object per step to this file");
  app.add_option("--save-dir", c.save_dir, "Write checkpoints here");
  app.add_option("--preempt-signal", c.preempt_signals,
                 "Signals that ask for a checkpoint and a clean exit (status 75) after the step "
                 "in flight, e.g. TERM,USR1 (Slurm: sbatch --signal=USR1@120), or none")
      ->capture_default_str();
  app.add_option("--save-every", c.save_every, "Checkpoint every N steps (0: only at the end)")
      ->capture_default_str();
  app.add_option("--save-every-s", c.save_every_s,
                 "Also checkpoint after the step that ends this many seconds after the last "
                 "checkpoint (or the start; 0: by steps only); the ranks agree on it")
      ->capture_default_str();
  app.add_flag("--async-save", c.async_save,
               "Write checkpoints in the background: the step waits only for copies of the state, "
               "rank 0 writes the files while training goes on (the next save, the end and a "
               "preemption wait for it)");
  app.add_option("--keep-checkpoints", c.keep_checkpoints,
                 "The newest N checkpoints stay in --save-dir, older ones are removed (0: all)")
      ->capture_default_str();
  app.add_option("--resume", c.resume, "Resume from a save directory or a checkpoint directory");
  app.add_option("--export-hf", c.export_hf, "Write a Hugging Face directory at the end");
  app.add_option("--export-hf-shard-mb", c.export_hf_shard_mb,
                 "Largest weight file of the Hugging Face export, in MB (10^6 bytes); a larger "
                 "model is written as shards with model.safetensors.index.json")
      ->capture_default_str();
  app.add_option("--log-every", c.log_every, "Progress line every N steps")->capture_default_str();
  app.add_option("--eval-every", c.eval_every, "Validation loss every N steps (0: only at the end)")
      ->capture_default_str();
  app.add_option("--eval-batches", c.eval_batches,
                 "Validation batches (of --batch-size sequences, in file order) per evaluation")
      ->capture_default_str();
  app.add_option("--dp", c.dp,
                 "Data-parallel size (0: the number of ranks mpirun started, divided by the "
                 "other mesh dimensions)")
      ->capture_default_str();
  app.add_option("--bucket-mb", c.bucket_mb,
                 "Gradient bucket size in MiB: each bucket's all-reduce starts during backward")
      ->capture_default_str();
  app.add_option("--comm-hook", c.comm_hook,
                 "How gradient buckets are reduced: avg (all-reduce mean) | bf16 (compressed "
                 "to bfloat16 on the wire) | int8 (blockwise int8 with error feedback) | onebit "
                 "(a sign bit per value and a scale per 1024, with error feedback) | "
                 "powersgd[:rank=4] (each gradient matrix as two rank-R factors, with error "
                 "feedback) | topk[:ratio=0.01] (the largest values with error feedback) | "
                 "threshold[:ratio=0.01,every=10] (the same, the threshold recomputed every "
                 "`every` steps); any of them with warmup=N (plain averages for the first N "
                 "steps) and momentum=B (sends momenta, not gradients: 1-bit Adam with "
                 "--freeze-variance-after W and warmup=W; B = --beta1; preconditioned by the "
                 "warm-up's variance unless precondition=0); every hook also under --zero; "
                 "docs/compression.md")
      ->capture_default_str();
  app.add_option("--tp", c.tp,
                 "Tensor-parallel size: attention heads, MLP and vocabulary split across this "
                 "many ranks (neighbouring ranks, ideally on one node)")
      ->capture_default_str();
  app.add_flag("--sequence-parallel", c.sequence_parallel,
               "With --tp: norms, dropout and residuals on 1/tp of the sequence each, all-reduces "
               "replaced by all-gather + reduce-scatter");
  app.add_option("--pad-vocab-multiple", c.pad_vocab_multiple,
                 "Pad the vocabulary to a multiple of this times --tp (padding is masked out of "
                 "the loss and never exported); 0: auto, 128 on CUDA (GPT-2's 50257 becomes "
                 "50304: aligned rows for the head and the loss), 1 on the CPU")
      ->capture_default_str();
  app.add_option(
         "--cp", c.cp,
         "Context-parallel size: each sequence split across this many ranks (2 x cp "
         "chunks, ring attention; --seq-len a multiple of 2 x cp; docs/context-parallel.md)")
      ->capture_default_str();
  app.add_option("--pp", c.pp,
                 "Pipeline-parallel size: the layers split into this many stages, one per rank "
                 "(outermost mesh dimension)")
      ->capture_default_str();
  app.add_option("--schedule", c.schedule,
                 "Pipeline schedule: gpipe | 1f1b | interleaved (or a registered custom one)")
      ->capture_default_str();
  app.add_option("--virtual-stages", c.virtual_stages,
                 "Model chunks per pipeline rank, for --schedule interleaved")
      ->capture_default_str();
  app.add_option("--micro-batches", micro_batches,
                 "Micro-batches per step on each data-parallel rank (the pipeline's m; the same "
                 "as --grad-accum, which it sets)");
  app.add_option("--pp-partition", c.pp_partition,
                 "What balances the pipeline stages: uniform (equal layer counts) | params | "
                 "flops | measured (timed at start-up) | model (the cost model's seconds on the "
                 "machine profile --pp-devices names; docs/planner.md)")
      ->capture_default_str();
  app.add_option("--pp-devices", c.pp_devices,
                 "JSON file of the pipeline ranks' devices: {\"devices\": [{\"name\": ..., "
                 "\"speed\": 2.0, \"memory_gb\": 80}, ...]}; faster ranks get more layers. "
                 "'measured': each rank times a block at start-up. A machine profile "
                 "(loom-plan --measure file, h100-node, h200-node) gives the cost model's "
                 "speeds and memory");
  app.add_option("--compress-activations", c.compress_activations,
                 "What crosses the pipeline stages, activations forward and their gradients "
                 "backward: none | bf16 (half of fp32's bytes) | int8 (blocks of 256 with a "
                 "scale: about a quarter)")
      ->capture_default_str();
  app.add_option("--zero", c.zero,
                 "ZeRO stage: 0 replicated data parallelism | 1 optimizer state sharded across "
                 "dp ranks | 2 plus gradients | 3 plus parameters (gathered per block)")
      ->capture_default_str();
  app.add_option("--zero3-reshard-after-forward", c.zero3_reshard_after_forward,
                 "With --zero 3: release each block's gathered parameters after its forward and "
                 "backward (true: least memory) or keep them until the step's last backward "
                 "(false: one all-gather per block per step)")
      ->capture_default_str();
  app.add_option("--activation-checkpointing", c.activation_checkpointing,
                 "none | full (recompute each block in backward) | selective (recompute the "
                 "attention core only)")
      ->capture_default_str();
  app.add_flag("--offload-optimizer", c.offload_optimizer,
               "With --zero: optimizer state and the AdamW step on the host (ZeRO-Offload)");
  app.add_flag("--offload-activations", c.offload_activations,
               "With --activation-checkpointing full: each block's saved input waits in host "
               "memory (pinned, copied on a side stream on a GPU) until its recompute");
  app.add_option("--memory-cap-mb", c.memory_cap_mb,
                 "Fail any allocation that would hold more than this many MiB on a rank: host "
                 "memory on the CPU, LibTorch's caching allocator (reserved bytes) with --device "
                 "cuda (simulates a smaller device; 0: no cap)")
      ->capture_default_str();
  app.add_option("--prune-to", c.prune.to,
                 "Gradual magnitude pruning: the final sparsity, in [0, 1) (0: no pruning, unless "
                 "--prune-pattern is N:M)")
      ->capture_default_str();
  app.add_option("--prune-pattern", c.prune.pattern,
                 "unstructured | N:M (keep N of every M weights of a row, e.g. 2:4) | block:B "
                 "(B x B tiles kept or dropped whole)")
      ->capture_default_str();
  app.add_option("--prune-start", c.prune.start,
                 "Step (optimizer steps completed) of the first mask update")
      ->capture_default_str();
  app.add_option("--prune-end", c.prune.end,
                 "Step at which the final sparsity is reached (0: --steps); masks stay fixed after")
      ->capture_default_str();
  app.add_option("--prune-every", c.prune.every, "Steps between mask updates")
      ->capture_default_str();
  app.add_option("--prune-scope", c.prune.scope,
                 "layer (a threshold per weight) | global (one threshold over every pruned "
                 "weight, computed across tp and pp ranks without gathering them)")
      ->capture_default_str();
  app.add_option("--prune-targets", c.prune.targets,
                 "Which linears are pruned: mlp, attention, or both (comma-separated); "
                 "embeddings, the output head and norms never are")
      ->capture_default_str();
  app.add_option("--prune-kernels", c.prune.kernels,
                 "auto: pruned linears use a sparse kernel where the pattern has one on the "
                 "device (2:4 / 2:4t on CUDA; block:B from 70% of tiles dropped: on CUDA with "
                 "B 32 or 64, on the CPU with B >= 32), and say which in the log | off: always "
                 "the masked dense product")
      ->capture_default_str();
  app.add_option("--strategy", c.strategies,
                 "A registered strategy, NAME or NAME:key=value,... (repeatable; the binary "
                 "must register it, see docs/strategies.md). Registered here: " +
                     (loom::train::user_strategy_names().empty()
                          ? std::string("none")
                          : fmt::format("{}", fmt::join(loom::train::user_strategy_names(), ", "))))
      ->allow_extra_args(false);
  app.add_option("--plan", plan,
                 "none: the layout flags as given | auto: the cost model's best layout for this "
                 "model, batch and world, among those agreeing with the layout flags given "
                 "(--dp, --tp, --pp, --cp, --zero, --micro-batches, --schedule, ...); the choice "
                 "and why are logged (docs/planner.md)")
      ->capture_default_str();
  app.add_option("--plan-profile", plan_profile,
                 "The machine --plan auto plans for: measure (every rank times this machine at "
                 "start-up, a few seconds), a profile file (loom-plan --measure --out), or "
                 "h100-node / h200-node")
      ->capture_default_str();
  app.add_option("--dist-backend", c.dist_backend,
                 "auto | nccl | mpi: NCCL for groups whose ranks have distinct GPUs, MPI "
                 "otherwise (CUDA tensors staged through host memory); CPU runs use MPI")
      ->capture_default_str();
  app.add_option("--comm-timeout", comm_timeout,
                 "Seconds a collective may run before the watchdog aborts the job")
      ->capture_default_str();
  app.add_option("--threads", threads,
                 "Intra-op threads per rank (0: OMP_NUM_THREADS if set, else cores / ranks on "
                 "this node)")
      ->capture_default_str();
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error|off")
      ->capture_default_str();
}

void PretrainCommandLine::finish() {
  // 0 is the config's "no heads", but given on the command line it is a mistake.
  LOOM_CHECK(app.count("--mtp") == 0 ||
                 (config.mtp >= 1 && config.mtp <= models::ModelConfig::kMaxMtpHeads),
             "--mtp {} must be in [1, {}] (extra heads predicting 2, 3, ... tokens ahead), or "
             "left out",
             config.mtp, models::ModelConfig::kMaxMtpHeads);
  if (app.count("--micro-batches") > 0) {
    LOOM_CHECK(micro_batches > 0, "--micro-batches {} must be positive", micro_batches);
    LOOM_CHECK(app.count("--grad-accum") == 0 || config.grad_accum == micro_batches,
               "--micro-batches {} and --grad-accum {} disagree: they are the same setting "
               "(micro-batches per step on each data-parallel rank); pass one",
               micro_batches, config.grad_accum);
    config.grad_accum = micro_batches;
  }
}

}  // namespace loom::apps
