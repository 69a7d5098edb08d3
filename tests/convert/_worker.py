"""Builds and saves the Megatron checkpoints of tests/convert (torchrun, 2 gloo processes, CPU).

For every case of ``_cases.CASES``: megatron parallel state in the case's layout (TP=2 or PP=2),
``build_model`` with megatron's init plus random norms and eviction heads, a trainer-format
distributed checkpoint (``<out>/<case>/iter_0000000`` with the model under key ``model``,
``nosa_config.json``, ``latest``), the Megatron forward of fixed tokens (logits gathered over TP,
passed between PP stages by hand) and the NOSA selections of every layer (per KV head).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

import torch

from runtime.megatron_cpu import lean_megatron_import  # noqa: E402

lean_megatron_import()  # before anything imports megatron-core

from runtime.checkpoint_manifest import hash_files, list_files, write_manifest
from runtime.megatron_cpu import apply_cpu_shim

apply_cpu_shim()

import torch.distributed as dist  # noqa: E402
from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cases import BATCH, CASES  # noqa: E402

from nosa_layers.megatron.core_attention import NOSACoreAttention  # noqa: E402
from nosa_layers.megatron.model import build_model  # noqa: E402


def tokens_for(case) -> torch.Tensor:
    gen = torch.Generator().manual_seed(case.seed)
    return torch.randint(0, case.model.vocab_size, (BATCH, case.seq), generator=gen)


def randomize(model, seed: int) -> None:
    """Norm weights 1 + noise and real eviction heads (A = 0 at init would hide the bias path).
    These tensors are replicated over TP, so a generator seeded by name gives every rank the same."""
    for name, p in model.named_parameters():
        if "layernorm" in name or "layer_norm" in name or "eviction_head" in name:
            gen = torch.Generator().manual_seed(seed + sum(map(ord, name)))
            with torch.no_grad():
                if name.endswith(".A"):
                    p.copy_(0.5 + torch.rand(p.shape, generator=gen))
                elif "eviction_head" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
                else:
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))


def forward_logits(model, tokens: torch.Tensor, vocab: int):
    """Full logits on the last PP stage's TP rank 0 (None elsewhere)."""
    pos = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    pp, pr = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    with torch.no_grad():
        if pp > 1 and pr > 0:
            hidden = torch.empty(tokens.shape[1], tokens.shape[0], model.config.hidden_size)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(tokens, pos, None)
        if pp > 1 and pr < pp - 1:
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(out) for _ in range(tp)]
        dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
        out = torch.cat(parts, dim=-1)
    return out[..., :vocab].float() if ps.get_tensor_model_parallel_rank() == 0 else None


def selections(model) -> dict:
    """{(global layer, global kv head): bool [T, nb]} of this rank's heads (batch row 0)."""
    out = {}
    for m in model.modules():
        if isinstance(m, NOSACoreAttention) and m.last_selection is not None:
            lay = m.layout
            for j in range(m.last_selection.shape[1]):
                out[(m.layer_number - 1, lay.kv_start + j)] = m.last_selection[0, j].clone()
    return out


def run_case(case, out_root: str) -> None:
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    par = case.parallel
    ps.initialize_model_parallel(tensor_model_parallel_size=par.tensor_parallel,
                                 pipeline_model_parallel_size=par.pipeline_parallel)
    model_parallel_cuda_manual_seed(case.seed)
    torch.manual_seed(case.seed)
    model = build_model(case.model, case.attn, par, use_te=False)
    randomize(model, case.seed)
    model.eval()
    for m in model.modules():
        if isinstance(m, NOSACoreAttention):
            m.record_selection = True

    root = os.path.join(out_root, case.name)
    ckpt = os.path.join(root, "iter_0000000")
    if dist.get_rank() == 0:
        os.makedirs(ckpt, exist_ok=True)
    dist.barrier()
    meta = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    dist_checkpointing.save({"model": model.sharded_state_dict(metadata=meta)}, ckpt)
    dist.barrier()
    if dist.get_rank() == 0:
        cfg = {"model": dataclasses.asdict(case.model), "attention": dataclasses.asdict(case.attn),
               "recipe": "tests/convert", "step": 0}
        with open(os.path.join(ckpt, "nosa_config.json"), "w") as fh:
            json.dump(cfg, fh)
        write_manifest(ckpt, hash_files(ckpt, list_files(ckpt)))
        with open(os.path.join(root, "latest"), "w") as fh:
            fh.write("iter_0000000\n")

    tokens = tokens_for(case)
    t0 = time.time()
    logits = forward_logits(model, tokens, case.model.vocab_size)
    sel = selections(model)
    torch.save({"logits": logits, "tokens": tokens, "selections": sel, "forward_s": time.time() - t0},
               os.path.join(root, f"rank{dist.get_rank()}.pt"))
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="all")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    names = list(CASES) if args.cases == "all" else args.cases.split(",")
    status = {}
    for name in names:
        t0 = time.time()
        try:
            run_case(CASES[name], args.out)
            status[name] = "ok"
        except Exception:  # noqa: BLE001 - reported per case to the test
            status[name] = traceback.format_exc()
        status[name + ":seconds"] = round(time.time() - t0, 2)
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "status.json"), "w") as fh:
            json.dump(status, fh, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
