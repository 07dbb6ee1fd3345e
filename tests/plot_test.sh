#!/usr/bin/env bash
# scripts/plot: two metrics files whose runs differ in --comm-hook are labelled by that flag alone
# (not by where they wrote their metrics), --label overrides, the figure is a PNG, and bad input
# (a missing file, a file without a loss record, a line that is not JSON, an unknown format, a
# --label count that does not match) exits with 2 and a message naming it.
set -uo pipefail
: "${LOOM_SOURCE_DIR:?}"
plot="$LOOM_SOURCE_DIR/scripts/plot"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail=0

# A metrics file as loom-pretrain writes it: a record per step, the run's flags in the first,
# a validation loss every 10 steps.
write_run() {  # FILE HOOK
  "$LOOM_SOURCE_DIR/.venv/bin/python" - "$1" "$2" <<'PYEOF'
import json, math, sys
path, hook = sys.argv[1], sys.argv[2]
with open(path, "w") as f:
    for step in range(1, 31):
        r = {"step": step, "loss": 3 + 2 * math.exp(-step / 8), "grad_norm": 1 / step,
             "tokens_per_s": 1000 + step, "memory": {"peak_bytes": 2**20 * (10 + step)}}
        if step == 1:
            r["run"] = {"flags": {"model": "gpt2", "comm_hook": hook, "lr": 0.003,
                                  "metrics_out": path, "prune": {"to": 0.0}},
                        "world_size": 4, "dp": 4}
        if step % 10 == 0:
            r["val_loss"] = r["loss"] + 0.1
        f.write(json.dumps(r) + "\n")
PYEOF
}
is_png() { [ "$(head -c 8 "$1" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ]; }

write_run "$work/a.jsonl" avg
write_run "$work/b.jsonl" int8
if ! "$plot" "$work/a.jsonl" "$work/b.jsonl" --out "$work/out/two.png" > "$work/log" 2>&1; then
  echo "FAIL: two runs"; cat "$work/log"; fail=1
fi
grep -q "a.jsonl: '--comm-hook avg', steps 1-30" "$work/log" &&
  grep -q "b.jsonl: '--comm-hook int8', steps 1-30" "$work/log" ||
  { echo "FAIL: labels are not the differing flag"; cat "$work/log"; fail=1; }
is_png "$work/out/two.png" || { echo "FAIL: two.png is not a PNG"; fail=1; }
"$plot" "$work/a.jsonl" "$work/b.jsonl" --label plain --label quantized --out "$work/l.svg" \
  > "$work/log" 2>&1 && grep -q "'quantized'" "$work/log" && grep -q "<svg" "$work/l.svg" ||
  { echo "FAIL: --label"; cat "$work/log"; fail=1; }

expect_error() {  # MESSAGE ARGS...
  local message=$1
  shift
  "$plot" "$@" > "$work/log" 2>&1
  local rc=$?
  if [ "$rc" -ne 2 ] || ! grep -qF -- "$message" "$work/log"; then
    echo "FAIL: scripts/plot $* exited $rc, wanted 2 and: $message"; cat "$work/log"; fail=1
  fi
}
expect_error "metrics file '$work/none.jsonl' does not exist" "$work/none.jsonl" --out "$work/x.png"
echo '{"step": 1, "val_loss": 2.0}' > "$work/val_only.jsonl"
expect_error "holds no training-loss record" "$work/val_only.jsonl" --out "$work/x.png"
{ head -n 3 "$work/a.jsonl"; echo '{"step": 4, "loss": '; } > "$work/cut.jsonl"
expect_error "cut.jsonl:4: not a JSON record" "$work/cut.jsonl" --out "$work/x.png"
expect_error "the extension '.jpg' is not one of .png, .pdf, .svg" "$work/a.jsonl" --out "$work/x.jpg"
expect_error "--label given 1 times for 2 metrics files" "$work/a.jsonl" "$work/b.jsonl" \
  --label one --out "$work/x.png"
[ ! -e "$work/x.png" ] || { echo "FAIL: a figure was written despite bad input"; fail=1; }

[ "$fail" -eq 0 ] && echo "plot_test: ok"
exit "$fail"
