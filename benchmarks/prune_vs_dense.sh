#!/usr/bin/env bash
# The pruning papers' claim on loom's corpus (Zhu & Gupta 2017; docs/benchmarks.md): a larger
# model gradually pruned to N nonzero linear weights against a dense model with N linear weights,
# the same tokens seen. Four CPU runs of loom-pretrain on the bundled corpus (bytes as tokens);
# prints each run's last metrics line (val_loss, sparsity, elapsed_s).
# Knobs: STEPS (600), OUT (runs/prune-vs-dense). Needs build/examples (scripts/build).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=build/examples
out=${OUT:-runs/prune-vs-dense}
steps=${STEPS:-600}
mkdir -p "$out"
[ -f "$out/data/train.bin" ] ||
  "$bin/loom-prepare" --input data/corpus/kjv.txt --out-dir "$out/data" --val-fraction 0.05 > /dev/null
common=(--model gpt2 --data "$out/data/train.bin" --val-data "$out/data/val.bin" --steps "$steps"
  --batch-size 16 --seq-len 128 --lr 3e-3 --min-lr 3e-4 --warmup-steps 50 --log-every 100
  --eval-every "$steps" --eval-batches 64 --seed 1)
prune=(--prune-start 60 --prune-end $((steps * 2 / 3)) --prune-every 30)
run() {
  local name=$1
  shift
  "$bin/loom-pretrain" "${common[@]}" "$@" --metrics-out "$out/$name.jsonl" > "$out/$name.log" 2>&1
  echo "$name $(tail -n 1 "$out/$name.jsonl")"
}
# 12 d^2 L linear weights: tiny L4 (d 128) = mini L4 (d 256) at 75 %; tiny L8 = mini L4 at 50 %.
run tiny_l4_dense --preset gpt2-tiny --layers 4
run mini_l4_pruned75 --preset gpt2-mini --layers 4 --prune-to 0.75 "${prune[@]}"
run tiny_l8_dense --preset gpt2-tiny --layers 8
run mini_l4_pruned50 --preset gpt2-mini --layers 4 --prune-to 0.5 "${prune[@]}"
