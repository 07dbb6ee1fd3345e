#!/usr/bin/env bash
# Multi-rank failure behaviour and loom-pretrain under mpirun:
#  1. a rank that skips a collective: the watchdog aborts the job within seconds, naming the op,
#     the group, its sequence number, the rank and the tensor;
#  2. a mesh that does not fit the world: every rank exits with status 2 and the numbers;
#  3. the same training run on 1 and on 2 ranks writes the same losses (one metrics file), as
#     data-parallel replicas and as tensor-parallel (+ sequence-parallel) shards;
#  4. a --tp that does not divide the heads or the world: status 2 and the numbers;
#  5. ZeRO from the command line (shards, resume, resharding to another stage and dp size,
#     refusals);
#  6. pipeline parallelism from the command line: --pp 2 equals 1 rank, its checkpoint resumes
#     on one process (another layout), its export is the whole model; bad pipeline flags are
#     refused with status 2 on every rank.
#  7. a data mixture (a glob of two shards weighted 0.7, one shard 0.3; validation per source):
#     1 rank to step 2, resumed on 2 ranks (dp 2) to step 4, equals 1 rank to step 4 (and resumed
#     on 1 rank, bit for bit), and the
#     records say each source's samples, epochs, training and validation losses (the training
#     ones also under --tp 2, --pp 2 and --cp 2);
#  8. --doc-mask over an interleaved pipeline (pp 2, 2 virtual stages) equals 1 rank.
# The tp 2, ZeRO-3 and pp 2 runs also save checkpoints: loom-export-hf of each (one process,
# whatever the layout it was saved under) writes the same bytes as the run's own --export-hf.
set -uo pipefail
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail=0
say() { echo "$@"; }
# SAVE_DIR EXPORT_DIR LABEL: loom-export-hf of the newest checkpoint in SAVE_DIR writes the
# weights and config.json that the run's --export-hf wrote into EXPORT_DIR.
same_export() {
  local again="$2-again" out
  if ! out=$("$TOOLS/loom-export-hf" --checkpoint "$1" --out "$again" 2>&1); then
    say "FAIL: loom-export-hf --checkpoint $1: $out"; fail=1; return
  fi
  if cmp "$2/model.safetensors" "$again/model.safetensors" && cmp "$2/config.json" "$again/config.json"
  then say "ok: loom-export-hf of the $3 checkpoint writes what its --export-hf wrote"
  else say "FAIL: loom-export-hf of the $3 checkpoint differs from its --export-hf"; fail=1; fi
}

# 1. The watchdog.
start=$(date +%s)
out=$(LOOM_TEST_COMM_TIMEOUT=2 "$MPIEXEC" -np 2 "$DIST_TESTS" --gtest_also_run_disabled_tests \
  --gtest_filter='WatchdogProvoke.*' 2>&1)
status=$?
elapsed=$(( $(date +%s) - start ))
if [ $status -eq 0 ]; then say "FAIL: a skipped collective did not abort the job"; fail=1; fi
for want in "loom watchdog: all_reduce(sum) #1 on group 'world' (rank 0 of 2; world rank 0, local rank 0) Float[1024]" \
            "has not completed after" "aborting the job"; do
  if ! grep -qF -- "$want" <<< "$out"; then say "FAIL: watchdog output lacks '$want'"; fail=1; fi
done
if [ $elapsed -gt 40 ]; then say "FAIL: the watchdog took ${elapsed}s for a 2s timeout"; fail=1; fi
[ $fail -eq 0 ] && say "ok: watchdog aborted in ${elapsed}s (status $status): $(grep -m1 'loom watchdog' <<< "$out")"
[ $fail -ne 0 ] && say "$out"

# 2. A mesh that cannot be: status 2 from every rank, the numbers in the message.
printf 'hello world, this is a small corpus for the loom tools. %.0s' {1..200} > "$work/a.txt"
"$TOOLS/loom-prepare" --input "$work/a.txt" --out-dir "$work/data" > /dev/null 2>&1 || { echo "prepare failed"; exit 1; }
# fp64 (the correctness instrument, docs/testing.md): a layout matches one rank to 1e-9 relative
# on any CPU, where fp32 would differ by kernel-dependent rounding.
base=("$TOOLS/loom-pretrain" --data "$work/data/train.bin" --steps 3 --seq-len 16 --log-level warn
      --lr 3e-3 --warmup-steps 1 --precision fp64)
