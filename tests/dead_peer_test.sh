#!/usr/bin/env bash
# A dead or stuck peer (docs/reliability.md): every other rank exits non-zero promptly, the
# output names the dead rank (the launcher's line) and the operation the survivors waited in
# (loom's watchdog line), no process of the job is left, and the last complete checkpoint loads.
#  1. SIGKILL of one rank mid-step: dp 3 (gradient all-reduce), dp 2 x tp 2 (tensor-parallel
#     collectives), pp 3 (pipeline send/recv);
#  2. a stuck rank (SIGSTOP) of dp 3: the watchdog aborts the job after --comm-timeout, naming
#     the op; the stopped rank is taken down too.
# (SIGKILL during a checkpoint write, at dp 2 x tp 2: tests/kill_test.sh.)
# Needs TOOLS (loom-pretrain, loom-prepare, loom-eval) and MPIEXEC.
set -uo pipefail
work=$(mktemp -d)
trap 'pkill -9 -f -- "$work/" 2> /dev/null; rm -rf "$work"' EXIT
fail=0
printf 'a corpus for the dead peer test, long enough for many steps of training. %.0s' {1..300} > "$work/a.txt"
"$TOOLS/loom-prepare" --input "$work/a.txt" --out-dir "$work/data" > /dev/null 2>&1 || { echo "prepare failed"; exit 1; }
timeout_s=10
base=("$TOOLS/loom-pretrain" --data "$work/data/train.bin" --layers 3 --steps 1000000
  --batch-size 6 --seq-len 32 --threads 1 --log-level warn --log-every 1000000
  --comm-timeout $timeout_s --save-every 2)

# run NAME SIGNAL VICTIM_RANK NP FLAGS...: starts the job, waits for its second checkpoint (or a
# later one), sends SIGNAL to world rank VICTIM_RANK, and checks how the job ends.
run() {
  local name=$1 signal=$2 victim_rank=$3 np=$4
  shift 4
  local dir="$work/$name"
  "$MPIEXEC" -n "$np" "${base[@]}" --save-dir "$dir" "$@" \
    > "$dir.log" 2>&1 &
  local pid=$!
  # At least step 4: a fast layout can pass step 4 between two polls.
  local latest
  for ((w = 0; w < 1800; w++)); do
    latest=$(cat "$dir/latest" 2> /dev/null)
    [[ $latest =~ ^step-([0-9]+)$ ]] && ((10#${BASH_REMATCH[1]} >= 4)) && break
    kill -0 $pid 2> /dev/null || break
    sleep 0.1
  done
  if ! [[ $latest =~ ^step-([0-9]+)$ ]] || ((10#${BASH_REMATCH[1]} < 4)); then
    echo "FAIL: $name: no checkpoint of step 4 or later (latest: '${latest}')"
    grep -v '^\s*$' "$dir.log" | tail -15
    fail=1; kill -9 $pid 2> /dev/null; wait $pid; return
  fi
  sleep 0.3
  # The rank's process: Open MPI gives each its rank in the environment.
  local victim=""
  for p in $(pgrep -f -- "--save-dir $dir" | grep -vx "$pid"); do
    if tr '\0' '\n' < "/proc/$p/environ" 2> /dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$victim_rank"; then
      victim=$p
    fi
  done
  if [ -z "$victim" ]; then echo "FAIL: $name: no process for rank $victim_rank"; fail=1; kill -9 $pid; wait $pid; return; fi
  local t0
  t0=$(date +%s.%N)
  kill -s "$signal" "$victim"
  wait $pid
  local status=$? took
  took=$(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$t0" "$(date +%s.%N)")
  cp "$dir.log" "$dir.all"
  local bad=0
  if [ $status -eq 0 ]; then echo "FAIL: $name: the job exited 0"; bad=1; fi
  # Within the comm timeout and a few seconds.
  if python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) <= float(sys.argv[2]) + 5 else 1)" "$took" "$timeout_s"; then :; else
    echo "FAIL: $name: the job took ${took}s to end (comm timeout ${timeout_s}s)"; bad=1
  fi
  if [ "$signal" = KILL ]; then
    grep -qE "rank $victim_rank .*(exited on signal 9|Killed)" "$dir.all" ||
      { echo "FAIL: $name: no line names dead rank $victim_rank"; bad=1; }
    grep -qE "loom watchdog: SIGTERM arrived while [a-z_]+.* on group '[a-z][a-z0-9.]*'" "$dir.all" ||
      { echo "FAIL: $name: no line names the op the survivors waited in"; bad=1; }
  else
    grep -qE "loom watchdog: [a-z_]+.* on group '[a-z][a-z0-9.]*'.* has not completed after" "$dir.all" ||
      { echo "FAIL: $name: the watchdog did not name the op"; bad=1; }
  fi
  sleep 0.5
  if pgrep -f -- "--save-dir $dir" > /dev/null; then
    echo "FAIL: $name: processes left: $(pgrep -af -- "--save-dir $dir")"; bad=1
    pkill -9 -f -- "--save-dir $dir"
  fi
  if ! "$TOOLS/loom-eval" --checkpoint "$dir" --data "$work/data/val.bin" --seq-len 32 \
    --batches 1 > "$dir.eval" 2>&1; then
    echo "FAIL: $name: the last checkpoint ($(cat "$dir/latest" 2> /dev/null)) does not load"; bad=1
  fi
  if [ $bad -ne 0 ]; then fail=1; echo "--- $name output:"; grep -v '^\s*$' "$dir.all" | tail -15; return; fi
  echo "ok: $name: SIG$signal to rank $victim_rank -> status $status after ${took}s; $(grep -m1 -oE "loom watchdog: [^:]*" "$dir.all")"
}

run dp3_killed KILL 1 3 --dp 3
run dp2_tp2_killed KILL 2 4 --dp 2 --tp 2
run pp3_killed KILL 2 3 --pp 3 --micro-batches 3
run dp3_stuck STOP 1 3 --dp 3
[ $fail -eq 0 ] && echo "dead peers: all passed"
exit $fail
