#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpus (tests/fuzz/corpus/<target>/): small valid inputs of
each format and a few near misses, so the fuzzer starts from the formats' real structure.
Standard library only. Run from anywhere; rewrites the corpus folders."""
import json
import pathlib
import shutil
import struct
import zlib

HERE = pathlib.Path(__file__).resolve().parent / "corpus"
SEP = b"\n#~#~#\n"  # fuzz_util.h's kFileSeparator


def safetensors(tensors, metadata=None):
    """tensors: {name: (dtype, shape, raw bytes)} -> the file's bytes."""
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def f32(*values):
    return struct.pack(f"<{len(values)}f", *values)


def write(target, name, data):
    d = HERE / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)


def main():
    for d in HERE.glob("*"):
        shutil.rmtree(d)
    # safetensors
    write("safetensors", "two_tensors", safetensors(
        {"w": ("F32", [2, 2], f32(1, 2, 3, 4)), "b": ("BF16", [2], b"\x80\x3f\x00\x40")},
        {"format": "pt"}))
    write("safetensors", "every_dtype", safetensors({
        f"t_{d}": (d, [2], b"\x01" * (2 * s)) for d, s in
        [("F64", 8), ("F32", 4), ("F16", 2), ("BF16", 2), ("I64", 8), ("I32", 4), ("I16", 2),
         ("U8", 1), ("I8", 1), ("BOOL", 1)]}))
    write("safetensors", "empty_and_scalar", safetensors(
        {"e": ("F32", [0, 3], b""), "s": ("I64", [], struct.pack("<q", 7))}))
    write("safetensors", "huge_claim", struct.pack("<Q", 1 << 40) + b"{}")
    write("safetensors", "overflowing_shape", safetensors(
        {"x": ("F32", [1 << 62, 4], b"")}))
    # token shards: the first byte picks the extension (.bin, .u16, .raw, other, .u32)
    tokens = struct.pack("<8H", 1, 2, 3, 50256, 0, 7, 7, 9)
    header = struct.pack("<3i", 20240520, 1, 8) + b"\0" * (256 * 4 - 12)
    write("token_shard", "llmc", b"\x00" + header + tokens)
    write("token_shard", "llmc_truncated", b"\x00" + header + tokens[:6])
    write("token_shard", "llmc_negative_count",
          b"\x00" + struct.pack("<3i", 20240520, 1, -5) + b"\0" * (256 * 4 - 12))
    write("token_shard", "raw_u16", b"\x01" + tokens)
    write("token_shard", "raw_odd", b"\x02" + tokens + b"\x01")
    # version 2: uint32 tokens (Llama 3's 128256-id vocabulary), and raw uint32 (.u32)
    tokens32 = struct.pack("<6I", 1, 128000, 128255, 0, 65536, 7)
    header2 = struct.pack("<3i", 20240520, 2, 6) + b"\0" * (256 * 4 - 12)
    write("token_shard", "llmc_v2", b"\x00" + header2 + tokens32)
    write("token_shard", "llmc_v2_truncated", b"\x00" + header2 + tokens32[:10])
    write("token_shard", "llmc_v3", b"\x00" + struct.pack("<3i", 20240520, 3, 0) + b"\0" * (256 * 4 - 12))
    write("token_shard", "raw_u32", b"\x04" + tokens32)
    write("token_shard", "raw_u32_ragged", b"\x04" + tokens32 + b"\x01\x02")
    # checkpoints: state.json, latest, model, optimizer, tp shards, ZeRO shards
    model = safetensors({"wte.weight": ("F32", [2, 2], f32(1, 2, 3, 4))})
    optim = safetensors({"step": ("I64", [], struct.pack("<q", 1)),
                         "wte.weight.exp_avg": ("F32", [2, 2], f32(0, 0, 0, 0))})
    state = {"format_version": 1, "step": 1,
             "checksums": {"model.safetensors": zlib.crc32(model),
                           "optimizer.safetensors": zlib.crc32(optim)}}
    write("checkpoint", "plain", SEP.join(
        [json.dumps(state).encode(), b"step-00000001\n", model, optim]))
    shard = [safetensors({"model/wte.weight": ("F32", [1, 2], f32(r, r))},
                         {"loom.tp_rank": str(r), "loom.tp_size": "2",
                          "model/wte.weight": "0,2,0,1,0"}) for r in (0, 1)]
    tp_state = dict(state, model_shards=["model-pp0-tp0.safetensors",
                                         "model-pp0-tp1.safetensors"])
    tp_state["checksums"] = dict(state["checksums"], **{
        "model-pp0-tp0.safetensors": 0, "model-pp0-tp1.safetensors": 0})
    write("checkpoint", "tensor_parallel", SEP.join(
        [json.dumps(tp_state).encode(), b"step-00000001\n", safetensors({}), optim] + shard))
    zero = [safetensors({f"zero.bucket0.{k}": ("F32", [2], f32(r, r)) for k in
                         ("exp_avg", "exp_avg_sq", "master")},
                        {"loom.group": "pp0", "loom.tp_rank": "0", "loom.tp_size": "1",
                         "dp_rank": str(r), "dp_size": "2",
                         "bucket_params": json.dumps([[["wte.weight", [2, 2]]]]),
                         "loom.specs": json.dumps({"wte.weight": "-1,0,0,1,0"})})
            for r in (0, 1)]
    zero_state = dict(state, zero_shards=["zero-dp0.safetensors", "zero-dp1.safetensors"])
    zero_state["checksums"] = dict(state["checksums"], **{
        "zero-dp0.safetensors": 0, "zero-dp1.safetensors": 0})
    write("checkpoint", "zero", SEP.join(
        [json.dumps(zero_state).encode(), b"step-00000001\n", model, optim, b"", b""] + zero))
    write("checkpoint", "latest_outside", SEP.join(
        [json.dumps(state).encode(), b"../../etc\n", model, optim]))
    # JSON configs: the first byte picks the reader (0 HF, 1 devices, 2 meta, 3 model, 4 train)
    write("json_config", "hf_gpt2", b"\x00" + json.dumps({
        "model_type": "gpt2", "vocab_size": 256, "n_positions": 64, "n_embd": 32, "n_layer": 2,
        "n_head": 4, "activation_function": "gelu_new"}).encode())
    write("json_config", "hf_llama", b"\x00" + json.dumps({
        "model_type": "llama", "vocab_size": 256, "max_position_embeddings": 64,
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 64, "head_dim": 8,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}).encode())
    write("json_config", "devices", b"\x01" + json.dumps({"devices": [
        {"name": "a", "speed": 2.0, "memory_gb": 80}, {"name": "b", "speed": 1.0}]}).encode())
    write("json_config", "meta", b"\x02" + json.dumps(
        {"tokenizer": "byte", "vocab_size": 256}).encode())
    write("json_config", "model_config", b"\x03" + json.dumps({
        "family": "llama", "vocab_size": 256, "max_seq_len": 64, "d_model": 32, "n_layers": 2,
        "n_heads": 4, "n_kv_heads": 2, "d_ff": 64}).encode())
    write("json_config", "train_config", b"\x04" + json.dumps({
        "model": "gpt2", "preset": "gpt2-tiny", "data": "x.bin", "steps": 3, "tp": 2,
        "pp": 2, "zero": 1, "schedule": "1f1b"}).encode())
    # loom-pretrain --config files
    write("toml_config", "train", b'model = "llama"\npreset = "llama-tiny"\ndata = "t.bin"\n'
          b'steps = 3\nbatch-size = 4\nseq-len = 32\nmicro-batches = 2\npp = 2\n'
          b'preempt-signal = "TERM,USR1"\nstrategy = ["a", "b:x=1"]\n')
    write("toml_config", "ini", b"[default]\ndata=t.bin\nzero=3\ndp=2\nlr=1e-3\n"
          b"activation-checkpointing=selective\n")
    # BPE: vocab.json, merges.txt, text
    vocab = {chr(c): i for i, c in enumerate(range(ord("!"), ord("~") + 1))}
    vocab.update({"\u0120": len(vocab), "he": len(vocab) + 1, "ll": len(vocab) + 2,
                  "hell": len(vocab) + 3, "<|endoftext|>": len(vocab) + 4})
    merges = b"#version: 0.2\nh e\nl l\nhe ll\n"
    write("bpe", "small", SEP.join(
        [json.dumps(vocab).encode(), merges, b"hello hell<|endoftext|>he"]))
    write("bpe", "bad_merge", SEP.join([json.dumps(vocab).encode(), b"h\n", b"x"]))

    # tokenizer.json: a byte-level BPE with a Split pattern and added tokens, and the
    # SentencePiece kind (Metaspace, byte fallback); then SentencePiece .model files.
    text = "Hello  world<|x|> caf\u00e9 \U0001F600 12345\r\n".encode()
    byte_chars = [chr(b) if (33 <= b <= 126 or 161 <= b <= 172 or b >= 174) else None
                  for b in range(256)]
    nxt = 256
    for b in range(256):
        if byte_chars[b] is None:
            byte_chars[b] = chr(nxt)
            nxt += 1
    bl_vocab = {c: i for i, c in enumerate(byte_chars)}
    bl_vocab["he"] = 256
    bl_vocab["ll"] = 257
    byte_level = {
        "added_tokens": [{"id": 258, "content": "<|x|>", "special": True, "lstrip": True}],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": r"\p{N}{1,3}+|\s+$|[^\s\p{N}]+|\s+(?!\S)"},
             "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]},
        "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "vocab": bl_vocab, "merges": ["h e", ["l", "l"]],
                  "ignore_merges": True}}
    write("tokenizer_files", "byte_level_json", SEP.join([json.dumps(byte_level).encode(), text]))
    sp_vocab = {"<unk>": 0, "<s>": 1, "\u2581": 2, "a": 3, "\u2581a": 4}
    sp_vocab.update({"<0x%02X>" % b: 5 + b for b in range(256)})
    sp_json = {
        "added_tokens": [{"id": 1, "content": "<s>", "special": True}],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "vocab": sp_vocab, "merges": ["\u2581 a"], "byte_fallback": True,
                  "unk_token": "<unk>", "fuse_unk": True}}
    write("tokenizer_files", "sentencepiece_json", SEP.join([json.dumps(sp_json).encode(), text]))

    def varint(v):
        out = b""
        while True:
            out += bytes([(v & 0x7F) | (0x80 if v > 0x7F else 0)])
            v >>= 7
            if not v:
                return out

    def field(f, payload):
        return varint(f << 3 | 2) + varint(len(payload)) + payload

    def piece(p, score, kind=1):
        return field(1, field(1, p.encode()) + varint(2 << 3 | 5) + struct.pack("<f", score)
                     + varint(3 << 3) + varint(kind))

    pieces = (piece("<unk>", 0, 2) + piece("<s>", 0, 3) + piece("</s>", 0, 3)
              + piece("\u2581", -1) + piece("a", -2) + piece("\u2581a", -0.5)
              + piece("[X]", 0, 4) + b"".join(piece("<0x%02X>" % b, 0, 6) for b in range(256)))
    trainer = field(2, varint(3 << 3) + varint(2) + varint(35 << 3) + varint(1))
    normalizer = field(3, field(1, b"identity") + varint(3 << 3) + varint(1))
    model = pieces + trainer + normalizer
    write("tokenizer_files", "sentencepiece_model", SEP.join([model, b"a [X]a " + text]))
    write("tokenizer_files", "sentencepiece_truncated", SEP.join([model[:700], text]))
    # Found by the fuzzer: a byte piece whose hex digits are a sign and a digit ("<0x-A>").
    write("tokenizer_files", "sentencepiece_signed_byte_piece",
          SEP.join([piece("<unk>", 0, 2) + piece("<0x-A>", 0, 6) + trainer + normalizer, text]))
    # And an empty user-defined piece, which matched everywhere without advancing.
    write("tokenizer_files", "sentencepiece_empty_user_piece",
          SEP.join([piece("<unk>", 0, 2) + piece("", 0, 4) + trainer + normalizer, text]))


if __name__ == "__main__":
    main()
