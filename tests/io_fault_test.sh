#!/usr/bin/env bash
# I/O faults around checkpoints (docs/reliability.md). Whatever fails, the previous checkpoint
# stays loadable, `latest` names it, and the failed save leaves no partial files behind:
#  1. a write failure injected at points across one save (LOOM_TEST_WRITE_FAULT: the model file,
#     the optimizer file, the tokenizer files, state.json), as ENOSPC and as EROFS;
#  2. a real full disk: a tmpfs with room for one checkpoint but not two (when this machine lets
#     the test mount one; said and skipped otherwise);
#  3. a checkpoint damaged after it was written: truncated, one bit flipped, a file missing,
#     `latest` naming a missing or an outside directory -> a clear error (status 2), no crash;
#  4. 4 ranks as dp 2 x tp 2 with ZeRO-1: one rank's shard write fails -> every rank exits
#     non-zero, the earlier checkpoint intact, no staging left; a missing tp shard is named.
# Needs TOOLS (loom-pretrain, loom-prepare, loom-eval) and MPIEXEC.
set -uo pipefail
work=$(mktemp -d)
mounted=""
trap '[ -n "$mounted" ] && umount "$mounted"; rm -rf "$work"' EXIT
fail=0

printf 'a corpus for the I/O fault test, long enough for a few steps of training. %.0s' {1..200} > "$work/a.txt"
"$TOOLS/loom-prepare" --input "$work/a.txt" --out-dir "$work/data" > /dev/null 2>&1 || { echo "prepare failed"; exit 1; }
train=("$TOOLS/loom-pretrain" --model llama --preset llama-tiny --data "$work/data/train.bin"
  --batch-size 4 --seq-len 32 --threads 1 --log-level warn --save-every 1 --lr-decay-steps 100)

# intact DIR STEP: `latest` names step-STEP, nothing half-written is left, and it loads.
intact() {
  local dir=$1 step=$2 what=$3 want
  want=$(printf 'step-%08d' "$step")
  if [ "$(cat "$dir/latest" 2> /dev/null)" != "$want" ]; then
    echo "FAIL: $what: latest is '$(cat "$dir/latest" 2> /dev/null)', wanted $want"; fail=1; return
  fi
  local leftovers
  leftovers=$(find "$dir" -name '*.tmp' -o -name '*.zero-staging' -o -name '*.old' | head -3)
  if [ -n "$leftovers" ]; then echo "FAIL: $what: left behind $leftovers"; fail=1; fi
  if ! "$TOOLS/loom-eval" --checkpoint "$dir" --data "$work/data/val.bin" --seq-len 32 \
    --batches 1 > /dev/null 2>&1; then
    echo "FAIL: $what: $want does not load"; fail=1
  fi
}
# expect_fail STATUS TEXT LOG what: the command behind it exited STATUS (any non-zero: '!0') and
# its output names TEXT.
expect_fail() {
  local want=$1 text=$2 log=$3 what=$4 status=$5
  if { [ "$want" = '!0' ] && [ "$status" -eq 0 ]; } || { [ "$want" != '!0' ] && [ "$status" -ne "$want" ]; } ||
    ! grep -qF -- "$text" "$log"; then
    echo "FAIL: $what: status $status (wanted $want) and '$text' in:"; tail -5 "$log"; fail=1
  else
    echo "ok: $what -> status $status, '$text'"
  fi
}

# --- 1. injected write failures across one save -------------------------------------------------
"${train[@]}" --steps 2 --save-dir "$work/save" > "$work/first.log" 2>&1 ||
  { echo "FAIL: first run"; cat "$work/first.log"; exit 1; }
