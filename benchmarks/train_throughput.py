"""Training throughput of GPT-2 or Llama in plain PyTorch (Python API), the twin of loom-bench-train.

The model, optimizer, clipping, batches, flags and JSON line are those of
benchmarks/train_throughput.cpp, op for op where it matters (src/models/gpt2.cpp,
src/models/llama.cpp: pre-norm RMSNorm blocks, rotary embeddings, grouped-query attention through
SDPA, SwiGLU, an untied head). The loop is
the fastest eager one a user would write: SDPA attention, the fused (vectorised, multi-tensor)
AdamW kernel, foreach gradient clipping, no host sync inside the step. --compile runs the same
model under torch.compile (inductor) instead: a second reference, reported as such.

--profile N adds N steps under torch.profiler and reports each op's self time by phase and op
class, with the same phases and classes as loom-bench-train's (benchmarks/step_profile.h).

--device cuda --precision bf16 is the GPU reference for loom-bench-train's figures on the same
GPU in the same run (scripts/gpu-check): the model on the GPU, forward and loss under bf16
autocast with fp32 master weights (loom's --precision bf16), the fused CUDA AdamW, the device
synchronised once a step in the metrics phase (as loom-bench-train does); eager, and with
--compile the torch.compile reference. The device and precision are reported beside "config"
(which scripts/bench compares between the two programs on the CPU).
"""
import argparse
import json
import resource
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# (d_model, n_layers, n_heads, max_seq_len) of loom's GPT-2 presets (src/models/config.cpp).
# scripts/bench checks that both programs report the same config, so drift here shows up.
PRESETS = {
    "gpt2-tiny": (128, 4, 4, 256),
    "gpt2-mini": (256, 6, 8, 512),
    "gpt2-124m": (768, 12, 12, 1024),
    "gpt2-350m": (1024, 24, 16, 1024),
}
# (d_model, n_layers, n_heads, n_kv_heads, d_ff, max_seq_len) of loom's Llama presets.
LLAMA_PRESETS = {
    "llama-tiny": (128, 4, 4, 2, 352, 256),
    "llama-mini": (256, 6, 8, 4, 704, 512),
    "llama-1b": (2048, 22, 32, 4, 5632, 2048),
}
NORM_EPS = 1e-5
ROPE_THETA = 10000.0
LR, BETAS, EPS, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-3, (0.9, 0.95), 1e-8, 0.1, 1.0


class Block(nn.Module):
    def __init__(self, d, d_ff, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.ln_1 = nn.LayerNorm(d, eps=NORM_EPS)
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(d, 3 * d)
        self.attn.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d, eps=NORM_EPS)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(d, d_ff)
        self.mlp.c_proj = nn.Linear(d_ff, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.n_heads
        # Same views as loom: [B, T, 3D] -> three [B, H, T, hd], handed to SDPA uncopied.
        qkv = self.attn.c_attn(self.ln_1(x)).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        x = x + self.attn.c_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))


class Gpt2(nn.Module):
    # Submodule names are loom's (and Hugging Face's), so the decay rule below reads the same.
    def __init__(self, vocab, max_seq_len, d, n_layers, n_heads, d_ff):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(vocab, d)
        self.transformer.wpe = nn.Embedding(max_seq_len, d)
        self.transformer.h = nn.ModuleList(Block(d, d_ff, n_heads) for _ in range(n_layers))
        self.transformer.ln_f = nn.LayerNorm(d, eps=NORM_EPS)

    def forward(self, tokens):
        tr = self.transformer
        x = tr.wte(tokens) + tr.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in tr.h:
            x = block(x)
        # Tied head, the same matmul loom does.
        return torch.matmul(tr.ln_f(x), tr.wte.weight.t())


