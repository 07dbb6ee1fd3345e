#!/usr/bin/env bash
# Runs a multi-rank command and passes only if it exits 0 (mpirun exits non-zero when any rank
# does) AND its output has at least COUNT distinct lines matching REGEX (one per rank where every
# rank reports, each naming its rank). A pass regex alone would let a failing rank through.
#   expect_ranks.sh COUNT REGEX -- command...
set -uo pipefail
count=$1
regex=$2
shift 2
[ "${1:-}" = "--" ] && shift
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$@" 2>&1 | tee "$out"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ]; then
  echo "FAIL: exit status $rc (a rank failed): $*" >&2
  exit 1
fi
lines=$(grep -E -e "$regex" "$out")
if [ $? -gt 1 ]; then
  echo "FAIL: could not count the lines matching '$regex' (grep failed)" >&2
  exit 1
fi
matched=$(printf '%s' "$lines" | sort -u | grep -c .)  # a rank that prints twice counts once
if [ "$matched" -lt "$count" ]; then
  echo "FAIL: $matched line(s) match '$regex', expected $count (one per reporting rank)" >&2
  exit 1
fi
echo "ok: exit 0 and $matched line(s) match '$regex'"
