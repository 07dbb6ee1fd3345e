"""Training throughput of GPT-2 in plain PyTorch (Python API), the twin of loom-bench-train.

The model, optimizer, clipping, batches, flags and JSON line are those of
benchmarks/train_throughput.cpp, op for op where it matters (src/models/gpt2.cpp), so the two
numbers differ only by what runs around the same ATen kernels. No torch.compile: the point is
eager PyTorch against eager loom.
"""
import argparse
import json
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
NORM_EPS = 1e-5
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
        x = tr.wte(tokens) + tr.wpe(torch.arange(tokens.shape[1]))
        for block in tr.h:
            x = block(x)
        # Tied head, the same matmul loom does.
        return torch.matmul(tr.ln_f(x), tr.wte.weight.t())


def init_parameters(model, n_layers):
    # loom's rules (Gpt2::init_for); the values differ from loom's, their distribution does not.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif ".ln_" in name:
                p.fill_(1.0)
            elif name.endswith("c_proj.weight"):
                p.normal_(0.0, 0.02 / (2.0 * n_layers) ** 0.5)
            else:
                p.normal_(0.0, 0.02)


def decays(name, p):
    # loom::train::default_decays: 2-D weights, except embedding tables.
    return p.dim() >= 2 and not any(e in name for e in ("wte.", "wpe.", "embed_tokens."))


def fail(message):
    # Exit code 2 for bad flags, as loom-bench-train and argparse.
    print(f"train_throughput.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def model_config(args):
    if args.preset not in PRESETS:
        fail(f"--preset {args.preset} is not a GPT-2 preset; valid: {', '.join(PRESETS)}")
    d, layers, heads, max_seq_len = PRESETS[args.preset]
    d = args.d_model or d
    layers = args.layers or layers
    heads = args.heads or heads
    checks = [
        (d > 0 and layers > 0 and heads > 0 and args.vocab > 0, "sizes must be positive"),
        (d % heads == 0, f"--heads {heads} does not divide --d-model {d}"),
        (0 < args.seq_len <= max_seq_len,
         f"--seq-len {args.seq_len} must be in [1, {max_seq_len}] (the preset's max_seq_len)"),
        (args.batch_size > 0 and args.steps > 0 and args.warmup >= 0 and args.threads > 0,
         "--batch-size, --steps, --threads must be positive and --warmup >= 0"),
    ]
    for ok, message in checks:
        if not ok:
            fail(message)
    return {"d_model": d, "n_layers": layers, "n_heads": heads, "d_ff": 4 * d,
            "vocab_size": args.vocab, "max_seq_len": max_seq_len}


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
    args = ap.parse_args()
    c = model_config(args)
    torch.set_num_threads(args.threads)

    torch.manual_seed(args.seed)
    model = Gpt2(c["vocab_size"], c["max_seq_len"], c["d_model"], c["n_layers"], c["n_heads"],
                 c["d_ff"])
    init_parameters(model, c["n_layers"])
    model.train()
    named = list(model.named_parameters())
    params = [p for _, p in named]
    decay = [p for n, p in named if decays(n, p)]
    no_decay = [p for n, p in named if not decays(n, p)]
    # Default implementation choice (no foreach/fused on the CPU), as a user would get it.
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY},
              {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)

    # Drawn before timing, with the generator and call loom-bench-train uses: the same tokens.
    total = args.warmup + args.steps
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(args.vocab, (total, args.batch_size, args.seq_len + 1), generator=gen)
    inputs = [tokens[i, :, :-1].contiguous() for i in range(total)]
    targets = [tokens[i, :, 1:].contiguous() for i in range(total)]

    step_ms, losses = [], []
    for i in range(total):
        start = time.perf_counter()
        logits = model(inputs[i])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets[i].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()  # set_to_none, as loom's AdamW::zero_grad
        stop = time.perf_counter()
        losses.append(loss.detach())
        if i >= args.warmup:
            step_ms.append((stop - start) * 1000.0)

    med = statistics.median(step_ms)
    out = {
        "impl": "pytorch",
        "tokens_per_s": args.batch_size * args.seq_len / (med / 1000.0),
        "step_ms_median": med,
        "step_ms_mean": statistics.fmean(step_ms),
        "step_ms_min": min(step_ms),
        "params": sum(p.numel() for p in params),
        "loss_first": losses[0].item(),
        "loss_last": losses[-1].item(),
        "threads_used": torch.get_num_threads(),
        "config": {"preset": args.preset, **c, "seq_len": args.seq_len,
                   "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup,
                   "threads": args.threads, "seed": args.seed, "decayed_tensors": len(decay),
                   "undecayed_tensors": len(no_decay)},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
