# Shared by the sample models: who am I in the multi-node run.
: "${NODE_RANK:?NODE_RANK is not set}" "${NNODES:?NNODES is not set}" "${MASTER_ADDR:?MASTER_ADDR is not set}"
LAST_RANK=$((NNODES - 1))
echo "rank ${NODE_RANK}/${NNODES} on $(hostname), master ${MASTER_ADDR}:${MASTER_PORT:-?}, args: $*"