class LlamaBlock(nn.Module):
    def __init__(self, d, d_ff, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.hd = n_heads, n_kv_heads, d // n_heads
        self.input_layernorm = nn.RMSNorm(d, eps=NORM_EPS)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(d, d, bias=False)
        self.self_attn.k_proj = nn.Linear(d, n_kv_heads * self.hd, bias=False)
        self.self_attn.v_proj = nn.Linear(d, n_kv_heads * self.hd, bias=False)
        self.self_attn.o_proj = nn.Linear(d, d, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=NORM_EPS)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(d, d_ff, bias=False)
        self.mlp.up_proj = nn.Linear(d, d_ff, bias=False)
        self.mlp.down_proj = nn.Linear(d_ff, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        a = self.self_attn
        hn = self.input_layernorm(x)
        q = a.q_proj(hn).view(b, t, self.n_heads, self.hd).transpose(1, 2)
        k = a.k_proj(hn).view(b, t, self.n_kv_heads, self.hd).transpose(1, 2)
        v = a.v_proj(hn).view(b, t, self.n_kv_heads, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(rope(q, cos, sin), rope(k, cos, sin), v,
                                           is_causal=True, enable_gqa=True)
        x = x + a.o_proj(y.transpose(1, 2).reshape(b, t, d))
        m = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(m)) * self.mlp.up_proj(m))


def rope(x, cos, sin):
    # Hugging Face's rotate_half form, in fp32 as loom's apply_rope.
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class Llama(nn.Module):
    def __init__(self, vocab, max_seq_len, d, n_layers, n_heads, n_kv_heads, d_ff):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, d)
        self.model.layers = nn.ModuleList(
            LlamaBlock(d, d_ff, n_heads, n_kv_heads) for _ in range(n_layers))
        self.model.norm = nn.RMSNorm(d, eps=NORM_EPS)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        hd = d // n_heads
        inv = 1.0 / ROPE_THETA ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.model.embed_tokens(tokens)
        cos, sin = self.cos[:t], self.sin[:t]
        for block in self.model.layers:
            x = block(x, cos, sin)
        return self.lm_head(self.model.norm(x))


def init_parameters(model, n_layers):
    # loom's rules (Gpt2::init_for); the values differ from loom's, their distribution does not.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif ".ln_" in name or "layernorm" in name or name == "model.norm.weight":
                p.fill_(1.0)
            elif name.endswith("c_proj.weight") or name.endswith("down_proj.weight"):
                p.normal_(0.0, 0.02 / (2.0 * n_layers) ** 0.5)
            else:
                p.normal_(0.0, 0.02)


def decays(name, p):
    # loom::train::default_decays: 2-D weights, except embedding tables.
    return p.dim() >= 2 and not any(e in name for e in ("wte.", "wpe.", "embed_tokens."))


PHASES = ["data", "forward", "backward", "clip", "optimizer", "zero_grad", "metrics"]
OP_CLASSES = ["matmul", "attention", "norm", "activation", "cross_entropy", "memory",
              "embedding", "autograd", "elementwise", "other"]
SCOPE_FUNCTION, SCOPE_BACKWARD_FUNCTION = 0, 1  # at::RecordScope; loom hooks only these two


def op_class(name, backward_node):
    # The rules and order of op_class in benchmarks/step_profile.h (keep them in step).
    def has(*parts):
        return any(p in name for p in parts)
    if backward_node or has("autograd::", "Backward"):
        return "autograd"
    if has("scaled_dot_product", "flash_attention", "attention"):
        return "attention"
    if has("layer_norm", "rms_norm"):
        return "norm"
    if has("gelu", "silu", "relu"):
        return "activation"
    if has("log_softmax", "nll_loss", "cross_entropy"):
        return "cross_entropy"
    if has("::mm", "addmm", "bmm", "matmul", "linear"):
        return "matmul"
    if has("embedding", "index_select"):
        return "embedding"
    if has("copy", "fill_", "zero", "empty", "cat", "stack", "clone", "contiguous"):
        return "memory"
    if has("aten::", "loom::"):
        return "elementwise"
    return "other"


