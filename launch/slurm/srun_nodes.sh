#!/usr/bin/env bash
# Shared body of the sbatch files: one torchrun per node through srun, c10d rendezvous on the
# job's first node, RUN_ID = SLURM job id (the same on every node, and again after a requeue).
#
#   NOSA_LAUNCH_DRY=1 launch/slurm/srun_nodes.sh recipe=...   (inside an allocation, or with the
#   SLURM_* variables set by hand): print the srun line and each node's command; run nothing.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$(dirname "$here")")"
fail() { echo "error: $*" >&2; exit 2; }

[ -n "${SLURM_JOB_ID:-}" ] || fail "SLURM_JOB_ID is not set: submit with sbatch (or use launch/run_train.sh)"
[ -n "${SLURM_JOB_NODELIST:-}" ] && [ -n "${SLURM_JOB_NUM_NODES:-}" ] \
  || fail "SLURM_JOB_NODELIST / SLURM_JOB_NUM_NODES are not set: run this inside an sbatch allocation"
export RUN_ID="${RUN_ID:-$SLURM_JOB_ID}"
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
export MASTER_ADDR MASTER_PORT="${MASTER_PORT:-29500}"
export NNODES="$SLURM_JOB_NUM_NODES" NPROC_PER_NODE="${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}"
# srun does not inherit sbatch's --cpus-per-task (SLURM >= 22.05): pass it, or every rank of a
# node may be pinned to the same core.
cpus="${SLURM_CPUS_PER_TASK:-$(( $(nproc) ))}"
srun_cmd=(srun --nodes="$NNODES" --ntasks-per-node=1 --cpus-per-task="$cpus" --kill-on-bad-exit=1)
per_node='NODE_RANK=$SLURM_NODEID exec "$0/launch/run_train.sh" "$@"'

if [ "${NOSA_LAUNCH_DRY:-0}" = 1 ]; then
  printf 'srun:'; printf ' %q' "${srun_cmd[@]}"; printf '\n'
  for ((i = 0; i < NNODES; i++)); do
    SLURM_NODEID=$i SLURM_CPUS_PER_TASK="$cpus" NODE_RANK=$i "$repo/launch/run_train.sh" --dry "$@"
  done
  exit 0
fi
exec "${srun_cmd[@]}" bash -c "$per_node" "$repo" "$@"
