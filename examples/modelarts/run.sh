#!/bin/bash
# Tandem's version of ModelArts' torchlaunch.sh: one `tandem launch` agent per node (ModelArts
# runs this script once on every node of the training job), as torch.distributed.launch was.
#
#   bash run.sh                           # ResNet-18 on CIFAR-10 as in the tutorial
#   bash run.sh --data synthetic ...      # any `tandem train` flags instead of the defaults
#
# ModelArts sets VC_WORKER_HOSTS (the nodes' host names, comma-separated, node 0 first),
# MA_NUM_HOSTS (nodes), VC_TASK_INDEX (this node) and MA_NUM_GPUS (GPUs per node, 0 on CPU
# flavours). Set in the job's environment:
#   TANDEM_JOB_TOKEN   the secret every node's store client must prove (required on >1 node)
# and optionally:
#   MASTER_PORT        the store's port on node 0 (default 6060, as the tutorial's)
#   NPROC_PER_NODE     workers per node (default MA_NUM_GPUS, or `auto` when it is 0)
#   TANDEM             the tandem binary (default: tandem on PATH, else next to this script)
#   MA_JOB_DIR         where the code was placed (ModelArts sets it); data and runs go below
set -euo pipefail

fail() {
    echo "run.sh: $*" >&2
    exit 2
}

[ -n "${VC_WORKER_HOSTS:-}" ] || fail "VC_WORKER_HOSTS is not set: run this script as a ModelArts training job's start command"
[ -n "${MA_NUM_HOSTS:-}" ] || fail "MA_NUM_HOSTS is not set"
[ -n "${VC_TASK_INDEX:-}" ] || fail "VC_TASK_INDEX is not set"

MASTER_ADDR="${VC_WORKER_HOSTS%%,*}"
MASTER_PORT="${MASTER_PORT:-6060}"
NNODES="$MA_NUM_HOSTS"
NODE_RANK="$VC_TASK_INDEX"
if [ -z "${NPROC_PER_NODE:-}" ]; then
    if [ "${MA_NUM_GPUS:-0}" -gt 0 ]; then
        NPROC_PER_NODE="$MA_NUM_GPUS"
    else
        NPROC_PER_NODE=auto
    fi
fi
if [ "$NNODES" -gt 1 ] && [ -z "${TANDEM_JOB_TOKEN:-}" ]; then
    fail "a job of $NNODES nodes needs TANDEM_JOB_TOKEN, the same secret on every node: set it in the training job's environment variables"
fi
if [ -z "${TANDEM:-}" ]; then
    if command -v tandem >/dev/null; then
        TANDEM=tandem
    else
        TANDEM="$(dirname "$0")/tandem"
    fi
fi

JOB_DIR="${MA_JOB_DIR:-.}"
if [ "$#" -eq 0 ]; then
    # The tutorial's training: ResNet-18, Adam at its learning rate times the processes,
    # 128 images per process, CIFAR-10's python version in input_dir.
    set -- --model resnet18 --data cifar10-py --data-dir "$JOB_DIR/input_dir" \
        --optimizer adam --lr 0.01 --scale-lr --batch-size 128 --epochs 100 \
        --output-dir "$JOB_DIR/output_dir"
fi

CMD=("$TANDEM" launch
    --nnodes "$NNODES"
    --node-rank "$NODE_RANK"
    --nproc-per-node "$NPROC_PER_NODE"
    --master-addr "$MASTER_ADDR"
    --master-port "$MASTER_PORT"
    -- train "$@")
echo "${CMD[*]}"
exec "${CMD[@]}"