run=("${base[@]}" --batch-size 4)
out=$("$MPIEXEC" -np 2 "${run[@]}" --dp 3 2>&1)
status=$?
if [ $status -ne 2 ] || ! grep -qF "dp 3 x tp 1 x pp 1 = 3 ranks, but the world has 2 processes" <<< "$out"; then
  say "FAIL: --dp 3 on 2 ranks -> status $status: $out"; fail=1
else say "ok: bad mesh rejected with status 2"; fi
out=$("$MPIEXEC" -np 2 "${base[@]}" --batch-size 3 2>&1)
status=$?
if [ $status -ne 2 ] || ! grep -qF "batch-size 3 cannot be split evenly: dp 2" <<< "$out"; then
  say "FAIL: --batch-size 3 on 2 ranks -> status $status: $out"; fail=1
else say "ok: indivisible batch rejected with status 2"; fi

# NCCL asked for on CPU ranks: status 2 on every rank, before any training; auto plans MPI and
# says so.
out=$("$MPIEXEC" -np 2 "${run[@]}" --dist-backend nccl 2>&1)
status=$?
if [ $status -ne 2 ] || ! grep -qF "the dp group's tensors are on the CPU, and NCCL only moves CUDA tensors" <<< "$out"; then
  say "FAIL: --dist-backend nccl on CPU ranks -> status $status: $out"; fail=1
else say "ok: --dist-backend nccl on CPU ranks rejected with status 2"; fi
out=$("$MPIEXEC" -np 2 "$TOOLS/loom-pretrain" --data "$work/data/train.bin" --steps 1 --seq-len 16 \
  --batch-size 4 --log-level info 2>&1)
status=$?
if [ $status -ne 0 ] || ! grep -qF "communication (--dist-backend auto): dp mpi" <<< "$out"; then
  say "FAIL: a 2-rank CPU run does not log its MPI plan (status $status): $out"; fail=1
else say "ok: the 2-rank CPU run logs its plan: dp mpi"; fi

# 3. One rank vs two: same losses at every step, one metrics file written by rank 0.
"${run[@]}" --metrics-out "$work/m1.jsonl" || { say "FAIL: 1-rank run"; fail=1; }
"$MPIEXEC" -np 2 "${run[@]}" --metrics-out "$work/m2.jsonl" --bucket-mb 0.05 || { say "FAIL: 2-rank run"; fail=1; }
if ! python3 - "$work/m1.jsonl" "$work/m2.jsonl" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
assert len(a) == len(b) == 3, (len(a), len(b))
for x, y in zip(a, b):
    assert x["step"] == y["step"]
    assert abs(x["loss"] - y["loss"]) <= 1e-9 * abs(x["loss"]), (x["loss"], y["loss"])
print("ok: 1-rank and 2-rank losses agree:", [round(x["loss"], 6) for x in a])
PY
then say "FAIL: losses differ between 1 and 2 ranks"; fail=1; fi
"$MPIEXEC" -np 2 "${run[@]}" --metrics-out "$work/m3.jsonl" --tp 2 --sequence-parallel \
  --pad-vocab-multiple 8 --export-hf "$work/hf_tp2" --save-dir "$work/tp2" \
  || { say "FAIL: 2-rank tp run"; fail=1; }
same_export "$work/tp2" "$work/hf_tp2" "tp 2 (padded vocabulary)"
if ! python3 - "$work/m1.jsonl" "$work/m3.jsonl" "$work/hf_tp2/config.json" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
assert len(a) == len(b) == 3, (len(a), len(b))
for x, y in zip(a, b):
    assert abs(x["loss"] - y["loss"]) <= 1e-9 * abs(x["loss"]), (x["loss"], y["loss"])
