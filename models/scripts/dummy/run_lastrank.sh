#!/bin/sh
# dummy_lastrank: like Primus/Megatron, only the last global rank prints the throughput.
. "$(dirname "$0")/common.sh"
sleep 1
if [ "$NODE_RANK" -eq "$LAST_RANK" ]; then
  echo "iteration 10/10 | elapsed 1.0 s | throughput on $(hostname)"
  echo "performance: 1.0123e+04 tokens/sec"
fi