ck="$work/save/step-00000002"
m=$(stat -c %s "$ck/model.safetensors")
o=$(stat -c %s "$ck/optimizer.safetensors")
s=$(stat -c %s "$ck/state.json")
extras=0
for f in "$ck"/*; do
  case $(basename "$f") in model.safetensors | optimizer.safetensors | state.json) ;;
    *) extras=$((extras + $(stat -c %s "$f"))) ;; esac
done
# Byte budgets that stop the next save in each of its files (the file in the label).
points=("0 model-header" "$((m / 2)) model" "$((m + o / 2)) optimizer"
  "$((m + o + extras / 2)) tokenizer-files" "$((m + o + extras + s / 2)) state.json"
  "$((m + o + extras + s + 8)) state.json-or-latest")
for point in "${points[@]}"; do
  set -- $point
  LOOM_TEST_WRITE_FAULT=$1 "${train[@]}" --steps 3 --resume "$work/save" --save-dir "$work/save" \
    > "$work/fault.log" 2>&1
  expect_fail 2 "No space left on device" "$work/fault.log" "ENOSPC during $2 (byte $1)" $?
  grep -o "writing [^ ]* failed" "$work/fault.log" | head -1
  if [ "$2" = state.json-or-latest ]; then
    # Where the resumed run's state.json outgrows step 2's, this falls in state.json; else in
    # `latest`, leaving a complete step-3 that `latest` does not name. Either way step 2 stays.
    intact "$work/save" 2 "ENOSPC during $2"
    rm -rf "$work/save/step-00000003"
  else
    intact "$work/save" 2 "ENOSPC during $2"
    [ -e "$work/save/step-00000003" ] && { echo "FAIL: $2: a step-3 directory exists"; fail=1; }
  fi
done
LOOM_TEST_WRITE_FAULT=$((m + 10)):EROFS "${train[@]}" --steps 3 --resume "$work/save" \
  --save-dir "$work/save" > "$work/fault.log" 2>&1
expect_fail 2 "Read-only file system" "$work/fault.log" "EROFS during optimizer" $?
intact "$work/save" 2 "EROFS"
LOOM_TEST_WRITE_FAULT=lots "${train[@]}" --steps 3 --save-dir "$work/bad" > "$work/fault.log" 2>&1
expect_fail 2 "LOOM_TEST_WRITE_FAULT='lots' is not BYTES" "$work/fault.log" "malformed switch" $?
# A save that succeeds after a failed one: the same step, no leftovers in the way.
"${train[@]}" --steps 3 --resume "$work/save" --save-dir "$work/save" > "$work/ok.log" 2>&1 ||
  { echo "FAIL: save after failures"; cat "$work/ok.log"; fail=1; }
intact "$work/save" 3 "a save after the failed ones"

# --- 2. a real full disk ------------------------------------------------------------------------
mnt="$work/tmpfs"
mkdir -p "$mnt"
room=$(((m + o + extras + s) * 3 / 2 + 65536))
if mount -t tmpfs -o size=$room tmpfs "$mnt" 2> /dev/null; then
  mounted=$mnt
  "${train[@]}" --steps 4 --save-dir "$mnt/save" > "$work/full.log" 2>&1
  expect_fail 2 "No space left on device" "$work/full.log" "tmpfs of $room bytes fills at the 2nd save" $?
  intact "$mnt/save" 1 "tmpfs full"
  umount "$mnt" && mounted=""
else
  echo "skip: cannot mount a tmpfs here (not root, or no CAP_SYS_ADMIN); the injected faults above stand in"
fi

# --- 3. a checkpoint damaged after writing -------------------------------------------------------
damaged() {  # damaged TEXT what: loom-eval and a resume both refuse with TEXT, status 2
  local text=$1 what=$2
  "$TOOLS/loom-eval" --checkpoint "$work/dmg" --data "$work/data/val.bin" --seq-len 32 \
    --batches 1 > "$work/dmg.log" 2>&1
  expect_fail 2 "$text" "$work/dmg.log" "loom-eval on $what" $?
  "${train[@]}" --steps 4 --resume "$work/dmg" --save-dir "$work/dmg-out" > "$work/dmg.log" 2>&1
  expect_fail 2 "$text" "$work/dmg.log" "resume from $what" $?
}
fresh() { rm -rf "$work/dmg"; cp -r "$work/save" "$work/dmg"; d="$work/dmg/step-00000003"; }
fresh; truncate -s $((m - 100)) "$d/model.safetensors"
damaged "is corrupt: CRC-32" "a truncated model file"
fresh; python3 -c "
import sys
p = sys.argv[1]; b = bytearray(open(p, 'rb').read()); b[len(b) // 2] ^= 0x10; open(p, 'wb').write(b)" "$d/optimizer.safetensors"
damaged "is corrupt: CRC-32" "one flipped bit"
fresh; rm "$d/optimizer.safetensors"
damaged "'optimizer.safetensors' is missing" "a missing optimizer file"
fresh; echo "step-00000009" > "$work/dmg/latest"
damaged "step-00000009" "latest naming a missing checkpoint"
fresh; echo "../save/step-00000003" > "$work/dmg/latest"
damaged "not a checkpoint of this directory" "latest naming a directory elsewhere"
fresh; echo '{"format_version": 1, "step": "three"' > "$d/state.json"
damaged "state.json is not valid JSON" "a cut state.json"

# --- 4. dp 2 x tp 2, ZeRO-1 ----------------------------------------------------------------------
mpi=("$MPIEXEC" -n 4 "${train[@]}" --dp 2 --tp 2 --zero 1)
"${mpi[@]}" --steps 2 --save-dir "$work/mr" > "$work/mr.log" 2>&1 ||
  { echo "FAIL: dp2 x tp2 run"; tail -20 "$work/mr.log"; fail=1; }
# Rank 1 alone cannot write its ZeRO shard (its first write of the next save).
LOOM_TEST_WRITE_FAULT=0:ENOSPC:1 "${mpi[@]}" --steps 3 --resume "$work/mr" --save-dir "$work/mr" \
  > "$work/mr-fault.log" 2>&1
expect_fail '!0' "No space left on device" "$work/mr-fault.log" "dp2 x tp2: rank 1's shard write fails" $?
intact "$work/mr" 2 "dp2 x tp2 after rank 1's failed write"
rm -rf "$work/dmg" && cp -r "$work/mr" "$work/dmg"
shard=$(ls "$work/dmg/step-00000002"/model-*tp001.safetensors 2> /dev/null | head -1)
if [ -n "$shard" ]; then
  rm "$shard"
  "$TOOLS/loom-eval" --checkpoint "$work/dmg" --data "$work/data/val.bin" --seq-len 32 \
    --batches 1 > "$work/dmg.log" 2>&1
  status=$?  # before the substitution below, which resets $?
  expect_fail 2 "$(basename "$shard")' is missing" "$work/dmg.log" "a missing tp shard" $status
else
  echo "FAIL: the dp2 x tp2 checkpoint has no tp1 model shard: $(ls "$work/dmg/step-00000002")"; fail=1
fi

[ $fail -eq 0 ] && echo "io faults: all passed"
exit $fail