vocab = json.load(open(sys.argv[3]))["vocab_size"]
assert vocab == 256, vocab  # the byte vocabulary, not the padded 272
print("ok: tp 2 + sequence parallel losses agree with 1 rank:", [round(y["loss"], 6) for y in b])
PY
then say "FAIL: tp 2 losses differ from 1 rank (or the export is padded)"; fail=1; fi

# 4. Tensor-parallel sizes that cannot be.
out=$("$MPIEXEC" -np 2 "${run[@]}" --tp 3 2>&1)
status=$?
if [ $status -ne 2 ] || ! grep -qF "tp 3" <<< "$out"; then
  say "FAIL: --tp 3 on 2 ranks -> status $status: $out"; fail=1
else say "ok: --tp 3 on 2 ranks rejected with status 2"; fi
out=$("$MPIEXEC" -np 2 "$TOOLS/loom-pretrain" --data "$work/data/train.bin" --steps 3 --seq-len 15 \
  --batch-size 4 --model llama --preset llama-tiny --tp 2 --sequence-parallel 2>&1)
status=$?
if [ $status -ne 2 ] || ! grep -qF "seq-len 15 is not divisible by --tp 2" <<< "$out"; then
  say "FAIL: --seq-len 15 --tp 2 --sequence-parallel -> status $status: $out"; fail=1
else say "ok: a sequence tp cannot split rejected with status 2"; fi

# 5. ZeRO from the command line: stage 3 with full checkpointing and activation offload on 2
# ranks equals 1 rank; it writes one optimizer shard per rank and resumes from it exactly, and
# at another stage or on one rank without ZeRO (resharded); flags that do not fit are refused
# with status 2 on every rank.
"$MPIEXEC" -np 2 "${run[@]}" --metrics-out "$work/m4.jsonl" --zero 3 --activation-checkpointing full \
  --offload-activations --save-dir "$work/z3" --save-every 1 --export-hf "$work/hf_z3" \
  || { say "FAIL: 2-rank --zero 3 run"; fail=1; }
same_export "$work/z3" "$work/hf_z3" "dp 2 --zero 3"
if ! python3 - "$work/m1.jsonl" "$work/m4.jsonl" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
assert len(a) == len(b) == 3, (len(a), len(b))
for x, y in zip(a, b):
    assert abs(x["loss"] - y["loss"]) <= 1e-9 * abs(x["loss"]), (x["loss"], y["loss"])
    assert y["memory"]["parameters_bytes"] > 0 and y["memory"]["optimizer_bytes"] > 0, y
print("ok: --zero 3 on 2 ranks agrees with 1 rank:", [round(y["loss"], 6) for y in b])
PY
then say "FAIL: --zero 3 losses differ from 1 rank"; fail=1; fi
for r in 0 1; do
  [ -f "$work/z3/step-00000003/zero-dp0000$r-of-00002.safetensors" ] \
    || { say "FAIL: no ZeRO shard for dp rank $r"; fail=1; }
