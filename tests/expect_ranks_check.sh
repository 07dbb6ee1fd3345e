#!/usr/bin/env bash
# Checks expect_ranks.sh itself: it must fail when one rank exits non-zero although every rank
# printed its line, and when a rank's line is missing although every rank exited 0; and pass
# when both hold.   expect_ranks_check.sh MPIEXEC
set -u
mpiexec=$1
here=$(dirname "$0")
check=("$here/expect_ranks.sh" 2 '^rank [01] ok' -- "$mpiexec" -np 2 sh -c)
# The rank number comes from the launcher's environment (Open MPI, else MPICH/PMI).
fail=0
if "${check[@]}" 'echo rank ${OMPI_COMM_WORLD_RANK:-$PMI_RANK} ok; exit ${OMPI_COMM_WORLD_RANK:-$PMI_RANK}' > /dev/null 2>&1; then
  echo "FAIL: passed although rank 1 exited 1"; fail=1
fi
if "${check[@]}" '[ "${OMPI_COMM_WORLD_RANK:-$PMI_RANK}" = 0 ] && echo rank 0 ok; exit 0' > /dev/null 2>&1; then
  echo "FAIL: passed although rank 1 printed nothing"; fail=1
fi
if "${check[@]}" '[ "${OMPI_COMM_WORLD_RANK:-$PMI_RANK}" = 0 ] && echo rank 0 ok && echo rank 0 ok; exit 0' \
  > /dev/null 2>&1; then
  echo "FAIL: passed although rank 0 printed twice and rank 1 nothing"; fail=1
fi
if ! "${check[@]}" 'echo rank ${OMPI_COMM_WORLD_RANK:-$PMI_RANK} ok' > /dev/null 2>&1; then
  echo "FAIL: failed although both ranks exited 0 and printed their line"; fail=1
fi
[ $fail = 0 ] && echo "ok: expect_ranks.sh fails on a failing or silent rank, passes otherwise"
exit $fail
