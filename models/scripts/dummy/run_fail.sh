#!/bin/sh
# dummy_fail: rank 1 (or rank 0 on one node) crashes; the others would wait in a collective for a long time.
. "$(dirname "$0")/common.sh"
FAIL_RANK=$((NNODES > 1 ? 1 : 0))
if [ "$NODE_RANK" -eq "$FAIL_RANK" ]; then
  sleep 2
  echo "RuntimeError: simulated NCCL failure on rank $NODE_RANK" >&2
  exit 3
fi
sleep 600
echo "performance: 1 samples_per_second"