done
# The step-3 weights of a resharded resume against the uninterrupted run's (the step's loss is
# computed before the update: only the weights show that the optimizer state came back).
same_weights() {
  python3 - "$1" "$2" <<'PY'
import json, struct, sys, array
def read(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__": continue
        assert info["dtype"] in ("F32", "F64"), (name, info["dtype"])
        a, b = info["data_offsets"]
        out[name] = array.array("f" if info["dtype"] == "F32" else "d", raw[8 + n + a:8 + n + b])
    return out
want, got = read(sys.argv[1]), read(sys.argv[2])
assert want.keys() == got.keys(), (sorted(want), sorted(got))
diff2 = sum((x - y) ** 2 for k in want for x, y in zip(got[k], want[k]))
norm2 = sum(y * y for k in want for y in want[k])
assert (diff2 / norm2) ** 0.5 <= 1e-9, (diff2 / norm2) ** 0.5
PY
}
out=$("$MPIEXEC" -np 2 "${run[@]}" --zero 2 --resume "$work/z3/step-00000002" \
  --metrics-out "$work/m5b.jsonl" --save-dir "$work/z3b" 2>&1)
status=$?
if [ $status -ne 0 ] || ! python3 - "$work/m4.jsonl" "$work/m5b.jsonl" <<'PY'
import json, sys
full = {json.loads(l)["step"]: json.loads(l)["loss"] for l in open(sys.argv[1])}
resumed = [json.loads(l) for l in open(sys.argv[2])]
assert [r["step"] for r in resumed] == [3], resumed
assert abs(resumed[0]["loss"] - full[3]) <= 1e-9 * full[3], (resumed[0]["loss"], full[3])
PY
then
  say "FAIL: resuming --zero 3 shards at --zero 2 -> status $status (or step 3 differs): $out"; fail=1
elif ! same_weights "$work/z3/step-00000003/model.safetensors" "$work/z3b/step-00000003/model.safetensors"; then
  say "FAIL: --zero 3 shards resharded for --zero 2: step-3 weights differ"; fail=1
else say "ok: --zero 3 shards resharded for --zero 2 (same step-3 weights)"; fi
out=$("$MPIEXEC" -np 2 "${run[@]}" --zero 3 --resume "$work/z3/step-00000002" \
  --metrics-out "$work/m5.jsonl" 2>&1)
status=$?
if [ $status -ne 0 ] || ! python3 - "$work/m4.jsonl" "$work/m5.jsonl" <<'PY'
import json, sys
full = {json.loads(l)["step"]: json.loads(l)["loss"] for l in open(sys.argv[1])}
resumed = [json.loads(l) for l in open(sys.argv[2])]
assert [r["step"] for r in resumed] == [3], resumed
assert resumed[0]["loss"] == full[3], (resumed[0]["loss"], full[3])
PY
then
  say "FAIL: resuming --zero 3 from step 2 -> status $status (or step 3 differs): $out"; fail=1
else say "ok: --zero 3 resumed from its shards"; fi
out=$("${run[@]}" --resume "$work/z3/step-00000002" --metrics-out "$work/m5c.jsonl" \
  --save-dir "$work/z3c" 2>&1)
status=$?
if [ $status -ne 0 ] || ! python3 - "$work/m4.jsonl" "$work/m5c.jsonl" <<'PY'
import json, sys
full = {json.loads(l)["step"]: json.loads(l)["loss"] for l in open(sys.argv[1])}
resumed = [json.loads(l) for l in open(sys.argv[2])]
assert [r["step"] for r in resumed] == [3], resumed
assert abs(resumed[0]["loss"] - full[3]) <= 1e-9 * full[3], (resumed[0]["loss"], full[3])
PY
then
  say "FAIL: resuming dp 2 --zero 3 shards on 1 rank without ZeRO -> status $status: $out"; fail=1
elif ! same_weights "$work/z3/step-00000003/model.safetensors" "$work/z3c/step-00000003/model.safetensors"; then
  say "FAIL: a dp 2 --zero 3 checkpoint resumed on 1 rank: step-3 weights differ"; fail=1
else say "ok: a dp 2 --zero 3 checkpoint resumed on 1 rank, replicated (same step-3 weights)"; fi
# Each "FLAGS|MESSAGE": loom-pretrain on 2 ranks with the base flags, --batch-size 4 unless
# FLAGS give one, and FLAGS must exit with status 2 naming MESSAGE.
refuse_each() {
  local bad flags want out status
  for bad in "$@"; do
    flags=${bad%%|*}; want=${bad#*|}
    [[ $flags == *--batch-size* ]] || flags="$flags --batch-size 4"
    # shellcheck disable=SC2086
    out=$("$MPIEXEC" -np 2 "${base[@]}" $flags 2>&1)
    status=$?
    if [ $status -ne 2 ] || ! grep -qF -- "$want" <<< "$out"; then
      say "FAIL: $flags -> status $status: $out"; fail=1
    else say "ok: $flags rejected with status 2"; fi
  done
}
refuse_each "--zero 4|--zero 4 is not valid" \
            "--offload-optimizer|--offload-optimizer moves the ZeRO optimizer shards" \
            "--offload-activations|--offload-activations moves the block inputs" \
            "--activation-checkpointing most|--activation-checkpointing 'most' is not valid"
# 6. Pipeline parallelism.
"$MPIEXEC" -np 2 "${run[@]}" --metrics-out "$work/m6.jsonl" --pp 2 --schedule 1f1b --micro-batches 2 \
  --save-dir "$work/pp2" --save-every 1 --export-hf "$work/hf_pp2" || { say "FAIL: --pp 2 run"; fail=1; }
"${run[@]}" --resume "$work/pp2/step-00000002" --metrics-out "$work/m7.jsonl" --grad-accum 2 \
  || { say "FAIL: resuming a --pp 2 checkpoint on 1 rank"; fail=1; }
if ! python3 - "$work/m1.jsonl" "$work/m6.jsonl" "$work/m7.jsonl" "$work/hf_pp2/config.json" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
c = [json.loads(l) for l in open(sys.argv[3])]
assert len(a) == len(b) == 3, (len(a), len(b))
for x, y in zip(a, b):
    assert abs(x["loss"] - y["loss"]) <= 1e-9 * abs(x["loss"]), (x["loss"], y["loss"])
    assert 0 <= y["pipeline"]["bubble"] < 1 and y["pipeline"]["max_in_flight"] == 2, y
assert [r["step"] for r in c] == [3], c
assert abs(c[0]["loss"] - b[2]["loss"]) <= 1e-9 * abs(b[2]["loss"]), (c[0]["loss"], b[2]["loss"])
assert json.load(open(sys.argv[4]))["n_layer"] == 4
print("ok: --pp 2 agrees with 1 rank and resumes on 1 rank:", [round(y["loss"], 6) for y in b])
PY
then say "FAIL: --pp 2 losses differ from 1 rank, or its checkpoint/export is wrong"; fail=1; fi
for p in 0 1; do
  [ -f "$work/pp2/step-00000003/model-pp00$p-tp000.safetensors" ] \
    || { say "FAIL: no model shard file for pipeline rank $p"; fail=1; }
done
same_export "$work/pp2" "$work/hf_pp2" "pp 2"
# ZeRO-3 over the pipeline (each stage's blocks kept gathered across its micro-batches): the same
# losses as one rank, and its export is the whole model.
"$MPIEXEC" -np 2 "${run[@]}" --metrics-out "$work/m8.jsonl" --pp 2 --micro-batches 2 --zero 3 \
  --zero3-reshard-after-forward false --export-hf "$work/hf_pp2_z3" \
  || { say "FAIL: --pp 2 --zero 3 run"; fail=1; }
if python3 - "$work/m1.jsonl" "$work/m8.jsonl" "$work/hf_pp2_z3/config.json" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
assert len(a) == len(b) == 3, (len(a), len(b))
for x, y in zip(a, b):
    assert abs(x["loss"] - y["loss"]) <= 1e-9 * abs(x["loss"]), (x["loss"], y["loss"])
assert json.load(open(sys.argv[3]))["n_layer"] == 4
PY
then say "ok: --pp 2 --zero 3 agrees with 1 rank"
else say "FAIL: --pp 2 --zero 3 losses differ from 1 rank, or its export is wrong"; fail=1; fi
refuse_each "--pp 2 --schedule zigzag|--schedule 'zigzag' is not a known pipeline schedule; valid: 1f1b, gpipe, interleaved" \
            "--pp 2 --schedule interleaved --virtual-stages 2 --micro-batches 3 --batch-size 6|--micro-batches 3 must be a multiple of --pp 2" \
            "--pp 2 --virtual-stages 2 --micro-batches 2|--schedule 1f1b runs one model chunk per rank" \
            "--pp 2 --schedule interleaved --virtual-stages 4 --micro-batches 2|the model has 4 layers but the pipeline has 8 stages" \
            "--pp 2 --zero3-reshard-after-forward false|--zero3-reshard-after-forward false keeps ZeRO-3's gathered blocks across micro-batches: it needs --zero 3 (it is 0)" \
            "--pp 3|tp 1 x pp 3 = 3 ranks does not divide the world of 2 processes" \
            "--pp 2 --micro-batches 2 --grad-accum 4|--micro-batches 2 and --grad-accum 4 disagree"
# 7. A data mixture, resumed at another layout.
mkdir -p "$work/web" "$work/code"
printf 'the quick brown fox jumps over the lazy dog, again and again. %.0s' {1..120} > "$work/w.txt"
printf 'int main() { return fold(xs, 0, [](int a, int b) { return a + b; }); } %.0s' {1..120} > "$work/c.txt"
"$TOOLS/loom-prepare" --input "$work/w.txt" --out-dir "$work/web" > /dev/null 2>&1 &&
  cp "$work/data/train.bin" "$work/web/train2.bin" &&
  "$TOOLS/loom-prepare" --input "$work/c.txt" --out-dir "$work/code" > /dev/null 2>&1 ||
  { say "FAIL: preparing the mixture's sources"; fail=1; }
mix_flags=("$TOOLS/loom-pretrain" --val-data "web=$work/web/val.bin,code=$work/code/val.bin"
     --seq-len 16 --batch-size 4 --log-level warn --lr 3e-3 --warmup-steps 1 --precision fp64
     --steps 4 --eval-every 2 --eval-batches 2)
mix=("${mix_flags[@]}" --data "web=$work/web/train*.bin:0.7,code=$work/code/train.bin:0.3")
"${mix[@]}" --metrics-out "$work/mix1.jsonl" --save-dir "$work/mix1" --save-every 2 \
  || { say "FAIL: 1-rank mixture run"; fail=1; }
"$MPIEXEC" -np 2 "${mix[@]}" --metrics-out "$work/mix2.jsonl" --resume "$work/mix1/step-00000002" \
  --save-dir "$work/mix2" || { say "FAIL: mixture resumed on 2 ranks"; fail=1; }
"${mix[@]}" --metrics-out "$work/mix3.jsonl" --resume "$work/mix1/step-00000002" \
  --save-dir "$work/mix3" || { say "FAIL: mixture resumed on 1 rank"; fail=1; }
if python3 - "$work/mix1.jsonl" "$work/mix2.jsonl" "$work/mix3.jsonl" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
c = [json.loads(l) for l in open(sys.argv[3])]
# The same layout resumes bit for bit.
assert [(r["loss"], r["sources"]) for r in c] == [(r["loss"], r["sources"]) for r in a[2:]], (a, c)
assert [r["step"] for r in a] == [1, 2, 3, 4] and [r["step"] for r in b] == [3, 4], (a, b)
for x, y in zip(a[2:], b):
    assert abs(x["loss"] - y["loss"]) <= 1e-9 * abs(x["loss"]), (x["loss"], y["loss"])
    assert x["sources"] == y["sources"], (x["sources"], y["sources"])
    assert ("val_loss" in x) == ("val_loss" in y) == (x["step"] % 2 == 0), (x, y)
    for k in ("web", "code") if "val_loss" in x else ():
        assert abs(x["val_loss_by_source"][k] - y["val_loss_by_source"][k]) <= 1e-9 * x["val_loss"]
for r in a:
    s = r["sources"]
    assert s["web"]["samples"] + s["code"]["samples"] == 4, s
    assert s["web"]["tokens"] == 16 * s["web"]["samples"], s
    # Per-source training losses: their token-weighted mean is the step's loss (fp64).
    by = r["loss_by_source"]
    assert set(by) == {k for k in s if s[k]["samples"] > 0}, (by, s)
    mean = sum(by[k] * s[k]["tokens"] for k in by) / sum(s[k]["tokens"] for k in by)
    assert abs(mean - r["loss"]) <= 1e-9 * r["loss"], (mean, r["loss"], by)
for x, y in zip(a[2:], b):
    for k in x["loss_by_source"]:
        assert abs(x["loss_by_source"][k] - y["loss_by_source"][k]) <= 1e-9 * x["loss"], (x, y)
web = a[-1]["val_loss_by_source"]["web"]; code = a[-1]["val_loss_by_source"]["code"]
assert web != code and min(web, code) <= a[-1]["val_loss"] <= max(web, code), a[-1]
print("ok: a mixture resumed on 2 ranks continues the 1-rank run:",
      [round(y["loss"], 6) for y in b], a[-1]["sources"], a[-1]["val_loss_by_source"])
PY
then :; else say "FAIL: the mixture run differs when resumed on 2 ranks, or its records are wrong"; fail=1; fi
# Per-source losses under tensor and pipeline parallelism: the 1-rank run's, step by step.
for layout in "--tp 2" "--pp 2 --micro-batches 2" "--cp 2"; do
  # shellcheck disable=SC2086
  "$MPIEXEC" -np 2 "${mix[@]}" $layout --metrics-out "$work/mixl.jsonl" \
    || { say "FAIL: mixture run with $layout"; fail=1; }
  if python3 - "$work/mix1.jsonl" "$work/mixl.jsonl" "$layout" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
assert [r["step"] for r in b] == [1, 2, 3, 4], b
for x, y in zip(a, b):
    assert x["loss_by_source"].keys() == y["loss_by_source"].keys(), (x, y)
    for k, v in x["loss_by_source"].items():
        assert abs(v - y["loss_by_source"][k]) <= 1e-9 * x["loss"], (k, v, y["loss_by_source"])
print("ok: per-source losses with", sys.argv[3], "equal 1 rank's:", [r["loss_by_source"] for r in b])
PY
  then :; else say "FAIL: per-source losses with $layout differ from 1 rank"; fail=1; fi
done
out=$("${mix_flags[@]}" --data "web=$work/web/train*.bin:0.7,code=$work/code/train.bin:zero" 2>&1)
status=$?
if [ $status -ne 2 ] || ! grep -qF "the weight 'zero' of 'code=" <<< "$out"; then
  say "FAIL: a bad mixture weight -> status $status: $out"; fail=1
else say "ok: a bad mixture weight rejected with status 2"; fi

# 8. Document masks through an interleaved pipeline (stages that are neither first nor last read
# their micro-batch's tokens for the mask): --pp 2 equals 1 rank, and the mask changes the run.
mkdir -p "$work/tok"
python3 "$(dirname "$0")/../tiny_tokenizer.py" "$work/tok/tokenizer.json"
for i in $(seq 1 80); do printf '{"text": "doc %d %s"}\n' "$i" "$(printf 'ab%.0s' $(seq 1 $((i % 9 + 1))))"; done \
  > "$work/docs.jsonl"
"$TOOLS/loom-prepare" --tokenizer "$work/tok" --input "$work/docs.jsonl" --out-dir "$work/docs" \
  > /dev/null 2>&1 || { say "FAIL: preparing the documents"; fail=1; }
doc=("$TOOLS/loom-pretrain" --data "$work/docs/train.bin" --vocab-size 259 --model llama
     --preset llama-tiny --steps 3 --seq-len 32 --batch-size 4 --log-level warn --lr 3e-3
     --warmup-steps 1 --precision fp64)
"${doc[@]}" --doc-mask --metrics-out "$work/doc1.jsonl" || { say "FAIL: --doc-mask run"; fail=1; }
"$MPIEXEC" -np 2 "${doc[@]}" --doc-mask --pp 2 --schedule interleaved --virtual-stages 2 \
  --micro-batches 2 --metrics-out "$work/doc2.jsonl" || { say "FAIL: --doc-mask --pp 2 run"; fail=1; }
"${doc[@]}" --metrics-out "$work/doc0.jsonl" || { say "FAIL: run without --doc-mask"; fail=1; }
if python3 - "$work/doc1.jsonl" "$work/doc2.jsonl" "$work/doc0.jsonl" <<'PY'
import json, sys
a, b, c = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:4])
assert len(a) == len(b) == len(c) == 3, (a, b, c)
for x, y in zip(a, b):
    assert abs(x - y) <= 1e-9 * abs(x), (x, y)
assert all(abs(x - z) > 1e-6 * abs(x) for x, z in zip(a, c)), (a, c)
print("ok: --doc-mask over an interleaved --pp 2 agrees with 1 rank:", [round(x, 6) for x in b],
      "and differs from no mask:", [round(z, 6) for z in c])
PY
then :; else say "FAIL: --doc-mask losses differ between 1 rank and --pp 2, or equal no mask"; fail=1; fi
exit $fail
