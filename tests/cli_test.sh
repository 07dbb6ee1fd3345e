#!/usr/bin/env bash
# The command-line tools: --help documents every flag, and bad input exits with status 2 and a
# message naming the problem — no crash, no half-written checkpoint.
set -uo pipefail
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail=0
expect() {  # expect "<text in stderr>" command...
  local want=$1
  shift
  local out status
  out=$("$@" 2>&1)
  status=$?
  if [ $status -ne 2 ] || ! grep -qF -- "$want" <<< "$out"; then
    echo "FAIL: $* -> status $status, wanted 2 and '$want'; got: $out"
    fail=1
  else
    echo "ok: '$want'"
  fi
}
help=$("$TOOLS/loom-pretrain" --help)
for flag in --model --preset --data --val-data --steps --batch-size --seq-len --grad-accum --lr \
  --seed --metrics-out --save-dir --resume --precision --init-from-hf --export-hf --config \
  --device --sampling --attention --loss --loss-chunk-rows --norm --swiglu --adamw --profile-steps --profile-out --z-loss --peak-tflops --dist-backend; do
  if ! grep -qE -- "^ +$flag " <<< "$help"; then echo "FAIL: --help lacks $flag"; fail=1; fi
done
for tool in loom-prepare loom-eval loom-generate loom-plan loom-tokenize loom-export-hf; do
  "$TOOLS/$tool" --help > /dev/null || { echo "FAIL: $tool --help"; fail=1; }
done
printf 'hello world, this is a small corpus for the loom tools. %.0s' {1..50} > "$work/a.txt"
"$TOOLS/loom-prepare" --input "$work/a.txt" --out-dir "$work/data" > /dev/null 2>&1 || { echo "prepare failed"; exit 1; }
# A tokenizer.json (Metaspace, byte fallback: 259 ids): loom-prepare and loom-tokenize read it,
# loom-pretrain refuses a model vocabulary smaller than it, bad paths are named.
mkdir -p "$work/tok"
python3 "$(dirname "$0")/tiny_tokenizer.py" "$work/tok/tokenizer.json"
"$TOOLS/loom-prepare" --tokenizer "$work/tok" --input "$work/a.txt" --out-dir "$work/data_hf" > /dev/null 2>&1 ||
  { echo "FAIL: loom-prepare --tokenizer"; fail=1; }
grep -q '"hf-json"' "$work/data_hf/meta.json" || { echo "FAIL: meta.json of data_hf"; fail=1; }
ids=$(printf 'hi' | "$TOOLS/loom-tokenize" --tokenizer "$work/data_hf" --document-start)
[ "$ids" = "[1,2,107,108]" ] || { echo "FAIL: loom-tokenize gave $ids, wanted [1,2,107,108]"; fail=1; }
text=$(echo '[2,107,108]' | "$TOOLS/loom-tokenize" --tokenizer "$work/tok/tokenizer.json" --decode)
[ "$text" = $'\xe2\x96\x81hi' ] || { echo "FAIL: loom-tokenize --decode gave '$text'"; fail=1; }
expect "does not exist" "$TOOLS/loom-prepare" --tokenizer "$work/nope.json" --input "$work/a.txt" --out-dir "$work/d2"
expect "holds no tokenizer.json" "$TOOLS/loom-tokenize" --tokenizer "$work"
expect "raise --vocab-size to at least 259" "$TOOLS/loom-pretrain" --steps 2 --batch-size 2 --seq-len 16 \
  --log-level warn --data "$work/data_hf/train.bin" --vocab-size 256
# --doc-mask needs the tokenizer's document-start token: the byte tokenizer has none; the
# tokenizer.json above has <s>.
expect "--doc-mask needs a tokenizer that puts a document-start token" "$TOOLS/loom-pretrain" \
  --steps 1 --batch-size 2 --seq-len 16 --log-level warn --data "$work/data/train.bin" --doc-mask
"$TOOLS/loom-pretrain" --steps 2 --batch-size 2 --seq-len 16 --log-level warn --data \
  "$work/data_hf/train.bin" --vocab-size 259 --doc-mask > /dev/null 2>&1 ||
  { echo "FAIL: --doc-mask training on data_hf"; fail=1; }
