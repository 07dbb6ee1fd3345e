"""Hugging Face interop, checked by transformers itself, both ways.

Tokenizer: loom-prepare --vocab/--merges must produce exactly the ids of transformers'
GPT2Tokenizer for the same vocab.json/merges.txt (a small BPE learned here on the corpus); and
--export-hf must leave a directory whose AutoTokenizer gives loom's ids (tokenizer.json and
GPT-2's two files).

loom -> HF: loom-pretrain trains (60 steps, so attention is far from uniform) and --export-hf
writes a directory; transformers' from_pretrained loads it, and its logits on the same windows
must equal loom-eval's.
HF -> loom: transformers builds a randomly initialised model (initializer_range 0.2, ten times
the usual, so that every weight matters) and save_pretrained()s it; loom-eval --init-from-hf
must produce the same logits.
Sharded checkpoints both ways (loom's --export-hf-shard-mb, transformers' max_shard_size, each
with model.safetensors.index.json), and Llama 3's RoPE scaling both ways (a transformers model
with rope_type llama3, in transformers 5's rope_parameters and in the older top-level
rope_scaling; loom fine-tunes it and exports it back).
Both compare every logit: max |difference| <= 1e-5 x max(1, max |logit|).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import safetensors.torch
import torch
import transformers

TOL = 1e-5  # fp32 on CPU: different kernels, same math (seen: <= 1.1e-5 of max |logit| 7)


def run(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out.stdout


def read_llmc(path):
    header = np.fromfile(path, dtype=np.int32, count=256)
    assert header[0] == 20240520 and header[1] == 1, header[:3]
    return np.fromfile(path, dtype=np.uint16, offset=1024, count=int(header[2])).astype(np.int64)


def hf_logits(model_dir, tokens, seq_len, batches):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    windows = torch.tensor(tokens[: batches * seq_len]).view(batches, seq_len)
    with torch.no_grad():
        return model(windows).logits


def loom_logits(tools, model_dir, data, seq_len, batches, out_file):
    run([os.path.join(tools, "loom-eval"), "--init-from-hf", model_dir, "--data", data,
         "--seq-len", str(seq_len), "--batches", str(batches), "--threads", "1",
         "--logits-out", out_file])
    return safetensors.torch.load_file(out_file)["logits"]


def byte_symbols():
    """GPT-2's printable stand-in for every byte (bytes_to_unicode)."""
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def learn_bpe(text, merges_wanted):
    """A small byte-level BPE learned greedily on words of `text` (enough to exercise merges)."""
    sym = byte_symbols()
    words = {}
    for w in text.split(" ")[:20000]:
        key = tuple(sym[b] for b in (" " + w).encode())
        words[key] = words.get(key, 0) + 1
    merges = []
    for _ in range(merges_wanted):
        pairs = {}
        for w, n in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + n
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        merged = {}
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + n
        words = merged
    vocab = {s: i for i, s in enumerate(sym[b] for b in range(256))}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    return vocab, merges


