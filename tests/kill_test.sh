#!/usr/bin/env bash
# kill -9 at 20 random moments while checkpoints are written every step (docs/reliability.md):
# after each kill the save directory holds a checkpoint that loads, `latest` names it, no process
# of the killed run is left, and the next run resumes from it.
#  - 12 kills of one process (llama-tiny);
#  - 8 kills of ONE random rank of a 4-rank dp 2 x tp 2 ZeRO-1 run, whose saves gather ZeRO
#    shards and tp model shards through a staging directory (each then loaded by one process:
#    a resharded load).
# Needs TOOLS (loom-pretrain, loom-prepare, loom-eval) and MPIEXEC.
set -uo pipefail
work=$(mktemp -d)
trap 'pkill -9 -f -- "$work/" 2> /dev/null; rm -rf "$work"' EXIT
fail=0
mid_saves=0
printf 'a corpus for the kill test, long enough for many steps of training. %.0s' {1..300} > "$work/a.txt"
"$TOOLS/loom-prepare" --input "$work/a.txt" --out-dir "$work/data" > /dev/null 2>&1 || { echo "prepare failed"; exit 1; }
base=("$TOOLS/loom-pretrain" --model llama --preset llama-tiny --data "$work/data/train.bin"
  --steps 1000000 --batch-size 4 --seq-len 32 --save-every 1 --threads 1 --log-level off)

# cycle N SAVE_DIR RANKS: one run (resuming when a checkpoint exists), killed at a random moment
# after it wrote a checkpoint of its own; RANKS > 1 kills one random rank of an mpirun job.
cycle() {
  local n=$1 dir=$2 ranks=$3 before pid victim extra=()
  [ -f "$dir/latest" ] && extra=(--resume "$dir")
  before=$(cat "$dir/latest" 2> /dev/null)
  if [ "$ranks" -gt 1 ]; then
    "$MPIEXEC" -n "$ranks" "${base[@]}" --dp 2 --tp 2 --zero 1 --save-dir "$dir" "${extra[@]}" \
      > "$work/run.log" 2>&1 &
  else
    "${base[@]}" --save-dir "$dir" "${extra[@]}" > "$work/run.log" 2>&1 &
  fi
  pid=$!
  # Until this run has written a checkpoint of its own (at most 120 s), then a random moment
  # within the next second: mid-save or between saves.
  for ((w = 0; w < 1200; w++)); do
    [ "$(cat "$dir/latest" 2> /dev/null)" != "$before" ] && break
    kill -0 $pid 2> /dev/null || break
    sleep 0.1
  done
  sleep "0.$((RANDOM % 10))"
  victim=$pid
  if [ "$ranks" -gt 1 ]; then
    local ranks_pids
    ranks_pids=($(pgrep -f -- "--save-dir $dir" | grep -vx "$pid"))
    [ ${#ranks_pids[@]} -gt 0 ] && victim=${ranks_pids[$((RANDOM % ${#ranks_pids[@]}))]}
  fi
  kill -9 "$victim" 2> /dev/null
  # The job ends by itself (mpirun takes the other ranks down): no kill of ours beyond the one.
  local t0=$SECONDS
  wait $pid 2> /dev/null
  local took=$((SECONDS - t0))
  if [ "$ranks" -gt 1 ] && [ $took -gt 30 ]; then echo "FAIL: kill $n: the job took ${took}s to end"; fail=1; fi
  sleep 0.5
  if pgrep -f -- "--save-dir $dir" > /dev/null; then
    echo "FAIL: kill $n left processes: $(pgrep -af -- "--save-dir $dir")"; fail=1
    pkill -9 -f -- "--save-dir $dir"
  fi
  if [ ! -f "$dir/latest" ]; then
    echo "FAIL: kill $n: no checkpoint at all"; tail -5 "$work/run.log"; fail=1; return
  fi
  if ! "$TOOLS/loom-eval" --checkpoint "$dir" --data "$work/data/val.bin" --seq-len 32 \
    --batches 1 > "$work/eval.log" 2>&1; then
    echo "FAIL: kill $n (pid $victim) left no loadable checkpoint ($(cat "$dir/latest"))"
    cat "$work/eval.log"; fail=1
  else
    # A save the kill interrupted leaves its temporary directory (the next save clears it).
    local mid=""
    [ -n "$(find "$dir" -maxdepth 1 -name '*.tmp' -o -maxdepth 1 -name '*.zero-staging')" ] &&
      mid=", mid-save" && mid_saves=$((mid_saves + 1))
    echo "ok: kill $n ($ranks rank(s), pid $victim$mid) -> $(cat "$dir/latest") loads"
  fi
}

for i in $(seq 1 12); do cycle "$i" "$work/one" 1; done
for i in $(seq 13 20); do cycle "$i" "$work/dp2tp2" 4; done
[ $fail -eq 0 ] && echo "kill -9: 20 kills ($mid_saves of them mid-save), every checkpoint loads"
exit $fail