# scripts/prepare-hf: parquet rows streamed into loom-prepare write the same bytes as the same
# documents in a JSON-lines file; a missing column is named.
PY=${LOOM_SOURCE_DIR}/.venv/bin/python
if "$PY" - "$work" << 'PY'
import json, sys
import pyarrow as pa, pyarrow.parquet as pq
docs = ["hello world, a first document", None, "zweites Dokument: \u00fc\u00df", "\U0001F600 emoji\n\nand   spaces",
        "code: int main() { return 0; }"] * 40
pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), sys.argv[1] + "/p1.parquet",
               row_group_size=37)
with open(sys.argv[1] + "/p1.jsonl", "w") as f:
    for d in docs:
        if d is not None:
            f.write(json.dumps({"text": d}) + "\n")
PY
then
  "$LOOM_SOURCE_DIR/scripts/prepare-hf" --parquet "$work/p1.parquet" --out-dir "$work/phf" \
    --tokenizer "$work/tok" --prepare "$TOOLS/loom-prepare" > /dev/null 2>&1 ||
    { echo "FAIL: scripts/prepare-hf"; fail=1; }
  "$TOOLS/loom-prepare" --input "$work/p1.jsonl" --out-dir "$work/pjs" --tokenizer "$work/tok" \
    > /dev/null 2>&1 || { echo "FAIL: loom-prepare of p1.jsonl"; fail=1; }
  for f in train.bin val.bin meta.json tokenizer.json; do
    cmp -s "$work/phf/$f" "$work/pjs/$f" || { echo "FAIL: prepare-hf's $f differs"; fail=1; }
  done
  expect "no column 'body' (--text-field); it has id, text" "$LOOM_SOURCE_DIR/scripts/prepare-hf" \
    --parquet "$work/p1.parquet" --text-field body --out-dir "$work/p2" --prepare "$TOOLS/loom-prepare"
  expect "column 'id' holds int64, not text" "$LOOM_SOURCE_DIR/scripts/prepare-hf" \
    --parquet "$work/p1.parquet" --text-field id --out-dir "$work/p2" --prepare "$TOOLS/loom-prepare"
  [ ! -e "$work/p2" ] || { echo "FAIL: prepare-hf wrote into --out-dir before refusing"; fail=1; }
  expect "does not exist" "$LOOM_SOURCE_DIR/scripts/prepare-hf" --parquet "$work/nope.parquet" \
    --out-dir "$work/p2" --prepare "$TOOLS/loom-prepare"
else
  echo "FAIL: pyarrow is missing from .venv (scripts/setup installs it)"; fail=1
fi
# loom-export-hf of that run's checkpoint: the model, generation_config.json with the document
# start (<s>, id 1) as BOS and EOS, the tokenizer's files.
"$TOOLS/loom-pretrain" --steps 2 --batch-size 2 --seq-len 16 --log-level warn --model llama \
  --preset llama-tiny --data "$work/data_hf/train.bin" --vocab-size 259 --save-dir "$work/ck_hf" \
  > /dev/null 2>&1 || { echo "FAIL: training on data_hf"; fail=1; }
"$TOOLS/loom-export-hf" --checkpoint "$work/ck_hf" --out "$work/hf_out" --dtype bfloat16 \
  > /dev/null 2>&1 || { echo "FAIL: loom-export-hf"; fail=1; }
if python3 - "$work/hf_out" << 'PY'
import json, os, sys
d = sys.argv[1]
g = json.load(open(os.path.join(d, "generation_config.json")))
c = json.load(open(os.path.join(d, "config.json")))
assert g["bos_token_id"] == g["eos_token_id"] == c["bos_token_id"] == 1, (g, c)
assert c["dtype"] == "bfloat16" and c["vocab_size"] == 259, c
assert os.path.exists(os.path.join(d, "tokenizer.json")), os.listdir(d)
assert os.path.exists(os.path.join(d, "model.safetensors")), os.listdir(d)
PY
then echo "ok: loom-export-hf wrote the model, its token ids and its tokenizer"
else echo "FAIL: loom-export-hf's directory"; fail=1; fi
expect "does not exist" "$TOOLS/loom-export-hf" --checkpoint "$work/no_such_run" --out "$work/hf_x"
expect "must be from 1e-6" "$TOOLS/loom-export-hf" --checkpoint "$work/ck_hf" --out "$work/hf_x" --shard-mb 0
# loom-eval --doc-mask on short documents (JSON lines): the data's tokenizer's <s> starts each
# one, so the loss moves; the byte tokenizer has no document start.
for i in $(seq 1 40); do printf '{"text": "note %d: %s"}\n' "$i" "$(printf 'xy%.0s' $(seq 1 $((i % 5 + 1))))"; done \
  > "$work/docs.jsonl"
