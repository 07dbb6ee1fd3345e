#!/usr/bin/env bash
# loom-pretrain --plan auto (docs/planner.md):
#  1. on a built-in profile, 2 ranks train with the layout loom-plan ranks first for the same
#     model, batch and world, and rank 0 logs it and why;
#  2. a layout flag given with it is kept (--tp 2), and the choice is the best with it; a flag
#     that needs some layouts (--offload-optimizer: ZeRO) narrows the choice to them;
#  3. flags no fitting layout has (--tp 3), a bad --plan, --plan auto with a --resume that names
#     no checkpoint or with an unknown profile: status 2 on every rank and a message naming the
#     value; --plan auto with --resume plans for the checkpoint's model and resumes it, resharded
#     from 1 rank to the 2-rank layout chosen (what loom-elastic relies on);
#  4. the default profile: every rank measures the machine first (1 rank here).
# Needs TOOLS (loom-pretrain, loom-plan, loom-prepare) and MPIEXEC.
set -uo pipefail
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail=0
say() { echo "$@"; }

printf 'a corpus for the planner test, long enough for a few steps of training. %.0s' {1..300} > "$work/a.txt"
"$TOOLS/loom-prepare" --input "$work/a.txt" --out-dir "$work/data" > /dev/null 2>&1 || { echo "prepare failed"; exit 1; }
shape=(--model gpt2 --preset gpt2-tiny --seq-len 32 --batch-size 8 --precision fp32)
train=("$TOOLS/loom-pretrain" "${shape[@]}" --data "$work/data/train.bin" --steps 2 --threads 1
       --log-every 1)

# The planner's best layout for (world, extra loom-plan args) as "dp tp pp cp zero micro schedule
# virtual_stages checkpointing sp", the way the metrics file's flags will say it.
best_of() {
  local world=$1; shift
  "$TOOLS/loom-plan" "${shape[@]}" --vocab-size 256 --world "$world" --json --top 1000 "$@" |
    python3 -c "
import json, sys
want = dict(a.split('=') for a in sys.argv[1:])
for p in json.load(sys.stdin):
    if all(str(p[k]) == v for k, v in want.items()):
        s = p['schedule'] if p['pp'] > 1 else '1f1b'
        print(p['dp'], p['tp'], p['pp'], p['cp'], p['zero'], p['micro_batches'], s,
              p['virtual_stages'], p['checkpointing'], p['sequence_parallel'])
        break" "${CONSTRAINT[@]}"
}
# The layout a run trained with, from its metrics file.
used() { python3 -c "
import json, sys
f = json.loads(open(sys.argv[1]).readline())['run']['flags']
print(f['dp'], f['tp'], f['pp'], f['cp'], f['zero'], f['grad_accum'], f['schedule'],
      f['virtual_stages'], f['activation_checkpointing'], f['sequence_parallel'])" "$1"; }

# 1-2. The planner's first choice, then its first with tp 2.
for case in "none" "tp"; do
  if [ "$case" = none ]; then CONSTRAINT=(); extra=(); else CONSTRAINT=(tp=2); extra=(--tp 2); fi
  want=$(best_of 2 --profile h100-node)
  out=$("$MPIEXEC" -np 2 "${train[@]}" --plan auto --plan-profile h100-node "${extra[@]}" \
    --metrics-out "$work/m-$case.jsonl" 2>&1)
  status=$?
  got=$([ -f "$work/m-$case.jsonl" ] && used "$work/m-$case.jsonl")
  if [ $status -ne 0 ] || [ -z "$want" ] || [ "$got" != "$want" ]; then
    say "FAIL: --plan auto (${extra[*]:-no flags}): status $status, trained '$got', planner's best '$want'"
    say "$out"; fail=1
  elif ! grep -qF -- "--plan auto on profile 'h100-node'" <<< "$out" || ! grep -qF "chose dp" <<< "$out" \
      || ! grep -qF "predicted" <<< "$out"; then
    say "FAIL: --plan auto (${extra[*]:-no flags}) did not log its choice and why: $out"; fail=1
  elif [ "$case" = tp ] && ! grep -qF "of them with tp 2" <<< "$out"; then
    say "FAIL: --plan auto --tp 2 did not say it kept tp 2: $out"; fail=1
  else
    say "ok: --plan auto ${extra[*]:-} trained as '$got' (the planner's best)"
  fi
done

# 2b. Flags that only go with some layouts narrow the choice: --offload-optimizer needs ZeRO.
out=$("$MPIEXEC" -np 2 "${train[@]}" --plan auto --plan-profile h100-node --offload-optimizer \
  --metrics-out "$work/m-offload.jsonl" 2>&1)
status=$?
zero=$([ -f "$work/m-offload.jsonl" ] && used "$work/m-offload.jsonl" | cut -d' ' -f5)
if [ $status -ne 0 ] || [ -z "$zero" ] || [ "$zero" -lt 1 ]; then
  say "FAIL: --plan auto --offload-optimizer: status $status, ZeRO stage '$zero'"; say "$out"; fail=1
else say "ok: --plan auto --offload-optimizer chose ZeRO-$zero"; fi

# 3. Refusals: status 2 from every rank, the value named.
refuse() {
  local np=$1 want=$2; shift 2
  out=$("$MPIEXEC" -np "$np" "${train[@]}" "$@" 2>&1)
  status=$?
  if [ $status -ne 2 ] || ! grep -qF -- "$want" <<< "$out"; then
    say "FAIL: $* -> status $status, wanted 2 and '$want': $out"; fail=1
  else say "ok: $* refused: $want"; fi
}
refuse 2 "none has tp 3" --plan auto --plan-profile h100-node --tp 3
refuse 1 "--plan 'sometimes' is not valid: none" --plan sometimes
refuse 1 "$work/nowhere" --plan auto --resume "$work/nowhere"

# 3b. A checkpoint written by 1 rank, resumed by 2 with the layout --plan auto picks.
"${train[@]}" --lr-decay-steps 4 --save-dir "$work/one" > "$work/one.log" 2>&1 || { say "FAIL: the 1-rank run: $(cat "$work/one.log")"; fail=1; }
four=("${train[@]}")
for i in "${!four[@]}"; do [ "${four[$i]}" = --steps ] && four[$((i + 1))]=4; done
out=$("$MPIEXEC" -np 2 "${four[@]}" --lr-decay-steps 4 --plan auto --plan-profile h100-node \
  --resume "$work/one" --metrics-out "$work/m-resumed.jsonl" 2>&1)
status=$?
steps=$([ -f "$work/m-resumed.jsonl" ] && python3 -c "
import json, sys
print(' '.join(str(json.loads(l)['step']) for l in open(sys.argv[1]) if l.strip()))" "$work/m-resumed.jsonl")
if [ $status -ne 0 ] || [ "$steps" != "3 4" ] || ! grep -qF -- "--plan auto on profile 'h100-node'" <<< "$out"; then
  say "FAIL: --plan auto --resume: status $status, steps '$steps': $out"; fail=1
else say "ok: --plan auto --resume planned and resumed steps 3-4 at 2 ranks"; fi
refuse 1 "machine profile 'tpu-pod' is neither a file nor built in" --plan auto --plan-profile tpu-pod

# 4. Measured at start-up.
out=$("$MPIEXEC" -np 1 "${train[@]}" --plan auto 2>&1)
status=$?
if [ $status -ne 0 ] || ! grep -qF -- "--plan auto on profile 'measured'" <<< "$out"; then
  say "FAIL: --plan auto measuring the machine: status $status: $out"; fail=1
else say "ok: --plan auto measured the machine and trained"; fi

exit $fail
