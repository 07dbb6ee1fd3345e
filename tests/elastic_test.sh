#!/usr/bin/env bash
# loom-elastic (docs/reliability.md, "Elastic restarts"):
#  1. a 4-rank dp run (saving with --async-save) with one rank SIGKILLed mid-run resumes on 3
#     ranks from the last complete checkpoint and finishes; its loss curve from the resumed step equals (relative 1e-12) an
#     uninterrupted 3-rank run started from that checkpoint; every checkpoint it left loads; the
#     report names the lost rank; no process is left; each save's cost is in the metrics;
#  2. dp 2 x tp 2 losing a rank: tp 2 does not divide 3 ranks, so the relaunch asks the planner
#     (--plan auto), which reshards the tp-2 checkpoint and finishes;
#  3. giving up: below --min-np, after --max-restarts, and a run that fails without losing a
#     rank (a flag that does not fit the world) is not restarted: status 1, the reason reported;
#  4. bad input: no --save-dir, --min-np above --np, no --np, layout flags in a --config file
#     (a relaunch could not change them): status 2 and the value named;
#  5. --save-every-s: saves by time, each save's cost in the next step's metrics record; a
#     background write that fails (LOOM_TEST_WRITE_FAULT) stops the run at the next save, naming
#     the checkpoint, with `latest` on the previous one and nothing half-written left;
#  6. SIGUSR1 to loom-elastic: passed on to every rank, which checkpoints; status 75, no restart.
# Needs TOOLS (loom-elastic, loom-pretrain, loom-prepare, loom-eval) and MPIEXEC.
set -uo pipefail
work=$(mktemp -d)
trap 'pkill -9 -f -- "$work/" 2> /dev/null; rm -rf "$work"' EXIT
fail=0
cd "$work" || exit 1
printf 'a corpus for the elastic test, long enough for many steps of training. %.0s' {1..300} > a.txt
"$TOOLS/loom-prepare" --input a.txt --out-dir data > /dev/null 2>&1 || { echo "prepare failed"; exit 1; }
launcher=(--launcher "$MPIEXEC" --launcher-args "--oversubscribe -x OMP_NUM_THREADS=1")
train() {  # train SAVE_DIR STEPS [flags...]: loom-pretrain's command line
  local dir=$1 steps=$2
  shift 2
  echo "$TOOLS/loom-pretrain" --model gpt2 --preset gpt2-tiny --data "$work/data/train.bin" \
    --steps "$steps" --batch-size 12 --seq-len 32 --save-every 5 --keep-checkpoints 0 \
    --save-dir "$work/$dir" \
    --metrics-out "$work/$dir.jsonl" --threads 1 --log-every 10 "$@"
}
field() { python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print(eval(sys.argv[2]))" "$@"; }

# elastic NAME NP KILL_AFTER_STEP KILL_RANK [elastic flags] -- TRAINING COMMAND: runs loom-elastic
# in the background, SIGKILLs rank KILL_RANK of its first attempt once the metrics file holds
# KILL_AFTER_STEP steps (0: no kill), waits; sets $status.
elastic() {
  local name=$1 np=$2 after=$3 victim=$4
  shift 4
  "$TOOLS/loom-elastic" --np "$np" "${launcher[@]}" "$@" > "$work/$name.log" 2>&1 &
  local pid=$!
  if [ "$after" -gt 0 ]; then
    local status_file="$work/$name.elastic/attempt-0/rank-$victim.json" rank_pid=""
    for ((w = 0; w < 1200; w++)); do
      [ "$(cat "$work/$name.jsonl" 2> /dev/null | wc -l)" -ge "$after" ] &&
        rank_pid=$(field "$status_file" "r.get('pid', '')" 2> /dev/null) && [ -n "$rank_pid" ] && break
      kill -0 $pid 2> /dev/null || break
      sleep 0.1
    done
    if [ -n "$rank_pid" ]; then kill -9 "$rank_pid"; else echo "FAIL: $name: no rank $victim to kill"; fail=1; fi
  fi
  wait $pid
  status=$?
  sleep 0.5
  if pgrep -f -- "$work/$name" > /dev/null; then
    echo "FAIL: $name left processes: $(pgrep -af -- "$work/$name")"; fail=1
    pkill -9 -f -- "$work/$name"
  fi
}
report() { field "$work/$1.elastic/report.json" "$2"; }

# 1. dp 4 -> 3.
elastic dp4 4 12 2 --min-np 2 -- $(train dp4 30) --async-save
resumed_at=$(report dp4 "r['attempts'][1]['checkpoint_step_before']" 2> /dev/null)
if [ $status -ne 0 ] || [ "$(report dp4 "r['outcome']")" != finished ] ||
  [ "$(report dp4 "r['attempts'][0]['lost_ranks']")" != "[2]" ] ||
  [ "$(report dp4 "r['attempts'][1]['world']")" != 3 ] || [ -z "$resumed_at" ] || [ "$resumed_at" -lt 5 ]; then
  echo "FAIL: dp 4 losing rank 2: status $status"; tail -20 "$work/dp4.log"
  cat "$work/dp4.elastic/report.json" 2> /dev/null; fail=1
else
  echo "ok: dp 4 lost rank 2 and finished on 3 ranks from step $resumed_at"
  # The same resume by hand, uninterrupted: the curves after the resumed step must agree.
  "$MPIEXEC" -np 3 --oversubscribe -x OMP_NUM_THREADS=1 $(train ref 30) --dp 3 \
    --resume "$work/dp4/step-$(printf %08d "$resumed_at")" > "$work/ref.log" 2>&1 ||
    { echo "FAIL: the reference run: $(grep -v "^ *$" "$work/ref.log" | head -20)"; fail=1; }
  python3 - "$work/dp4.jsonl" "$work/ref.jsonl" "$resumed_at" << 'EOF' || fail=1
import json, sys
def losses(path):
    return {r["step"]: r["loss"] for r in map(json.loads, filter(str.strip, open(path)))}
elastic, ref, start = losses(sys.argv[1]), losses(sys.argv[2]), int(sys.argv[3])
steps = [s for s in sorted(ref) if s > start]
worst = max((abs(elastic[s] - ref[s]) / abs(ref[s]) for s in steps if s in elastic), default=1.0)
missing = [s for s in steps if s not in elastic]
if missing or not steps or worst > 1e-12:
    print(f"FAIL: the resumed curve: steps {steps[:3]}..{steps[-3:]}, missing {missing}, "
          f"worst relative difference {worst:.3g} (bound 1e-12)")
    sys.exit(1)
print(f"ok: steps {steps[0]}-{steps[-1]} equal the uninterrupted 3-rank run from step {start} "
      f"(worst relative difference {worst:.3g}, bound 1e-12)")
EOF
  saves=$(python3 -c "
import json, sys
print(sum('previous_checkpoint_s' in json.loads(l) for l in open(sys.argv[1]) if l.strip()))" "$work/dp4.jsonl")
  # Saves after steps 5 and 10 (the attempt that lost a rank), 20 and 25 (the relaunch): their
  # cost in the records of steps 6, 11, 21 and 26.
  [ "$saves" -ge 3 ] && grep -q "checkpoints: [0-9]* written" "$work/dp4.log" ||
    { echo "FAIL: the saves' cost is not reported ($saves records with previous_checkpoint_s)"; fail=1; }
fi
# No checkpoint left half-written: every one in the save directory loads, `latest` the last.
for ckpt in "$work"/dp4/step-*; do
  case $ckpt in *.tmp | *.zero-staging) continue ;; esac
  "$TOOLS/loom-eval" --checkpoint "$ckpt" --data "$work/data/val.bin" --seq-len 32 --batches 1 \
    > "$work/eval.log" 2>&1 || { echo "FAIL: $ckpt does not load: $(cat "$work/eval.log")"; fail=1; }
done
[ "$(cat "$work/dp4/latest" 2> /dev/null)" = step-00000030 ] ||
  { echo "FAIL: latest is '$(cat "$work/dp4/latest" 2> /dev/null)', not step-00000030"; fail=1; }

# 2. dp 2 x tp 2 -> 3 ranks: the planner's layout, the checkpoint resharded.
elastic tp2 4 8 1 --min-np 2 -- $(train tp2 20) --tp 2 --plan-profile h100-node --async-save
if [ $status -ne 0 ] || ! report tp2 "r['attempts'][1]['how']" | grep -q "plan auto chooses" ||
  [ "$(report tp2 "r['attempts'][1]['world']")" != 3 ]; then
  echo "FAIL: dp 2 x tp 2 losing a rank: status $status"; tail -20 "$work/tp2.log"; fail=1
else
  echo "ok: dp 2 x tp 2 lost rank 1; $(report tp2 "r['attempts'][1]['how']")"
fi

# 3. Giving up.
expect_gave_up() {
  local name=$1 want=$2
  if [ $status -ne 1 ] || ! report "$name" "r['reason']" | grep -qF -- "$want"; then
    echo "FAIL: $name: status $status, wanted 1 and '$want'"; tail -5 "$work/$name.log"; fail=1
  else echo "ok: $name gave up: $(report "$name" "r['reason']")"; fi
}
elastic minnp 2 6 1 --min-np 2 -- $(train minnp 1000)
expect_gave_up minnp "below --min-np 2"
elastic restarts 3 6 0 --max-restarts 0 -- $(train restarts 1000)
expect_gave_up restarts "--max-restarts 0 are spent"
elastic badflag 2 0 0 -- $(train badflag 10) --dp 3
expect_gave_up badflag "without losing a rank"
[ "$(report badflag "len(r['attempts'])")" = 1 ] || { echo "FAIL: badflag was restarted"; fail=1; }

# 5. --save-every-s: a save after every step whose interval has passed (a microsecond: every
# step), none before the end when it has not (an hour); each save's seconds in the next record.
for interval in 0.000001 3600; do
  "$TOOLS/loom-pretrain" --model gpt2 --preset gpt2-tiny --data "$work/data/train.bin" --steps 3 \
    --batch-size 4 --seq-len 32 --threads 1 --save-every-s $interval --keep-checkpoints 0 \
    --save-dir "$work/timed$interval" --metrics-out "$work/timed$interval.jsonl" \
    > "$work/timed.log" 2>&1 || { echo "FAIL: --save-every-s $interval: $(tail -3 "$work/timed.log")"; fail=1; }
  got=$(cd "$work/timed$interval" 2> /dev/null && ls -d step-* | tr '\n' ' ')
  timed=$(python3 -c "
import json, sys
print(sum('previous_checkpoint_s' in json.loads(l) for l in open(sys.argv[1]) if l.strip()))" "$work/timed$interval.jsonl")
  want="step-00000001 step-00000002 step-00000003 " records=2
  [ $interval = 3600 ] && want="step-00000003 " records=0
  if [ "$got" != "$want" ] || [ "$timed" != $records ]; then
    echo "FAIL: --save-every-s $interval saved '$got' ($timed records with previous_checkpoint_s), wanted '$want'"; fail=1
  else echo "ok: --save-every-s $interval saved $got"; fi
done

# 5b. A background write that fails (the disk full half-way through the third checkpoint,
# LOOM_TEST_WRITE_FAULT): the run stops at the next save with status 2 and the checkpoint named,
# `latest` still names the second one, which loads, and nothing half-written is left.
async_run() {  # async_run DIR STEPS: a 1-rank run saving every step in the background
  "$TOOLS/loom-pretrain" --model gpt2 --preset gpt2-tiny --data "$work/data/train.bin" --steps "$2" \
    --batch-size 4 --seq-len 32 --threads 1 --save-every 1 --keep-checkpoints 0 --async-save \
    --save-dir "$work/$1"
}
async_run probe 1 > /dev/null 2>&1
size=$(du -sb "$work/probe/step-00000001" | cut -f1)
out=$(LOOM_TEST_WRITE_FAULT=$((size * 5 / 2)) async_run faulty 6 2>&1)
status=$?
left=$(find "$work/faulty" -maxdepth 1 -name '*.tmp' -o -maxdepth 1 -name '*.zero-staging' | wc -l)
if [ $status -ne 2 ] || ! grep -qF "step-00000003' (written in the background)" <<< "$out" ||
  [ "$(cat "$work/faulty/latest" 2> /dev/null)" != step-00000002 ] || [ "$left" != 0 ] ||
  ! "$TOOLS/loom-eval" --checkpoint "$work/faulty" --data "$work/data/val.bin" --seq-len 32 \
    --batches 1 > /dev/null 2>&1; then
  echo "FAIL: a failed background write: status $status, latest '$(cat "$work/faulty/latest" 2> /dev/null)', $left leftovers: $(grep -i error <<< "$out" | head -3)"
  fail=1
else echo "ok: a failed background write: status 2, '$(grep -o "checkpoint '[^']*' (written in the background)" <<< "$out" | head -1)', step-00000002 still latest and loads"; fi

# 6. A preemption notice to the supervisor (SIGUSR1) reaches every rank through the launcher:
# they checkpoint and exit 75, and loom-elastic exits 75 without restarting.
"$TOOLS/loom-elastic" --np 2 "${launcher[@]}" -- $(train usr1 1000000) > "$work/usr1.log" 2>&1 &
pid=$!
for ((w = 0; w < 600; w++)); do
  [ "$(cat "$work/usr1.jsonl" 2> /dev/null | wc -l)" -ge 3 ] && break
  sleep 0.1
done
kill -USR1 $pid
wait $pid
status=$?
if [ $status -ne 75 ] || [ "$(report usr1 "r['outcome']")" != stopped ] ||
  [ "$(report usr1 "len(r['attempts'])")" != 1 ] || [ ! -f "$work/usr1/latest" ]; then
  echo "FAIL: SIGUSR1 to loom-elastic: status $status"; tail -5 "$work/usr1.log"; fail=1
else echo "ok: SIGUSR1 to loom-elastic: every rank checkpointed ($(cat "$work/usr1/latest")), status 75"; fi

# 4. Bad input.
refuse() {
  local want=$1
  shift
  out=$("$TOOLS/loom-elastic" "${launcher[@]}" "$@" 2>&1)
  local s=$?
  if [ $s -ne 2 ] || ! grep -qF -- "$want" <<< "$out"; then
    echo "FAIL: loom-elastic $* -> status $s, wanted 2 and '$want': $out"; fail=1
  else echo "ok: refused: $want"; fi
}
refuse "has no --save-dir" --np 2 -- "$TOOLS/loom-pretrain" --data "$work/data/train.bin"
refuse "--min-np 5 must be in [1, --np 4]" --np 4 --min-np 5 -- $(train bad 10)
refuse "--np is required" -- $(train bad 10)
printf 'tp = 2\n' > "$work/layout.toml"
refuse "--config file sets layout flags" --np 2 -- $(train bad 10) --config "$work/layout.toml"
exit $fail