"$TOOLS/loom-prepare" --tokenizer "$work/tok" --input "$work/docs.jsonl" --out-dir "$work/data_docs" \
  > /dev/null 2>&1 || { echo "FAIL: loom-prepare of docs.jsonl"; fail=1; }
plain=$("$TOOLS/loom-eval" --checkpoint "$work/ck_hf" --data "$work/data_docs/train.bin" \
  --seq-len 32 --batches 2 --batch-size 2 2>/dev/null | tail -1)
masked=$("$TOOLS/loom-eval" --checkpoint "$work/ck_hf" --data "$work/data_docs/train.bin" \
  --seq-len 32 --batches 2 --batch-size 2 --doc-mask 2>/dev/null | tail -1)
if [ -z "$plain" ] || [ -z "$masked" ] || [ "$plain" = "$masked" ]; then
  echo "FAIL: loom-eval --doc-mask gave '$masked', without it '$plain'"; fail=1
fi
expect "--doc-mask needs a tokenizer" "$TOOLS/loom-eval" --checkpoint "$work/ck_hf" \
  --data "$work/data/train.bin" --seq-len 16 --batches 1 --doc-mask
expect "--export-hf-shard-mb 0 is not valid" "$TOOLS/loom-pretrain" --steps 2 --batch-size 2 --seq-len 16 \
  --data "$work/data_hf/train.bin" --vocab-size 259 --export-hf-shard-mb 0
run=("$TOOLS/loom-pretrain" --steps 2 --batch-size 2 --seq-len 16 --log-level warn)
expect "missing.bin" "${run[@]}" --data "$work/missing.bin"
head -c 1500 "$work/data/train.bin" > "$work/data/cut.bin"
expect "truncated" "${run[@]}" --data "$work/data/cut.bin"
printf 'this is not a token file at all, just some text bytes......' > "$work/text.bin"
expect "wrong magic" "${run[@]}" --data "$work/text.bin"
expect "vocabulary has 100 ids" "${run[@]}" --data "$work/data/train.bin" --vocab-size 100
expect "--vocab-size -3 is not valid: 1..2147483647" "${run[@]}" --data "$work/data/train.bin" --vocab-size -3
expect "--dist-backend 'gloo' is not one of auto, nccl, mpi" "${run[@]}" --data "$work/data/train.bin" --dist-backend gloo
expect "model preset 'gpt2-huge' is not known" "${run[@]}" --data "$work/data/train.bin" --preset gpt2-huge
mkdir -p "$work/hf" && cat > "$work/hf/config.json" << 'JSON'
{"model_type": "gpt2", "vocab_size": 256, "n_positions": 64, "n_embd": 48, "n_layer": 1, "n_head": 5}
JSON
expect "n_heads = 5 does not divide d_model = 48" "${run[@]}" --data "$work/data/train.bin" --init-from-hf "$work/hf"
expect "/proc/loom-nope" "${run[@]}" --data "$work/data/train.bin" --save-dir /proc/loom-nope
expect "--ffn-blocks 0 must be at least 1" "${run[@]}" --data "$work/data/train.bin" --ffn-blocks 0
expect "ffn_blocks = 3 must be at least 1 and divide d_model = 128" "${run[@]}" --data "$work/data/train.bin" --ffn-blocks 3
expect "--prune-targets mlp,attention with --ffn-blocks 2" "${run[@]}" --data "$work/data/train.bin" --ffn-blocks 2 --prune-to 0.5
mkdir -p "$work/hf2" && cat > "$work/hf2/config.json" << 'JSON'
{"model_type": "gpt2", "vocab_size": 256, "n_positions": 64, "n_embd": 48, "n_layer": 1, "n_head": 4}
JSON
expect "--ffn-blocks 2 with --init-from-hf" "${run[@]}" --data "$work/data/train.bin" --ffn-blocks 2 --init-from-hf "$work/hf2"
expect "--d-ff -1 must be >= 0" "${run[@]}" --data "$work/data/train.bin" --d-ff -1
expect "--mtp 0 must be in [1, 16]" "${run[@]}" --data "$work/data/train.bin" --mtp 0
expect "--mtp-weights gives 1 weights for --mtp 2" "${run[@]}" --data "$work/data/train.bin" --mtp 2 --mtp-weights 0.5
expect "--mtp 2 with --init-from-hf" "${run[@]}" --data "$work/data/train.bin" --mtp 2 --init-from-hf "$work/hf2"
expect "--share-layers 'cycle:9': K = '9' must be an integer in [1, 4]" "${run[@]}" --data "$work/data/train.bin" --share-layers cycle:9
expect "entry '7=0' names layer 7, which does not exist" "${run[@]}" --data "$work/data/train.bin" --share-layers 7=0
expect "--share-layers 'all' with --init-from-hf" "${run[@]}" --data "$work/data/train.bin" --share-layers all --init-from-hf "$work/hf2"
expect "--precision 'fp16' is not valid: use fp32, bf16 or fp64" "${run[@]}" --data "$work/data/train.bin" --precision fp16
# fp64 (the correctness instrument) trains from the command line; its Hugging Face export is
# float32, and the log says it was rounded.
out=$("$TOOLS/loom-pretrain" --steps 2 --batch-size 2 --seq-len 16 --log-level info \
  --data "$work/data/train.bin" --precision fp64 --export-hf "$work/hf64" --save-dir "$work/ckpt64" 2>&1)
