#!/bin/sh
# pyt_ddp_tiny: MAD's torchrun convention, `$MAD_MULTI_NODE_RUNNER <script>`; the launcher contract gives the runner
# (torchrun with this job's nodes, rank, master address and port).
set -eu
: "${MAD_MULTI_NODE_RUNNER:?run with distributed.launcher torchrun}"
echo "rank ${NODE_RANK}/${NNODES} on $(hostname): $MAD_MULTI_NODE_RUNNER train_ddp.py $*"
exec $MAD_MULTI_NODE_RUNNER "$(dirname "$0")/train_ddp.py" "$@"
