"""Count, on the CPU, the bytes a tiny model keeps for its backward: the ground truth of
``train/memory_model.py``'s activation terms (``tests/train/test_memory_model.py``).

``python tests/train/kept_bytes.py OUT.json CASES.json`` (``CASES.json``: ``{name: [overrides]}``, each
a ``load_config`` override list with ``train.seq_length=128``) builds each case's megatron model (one
packed document of 128 tokens) with the GPU code paths: ``train.fusions`` layers, NOSA's Triton kernels under the
Triton interpreter, dense attention through the variable-length FlashAttention autograd function (its
CUDA kernel replaced by a CPU stand-in with the same outputs). One forward runs under a dispatch mode
that notes every storage an op creates and the module that was running (embedding, layer i, final
norm, output layer); what is still alive after the forward (the loss kept) is what the graph keeps.
Storages are counted, not saved tensors: a saved view keeps its whole base alive, and what autograd
functions keep as plain attributes (the kernels' block-sparse index) is invisible to saved-tensor hooks.
Writes ``{name: {region: bytes per token}}``.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
os.environ["NOSA_ATTN_BACKEND"] = "triton"
os.environ["TORCHDYNAMO_DISABLE"] = "1"  # megatron-core's torch.compile'd fusions run eagerly (same saved tensors)

import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

TOKENS = 128
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def flash_varlen_cpu(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, return_debug, scale=None, **unused):
    """CPU stand-in of ``aten._flash_attention_forward`` (varlen): ``out [t, Hq, D]``, fp32 log-sum-exp
    ``[Hq, t]``, the RNG state ``[2]`` int64 and an empty tensor, as the CUDA kernel returns them."""
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    bounds = cu_q.tolist()
    for s, e in zip(bounds, bounds[1:]):
        qq = q[s:e].transpose(0, 1).float()
        kk, vv = (x[s:e].transpose(0, 1).float().repeat_interleave(group, 0) for x in (k, v))
        logits = (qq @ kk.transpose(1, 2)) * (scale or q.shape[-1] ** -0.5)
        logits = logits.masked_fill(torch.ones(e - s, e - s, dtype=torch.bool).triu(1), float("-inf"))
        lses.append(torch.logsumexp(logits, -1))
        outs.append((logits.softmax(-1) @ vv).transpose(0, 1))
    return (torch.cat(outs).to(q.dtype), torch.cat(lses, 1), torch.zeros(2, dtype=torch.int64),
            torch.empty(0, dtype=torch.int64), torch.empty(0))


class StorageLog(TorchDispatchMode):
    """Notes every storage an op returns (skipping ``known`` ones, the parameters) under ``where``."""

    def __init__(self, known: set) -> None:
        super().__init__()
        self.known, self.where, self.created = known, "embedding", []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._flash_attention_forward.default:
            with _disable_current_modes():
                out = flash_varlen_cpu(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s.data_ptr() not in self.known:
                    self.created.append((s.data_ptr(), StorageWeakRef(s), s.nbytes(), self.where))
        return out

    def alive(self) -> dict:
        """Bytes per token still alive, by region (each storage once)."""
        seen, out = set(), {}
        for ptr, ref, nbytes, where in self.created:
            if not ref.expired() and ptr not in seen:
                seen.add(ptr)
                out[where] = out.get(where, 0.0) + nbytes / TOKENS
        return out


def count(overrides: list[str]) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import nosa_layers.megatron.core_attention as core_attention
    import nosa_layers.megatron.dense_varlen as dense_varlen
    from nosa_layers.megatron import ParallelConfig, build_model
    from train.compose import load_config

    cfg = load_config(overrides)
    if cfg.train.seq_length != TOKENS:
        raise ValueError(f"the cases run {TOKENS} tokens, got train.seq_length={cfg.train.seq_length}")
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1)
    recompute = {"selective": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
                 "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)}
    model = build_model(dataclasses.replace(cfg.model, params_dtype=DTYPES[cfg.train.precision]), cfg.attention,
                        ParallelConfig(), seq_length=TOKENS, fusions=cfg.train.fusions, use_cpu_initialization=True,
                        calculate_per_token_loss=True, **recompute.get(cfg.train.recompute, {}))
    model.train()
    known = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    log = StorageLog(known)
    for i, layer in enumerate(model.decoder.layers):
        layer.register_forward_pre_hook(lambda mod, args, i=i: setattr(log, "where", f"layer{i}"))
    model.decoder.final_layernorm.register_forward_pre_hook(lambda mod, args: setattr(log, "where", "final"))
    model.output_layer.register_forward_pre_hook(lambda mod, args: setattr(log, "where", "output"))
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, TOKENS))
    cu = torch.tensor([0, TOKENS], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=TOKENS,
                             max_seqlen_kv=TOKENS)
    supported = dense_varlen.varlen_supported
    core_attention.varlen_supported = dense_varlen.varlen_supported = \
        lambda q, k: q.dtype in (torch.float16, torch.bfloat16)
    try:
        with log:
            loss = model(tokens, torch.arange(TOKENS)[None], attention_mask=None, labels=tokens,
                         packed_seq_params=packed)
    finally:
        core_attention.varlen_supported = dense_varlen.varlen_supported = supported
    gc.collect()
    out = log.alive()
    del loss
    return out


if __name__ == "__main__":
    from runtime.megatron_cpu import apply_cpu_shim, lean_megatron_import

    lean_megatron_import()  # megatron-core's import without its compile machinery (its fusions run eagerly anyway)

    apply_cpu_shim(force=True)
    with open(sys.argv[2]) as fh:
        cases = json.load(fh)
    result = {}
    for name, overrides in cases.items():
        result[name] = count(overrides)
        print(name, json.dumps(result[name]), flush=True)
    tmp = sys.argv[1] + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(result, fh)
    os.replace(tmp, sys.argv[1])