status=$?
# ... and its checkpoint (fp64 tensors) evaluates with loom-eval.
if [ $status -eq 0 ]; then
  "$TOOLS/loom-eval" --checkpoint "$work/ckpt64" --data "$work/data/train.bin" > /dev/null 2>&1 ||
    { echo "FAIL: loom-eval of an fp64 checkpoint"; fail=1; }
fi
if [ $status -ne 0 ] || ! grep -qF "rounded to float32" <<< "$out" ||
  ! head -c 4096 "$work/hf64/model.safetensors" | grep -qF '"F32"' ||
  head -c 4096 "$work/hf64/model.safetensors" | grep -qF '"F64"'; then
  echo "FAIL: --precision fp64 with --export-hf -> status $status; got: $out"
  fail=1
else
  echo "ok: --precision fp64 trains and exports float32"
fi
expect "--device 'tpu' is not valid: cpu, cuda or cuda:N" "${run[@]}" --data "$work/data/train.bin" --device tpu
if ! command -v nvidia-smi > /dev/null; then  # a machine without a GPU says so
  expect "--device cuda: there is no such CUDA device (0 visible" "${run[@]}" --data "$work/data/train.bin" --device cuda
fi
expect "--attention 'flash' is not valid: auto, fused, sdpa, math" "${run[@]}" --data "$work/data/train.bin" --attention flash
expect "--loss 'fast' is not valid: auto, fused, math" "${run[@]}" --data "$work/data/train.bin" --loss fast
expect "--norm 'fast' is not valid: auto, fused, math" "${run[@]}" --data "$work/data/train.bin" --norm fast
expect "--loss-chunk-rows 'some' is not valid: auto, off (whole logits) or a number of rows > 0" "${run[@]}" --data "$work/data/train.bin" --loss-chunk-rows some
expect "--loss-chunk-rows 64 runs loom's fused cross-entropy passes, which --loss math turns off" "${run[@]}" --data "$work/data/train.bin" --loss-chunk-rows 64 --loss math
expect "--sampling 'shuffle' is not valid: auto (epoch for a new run" "${run[@]}" --data "$work/data/train.bin" --sampling shuffle
expect "--adamw fused: PyTorch's fused AdamW cannot hold the second moment frozen (--freeze-variance-after 5)" "${run[@]}" --data "$work/data/train.bin" --adamw fused --freeze-variance-after 5
expect "--swiglu 'geglu' is not valid: auto, fused, math" "${run[@]}" --data "$work/data/train.bin" --swiglu geglu
expect "--adamw 'apex' is not valid: auto, fused, math" "${run[@]}" --data "$work/data/train.bin" --adamw apex
expect "--adamw fused chooses the replicated optimizer's kernel; --zero 1 shards" "${run[@]}" --data "$work/data/train.bin" --adamw fused --zero 1
expect "--profile-steps '3:1' is not valid" "${run[@]}" --data "$work/data/train.bin" --profile-steps 3:1
expect "--z-loss -0.1 is not valid: a finite weight >= 0" "${run[@]}" --data "$work/data/train.bin" --z-loss -0.1
expect "does not exist" "$TOOLS/loom-eval" --checkpoint "$work/none" --data "$work/data/val.bin"
# A run refused for bad input leaves no checkpoint behind.
expect "missing.bin" "${run[@]}" --data "$work/missing.bin" --save-dir "$work/refused"
if [ -e "$work/refused/latest" ]; then echo "FAIL: a refused run wrote a checkpoint"; fail=1; fi

