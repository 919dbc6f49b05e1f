#!/bin/sh
# dummy_multiple_results: the last rank writes a multiple-results CSV (one row per sub-benchmark).
. "$(dirname "$0")/common.sh"
if [ "$NODE_RANK" -eq "$LAST_RANK" ]; then
  {
    echo "model,performance,metric"
    echo "dummy_multiple_results_bs1,120.5,samples_per_second"
    echo "dummy_multiple_results_bs8,801.25,samples_per_second"
    echo "dummy_multiple_results_bs32,2950,samples_per_second"
  } > perf_dummy_multiple.csv
fi
echo "wrote results on rank $NODE_RANK"
