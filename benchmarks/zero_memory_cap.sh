#!/usr/bin/env bash
# The largest GPT-2 that trains at dp = N under a per-rank memory cap, ZeRO stage by stage.
#
#   benchmarks/zero_memory_cap.sh [ranks=4] [cap_mib=1024] [stages="0 3"]
#
# For each stage, tries the gpt2 presets from small to large (byte vocabulary, 64-token
# sequences, one sequence per rank per step) with `loom-pretrain --memory-cap-mb`: every CPU
# allocation that would take a rank above the cap fails, as on a device with that much memory.
# A preset "fits" when 2 training steps complete; the first that does not ends the stage. One
# JSON line per attempt, then one per stage with the largest preset that fit.
set -uo pipefail
cd "$(dirname "$0")/.."
ranks=${1:-4}
cap=${2:-1024}
stages=${3:-"0 3"}
bin=${LOOM_BUILD_DIR:-build}/examples/loom-pretrain
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  OMPI_MCA_rmaps_base_oversubscribe=1
head -c 2000000 /dev/urandom | base64 > "$work/corpus.txt"
"${bin%/*}/loom-prepare" --input "$work/corpus.txt" --out-dir "$work/data" > /dev/null
for stage in $stages; do
  largest=none
  largest_params=0
  for preset in gpt2-tiny gpt2-mini gpt2-124m gpt2-350m; do
    start=$(date +%s)
    out=$(mpirun -np "$ranks" "$bin" --data "$work/data/train.bin" --preset "$preset" \
      --zero "$stage" --memory-cap-mb "$cap" --steps 2 --batch-size "$ranks" --seq-len 64 \
      --warmup-steps 1 --log-every 1 --metrics-out "$work/m.jsonl" 2>&1)
    status=$?
    seconds=$(( $(date +%s) - start ))
    params=$(grep -m1 -oE '[0-9.]+M parameters' <<< "$out" | grep -oE '[0-9.]+')
    if [ $status -eq 0 ]; then
      fits=true
      largest=$preset
      largest_params=$params
      peak=$(tail -1 "$work/m.jsonl" | python3 -c 'import json,sys; print(json.load(sys.stdin)["memory"]["peak_bytes"] / 2**20)')
    else
      fits=false
      peak=null
      grep -qF "memory cap" <<< "$out" || { echo "$out" | tail -20 >&2; echo "failed for another reason than the cap" >&2; exit 1; }
    fi
    echo "{\"bench\": \"zero_memory_cap\", \"stage\": $stage, \"dp\": $ranks, \"cap_mib\": $cap, \"preset\": \"$preset\", \"params_m\": ${params:-null}, \"fits\": $fits, \"rank0_peak_mib\": $peak, \"seconds\": $seconds}"
    [ "$fits" = true ] || break
  done
  echo "{\"bench\": \"zero_memory_cap\", \"stage\": $stage, \"dp\": $ranks, \"cap_mib\": $cap, \"largest_that_fits\": \"$largest\", \"params_m\": $largest_params}"
done