# kill -9 at random moments: tests/kill_test.sh (ctest reliability.kill9).

# The happy path through every tool: flags from a TOML config, checkpoint, resume, eval, sample.
cat > "$work/train.toml" << TOML
model = "llama"
preset = "llama-tiny"
data = "$work/data/train.bin"
val-data = "$work/data/val.bin"
steps = 3
lr-decay-steps = 5
batch-size = 4
seq-len = 32
save-dir = "$work/ckpt"
metrics-out = "$work/metrics.jsonl"
log-level = "warn"
TOML
if ! "$TOOLS/loom-pretrain" --config "$work/train.toml" > "$work/run1.log" 2>&1; then
  echo "FAIL: pretrain from config"; cat "$work/run1.log"; fail=1
fi
[ "$(wc -l < "$work/metrics.jsonl")" -eq 3 ] || { echo "FAIL: metrics lines"; fail=1; }
grep -q '"val_loss"' "$work/metrics.jsonl" || { echo "FAIL: no val_loss in metrics"; fail=1; }
"$TOOLS/loom-pretrain" --config "$work/train.toml" --steps 5 --resume "$work/ckpt" > "$work/run2.log" 2>&1 \
  || { echo "FAIL: resume"; cat "$work/run2.log"; fail=1; }
[ "$(wc -l < "$work/metrics.jsonl")" -eq 5 ] || { echo "FAIL: metrics after resume"; fail=1; }
[ "$(cat "$work/ckpt/latest")" = "step-00000005" ] || { echo "FAIL: latest checkpoint"; fail=1; }
# The first record of each process names the run (its flags), and scripts/plot draws the file.
head -n 1 "$work/metrics.jsonl" | grep -q '"run":{"dp":1,"flags":{' ||
  { echo "FAIL: no run entry in the first metrics record"; head -n 1 "$work/metrics.jsonl"; fail=1; }
[ "$(grep -c '"run":' "$work/metrics.jsonl")" -eq 2 ] ||
  { echo "FAIL: one run entry per process expected (start and resume)"; fail=1; }
if ! "$LOOM_SOURCE_DIR/scripts/plot" "$work/metrics.jsonl" --out "$work/curve.png" > "$work/plot.log" 2>&1 ||
   ! grep -q "'--model llama, --preset llama-tiny, 1 rank', steps 1-5" "$work/plot.log" ||
   [ "$(head -c 8 "$work/curve.png" | od -An -tx1 | tr -d ' \n')" != 89504e470d0a1a0a ]; then
  echo "FAIL: scripts/plot on the metrics"; cat "$work/plot.log"; fail=1
fi
last=$("$TOOLS/loom-eval" --checkpoint "$work/ckpt" --data "$work/data/val.bin" --seq-len 32 --batches 3 | tail -n 1)
grep -qE '^\{"loss":[0-9.]+,"tokens":96\}$' <<< "$last" || { echo "FAIL: eval printed '$last'"; fail=1; }
sample=$("$TOOLS/loom-generate" --checkpoint "$work/ckpt" --prompt "hello" --max-tokens 20 --seed 3)
[ "${sample:0:5}" = "hello" ] || { echo "FAIL: generate printed '$sample'"; fail=1; }
again=$("$TOOLS/loom-generate" --checkpoint "$work/ckpt" --prompt "hello" --max-tokens 20 --seed 3)
[ "$sample" = "$again" ] || { echo "FAIL: generation is not deterministic"; fail=1; }
expect "temperature must be 0 (got 0.8)" "$TOOLS/loom-generate" --checkpoint "$work/ckpt" --speculative
expect "this model has none (train it with --mtp N)" "$TOOLS/loom-generate" --checkpoint "$work/ckpt" --speculative --temperature 0
# Multi-token heads from the command line: trained, saved beside the Hugging Face export, and
# used by self-speculative decoding, which checks its tokens against greedy decoding's.
"$TOOLS/loom-pretrain" --steps 3 --batch-size 2 --seq-len 16 --log-level warn --mtp 2 \
  --mtp-weights 1,0.5 --d-ff 256 --data "$work/data/train.bin" --save-dir "$work/ckpt-mtp" \
  --export-hf "$work/hf-mtp" > "$work/mtp.log" 2>&1 || { echo "FAIL: --mtp run"; cat "$work/mtp.log"; fail=1; }
