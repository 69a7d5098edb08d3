#!/usr/bin/env bash
# torchrun wrapper for train/main.py on one node or many.
#
#   launch/run_train.sh recipe=nosa_1b_cpt data.paths=[/data/cpt] data.tokenizer=/data/tok
#   RUN_ID=exp7 NNODES=4 NODE_RANK=$i MASTER_ADDR=host0 launch/run_train.sh recipe=nosa_8b_cpt ...
#   NOSA_LAUNCH_DRY=1 launch/run_train.sh recipe=...   (or --dry first): print the command, run nothing
#
# Environment (all optional on one node):
#   RUN_ID          names the run dir and the rendezvous; default: SLURM_JOB_ID, else (one node only)
#                   a timestamp. REQUIRED when NNODES > 1 outside SLURM: every node must use the same id.
#   NNODES (1), NODE_RANK (0; SLURM_NODEID under srun), NPROC_PER_NODE (visible GPUs, else 1),
#   MASTER_ADDR (127.0.0.1), MASTER_PORT (29500), RUN_ROOT (runs), PYTHON (.venv/bin/python).
#   NOSA_SHUTDOWN_TIMEOUT (600): seconds torchrun lets the trainers save after SIGTERM / SIGUSR1
#                   before it kills them (torchrun's own default, 30 s, is too short for a checkpoint).
# The run directory is $RUN_ROOT/<recipe>-$RUN_ID unless the arguments set run.dir. Arguments are
# Hydra overrides. NCCL knobs (network interface, RoCE GID, IB HCAs): launch/env/nccl.sh.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"

dry="${NOSA_LAUNCH_DRY:-0}"
if [ "${1:-}" = "--dry" ]; then dry=1; shift; fi
fail() { echo "error: $*" >&2; exit 2; }

recipe=default has_dir=0
for a in "$@"; do
  case "$a" in
    recipe=*) recipe="${a#recipe=}" ;;
    run.dir=*) has_dir=1 ;;
    -*) fail "run_train.sh takes Hydra overrides (key=value), got '$a'; the only flag is --dry (first)" ;;
  esac
done

nnodes="${NNODES:-${SLURM_JOB_NUM_NODES:-1}}"
node_rank="${NODE_RANK:-${SLURM_NODEID:-0}}"
[[ "$nnodes" =~ ^[1-9][0-9]*$ ]] || fail "NNODES='$nnodes' is not a positive integer"
[[ "$node_rank" =~ ^[0-9]+$ ]] && [ "$node_rank" -lt "$nnodes" ] \
  || fail "NODE_RANK='$node_rank' must be in 0..$((nnodes - 1)) (NNODES=$nnodes)"
run_id="${RUN_ID:-${SLURM_JOB_ID:-}}"
if [ -z "$run_id" ]; then
  [ "$nnodes" = 1 ] || fail "NNODES=$nnodes needs RUN_ID (the same on every node; SLURM sets SLURM_JOB_ID): \
a per-node default would give every node its own rendezvous and run dir, and the job would hang"
  run_id="$(date +%Y%m%d-%H%M%S)"
fi
[[ "$run_id" =~ ^[A-Za-z0-9._-]+$ ]] || fail "RUN_ID='$run_id' may hold only letters, digits, '.', '_' and '-'"
export RUN_ID="$run_id"

extra=()
[ "$has_dir" = 1 ] || extra+=("run.dir=${RUN_ROOT:-runs}/${recipe}-${RUN_ID}")

if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=$(python3 -c 'import torch; print(max(1, torch.cuda.device_count()))' 2>/dev/null || echo 1)
fi
# shellcheck source=env/nccl.sh
source "$here/env/nccl.sh"
py="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$py" ] || py=python3

cmd=("$py" -m torch.distributed.run
  --nnodes="$nnodes" --node_rank="$node_rank" --nproc_per_node="$NPROC_PER_NODE"
  --rdzv_backend=c10d --rdzv_endpoint="${MASTER_ADDR:-127.0.0.1}:${MASTER_PORT:-29500}" --rdzv_id="$RUN_ID"
  --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
  --shutdown-timeout="${NOSA_SHUTDOWN_TIMEOUT:-600}"
  "$repo/train/main.py" "$@" "${extra[@]}")

if [ "$dry" = 1 ]; then
  printf 'node %s/%s:' "$node_rank" "$nnodes"
  for v in NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME NCCL_IB_HCA NCCL_IB_GID_INDEX OMP_NUM_THREADS; do
    [ -n "${!v:-}" ] && printf ' %s=%q' "$v" "${!v}"
  done
  printf ' %q' "${cmd[@]}"
  printf '\n'
  exit 0
fi
exec "${cmd[@]}"
