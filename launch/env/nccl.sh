# NCCL / CUDA settings shared by the launchers (sourced). Every one can be overridden in the environment.
#
# Knobs to set per cluster (left unset here: NCCL's auto-detection is right on most clusters):
#   NCCL_SOCKET_IFNAME   network interface for NCCL's bootstrap and socket transport, e.g. ib0, eth0,
#                        or ^docker,lo (exclude). Set it when nodes have several NICs and the job hangs
#                        at the first collective. GLOO_SOCKET_IFNAME follows it unless set.
#   NCCL_IB_HCA          InfiniBand/RoCE adapters to use, e.g. mlx5 or mlx5_0,mlx5_1 (the sbatch files set mlx5).
#   NCCL_IB_GID_INDEX    RoCE only: the GID index of the RoCE v2 address (often 3; `show_gids` lists
#                        them). Wrong or unset on RoCE fabrics gives "NET/IB : ... failed" or a hang.
#   NCCL_DEBUG=INFO      prints the chosen transport and interfaces (first thing to check on a hang).
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"   # megatron's overlap needs 1
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"
if [ -n "${NCCL_SOCKET_IFNAME:-}" ]; then
  export NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$NCCL_SOCKET_IFNAME}"
fi
[ -z "${NCCL_IB_GID_INDEX:-}" ] || export NCCL_IB_GID_INDEX
# NVLink SHARP / multicast off by default (shared hosts; enable explicitly on dedicated H100 nodes)
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
export NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
# Threads per training process: the cores SLURM gave each task divided by the processes of a node.
if [ -z "${OMP_NUM_THREADS:-}" ]; then
  if [ -n "${SLURM_CPUS_PER_TASK:-}" ] && [ -n "${NPROC_PER_NODE:-}" ]; then
    OMP_NUM_THREADS=$(( SLURM_CPUS_PER_TASK / NPROC_PER_NODE > 0 ? SLURM_CPUS_PER_TASK / NPROC_PER_NODE : 1 ))
  else
    OMP_NUM_THREADS=8
  fi
fi
export OMP_NUM_THREADS