def op_tables(events, walls_ms, steps):
    """Self time (ms per step) of every op by phase and class; a phase's wall time minus its ops'
    is what ran outside any op (the interpreter, dispatch, autograd's engine)."""
    table = {p: {c: 0.0 for c in OP_CLASSES} for p in PHASES}
    by_name = {}
    for e in events:
        if e.scope not in (SCOPE_FUNCTION, SCOPE_BACKWARD_FUNCTION):
            continue  # record_function ranges (phases, Optimizer.step): not ops
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("phase::"):
            parent = parent.cpu_parent
        if parent is None:
            continue
        phase = parent.name[len("phase::"):]
        cls = op_class(e.name, e.scope == SCOPE_BACKWARD_FUNCTION)
        table[phase][cls] += e.self_cpu_time_total / 1000.0
        key = phase + " " + e.name
        by_name[key] = by_name.get(key, 0.0) + e.self_cpu_time_total / 1000.0
    out = {}
    for p in PHASES:
        row = {c: table[p][c] / steps for c in OP_CLASSES}
        row["outside_ops"] = (walls_ms[p] - sum(table[p].values())) / steps
        out[p] = row
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:20]
    return out, {k: v / steps for k, v in top}


def minor_faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def fail(message):
    # Exit code 2 for bad flags, as loom-bench-train and argparse.
    print(f"train_throughput.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def model_config(args):
    if args.preset not in PRESETS and args.preset not in LLAMA_PRESETS:
        fail(f"--preset {args.preset} is not known; valid: "
             f"{', '.join(list(PRESETS) + list(LLAMA_PRESETS))}")
    llama = args.preset in LLAMA_PRESETS
    if llama:
        d, layers, heads, kv_heads, d_ff, max_seq_len = LLAMA_PRESETS[args.preset]
    else:
        d, layers, heads, max_seq_len = PRESETS[args.preset]
        kv_heads, d_ff = heads, 4 * d
    if args.d_model and llama:
        fail("--d-model changes GPT-2 presets only (a Llama preset's d_ff is its own)")
    d = args.d_model or d
    layers = args.layers or layers
    if args.heads:
        heads = args.heads
        kv_heads = heads if not llama else kv_heads
    d_ff = d_ff if llama else 4 * d
    checks = [
        (d > 0 and layers > 0 and heads > 0 and args.vocab > 0, "sizes must be positive"),
        (d % heads == 0, f"--heads {heads} does not divide --d-model {d}"),
        (heads % kv_heads == 0, f"{kv_heads} key/value heads do not divide --heads {heads}"),
        (0 < args.seq_len <= max_seq_len,
         f"--seq-len {args.seq_len} must be in [1, {max_seq_len}] (the preset's max_seq_len)"),
        (args.batch_size > 0 and args.steps > 0 and args.warmup >= 0 and args.threads > 0,
         "--batch-size, --steps, --threads must be positive and --warmup >= 0"),
    ]
    for ok, message in checks:
        if not ok:
            fail(message)
    c = {"d_model": d, "n_layers": layers, "n_heads": heads, "d_ff": d_ff,
         "vocab_size": args.vocab, "max_seq_len": max_seq_len}
    if llama:
        c["n_kv_heads"] = kv_heads
    return c


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-mini")
    ap.add_argument("--d-model", type=int, default=0, help="0: the preset's")
    ap.add_argument("--layers", type=int, default=0, help="0: the preset's")
    ap.add_argument("--heads", type=int, default=0, help="0: the preset's")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--profile", type=int, default=0,
                    help="after the timed steps, this many steps under torch.profiler")
    ap.add_argument("--adamw", choices=["fused", "foreach", "loop"], default="fused",
                    help="torch.optim.AdamW implementation (fused: the fastest on the CPU)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                    help="bf16: forward and loss under autocast, fp32 master weights")
    ap.add_argument("--compile", action="store_true",
                    help="the model under torch.compile (inductor): a second reference")
    args = ap.parse_args()
    if args.profile < 0:
        fail(f"--profile {args.profile} must be >= 0")
    c = model_config(args)
    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: no CUDA device is visible to this torch")
    device = torch.device(args.device)
    cuda = device.type == "cuda"

    torch.manual_seed(args.seed)
    if "n_kv_heads" in c:
        model = Llama(c["vocab_size"], c["max_seq_len"], c["d_model"], c["n_layers"], c["n_heads"],
                      c["n_kv_heads"], c["d_ff"])
    else:
        model = Gpt2(c["vocab_size"], c["max_seq_len"], c["d_model"], c["n_layers"],
                     c["n_heads"], c["d_ff"])
    init_parameters(model, c["n_layers"])
    model.to(device)
    model.train()
    named = list(model.named_parameters())
    params = [p for _, p in named]
    decay = [p for n, p in named if decays(n, p)]
    no_decay = [p for n, p in named if not decays(n, p)]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY},
              {"params": no_decay, "weight_decay": 0.0}]
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, **impl[args.adamw])
    forward = torch.compile(model) if args.compile else model

    # Drawn before timing, with the generator and call loom-bench-train uses: the same tokens.
    # Each step slices its own batch (the "data" phase), as loom-bench-train does.
    total = args.warmup + args.steps + args.profile
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(args.vocab, (total, args.batch_size, args.seq_len + 1), generator=gen)

    walls = {p: 0.0 for p in PHASES}
    clock = {"phase": None, "start": 0.0, "range": None}

    def phase(name):
        # Ends the running phase (its wall time, and its profiler range when profiling).
        now = time.perf_counter()
        if clock["phase"] is not None:
            walls[clock["phase"]] += (now - clock["start"]) * 1000.0
        if clock["range"] is not None:
            clock["range"].__exit__(None, None, None)
            clock["range"] = None
        clock["phase"], clock["start"] = name, time.perf_counter()
        if name is not None and profiler is not None:
            clock["range"] = torch.profiler.record_function("phase::" + name)
            clock["range"].__enter__()

    profiler = None
    step_ms, losses = [], []
    phase_ms, faults = None, minor_faults()
    for i in range(total):
        if i == args.warmup:
            walls, faults = {p: 0.0 for p in PHASES}, minor_faults()
        if i == args.warmup + args.steps:
            phase_ms = {p: walls[p] / args.steps for p in PHASES}
            phase_ms["minor_faults_per_step"] = (minor_faults() - faults) / args.steps
            walls = {p: 0.0 for p in PHASES}
            activities = [torch.profiler.ProfilerActivity.CPU]
            if cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            profiler = torch.profiler.profile(activities=activities)
            profiler.__enter__()
        start = time.perf_counter()
        phase("data")
        inp = tokens[i, :, :-1].contiguous().to(device)
        tgt = tokens[i, :, 1:].contiguous().to(device)
        phase("forward")
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            logits = forward(inp)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1))
        phase("backward")
        loss.backward()
        phase("clip")
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM, foreach=True)
        phase("optimizer")
        optimizer.step()
        phase("zero_grad")
        optimizer.zero_grad()  # set_to_none, as loom's AdamW::zero_grad
        phase("metrics")
        losses.append(loss.detach())
        if cuda:
            torch.cuda.synchronize()  # the step's device work, inside its time
        phase(None)
        stop = time.perf_counter()
        if args.warmup <= i < args.warmup + args.steps:
            step_ms.append((stop - start) * 1000.0)
    if profiler is not None:
        profiler.__exit__(None, None, None)
    if phase_ms is None:
        phase_ms = {p: walls[p] / args.steps for p in PHASES}
        phase_ms["minor_faults_per_step"] = (minor_faults() - faults) / args.steps

    med = statistics.median(step_ms)
    out = {
        "impl": "pytorch-compile" if args.compile else "pytorch",
        "device": args.device,
        "precision": args.precision,
        "tokens_per_s": args.batch_size * args.seq_len / (med / 1000.0),
        "step_ms_median": med,
        "step_ms_mean": statistics.fmean(step_ms),
        "step_ms_min": min(step_ms),
        "params": sum(p.numel() for p in params),
        "loss_first": losses[0].item(),
        "loss_last": losses[-1].item(),
        "threads_used": torch.get_num_threads(),
        "config": {"preset": args.preset,
                   **{k: v for k, v in c.items() if k != "n_kv_heads"}, "seq_len": args.seq_len,
                   "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup,
                   "threads": args.threads, "seed": args.seed, "decayed_tensors": len(decay),
                   "undecayed_tensors": len(no_decay)},
    }
    if "n_kv_heads" in c:  # after the keys both families share, as loom-bench-train
        out["config"]["n_kv_heads"] = c["n_kv_heads"]
    out["phase_ms"] = phase_ms
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    if cuda:
        out["peak_device_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    if profiler is not None:
        out["op_self_ms"], out["top_ops_ms"] = op_tables(profiler.events(), walls, args.profile)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
