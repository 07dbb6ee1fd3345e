#!/usr/bin/env bash
# A strategy written outside loom's tree (examples/custom_strategy: local SGD) against the
# installed package: installs loom into a fresh prefix, builds the project with find_package(loom),
# then checks, in fp64 (docs/testing.md):
#  1. its registration survives a static library (LOOM_LINK_STRATEGY): --help lists local-sgd;
#  2. local-sgd:every=1 on 2 ranks equals plain data parallelism (loom-pretrain, 2 ranks);
#  3. local-sgd:every=4 on 2 ranks equals local SGD recomputed without the strategy
#     (reference.cpp), and differs from plain data parallelism (the strategy does something); so
#     does every=2 with DiLoCo's outer Nesterov step, whose state (the strategy's own checkpoint
#     tensors) a resume restores: the resumed run ends where the uninterrupted one does;
#  4. bad compositions and options fail with status 2 on every rank, naming what is wrong;
#  5. a communication hook of the user's own with an option (fp16_hook.cpp) trains like dp.
#   custom_strategy_test.sh BUILD_DIR SOURCE_DIR WORK_DIR   (MPIEXEC, TOOLS in the environment)
set -uo pipefail
build_dir=$1 src_dir=$2 work=$3
rm -rf "$work"
mkdir -p "$work"
fail=0
say() { echo "$@"; }
cmake --install "$build_dir" --prefix "$work/prefix" > "$work/install.log" || { say "FAIL: install"; exit 1; }
torch_prefix=$("$src_dir/.venv/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)')
launcher=()
command -v ccache > /dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
cmake -S "$src_dir/examples/custom_strategy" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix;$torch_prefix" "${launcher[@]}" > "$work/configure.log" \
  || { cat "$work/configure.log"; say "FAIL: configure"; exit 1; }
cmake --build "$work/build" -j 2 || { say "FAIL: build"; exit 1; }
custom=$work/build/custom-pretrain
reference=$work/build/local-sgd-reference

# 1. Registered from a static library.
# Captured first: grep -q exits at the match, and under pipefail the SIGPIPE of a help text
# longer than one stdout buffer would count as a failure.
help_text=$("$custom" --help)
if grep -q "Registered here: local-sgd" <<< "$help_text"; then say "ok: --help lists local-sgd"
else say "FAIL: custom-pretrain --help does not list local-sgd"; fail=1; fi

printf 'hello world, this is a small corpus for the loom tools. %.0s' {1..200} > "$work/a.txt"
"$TOOLS/loom-prepare" --input "$work/a.txt" --out-dir "$work/data" > /dev/null 2>&1 || { say "FAIL: prepare"; exit 1; }
base=(--data "$work/data/train.bin" --seq-len 16 --batch-size 4 --log-level warn --lr 3e-3
      --warmup-steps 1 --precision fp64)

# 2. every=1 is plain data parallelism.
"$MPIEXEC" -np 2 "$TOOLS/loom-pretrain" "${base[@]}" --steps 4 --save-dir "$work/dp4" \
  --metrics-out "$work/dp4.jsonl" || { say "FAIL: plain dp run"; fail=1; }
"$MPIEXEC" -np 2 "$custom" "${base[@]}" --steps 4 --save-dir "$work/lsgd1" \
  --metrics-out "$work/lsgd1.jsonl" --strategy local-sgd:every=1 || { say "FAIL: every=1 run"; fail=1; }
if out=$("$reference" compare "$work/lsgd1" "$work/dp4" 1e-9); then say "ok: every=1 equals dp: $out"
else say "FAIL: every=1 differs from plain data parallelism: $out"; fail=1; fi
if python3 - "$work/lsgd1.jsonl" "$work/dp4.jsonl" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
assert len(a) == len(b) == 4, (len(a), len(b))
for x, y in zip(a, b):
    for k in ("loss", "grad_norm"):
        assert abs(x[k] - y[k]) <= 1e-9 * abs(y[k]), (x["step"], k, x[k], y[k])
assert all(x["local_sgd_synchronous"] for x in a)
PY
then say "ok: every=1 losses and gradient norms equal dp's to 1e-9"
else say "FAIL: every=1 metrics differ from dp's"; fail=1; fi

# 3. every=4 against the reference, and not plain data parallelism.
"$MPIEXEC" -np 2 "$custom" "${base[@]}" --steps 8 --save-dir "$work/lsgd4" \
  --strategy local-sgd:every=4 || { say "FAIL: every=4 run"; fail=1; }
if out=$("$reference" replay "$work/lsgd4" 1e-9); then say "ok: every=4 equals the reference: $out"
else say "FAIL: every=4 differs from the reference: $out"; fail=1; fi
"$MPIEXEC" -np 2 "$TOOLS/loom-pretrain" "${base[@]}" --steps 8 --save-dir "$work/dp8" > /dev/null \
  || { say "FAIL: plain dp 8-step run"; fail=1; }
if out=$("$reference" compare "$work/lsgd4" "$work/dp8" 1e-6); then
  say "FAIL: every=4 trains exactly like plain dp (the strategy did nothing): $out"; fail=1
else say "ok: every=4 differs from plain dp: $out"; fi

# DiLoCo's outer step: against the reference, and resumed from its step-4 checkpoint.
outer=local-sgd:every=2,outer_lr=0.7,outer_momentum=0.9
"$MPIEXEC" -np 2 "$custom" "${base[@]}" --steps 6 --save-dir "$work/outer" --save-every 2 \
  --strategy "$outer" || { say "FAIL: outer-step run"; fail=1; }
if out=$("$reference" replay "$work/outer" 1e-9); then say "ok: the outer step equals the reference: $out"
else say "FAIL: the outer step differs from the reference: $out"; fail=1; fi
"$MPIEXEC" -np 2 "$custom" "${base[@]}" --steps 6 --save-dir "$work/plain2" \
  --strategy local-sgd:every=2 > /dev/null || { say "FAIL: every=2 run"; fail=1; }
if out=$("$reference" compare "$work/outer/step-00000006" "$work/plain2" 1e-6); then
  say "FAIL: the outer step changed nothing: $out"; fail=1
else say "ok: the outer step differs from plain averaging: $out"; fi
"$MPIEXEC" -np 2 "$custom" "${base[@]}" --steps 6 --save-dir "$work/outer_resumed" \
  --resume "$work/outer/step-00000004" --strategy "$outer" || { say "FAIL: outer-step resume"; fail=1; }
if out=$("$reference" compare "$work/outer_resumed/step-00000006" "$work/outer/step-00000006" 0); then
  say "ok: the resumed outer-step run ends where the uninterrupted one does: $out"
else say "FAIL: the resumed outer-step run differs: $out"; fail=1; fi

# The same from a TOML config file (keys are flag names; --strategy repeats as a list).
printf 'strategy = ["local-sgd:every=2"]\nsteps = 2\n' > "$work/run.toml"
"$MPIEXEC" -np 2 "$custom" "${base[@]}" --config "$work/run.toml" --metrics-out "$work/toml.jsonl" \
  || { say "FAIL: run from a TOML config"; fail=1; }
if python3 -c 'import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; assert [x["local_sgd_synchronous"] for x in r] == [False, True], r' "$work/toml.jsonl"
then say "ok: --strategy from a TOML config"; else say "FAIL: the TOML config's strategy did not run"; fail=1; fi

# 4. Refusals: status 2 on every rank, the message naming the strategies or the option.
expect_refusal() {  # WANT, then the command
  local want=$1; shift
  local out status
  out=$("$@" 2>&1); status=$?
  if [ $status -ne 2 ] || ! grep -qF -- "$want" <<< "$out"; then
    say "FAIL: expected status 2 and '$want', got $status: $out"; fail=1
  else say "ok: refused: $(grep -m1 -F -- "$want" <<< "$out")"; fi
}
expect_refusal "strategies 'zero' and 'local-sgd' both synchronize gradients" \
  "$MPIEXEC" -np 2 "$custom" "${base[@]}" --steps 2 --zero 1 --strategy local-sgd:every=2
expect_refusal "'nope' is not a registered strategy; registered: local-sgd (the program" \
  "$custom" "${base[@]}" --steps 2 --strategy nope
expect_refusal "'local-sgd' has no option 'evry'; its options: every" \
  "$custom" "${base[@]}" --steps 2 --strategy local-sgd:evry=2
expect_refusal "--save-every 3 and --steps 6 must be multiples of 4" \
  "$MPIEXEC" -np 2 "$custom" "${base[@]}" --steps 6 --save-every 3 --save-dir "$work/bad" \
  --strategy local-sgd:every=4
expect_refusal "'zero' is built in and turned on by --zero 1|2|3, not by --strategy" \
  "$custom" "${base[@]}" --steps 2 --strategy zero

# 5. A communication hook of the user's own (fp16_hook.cpp), with an option: it trains like plain
# data parallelism within fp16's rounding of the averaged gradients, and a bad option is refused.
"$MPIEXEC" -np 2 "$custom" "${base[@]}" --steps 4 --comm-hook fp16:prescale=true \
  --metrics-out "$work/fp16.jsonl" || { say "FAIL: --comm-hook fp16 run"; fail=1; }
if python3 - "$work/fp16.jsonl" "$work/dp4.jsonl" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
assert len(a) == len(b) == 4, (len(a), len(b))
# The first step's gradients are the same; fp16 keeps 11 bits of the average (2^-11 relative), and
# the loss after three updates of lr 3e-3 moves far less than 1e-2 relative for it.
for x, y in zip(a, b):
    assert abs(x["loss"] - y["loss"]) <= 1e-2 * abs(y["loss"]), (x["step"], x["loss"], y["loss"])
assert a[0]["grad_norm"] != b[0]["grad_norm"], "the fp16 hook did not run"
assert abs(a[0]["grad_norm"] - b[0]["grad_norm"]) <= 2e-3 * b[0]["grad_norm"]
assert abs(a[-1]["compression_ratio"] - 2.0) < 1e-9, a[-1]["compression_ratio"]
PY
then say "ok: --comm-hook fp16 (a user's hook) trains like dp, half the gradient bytes"
else say "FAIL: --comm-hook fp16 metrics"; fail=1; fi
expect_refusal "'fp16' has no option 'scale'; its options: prescale" \
  "$custom" "${base[@]}" --steps 2 --comm-hook fp16:scale=2
exit $fail
