"""loom-prepare's throughput against the `tokenizers` library's batch encoding, same machine,
same tokenizer, same documents, same thread count.

The tokenizer is Llama 3's (llama-models' BPE ranks, made a tokenizer.json by transformers'
TikTokenConverter, as data.tokenizer_reference does). The corpus is JSON lines built from this
repository's sources and docs plus multilingual text, cut into documents of 200 B - 20 KB, with
one ASCII letter in 20 replaced at random, so that most long words are new (a corpus of repeats
would measure the two libraries' word caches, not their tokenizers).

  loom: the whole `loom-prepare --tokenizer T --input corpus.jsonl --threads N` run, wall
        clock: reading and parsing the JSON, encoding, writing the shards.
  tokenizers: only `Tokenizer.encode_batch(docs, add_special_tokens=False)` on documents
        already in memory, with RAYON_NUM_THREADS=N (the reference is not charged for I/O).
Each is run `--repeats` times; the best time counts. Prints a table and writes --json.

  .venv/bin/python benchmarks/prepare_throughput.py --tools build/examples --mb 40 --threads 1 2
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import tokenizer_reference  # noqa: E402  (its snippets and package lookup)

REF_SCRIPT = r"""
import json, sys, time
import tokenizers
tok = tokenizers.Tokenizer.from_file(sys.argv[1])
docs = [json.loads(l)["text"] for l in open(sys.argv[2], encoding="utf-8")]
best = None
for _ in range(int(sys.argv[3])):
    t = time.perf_counter()
    out = tok.encode_batch(docs, add_special_tokens=False)
    dt = time.perf_counter() - t
    best = dt if best is None else min(best, dt)
print(json.dumps({"seconds": best, "tokens": sum(len(e.ids) for e in out)}))
"""


LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def build_corpus(path, megabytes, source):
    rng = random.Random(1)
    texts = tokenizer_reference.corpus(source)
    pool = "\n".join(texts)
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < megabytes * 1e6:
            size = int(rng.lognormvariate(7.5, 1.0))
            size = max(200, min(size, 20000))
            start = rng.randrange(0, max(1, len(pool) - size))
            doc = "".join(rng.choice(LETTERS) if c.isascii() and c.isalpha() and
                          rng.random() < 0.05 else c for c in pool[start:start + size])
            line = json.dumps({"text": doc}, ensure_ascii=False)
            f.write(line + "\n")
            written += len(doc.encode())
    return written


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tools", required=True)
    ap.add_argument("--mb", type=float, default=40)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="loom-prepare-bench-")
    from transformers.convert_slow_tokenizer import TikTokenConverter
    llama3 = tokenizer_reference.package_file("llama_models", "llama3/tokenizer.model")
    tok_json = os.path.join(work, "tokenizer.json")
    TikTokenConverter(vocab_file=llama3, pattern=tokenizer_reference.LLAMA3_PATTERN,
                      extra_special_tokens=["<|begin_of_text|>", "<|end_of_text|>"]
                      ).converted().save(tok_json)
    corpus = os.path.join(work, "corpus.jsonl")
    text_bytes = build_corpus(corpus, args.mb, os.path.join(HERE, ".."))
    rows = []
    for threads in args.threads:
        loom_best = None
        for _ in range(args.repeats):
            out = os.path.join(work, "out")
            t = time.perf_counter()
            subprocess.run([os.path.join(args.tools, "loom-prepare"), "--tokenizer", tok_json,
                            "--input", corpus, "--out-dir", out, "--val-fraction", "0",
                            "--threads", str(threads), "--progress-seconds", "0"],
                           check=True, capture_output=True)
            dt = time.perf_counter() - t
            loom_best = dt if loom_best is None else min(loom_best, dt)
        with open(os.path.join(out, "train.bin"), "rb") as f:
            loom_tokens = int.from_bytes(f.read(12)[8:12], "little")
        with open(corpus, encoding="utf-8") as f:
            documents = sum(1 for _ in f)
        env = dict(os.environ, RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true")
        ref = json.loads(subprocess.run([sys.executable, "-c", REF_SCRIPT, tok_json, corpus,
                                         str(args.repeats)], check=True, capture_output=True,
                                        text=True, env=env).stdout)
        # The same ids in number (data.tokenizer_reference checks them one by one): loom adds
        # the document-start token to each document.
        if loom_tokens - documents != ref["tokens"]:
            sys.exit(f"FAIL: loom wrote {loom_tokens} tokens for {documents} documents, "
                     f"tokenizers gave {ref['tokens']}")
        rows.append({"threads": threads, "text_mb": text_bytes / 1e6,
                     "loom_s": loom_best, "loom_mb_s": text_bytes / 1e6 / loom_best,
                     "tokenizers_s": ref["seconds"],
                     "tokenizers_mb_s": text_bytes / 1e6 / ref["seconds"],
                     "ratio": ref["seconds"] / loom_best, "tokens": ref["tokens"]})
    print(f"corpus: {text_bytes / 1e6:.1f} MB of JSON lines; tokenizer: Llama 3 tokenizer.json")
    print("| threads | loom-prepare (whole run) | tokenizers encode_batch | loom / tokenizers |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['threads']} | {r['loom_s']:.2f} s, {r['loom_mb_s']:.2f} MB/s | "
              f"{r['tokenizers_s']:.2f} s, {r['tokenizers_mb_s']:.2f} MB/s | {r['ratio']:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
