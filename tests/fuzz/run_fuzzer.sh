#!/usr/bin/env bash
# Runs one libFuzzer target for a bounded time over its seed corpus (ctest label `fuzz`).
#   run_fuzzer.sh BINARY SEED_DIR WORK_DIR [SECONDS]
# Fails on any crash, sanitizer report, hang (> 10 s on one input), allocation of more than
# 512 MiB at once (a header that claims a terabyte must be refused, not attempted), or more
# than 2 GiB resident. New inputs the fuzzer finds go into WORK_DIR/corpus, never into the
# source tree; a failing input is left in WORK_DIR as crash-*/timeout-*/oom-* and printed.
# LOOM_FUZZ_SECONDS overrides SECONDS (run much longer by hand: docs/reliability.md).
set -uo pipefail
bin=$1 seeds=$2 work=$3
seconds=${LOOM_FUZZ_SECONDS:-${4:-30}}
mkdir -p "$work/corpus"
rm -f "$work"/crash-* "$work"/timeout-* "$work"/oom-* "$work"/leak-*
# One CPU per target: ctest runs two at a time on two cores.
TMPDIR="$work" "$bin" "$work/corpus" "$seeds" -max_total_time="$seconds" -timeout=10 \
  -malloc_limit_mb=512 -rss_limit_mb=2048 -artifact_prefix="$work/" -print_final_stats=1 \
  -close_fd_mask=1 2>&1 | tail -n 60
status=${PIPESTATUS[0]}
found=$(ls "$work"/crash-* "$work"/timeout-* "$work"/oom-* "$work"/leak-* 2> /dev/null)
if [ "$status" -ne 0 ] || [ -n "$found" ]; then
  echo "FAIL: $(basename "$bin") exited $status; failing inputs: ${found:-none written}"
  for f in $found; do echo "--- $f (base64)"; base64 "$f" | head -c 4000; echo; done
  exit 1
fi
echo "ok: $(basename "$bin") ran ${seconds} s with no finding ($(ls "$work/corpus" | wc -l) corpus files)"
