#!/usr/bin/env bash
# Preemption (docs/reliability.md): a signal asks loom-pretrain to stop; every rank finishes the
# step in flight, the checkpoint of that step is written, every rank exits with status 75, and a
# run resumed from it writes the same losses, bit for bit, as the same run never stopped.
#  1. one process, SIGUSR1;
#  2. one process, SIGTERM; no --save-dir: status 75 and a warning; with --preempt-signal none
#     SIGTERM kills as before; a bad signal name: status 2;
#  3. 4 ranks as dp 2 x pp 2 under mpirun, SIGUSR1 sent to ONE rank only: all stop together;
#  4. 2 ranks, SIGUSR1 sent to mpirun, which forwards it.
# Needs TOOLS (loom-pretrain, loom-prepare) and MPIEXEC.
set -uo pipefail
work=$(mktemp -d)
trap 'kill $(jobs -p) 2> /dev/null; rm -rf "$work"' EXIT
fail=0
say() { echo "$@"; }

printf 'a corpus for the preemption test, long enough for a few hundred steps. %.0s' {1..400} > "$work/a.txt"
"$TOOLS/loom-prepare" --input "$work/a.txt" --out-dir "$work/data" > /dev/null 2>&1 || { echo "prepare failed"; exit 1; }
# fp64 and one thread: runs of one layout repeat bit for bit. Enough steps that a signal sent
# once a few are logged lands long before the end.
steps=400
train=("$TOOLS/loom-pretrain" --data "$work/data/train.bin" --steps $steps --seq-len 16
  --batch-size 4 --layers 2 --precision fp64 --threads 1 --log-level warn --log-every 1000)

# Waits until `file` has at least `lines` lines (the run is under way), at most 120 s.
wait_lines() {
  local file=$1 lines=$2
  for _ in $(seq 1200); do
    [ -f "$file" ] && [ "$(wc -l < "$file")" -ge "$lines" ] && return 0
    sleep 0.1
  done
  return 1
}
# "step loss" per line of metrics files.
losses() { python3 -c "
import json, sys
for path in sys.argv[1:]:
    for line in open(path):
        r = json.loads(line)
        print(r['step'], repr(r['loss']))" "$@"; }
last_step() { tail -n 1 "$1" | python3 -c "import json, sys; print(json.loads(sys.stdin.read())['step'])"; }

# The pids to signal: the process itself, or the highest-numbered child of mpirun (one rank).
itself() { echo "$1"; }
one_rank() { pgrep -P "$1" | sort -n | tail -n 1; }

# check NAME SIGNAL TARGETS: runs "${launch[@]}" "${train[@]}" "${extra[@]}" uninterrupted, then
# again stopped by SIGNAL sent to `TARGETS <pid>`, then resumed; compares the losses.
check() {
  local name=$1 signal=$2 targets=$3 dir="$work/$1"
  mkdir -p "$dir"
  "${launch[@]}" "${train[@]}" "${extra[@]}" --metrics-out "$dir/ref.jsonl" > "$dir/ref.log" 2>&1 ||
    { say "FAIL: $name: the uninterrupted run failed"; cat "$dir/ref.log"; fail=1; return; }
  "${launch[@]}" "${train[@]}" "${extra[@]}" --save-dir "$dir/save" --metrics-out "$dir/m1.jsonl" \
    > "$dir/m1.log" 2>&1 &
  local job=$!
  if ! wait_lines "$dir/m1.jsonl" 3; then say "FAIL: $name: the run did not start"; fail=1; return; fi
  kill -s "$signal" $($targets $job)
  wait $job
  local status=$? stopped
  stopped=$(last_step "$dir/m1.jsonl")
  if [ $status -ne 75 ]; then
    say "FAIL: $name: status $status after SIG$signal, wanted 75"; cat "$dir/m1.log"; fail=1; return
  fi
  if [ "$stopped" -ge $steps ] || [ ! -d "$dir/save/$(printf 'step-%08d' "$stopped")" ] ||
    [ "$(cat "$dir/save/latest")" != "$(printf 'step-%08d' "$stopped")" ]; then
    say "FAIL: $name: stopped at step $stopped; save dir: $(ls "$dir/save")"; fail=1; return
  fi
  "${launch[@]}" "${train[@]}" "${extra[@]}" --save-dir "$dir/save" --resume "$dir/save" \
    --metrics-out "$dir/m2.jsonl" > "$dir/m2.log" 2>&1 ||
    { say "FAIL: $name: resume failed"; cat "$dir/m2.log"; fail=1; return; }
  if ! diff <(losses "$dir/ref.jsonl") <(losses "$dir/m1.jsonl" "$dir/m2.jsonl") > "$dir/diff"; then
    say "FAIL: $name: stopped + resumed losses differ from the uninterrupted run:"
    head -n 5 "$dir/diff"; fail=1; return
  fi
  say "ok: $name: SIG$signal -> status 75 after step $stopped of $steps, checkpoint step-$stopped" \
    "is latest, resumed losses equal the uninterrupted run's ($steps steps)"
}

launch=() extra=()
check one_rank_usr1 USR1 itself
check one_rank_term TERM itself

"${train[@]}" --preempt-signal none --metrics-out "$work/none.jsonl" > /dev/null 2>&1 &
job=$!
wait_lines "$work/none.jsonl" 3 && kill -s TERM $job
wait $job
status=$?
if [ $status -ne 143 ]; then say "FAIL: --preempt-signal none: SIGTERM -> status $status, wanted 143"; fail=1;
else say "ok: --preempt-signal none: SIGTERM kills (status 143)"; fi
"${train[@]}" --metrics-out "$work/nosave.jsonl" > "$work/nosave.log" 2>&1 &
job=$!
wait_lines "$work/nosave.jsonl" 3 && kill -s USR1 $job
wait $job
status=$?
if [ $status -ne 75 ] || ! grep -qF "stopping without a checkpoint (no --save-dir)" "$work/nosave.log"; then
  say "FAIL: no --save-dir: SIGUSR1 -> status $status: $(cat "$work/nosave.log")"; fail=1
else say "ok: no --save-dir: SIGUSR1 -> status 75 and a warning that no checkpoint was written"; fi
out=$("${train[@]}" --preempt-signal USR1,USR3 2>&1)
status=$?
if [ $status -ne 2 ] || ! grep -qF "preemption signal 'USR3' in 'USR1,USR3' is not known" <<< "$out"; then
  say "FAIL: --preempt-signal USR1,USR3 -> status $status: $out"; fail=1
else say "ok: --preempt-signal USR1,USR3 refused with status 2"; fi

launch=("$MPIEXEC" -np 4) extra=(--dp 2 --pp 2 --comm-timeout 30)
check dp2_pp2_one_rank_signalled USR1 one_rank
# Sent to mpirun itself, which forwards SIGUSR1 to every rank (docs/reliability.md).
launch=("$MPIEXEC" -np 2) extra=(--comm-timeout 30)
check dp2_signal_to_mpirun USR1 itself
exit $fail