def check_tokenizer(tools, work, text_file):
    with open(text_file, encoding="utf-8") as f:
        text = f.read()
    vocab, merges = learn_bpe(text, 300)
    vocab_file, merges_file = os.path.join(work, "vocab.json"), os.path.join(work, "merges.txt")
    with open(vocab_file, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(merges_file, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    out = os.path.join(work, "bpe-data")
    run([os.path.join(tools, "loom-prepare"), "--input", text_file, "--out-dir", out,
         "--val-fraction", "0", "--vocab", vocab_file, "--merges", merges_file])
    ours = read_llmc(os.path.join(out, "train.bin"))
    eot = vocab["<|endoftext|>"]  # loom-prepare starts every document with it
    theirs = [eot] + transformers.GPT2Tokenizer(vocab_file, merges_file)(text)["input_ids"]
    ok = len(ours) == len(theirs) and bool(np.all(ours == np.asarray(theirs)))
    print(f"{'ok' if ok else 'FAIL'}: GPT-2 BPE ({len(merges)} merges): loom-prepare gave "
          f"{len(ours)} ids, transformers' GPT2Tokenizer {len(theirs)}, identical: {ok}")
    # Beyond ASCII: letters, numbers, symbols and spaces of other scripts split like GPT-2's.
    other = os.path.join(work, "unicode.txt")
    sample = ("naïve café — «quoted» costs 5€; x² + y³ = z¹⁰ ١٢٣ ४५६ 中文字符、日本語テキスト\n"
              "Ünïcödé's résumé: 50 km² in 3½ hours…\u00a0no-break\u2003em space "
              "Ελληνικά Русский текст ½ ⅓ Ⅻ 🙂 emoji\n")
    with open(other, "w", encoding="utf-8") as f:
        f.write(sample * 3)
    run([os.path.join(tools, "loom-prepare"), "--input", other, "--out-dir", out,
         "--val-fraction", "0", "--vocab", vocab_file, "--merges", merges_file])
    ours = read_llmc(os.path.join(out, "train.bin"))
    theirs = [eot] + transformers.GPT2Tokenizer(vocab_file, merges_file)(sample * 3)["input_ids"]
    same = len(ours) == len(theirs) and bool(np.all(ours == np.asarray(theirs)))
    print(f"{'ok' if same else 'FAIL'}: GPT-2 BPE on non-ASCII text: {len(ours)} ids vs "
          f"{len(theirs)}, identical: {same}")
    # Two documents: <|endoftext|> before each (as llm.c prepares data), and the special token
    # inside a text stays one token.
    hf = transformers.GPT2Tokenizer(vocab_file, merges_file)
    doc1, doc2 = "first doc<|endoftext|>inner", "second doc\n"
    for name, text_ in (("d1.txt", doc1), ("d2.txt", doc2)):
        with open(os.path.join(work, name), "w", encoding="utf-8") as f:
            f.write(text_)
    run([os.path.join(tools, "loom-prepare"), "--input", os.path.join(work, "d1.txt"),
         os.path.join(work, "d2.txt"), "--out-dir", out, "--val-fraction", "0",
         "--vocab", vocab_file, "--merges", merges_file])
    want = [eot] + hf(doc1)["input_ids"] + [eot] + hf(doc2)["input_ids"]
    got = read_llmc(os.path.join(out, "train.bin")).tolist()
    docs = got == want and want.count(eot) == 3
    print(f"{'ok' if docs else 'FAIL'}: documents delimited by <|endoftext|> ({want.count(eot)} "
          f"in {len(want)} ids), identical: {docs}")
    return ok and same and docs


def check_exported_tokenizers(tools, work, text_file):
    """--export-hf puts the data's tokenizer beside the model: AutoTokenizer.from_pretrained on
    the export directory must load it and give loom's ids. Two kinds: a tokenizer.json (a
    byte-level BPE trained here by the tokenizers library, with <s> as its BOS) and GPT-2's two
    files (the vocab.json / merges.txt of check_tokenizer)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([text_file], trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>"],
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok_dir = os.path.join(work, "trained-tokenizer")
    os.makedirs(tok_dir, exist_ok=True)
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    sample = "In the beginning God created the heaven and the earth. naïve 123\n"
    ok = True
    for label, prep in (("tokenizer.json", ["--tokenizer", tok_dir]),
                        ("GPT-2 vocab.json + merges.txt",
                         ["--vocab", os.path.join(work, "vocab.json"),
                          "--merges", os.path.join(work, "merges.txt")])):
        data = os.path.join(work, "export-tok-data")
        out = os.path.join(work, "export-tok-model")
        shutil.rmtree(out, ignore_errors=True)
        run([os.path.join(tools, "loom-prepare"), "--input", text_file, "--out-dir", data,
             "--val-fraction", "0"] + prep)
        run([os.path.join(tools, "loom-pretrain"), "--model", "gpt2", "--preset", "gpt2-tiny",
             "--data", os.path.join(data, "train.bin"), "--steps", "2", "--batch-size", "2",
             "--seq-len", "32", "--export-hf", out, "--threads", "1", "--log-level", "warn"])
        hf = transformers.AutoTokenizer.from_pretrained(out)
        theirs = hf(sample, add_special_tokens=False)["input_ids"]
        ours = json.loads(subprocess.run(
            [os.path.join(tools, "loom-tokenize"), "--tokenizer", data], input=sample,
            capture_output=True, text=True, check=True).stdout)
        same = theirs == ours
        bos = hf.bos_token if label == "tokenizer.json" else "<|endoftext|>"
        start = json.loads(subprocess.run(
            [os.path.join(tools, "loom-tokenize"), "--tokenizer", data, "--document-start"],
            input="", capture_output=True, text=True, check=True).stdout)
        same = same and start == [hf.convert_tokens_to_ids(bos)]
        print(f"{'ok' if same else 'FAIL'}: AutoTokenizer loads the exported {label}: "
              f"{len(theirs)} ids equal loom's: {theirs == ours}; BOS {bos!r} is loom's "
              f"document start {start}")
        ok &= same
    return ok


def check_weight_files(model_dir, sharded):
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if sharded:
        ok = len(files) > 1 and os.path.exists(index) and "model.safetensors" not in files
        if ok:
            mapped = set(json.load(open(index))["weight_map"].values())
            ok = mapped == set(files)
    else:
        ok = files == ["model.safetensors"] and not os.path.exists(index)
    print(f"{'ok' if ok else 'FAIL'}: {os.path.basename(model_dir)}: "
          f"{'sharded' if sharded else 'one file'}: {files}")
    return ok


def check_rope_scaling_round_trip(tools, work, data_dir, val, tokens, seq_len, batches):
    """The llama3-scaled model in the older config format (rope_theta and rope_scaling at the top
    level, "type"), which transformers 5 still reads; then loom trains it a few steps and exports
    it, and transformers reads loom's rope_parameters."""
    src = os.path.join(work, "hf-llama3-rope")
    old = os.path.join(work, "hf-llama3-rope-old")
    shutil.copytree(src, old)
    config = json.load(open(os.path.join(old, "config.json")))
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    config["rope_scaling"] = rope
    with open(os.path.join(old, "config.json"), "w") as f:
        json.dump(config, f)
    # The scaling matters at these lengths: the same weights without it give other logits.
    plain = os.path.join(work, "hf-llama3-rope-unscaled")
    shutil.copytree(src, plain)
    config = json.load(open(os.path.join(plain, "config.json")))
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    with open(os.path.join(plain, "config.json"), "w") as f:
        json.dump(config, f)
    scaled_logits = hf_logits(src, tokens, seq_len, batches)
    gap = (hf_logits(plain, tokens, seq_len, batches) - scaled_logits).abs().max().item()
    ok = gap > 100 * TOL * max(1.0, scaled_logits.abs().max().item())
    print(f"{'ok' if ok else 'FAIL'}: without the scaling the logits move by {gap:.2e} "
          f"(more than 100 x the bound)")
    ok &= compare("llama3 rope in the older rope_scaling format, loaded by loom",
                 loom_logits(tools, old, val, seq_len, batches,
                             os.path.join(work, "hf-llama3-old.safetensors")),
                 hf_logits(old, tokens, seq_len, batches))
    out = os.path.join(work, "loom-llama3-rope")
    run([os.path.join(tools, "loom-pretrain"), "--init-from-hf", src,
         "--data", os.path.join(data_dir, "train.bin"), "--steps", "5", "--batch-size", "4",
         "--seq-len", "64", "--lr", "1e-3", "--export-hf", out, "--threads", "1",
         "--log-level", "warn"])
    rope = json.load(open(os.path.join(out, "config.json")))["rope_parameters"]
    same = rope == {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32}
    print(f"{'ok' if same else 'FAIL'}: loom's export keeps the rope parameters: {rope}")
    ok &= same and compare("llama3 rope fine-tuned in loom, loaded by transformers",
                           loom_logits(tools, out, val, seq_len, batches,
                                       os.path.join(work, "loom-llama3.safetensors")),
                           hf_logits(out, tokens, seq_len, batches))
    return ok


def compare(name, ours, theirs):
    ok = ours.shape == theirs.shape
    diff = (ours - theirs).abs().max().item() if ok else float("inf")
    scale = max(1.0, theirs.abs().max().item())
    ok = ok and diff <= TOL * scale
    print(f"{'ok' if ok else 'FAIL'}: {name}: {tuple(theirs.shape)} logits, max |diff| "
          f"{diff:.2e} (max |logit| {theirs.abs().max().item():.2f}, bound {TOL * scale:.1e})")
    return ok


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tools", required=True)
    p.add_argument("--work", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
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
    ok = check_tokenizer(args.tools, args.work, os.path.join(args.work, "small.txt"))
    ok &= check_exported_tokenizers(args.tools, args.work, os.path.join(args.work, "small.txt"))

    # loom -> transformers
    for model, preset in (("gpt2", "gpt2-tiny"), ("llama", "llama-tiny")):
        out_dir = os.path.join(args.work, f"loom-{model}")
        run([os.path.join(args.tools, "loom-pretrain"), "--model", model, "--preset", preset,
             "--data", os.path.join(data_dir, "train.bin"), "--steps", "60", "--batch-size", "8",
             "--seq-len", "64", "--lr", "3e-3", "--export-hf", out_dir, "--threads", "1",
             "--log-level", "warn",
             # A padded vocabulary (256 -> 300 rows) and the fused norms and loss (their host
             # reference on the CPU): the export holds the true vocabulary, and transformers
             # gives the same logits.
             "--pad-vocab-multiple", "100", "--norm", "fused", "--loss", "fused"]
            # Llama's export in files of at most 50 kB: shards and their index.
            + (["--export-hf-shard-mb", "0.05"] if model == "llama" else []))
        ok &= check_weight_files(out_dir, sharded=model == "llama")
        ok &= compare(f"{model} trained in loom, loaded by transformers",
                      loom_logits(args.tools, out_dir, val, seq_len, batches,
                                  os.path.join(args.work, f"{model}-loom.safetensors")),
                      hf_logits(out_dir, tokens, seq_len, batches))

    # transformers -> loom (random init by transformers; GQA for Llama)
    torch.manual_seed(0)
    configs = {
        "gpt2": transformers.GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=2,
                                        n_head=4, initializer_range=0.2),
        "llama": transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=128,
                                          rope_theta=10000.0, initializer_range=0.2),
    }
    # Llama 3's RoPE scaling, made to matter at these lengths: an original context of 32, so that
    # of head_dim 16's eight frequencies one is kept, one blended and six slowed 8 times.
    configs["llama3-rope"] = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.2,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
                         "rope_theta": 10000.0})
    for name, config in configs.items():
        model = transformers.AutoModelForCausalLM.from_config(config)
        out_dir = os.path.join(args.work, f"hf-{name}")
        # Llama's in shards of 50 kB, as the hub holds large models.
        shard = {"max_shard_size": "50KB"} if name.startswith("llama") else {}
        model.save_pretrained(out_dir, safe_serialization=True, **shard)
        ok &= check_weight_files(out_dir, sharded=bool(shard))
        ok &= compare(f"{name} made by transformers, loaded by loom",
                      loom_logits(args.tools, out_dir, val, seq_len, batches,
                                  os.path.join(args.work, f"hf-{name}.safetensors")),
                      hf_logits(out_dir, tokens, seq_len, batches))
    ok &= check_rope_scaling_round_trip(args.tools, args.work, data_dir, val, tokens, seq_len,
                                        batches)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
