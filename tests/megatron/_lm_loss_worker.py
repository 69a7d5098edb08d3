"""Chunked-loss parity worker at tensor parallelism 2, launched by ``tests/megatron/test_lm_loss.py`` as 2 gloo
rank processes on the CPU (``TORCHDYNAMO_DISABLE=1``: megatron-core's compiled cross-entropy helpers run eagerly).

Output-layer cases: megatron-core's ``ColumnParallelLinear`` output layer (vocabulary split over the 2 ranks,
with and without sequence parallelism, its own weight or a tied one, muP's logit multiplier) and random
hidden states, labels and masks of odd token counts; the masked loss sum and the gradients of the hidden
states and of the weight through ``ChunkedLMLossProcessor`` against megatron-core's whole-logit path (output
layer + vocab-parallel cross entropy; the bf16 case against its fused cross entropy) and, on rank 0, against
``reference_lm_loss`` on the whole weight. Model cases: a tiny GPT (tied embeddings and muP with sequence
parallelism; untied without) whose every parameter gradient is compared between the two losses.

``python tests/megatron/_lm_loss_worker.py OUT.json`` (as ``RANK`` 0 / 1 of ``WORLD_SIZE`` 2): rank 0 writes
``{case: {metric: relative difference, ...} or {"error": traceback}}``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from dataclasses import dataclass
from types import SimpleNamespace

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

from runtime.megatron_cpu import lean_megatron_import  # noqa: E402

lean_megatron_import()
from runtime.megatron_cpu import apply_cpu_shim  # noqa: E402

apply_cpu_shim()

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy  # noqa: E402
from megatron.core.tensor_parallel.layers import ColumnParallelLinear  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402

from nosa_layers.megatron import AttentionConfig, ModelConfig, ParallelConfig  # noqa: E402
from nosa_layers.megatron.lm_loss import ChunkedLMLossProcessor, reference_lm_loss  # noqa: E402
from nosa_layers.megatron.model import build_model, build_transformer_config  # noqa: E402

TP = 2


@dataclass
class LayerCase:
    seq: int  # tokens per sequence (divisible by TP with sequence parallelism)
    batch: int
    hidden: int
    vocab: int  # whole vocabulary (divisible by TP)
    chunk: int
    sequence_parallel: bool = False
    tied: bool = False  # the weight is handed in as output_weight (GPTModel's tied embeddings)
    logit_scale: float = 1.0
    dtype: torch.dtype = torch.float32
    seed: int = 0


LAYER_CASES = {
    "tp2": LayerCase(seq=37, batch=2, hidden=24, vocab=202, chunk=16, seed=11),
    "tp2_sp": LayerCase(seq=46, batch=1, hidden=40, vocab=130, chunk=7, sequence_parallel=True, seed=12),
    "tp2_tied_mup": LayerCase(seq=29, batch=3, hidden=32, vocab=90, chunk=25, tied=True, logit_scale=0.37, seed=13),
    "tp2_sp_one_chunk": LayerCase(seq=22, batch=1, hidden=16, vocab=64, chunk=1000, sequence_parallel=True, seed=14),
    "tp2_fused_bf16": LayerCase(seq=41, batch=2, hidden=48, vocab=160, chunk=19, dtype=torch.bfloat16, seed=15),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def setup() -> None:
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=TP)
    model_parallel_cuda_manual_seed(1)


def layer_case(c: LayerCase) -> dict:
    setup()
    rank, group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
    gen = torch.Generator().manual_seed(c.seed)  # the same draws on both ranks
    hidden_full = torch.randn(c.seq, c.batch, c.hidden, generator=gen)
    weight_full = torch.randn(c.vocab, c.hidden, generator=gen) * 0.5
    labels = torch.randint(0, c.vocab, (c.batch, c.seq), generator=gen)
    mask = (torch.rand(c.batch, c.seq, generator=gen) > 0.3).float()
    mask[0, :3] = 0.0
    model_cfg = ModelConfig(num_layers=1, hidden_size=c.hidden, num_attention_heads=4, num_kv_heads=2,
                            ffn_hidden_size=4 * c.hidden, vocab_size=c.vocab)
    cfg = build_transformer_config(model_cfg, AttentionConfig(),
                                   ParallelConfig(tensor_parallel=TP, sequence_parallel=c.sequence_parallel),
                                   use_cpu_initialization=True, params_dtype=c.dtype, bf16=c.dtype == torch.bfloat16)
    layer = ColumnParallelLinear(c.hidden, c.vocab, config=cfg, init_method=cfg.init_method, bias=False,
                                 gather_output=False, skip_bias_add=False, skip_weight_param_allocation=c.tied)
    shard = c.vocab // TP
    weight_local = weight_full[rank * shard:(rank + 1) * shard].to(c.dtype)
    if c.sequence_parallel:
        piece = c.seq // TP
        hidden_local = hidden_full[rank * piece:(rank + 1) * piece]
    else:
        hidden_local = hidden_full
    hidden_local = hidden_local.to(c.dtype)
    muP = SimpleNamespace(use_mup=c.logit_scale != 1.0, mup_output_mult=c.logit_scale)

    def run(chunked: bool):
        h = hidden_local.clone().requires_grad_(True)
        if c.tied:
            w = passed = torch.nn.Parameter(weight_local.clone())
        else:
            with torch.no_grad():
                layer.weight.copy_(weight_local)
            layer.weight.grad = None
            w, passed = layer.weight, None
        if chunked:
            processor = ChunkedLMLossProcessor(c.chunk, fused=c.dtype == torch.bfloat16)
            loss = processor(hidden_states=h, output_layer=layer, output_weight=passed, labels=labels,
                             loss_mask=mask, config=muP)
        else:
            logits, _ = layer(h, weight=passed)
            if c.logit_scale != 1.0:
                logits = logits * c.logit_scale
            target = labels.t().contiguous()
            if c.dtype == torch.bfloat16:
                per_token = fused_vocab_parallel_cross_entropy(logits, target, group)
            else:
                per_token = tensor_parallel.vocab_parallel_cross_entropy(logits, target, tp_group=group)
            loss = (per_token.float().t() * mask).sum()
        (loss * 1.75).backward()  # an incoming gradient other than 1
        return loss.detach().float(), h.grad.float(), w.grad.float()

    loss_c, gh_c, gw_c = run(True)
    loss_s, gh_s, gw_s = run(False)
    out = {"loss": abs(loss_c - loss_s).item() / abs(loss_s).item(), "hidden_grad": rel(gh_c, gh_s),
           "weight_grad": rel(gw_c, gw_s), "loss_value": loss_c.item()}
    # the plain reference on the whole weight (fp64), against this rank's shards, for both losses
    h = hidden_full.double().requires_grad_(True)
    w = weight_full.double().requires_grad_(True)
    ref = reference_lm_loss(h.reshape(-1, c.hidden), w, labels.t().reshape(-1), mask.t().reshape(-1), c.logit_scale)
    (ref * 1.75).backward()
    ref_gh = h.grad[rank * (c.seq // TP):(rank + 1) * (c.seq // TP)] if c.sequence_parallel else h.grad
    ref_gw = w.grad[rank * shard:(rank + 1) * shard]
    for name, (loss, gh, gw) in (("chunked", (loss_c, gh_c, gw_c)), ("standard", (loss_s, gh_s, gw_s))):
        out[f"{name}_vs_ref"] = {"loss": abs(loss.double() - ref).item() / abs(ref).item(),
                                 "hidden_grad": rel(gh, ref_gh), "weight_grad": rel(gw, ref_gw)}
    return out


MODEL_CASES = {
    "model_tied_mup_sp": dict(seq=30, batch=1, tied=True, mup=True, sp=True, chunk=11, seed=21),
    "model_untied": dict(seq=25, batch=2, tied=False, mup=False, sp=False, chunk=8, seed=22),
}


def model_case(name: str) -> dict:
    k = MODEL_CASES[name]
    setup()
    model_cfg = ModelConfig(family="minicpm4" if k["mup"] else "llama3", num_layers=2, hidden_size=32,
                            num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64, vocab_size=250,
                            tie_embeddings=k["tied"], use_mup=k["mup"], scale_emb=2.0 if k["mup"] else 1.0,
                            dim_model_base=8 if k["mup"] else None, max_position_embeddings=64)
    model = build_model(model_cfg, AttentionConfig(variant="dense"),
                        ParallelConfig(tensor_parallel=TP, sequence_parallel=k["sp"]), seq_length=k["seq"],
                        use_cpu_initialization=True, init_seed=5, calculate_per_token_loss=True)
    gen = torch.Generator().manual_seed(k["seed"])
    b, s = k["batch"], k["seq"]
    tokens = torch.randint(0, 250, (b, s + 1), generator=gen)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    mask = (torch.rand(b, s, generator=gen) > 0.25).float()
    pos = torch.arange(s)[None].expand(b, s)

    def run(chunked: bool):
        model.zero_grad(set_to_none=True)
        if chunked:
            loss = model(inputs, pos, None, labels=labels, loss_mask=mask,
                         output_processor=ChunkedLMLossProcessor(k["chunk"]))
        else:
            loss = (model(inputs, pos, None, labels=labels).float() * mask).sum()
        loss.backward()
        return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    loss_c, grads_c = run(True)
    loss_s, grads_s = run(False)
    assert grads_c.keys() == grads_s.keys() and grads_s, (sorted(grads_c), sorted(grads_s))
    worst = max(rel(grads_c[n], g) for n, g in grads_s.items())
    out = {"loss": abs(loss_c - loss_s).item() / abs(loss_s).item(), "grads_worst_tensor": worst,
           "params_with_grads": len(grads_s)}
    emb = "embedding.word_embeddings.weight"
    out["embedding_grad"] = rel(grads_c[emb], grads_s[emb])
    if not k["tied"]:
        out["output_grad"] = rel(grads_c["output_layer.weight"], grads_s["output_layer.weight"])
    return out


def main() -> None:
    dist.init_process_group("gloo")
    results = {}
    jobs = [(n, lambda n=n: layer_case(LAYER_CASES[n])) for n in LAYER_CASES]
    jobs += [(n, lambda n=n: model_case(n)) for n in MODEL_CASES]
    for name, job in jobs:
        try:
            got = job()
        except Exception:  # recorded per case so one failure does not hide the others
            got = {"error": traceback.format_exc()}
            print(got["error"], file=sys.stderr, flush=True)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, got)
        results[name] = {f"rank{r}": g for r, g in enumerate(gathered)}
        dist.barrier()
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as fh:
            json.dump(results, fh, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
