#!/usr/bin/env bash
# Bad input to the command-line tools: each case must exit with status 2 and a message naming
# the problem — no crash, no half-written checkpoint.
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
printf 'hello world, this is a small corpus for the loom tools. %.0s' {1..50} > "$work/a.txt"
"$TOOLS/loom-prepare" --input "$work/a.txt" --out-dir "$work/data" > /dev/null 2>&1 || { echo "prepare failed"; exit 1; }
run=("$TOOLS/loom-pretrain" --steps 2 --batch-size 2 --seq-len 16 --log-level warn)
expect "missing.bin" "${run[@]}" --data "$work/missing.bin"
head -c 1500 "$work/data/train.bin" > "$work/data/cut.bin"
expect "truncated" "${run[@]}" --data "$work/data/cut.bin"
printf 'this is not a token file at all, just some text bytes......' > "$work/text.bin"
expect "wrong magic" "${run[@]}" --data "$work/text.bin"
expect "vocabulary has 100 ids" "${run[@]}" --data "$work/data/train.bin" --vocab-size 100
expect "model preset 'gpt2-huge' is not known" "${run[@]}" --data "$work/data/train.bin" --preset gpt2-huge
mkdir -p "$work/hf" && cat > "$work/hf/config.json" << 'JSON'
{"model_type": "gpt2", "vocab_size": 256, "n_positions": 64, "n_embd": 48, "n_layer": 1, "n_head": 5}
JSON
expect "n_heads = 5 does not divide d_model = 48" "${run[@]}" --data "$work/data/train.bin" --init-from-hf "$work/hf"
expect "/proc/loom-nope" "${run[@]}" --data "$work/data/train.bin" --save-dir /proc/loom-nope
expect "--precision 'fp16'" "${run[@]}" --data "$work/data/train.bin" --precision fp16
expect "does not exist" "$TOOLS/loom-eval" --checkpoint "$work/none" --data "$work/data/val.bin"
# A save dir that is not writable leaves nothing behind.
if ls /proc/loom-nope > /dev/null 2>&1; then echo "FAIL: something was written"; fail=1; fi
exit $fail
