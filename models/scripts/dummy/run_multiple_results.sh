#!/bin/sh
# dummy_multiple_results: the last rank writes a multiple-results CSV (one row per sub-benchmark; MAD names
# each row <model>_<row model>).
. "$(dirname "$0")/common.sh"
if [ "$NODE_RANK" -eq "$LAST_RANK" ]; then
  {
    echo "model,performance,metric"
    echo "bs1,120.5,samples_per_second"
    echo "bs8,801.25,samples_per_second"
    echo "bs32,2950,samples_per_second"
  } > perf_dummy_multiple.csv
fi
echo "wrote results on rank $NODE_RANK"