[ -f "$work/hf-mtp/mtp_heads.safetensors" ] || { echo "FAIL: no mtp_heads.safetensors"; fail=1; }
grep -q '"n_inner": 256' "$work/hf-mtp/config.json" || { echo "FAIL: --d-ff 256 not in the export"; fail=1; }
spec=$("$TOOLS/loom-generate" --checkpoint "$work/ckpt-mtp" --prompt "hello" --max-tokens 12 \
  --temperature 0 --speculative 2>&1)
grep -q "output identical" <<< "$spec" || { echo "FAIL: --speculative printed '$spec'"; fail=1; }
# Shared blocks: trained with one copy each, exported as one copy per layer.
"$TOOLS/loom-pretrain" --steps 2 --batch-size 2 --seq-len 16 --log-level info --share-layers cycle:2 \
  --data "$work/data/train.bin" --export-hf "$work/hf-share" > "$work/share.log" 2>&1 || { echo "FAIL: --share-layers run"; cat "$work/share.log"; fail=1; }
grep -q "layers 4 (2 distinct blocks, shared 'cycle:2')" "$work/share.log" || { echo "FAIL: the log does not say the blocks are shared"; cat "$work/share.log"; fail=1; }
grep -q '"loom_share_layers": "cycle:2"' "$work/hf-share/config.json" || { echo "FAIL: the export does not record the sharing"; fail=1; }
# loom-plan: layouts ranked by the cost model, as a table or JSON; bad profiles and worlds that
# nothing fits are refused with the reason.
plan=$("$TOOLS/loom-plan" --model gpt2 --preset gpt2-mini --world 8 --batch-size 32 --seq-len 256 --json --top 3)
for key in '"dp"' '"tp"' '"pp"' '"zero"' '"micro_batches"' '"schedule"' '"step_s"' '"memory_bytes"'; do
  grep -qF "$key" <<< "$plan" || { echo "FAIL: loom-plan --json lacks $key"; fail=1; }
done
"$TOOLS/loom-plan" --model llama --preset llama-tiny --world 4 --batch-size 8 | grep -q "layouts fit" || { echo "FAIL: loom-plan table"; fail=1; }
printf '{"devices": [' > "$work/bad-profile.json"
expect "is not valid JSON" "$TOOLS/loom-plan" --world 2 --profile "$work/bad-profile.json"
cat > "$work/profile.json" << 'JSON'
{"devices": [{"name": "gpu", "matmul_flops": 1e14, "attention_flops": 5e13, "memory_bytes": 1e6,
              "adamw_params_per_s": 1e10}],
 "stage_devices": ["gpu", "tpu"],
 "links": {"intra_node": {"bandwidth": 1e11, "latency": 1e-5},
           "inter_node": {"bandwidth": 1e10, "latency": 1e-5}}}
JSON
expect "stage_devices names 'tpu', an unknown device (defined: gpu)" "$TOOLS/loom-plan" --world 2 --profile "$work/profile.json"
sed -i 's/"stage_devices": \["gpu", "tpu"\],//' "$work/profile.json"
expect "no layout of 4 ranks fits in 0.00 GiB per rank; the least memory any needs is" "$TOOLS/loom-plan" --world 4 --profile "$work/profile.json"
expect "machine profile 'tpu-pod' is neither a file nor built in" "$TOOLS/loom-plan" --world 4 --profile tpu-pod
expect "--measure writes a profile: give it --out FILE" "$TOOLS/loom-plan" --measure
expect "--measure-mesh 'tp=2' says which groups --measure times: give --measure too" "$TOOLS/loom-plan" --measure-mesh tp=2
expect "mesh 'tp=two': 'tp=two' is not NAME=N" "$TOOLS/loom-plan" --measure --out "$work/m.json" --measure-mesh tp=two
expect "mesh: tp 2 x pp 1 = 2 ranks does not divide the world of 1 processes" "$TOOLS/loom-plan" --measure --out "$work/m.json" --measure-mesh tp=2
"$TOOLS/loom-plan" --measure --out "$work/measured.json" > /dev/null 2>&1 || { echo "FAIL: loom-plan --measure"; fail=1; }
"$TOOLS/loom-plan" --model gpt2 --preset gpt2-tiny --world 1 --batch-size 8 --precision fp32 \
  --profile "$work/measured.json" | grep -q "layouts fit" || { echo "FAIL: planning with a measured profile"; fail=1; }
[ $fail -eq 0 ] && echo "all CLI checks passed"
exit $fail
