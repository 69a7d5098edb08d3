#!/usr/bin/env bash
# torchrun wrapper for train/main.py on one node or many.
#
#   launch/run_train.sh recipe=nosa_1b_cpt data.paths=[/data/cpt] data.tokenizer=/data/tok
#   NNODES=4 NODE_RANK=$i MASTER_ADDR=host0 launch/run_train.sh recipe=nosa_8b_cpt ...
#
# Environment (all optional): NPROC_PER_NODE (default: number of visible GPUs, else 1), NNODES (1),
# NODE_RANK (0), MASTER_ADDR (127.0.0.1), MASTER_PORT (29500), RUN_ID (default: a timestamp, shared
# by all nodes when set by the scheduler), RUN_ROOT (runs). The run directory is
# $RUN_ROOT/<recipe>-$RUN_ID unless the arguments set run.dir. Arguments are Hydra overrides.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
# shellcheck source=env/nccl.sh
source "$here/env/nccl.sh"

recipe=default
for a in "$@"; do case "$a" in recipe=*) recipe="${a#recipe=}";; esac; done
has_dir=0
for a in "$@"; do case "$a" in run.dir=*) has_dir=1;; esac; done

export RUN_ID="${RUN_ID:-$(date +%Y%m%d-%H%M%S)}"
extra=()
[ "$has_dir" = 1 ] || extra+=("run.dir=${RUN_ROOT:-runs}/${recipe}-${RUN_ID}")

if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=$(python3 -c 'import torch; print(max(1, torch.cuda.device_count()))' 2>/dev/null || echo 1)
fi
py="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$py" ] || py=python3

exec "$py" -m torch.distributed.run \
  --nnodes="${NNODES:-1}" --node_rank="${NODE_RANK:-0}" --nproc_per_node="$NPROC_PER_NODE" \
  --rdzv_backend=c10d --rdzv_endpoint="${MASTER_ADDR:-127.0.0.1}:${MASTER_PORT:-29500}" \
  --rdzv_id="$RUN_ID" \
  "$repo/train/main.py" "$@" "${extra[@]}"
