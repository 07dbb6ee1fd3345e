"""Hugging Face interop, checked by transformers itself, both ways.

loom -> HF: loom-pretrain trains a few steps and --export-hf writes a directory; transformers'
from_pretrained loads it and its loss on the same windows must equal loom-eval's.
HF -> loom: transformers builds a randomly initialised model and save_pretrained()s it;
loom-eval --init-from-hf scores it and must agree with transformers' own loss.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import torch
import transformers

TOL = 2e-5  # fp32 on CPU: different kernels, same math


def run(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out.stdout


def read_llmc(path):
    header = np.fromfile(path, dtype=np.int32, count=256)
    assert header[0] == 20240520 and header[1] == 1, header[:3]
    return np.fromfile(path, dtype=np.uint16, offset=1024, count=int(header[2])).astype(np.int64)


def hf_loss(model_dir, tokens, seq_len, batches):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(batches):
            window = torch.tensor(tokens[i * seq_len: i * seq_len + seq_len + 1]).unsqueeze(0)
            logits = model(window[:, :-1]).logits
            total += torch.nn.functional.cross_entropy(logits[0], window[0, 1:]).item()
    return total / batches


def loom_loss(tools, model_dir, data, seq_len, batches):
    out = run([os.path.join(tools, "loom-eval"), "--init-from-hf", model_dir, "--data", data,
               "--seq-len", str(seq_len), "--batches", str(batches), "--threads", "2"])
    return json.loads(out.strip().splitlines()[-1])["loss"]


def compare(name, a, b):
    ok = abs(a - b) <= TOL * max(1.0, abs(b))
    print(f"{'ok' if ok else 'FAIL'}: {name}: loom {a:.7f} transformers {b:.7f}")
    return ok


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tools", required=True)
    p.add_argument("--work", required=True)
    args = p.parse_args()
    torch.set_num_threads(2)
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    text = os.path.join(os.path.dirname(__file__), "..", "data", "corpus", "kjv.txt")
    data_dir = os.path.join(args.work, "data")
    with open(text, "rb") as f, open(os.path.join(args.work, "small.txt"), "wb") as g:
        g.write(f.read(200_000))
    run([os.path.join(args.tools, "loom-prepare"), "--input", os.path.join(args.work, "small.txt"),
         "--out-dir", data_dir])
    val = os.path.join(data_dir, "val.bin")
    tokens = read_llmc(val)
    seq_len, batches = 64, 4
    ok = True

    # loom -> transformers
    for model, preset in (("gpt2", "gpt2-tiny"), ("llama", "llama-tiny")):
        out_dir = os.path.join(args.work, f"loom-{model}")
        run([os.path.join(args.tools, "loom-pretrain"), "--model", model, "--preset", preset,
             "--data", os.path.join(data_dir, "train.bin"), "--steps", "5", "--batch-size", "4",
             "--seq-len", "64", "--lr", "3e-3", "--export-hf", out_dir, "--threads", "2",
             "--log-level", "warn"])
        ok &= compare(f"{model} trained in loom, loaded by transformers",
                      loom_loss(args.tools, out_dir, val, seq_len, batches),
                      hf_loss(out_dir, tokens, seq_len, batches))

    # transformers -> loom (random init by transformers; GQA for Llama)
    torch.manual_seed(0)
    configs = {
        "gpt2": transformers.GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=2,
                                        n_head=4),
        "llama": transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=128,
                                          rope_theta=10000.0),
    }
    for name, config in configs.items():
        model = transformers.AutoModelForCausalLM.from_config(config)
        out_dir = os.path.join(args.work, f"hf-{name}")
        model.save_pretrained(out_dir, safe_serialization=True)
        ok &= compare(f"{name} made by transformers, loaded by loom",
                      loom_loss(args.tools, out_dir, val, seq_len, batches),
                      hf_loss(out_dir, tokens, seq_len, batches))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
