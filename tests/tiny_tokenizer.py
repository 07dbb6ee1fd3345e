"""Writes a small Hugging Face tokenizer.json for the command-line tests (cli_test.sh,
dist/dist_cli_test.sh): Metaspace pre-tokenizer, byte fallback, no merges; ids 0 <unk>, 1 <s>
(the document start), 2 the Metaspace mark, 3..258 the bytes: 259 ids.

Usage: python3 tiny_tokenizer.py OUT.json
"""
import json
import sys

vocab = {"<unk>": 0, "<s>": 1, "\u2581": 2}
vocab.update({"<0x%02X>" % b: 3 + b for b in range(256)})
json.dump({"added_tokens": [{"id": 1, "content": "<s>", "special": True}],
           "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first"},
           "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]},
           "model": {"type": "BPE", "vocab": vocab, "merges": [], "byte_fallback": True}},
          open(sys.argv[1], "w"))
