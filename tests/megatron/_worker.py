"""Distributed parity worker, launched by tests/megatron under torchrun (gloo, CPU).

``--role ref`` (1 process): TP=PP=DP=1 reference of every case (initial weights saved, one
training step: loss, grads, grad norm, updated weights, NOSA selections) plus the single-process
checks (core attention vs ``nosa_attention``, megatron layer vs the plain reference layer, muP
forward vs MiniCPM formulas, megatron LongRoPE vs the pure LongRoPE tables, sync-free packed RoPE
vs megatron's).
``--role par`` (2 processes): every case in each of its layouts (tp2, tp2_sp, pp2, dp2), starting
from the reference weights. Each rank writes what it owns to ``OUT/<case>/<layout>/rank<r>.pt``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import traceback
from dataclasses import replace

import torch

from runtime.megatron_cpu import lean_megatron_import  # noqa: E402

lean_megatron_import()  # before anything imports megatron-core

from runtime.megatron_cpu import apply_cpu_shim

apply_cpu_shim()

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.distributed.finalize_model_grads import finalize_model_grads  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cases import CASES, GLOBAL_BATCH, LAYOUTS, MICRO_BATCH, PACKED_DOCS, ROPE_DOCS, SEQ  # noqa: E402

from nosa_layers.megatron.core_attention import NOSACoreAttention  # noqa: E402
from nosa_layers.megatron.model import build_model  # noqa: E402

# Adam eps of the parity step: with 1e-8, the first Adam step turns fp32 summation noise on gradient
# entries of ~1e-8 into visible update differences; 1e-5 keeps the comparison about parallelism.
ADAM_EPS = 1e-5
LAYER_RE = re.compile(r"decoder\.layers\.(\d+)\.")


def setup(parallel, seed: int = 1) -> None:
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=parallel.tensor_parallel,
                                 pipeline_model_parallel_size=parallel.pipeline_parallel)
    model_parallel_cuda_manual_seed(seed)


def global_names(model) -> dict:
    """local parameter name -> global name (pipeline stages renumber their layers from 0)."""
    layers = model.decoder.layers
    out = {}
    for name, _ in model.named_parameters():
        m = LAYER_RE.search(name)
        if m:
            g = layers[int(m.group(1))].layer_number - 1
            name_g = LAYER_RE.sub(f"decoder.layers.{g}.", name, count=1)
        else:
            name_g = name
        out[name] = name_g
    return out


def shard(full: torch.Tensor, p) -> torch.Tensor:
    """This TP rank's slice of a full tensor, as megatron's CPU init slices the master weight."""
    if not getattr(p, "tensor_model_parallel", False):
        return full
    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    dim, stride = p.partition_dim, getattr(p, "partition_stride", 1)
    chunk = full.shape[dim] // (tp * stride)
    pieces = torch.split(full, chunk, dim=dim)
    return torch.cat(pieces[r::tp], dim=dim)


def unshard(local: torch.Tensor, p) -> torch.Tensor:
    if not getattr(p, "tensor_model_parallel", False) or ps.get_tensor_model_parallel_world_size() == 1:
        return local
    tp = ps.get_tensor_model_parallel_world_size()
    dim, stride = p.partition_dim, getattr(p, "partition_stride", 1)
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    split = [torch.chunk(x, stride, dim=dim) for x in parts]
    return torch.cat([split[r][s] for s in range(stride) for r in range(tp)], dim=dim)


def skip_param(model, name: str) -> bool:
    """The last stage's copy of tied embeddings duplicates ``embedding.word_embeddings.weight``."""
    return name == "output_layer.weight" and model.share_embeddings_and_output_weights and not model.pre_process


def owner() -> bool:
    return ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0


def collect(model, what: str) -> dict:
    names = global_names(model)
    out = {}
    for name, p in model.named_parameters():
        if skip_param(model, name):
            continue
        t = p.main_grad if what == "grad" else p.data
        full = unshard(t.detach().float().clone(), p)
        if owner():
            out[names[name]] = full
    return out


def perturb_eviction(model, seed: int) -> None:
    """A = 0 at init leaves delta without gradient: give every eviction parameter real values."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "eviction_head" in name:
            with torch.no_grad():
                if name.endswith(".A"):
                    p.copy_(0.5 + torch.rand(p.shape, generator=gen))
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def make_batches(case, seed: int):
    """GLOBAL_BATCH rows of SEQ tokens (packed: rows of PACKED_DOCS documents)."""
    gen = torch.Generator().manual_seed(seed)
    V = case.model.vocab_size
    tokens = torch.randint(0, V, (GLOBAL_BATCH, SEQ + 1), generator=gen)
    mask = (torch.rand(GLOBAL_BATCH, SEQ, generator=gen) > 0.1).float()
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask


def packed_row(docs: list[int]) -> tuple[PackedSeqParams, torch.Tensor]:
    """THD params of one packed row of ``docs`` (lengths) and its per-document positions ``[1, sum]``."""
    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=max(docs), max_seqlen_kv=max(docs))
    return psp, torch.cat([torch.arange(n) for n in docs])[None]


def forward_step_factory(case, parallel):
    def forward_step(data_iterator, model):
        tok, lab, mask = next(data_iterator)
        b, t = tok.shape
        if case.packed:
            assert sum(PACKED_DOCS) == SEQ
            psp, pos = packed_row(PACKED_DOCS)
            tok, lab, mask = tok.reshape(1, -1), lab.reshape(1, -1), mask.reshape(1, -1)
            assert b == 1, "packed case uses micro-batch 1"
        else:
            psp = None
            pos = torch.arange(t)[None].expand(b, t)
        out = model(tok, pos, None, labels=lab, packed_seq_params=psp)

        def loss_func(output_tensor):
            loss = (output_tensor.float().view(-1) * mask.reshape(-1)).sum() / mask.sum()
            return loss, {"lm loss": loss.detach().clone()}  # megatron scales loss in place

        return out, loss_func

    return forward_step


def run_one(case_name: str, layout_name: str, out_dir: str, init_state) -> dict:
    case, layout = CASES[case_name], LAYOUTS[layout_name]
    par = layout.parallel
    setup(par)
    model = build_model(case.model, case.attn, par, seq_length=SEQ, use_te=False, **layout.overrides)
    names = global_names(model)
    if init_state is None:  # reference: keep megatron's init, perturb the eviction heads
        perturb_eviction(model, case.seed)
    else:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if skip_param(model, name):
                    continue
                p.copy_(shard(init_state[names[name]], p))
        if model.share_embeddings_and_output_weights and not model.pre_process and model.post_process:
            model.output_layer.weight.data.copy_(shard(init_state["embedding.word_embeddings.weight"],
                                                       model.output_layer.weight))
    full_init = collect(model, "param") if init_state is None else None
    for m in model.modules():
        if isinstance(m, NOSACoreAttention):
            m.record_selection = case.record_selection

    cfg = model.config
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True), model)
    cfg.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, adam_eps=ADAM_EPS, weight_decay=0.01,
                                                 clip_grad=1.0, use_distributed_optimizer=True, bf16=False,
                                                 fp16=False), [ddp])

    tok, lab, mask = make_batches(case, case.seed)
    dp, dpr = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = GLOBAL_BATCH // dp
    tok, lab, mask = (x[dpr * rows:(dpr + 1) * rows] for x in (tok, lab, mask))
    mbs = 1 if case.packed else MICRO_BATCH
    micro = [(tok[i:i + mbs], lab[i:i + mbs], mask[i:i + mbs]) for i in range(0, rows, mbs)]

    ddp.zero_grad_buffer()
    opt.zero_grad()
    fb = get_forward_backward_func()
    selection_calls: dict = {}  # selections computed per NOSA layer during the step (recompute must reuse them)
    prepare = NOSACoreAttention._prepare

    def counted_prepare(self, *args, **kwargs):
        selection_calls[self.layer_number] = selection_calls.get(self.layer_number, 0) + 1
        return prepare(self, *args, **kwargs)

    NOSACoreAttention._prepare = counted_prepare
    losses = fb(forward_step_func=forward_step_factory(case, par), data_iterator=iter(micro), model=[ddp],
                num_microbatches=len(micro), seq_length=SEQ if not case.packed else SEQ,
                micro_batch_size=mbs if not case.packed else 1, forward_only=False)
    NOSACoreAttention._prepare = prepare
    loss = None
    if ps.is_pipeline_last_stage():
        loss_t = torch.stack([x["lm loss"] for x in losses]).mean()
        dist.all_reduce(loss_t, group=ps.get_data_parallel_group())
        loss = (loss_t / dp).item()
    grads = collect(model, "grad") if dp == 1 else {}
    ok, grad_norm, _ = opt.step()
    params = collect(model, "param")

    selections = {}
    if case.record_selection:
        for m in model.modules():
            if isinstance(m, NOSACoreAttention) and m.last_selection is not None:
                sel = m.last_selection.to(torch.uint8)
                lay = m.layout
                if lay.tp_size > 1:
                    parts = [torch.empty_like(sel) for _ in range(lay.tp_size)]
                    dist.all_gather(parts, sel.contiguous(), group=ps.get_tensor_model_parallel_group())
                    parts = parts[::lay.replication]  # one copy per KV head
                    sel = torch.cat(parts, dim=1)
                if owner():
                    selections[m.layer_number - 1] = sel.bool()
    res = {"loss": loss, "grad_norm": float(grad_norm), "grads": grads, "params": params,
           "selections": selections, "init": full_init, "selection_calls": selection_calls,
           "micro_batches": len(micro)}
    d = os.path.join(out_dir, case_name, layout_name)
    os.makedirs(d, exist_ok=True)
    torch.save(res, os.path.join(d, f"rank{dist.get_rank()}.pt"))
    return res


# ----------------------------------------------------------------------------- single-process checks


def check_core_attention(out: dict) -> None:
    """Megatron's NOSA core attention (inputs captured in a real forward) vs nosa_attention."""
    from nosa_layers import nosa_attention

    for case_name in ("nosa", "nosa_kv1", "infllm_v2", "locret", "s_dma", "packed"):
        case = CASES[case_name]
        setup(LAYOUTS["ref"].parallel)
        model = build_model(case.model, case.attn, seq_length=SEQ, use_te=False)
        perturb_eviction(model, case.seed)
        captured = []

        def pre_hook(mod, args, kwargs):
            captured.append({"args": [a.detach().clone() for a in args[:3]], "kwargs": kwargs, "mod": mod})

        def hook(mod, args, kwargs, output):
            captured[-1]["out"] = output.detach().clone()

        for m in model.modules():
            if isinstance(m, NOSACoreAttention):
                m.register_forward_pre_hook(pre_hook, with_kwargs=True)
                m.register_forward_hook(hook, with_kwargs=True)
        tok, lab, _ = make_batches(case, case.seed)
        fwd = forward_step_factory(case, LAYOUTS["ref"].parallel)
        mb = (tok[:1], lab[:1], torch.ones(1, SEQ)) if case.packed else (tok[:2], lab[:2], torch.ones(2, SEQ))
        with torch.no_grad():
            fwd(iter([mb]), model)
        worst = 0.0
        for c in captured:
            q, k, v = c["args"]
            psp = c["kwargs"].get("packed_seq_params")
            cu = None if psp is None else psp.cu_seqlens_q
            to = (lambda x: x.unsqueeze(0)) if cu is not None else (lambda x: x.transpose(0, 1))
            score, bias = c["kwargs"].get("evict_score"), c["kwargs"].get("evict_bias")  # the layer's hand-over
            assert (score is not None) == (case_name != "infllm_v2"), f"{case_name}: eviction score not handed over"
            ref = nosa_attention(to(q), to(k), to(v), score, c["mod"].cfg, cu_seqlens=cu,
                                 backend="reference", attn_bias=bias,
                                 softmax_scale=c["mod"].softmax_scale)
            ref = ref.squeeze(0).flatten(-2) if cu is not None else ref.transpose(0, 1).flatten(-2)
            worst = max(worst, ((c["out"] - ref).norm() / ref.norm()).item())
        out[f"core_attention/{case_name}"] = {"rel": worst, "layers": len(captured)}


def check_layer_vs_reference(out: dict) -> None:
    """A megatron NOSAMegatronSelfAttention (TP=1) vs the reference NOSAReferenceSelfAttention."""
    from nosa_layers.reference_layer import NOSAReferenceSelfAttention as RefLayer

    case = CASES["nosa"]
    setup(LAYOUTS["ref"].parallel)
    model = build_model(case.model, case.attn, seq_length=SEQ, use_te=False)
    perturb_eviction(model, case.seed)
    m, a = case.model, case.attn
    att = model.decoder.layers[1].self_attention
    D, Hq, Hkv = m.kv_channels, m.num_attention_heads, m.num_kv_heads
    G = Hq // Hkv
    ref = RefLayer(m.hidden_size, Hq, Hkv, a.nosa, head_dim=D, rope_theta=m.rope_theta, backend="reference").double()
    w = att.linear_qkv.weight.detach().double().view(Hkv, (G + 2) * D, m.hidden_size)
    with torch.no_grad():
        ref.q_proj.weight.copy_(w[:, :G * D].reshape(Hq * D, -1))
        ref.k_proj.weight.copy_(w[:, G * D:(G + 1) * D].reshape(Hkv * D, -1))
        ref.v_proj.weight.copy_(w[:, (G + 1) * D:].reshape(Hkv * D, -1))
        ref.o_proj.weight.copy_(att.linear_proj.weight.double())
        ref.eviction.load_state_dict({k: v.double() for k, v in att.eviction_head.state_dict().items()})
    x = torch.randn(SEQ, 2, m.hidden_size, generator=torch.Generator().manual_seed(7))
    rot = model.rotary_pos_emb(SEQ)
    with torch.no_grad():
        y, _ = att(x, None, rotary_pos_emb=rot)
        y_ref = ref(x.transpose(0, 1).double()).transpose(0, 1)
    out["layer_vs_reference"] = {"rel": ((y.double() - y_ref).norm() / y_ref.norm()).item()}


def check_mup(out: dict) -> None:
    """tiny MiniCPM4 (muP) logits vs a plain re-implementation of MiniCPM's forward formulas."""

    from nosa_layers.megatron.config import AttentionConfig

    mcfg = CASES["minicpm4_mup"].model
    setup(LAYOUTS["ref"].parallel)
    model = build_model(mcfg, AttentionConfig(variant="dense"), seq_length=SEQ, use_te=False)
    sd = {k: v.detach().double() for k, v in model.state_dict().items() if v is not None and torch.is_tensor(v)}
    tok = torch.randint(0, mcfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(tok, torch.arange(64)[None].expand(2, 64), None).double()  # [b, s, V]
    out["mup"] = {"rel": ((logits - minicpm_reference(mcfg, sd, tok)).norm() / logits.norm()).item()}


def minicpm_reference(m, sd: dict, tok: torch.Tensor) -> torch.Tensor:
    """MiniCPM (modeling_minicpm.py) forward in fp64 from megatron weight names."""
    D, Hq, Hkv, L = m.kv_channels, m.num_attention_heads, m.num_kv_heads, m.num_layers
    G = Hq // Hkv
    B, T = tok.shape

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.norm_eps))

    inv = 1.0 / (m.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    f = torch.outer(torch.arange(T, dtype=torch.float64), inv)
    cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()

    def rope(x):
        x1, x2 = x.chunk(2, -1)
        return x * cos[None, :, None] + torch.cat([-x2, x1], -1) * sin[None, :, None]

    h = sd["embedding.word_embeddings.weight"][tok] * m.scale_emb
    res = m.scale_depth / math.sqrt(L)
    for i in range(L):
        p = f"decoder.layers.{i}."
        x = rms(h, sd[p + "input_layernorm.weight"])
        w = sd[p + "self_attention.linear_qkv.weight"].view(Hkv, (G + 2) * D, -1)
        q = (x @ w[:, :G * D].reshape(Hq * D, -1).T).view(B, T, Hq, D)
        k = (x @ w[:, G * D:(G + 1) * D].reshape(Hkv * D, -1).T).view(B, T, Hkv, D)
        v = (x @ w[:, (G + 1) * D:].reshape(Hkv * D, -1).T).view(B, T, Hkv, D)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(G, 2), v.repeat_interleave(G, 2)
        s = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(D)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        a = torch.einsum("bhts,bshd->bthd", s.softmax(-1), v).reshape(B, T, Hq * D)
        h = h + (a @ sd[p + "self_attention.linear_proj.weight"].T) * res
        x = rms(h, sd[p + "pre_mlp_layernorm.weight"])
        gate, up = (x @ sd[p + "mlp.linear_fc1.weight"].T).chunk(2, -1)
        h = h + ((torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.linear_fc2.weight"].T) * res
    h = rms(h, sd["decoder.final_layernorm.weight"])
    return (h / (m.hidden_size / m.dim_model_base)) @ sd["output_layer.weight"].T


def check_longrope(out: dict) -> None:
    """megatron LongRoPERotaryEmbedding tables vs the pure LongRoPE tables (below/above original)."""
    from nosa_layers.megatron.rope import LongRoPERotaryEmbedding
    from nosa_layers.rope.longrope import longrope_cos_sin

    m = CASES["longrope"].model
    emb = LongRoPERotaryEmbedding(m.kv_channels, m.longrope, m.rope_theta, use_cpu_initialization=True)
    f = m.longrope.resolved_attention_factor(m.max_position_embeddings)
    worst = 0.0
    for T in (100, 128, 129, 256):
        e = emb(T)[:, 0, 0]  # [T, D]
        cos, sin = longrope_cos_sin(m.longrope, torch.arange(T), m.kv_channels, m.rope_theta,
                                    m.max_position_embeddings)
        worst = max(worst, (torch.cos(e) * f - cos).abs().max().item(), (torch.sin(e) * f - sin).abs().max().item())
    out["longrope_megatron"] = {"abs": worst}


def _record_cases(out: dict, prefix: str, rows: tuple, run) -> None:
    """``out[f"{prefix}/{case}/{rows name}"] = run(case, docs)`` for the packed and LongRoPE cases,
    each recorded on its own so one failure does not hide the others."""
    for case_name in ("packed", "longrope"):
        for docs_name, docs in rows:
            key = f"{prefix}/{case_name}/{docs_name}"
            try:
                out[key] = run(CASES[case_name], docs)
            except Exception:
                out[key] = traceback.format_exc()
                print(out[key], file=sys.stderr, flush=True)


def _run_both(case, docs, seed: int, variant) -> tuple[dict, dict]:
    """One row (packed into ``docs``, or plain when None) through a fresh model of ``case``, forward and
    backward, once per ``variant(model, on)`` context (on, then off); returns the comparison of the two
    runs' logits and gradients, and the values each context yielded."""
    setup(LAYOUTS["ref"].parallel)
    model = build_model(case.model, case.attn, seq_length=SEQ, use_te=False)
    perturb_eviction(model, case.seed)
    tok = torch.randint(0, case.model.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(seed))
    w = torch.randn(1, SEQ, case.model.vocab_size, generator=torch.Generator().manual_seed(seed + 1))
    res, seen = {}, {}
    for on in (True, False):
        model.zero_grad(set_to_none=True)
        with variant(model, on) as counts:
            if docs is None:
                logits = model(tok, torch.arange(SEQ)[None], None)
            else:
                psp, pos = packed_row(docs)  # a fresh PackedSeqParams: no cached positions
                logits = model(tok, pos, None, packed_seq_params=psp)
            (logits.float() * w).sum().backward()
        seen[on] = dict(counts)
        res[on] = (logits.detach().clone(),
                   {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
    (l_new, g_new), (l_ref, g_ref) = res[True], res[False]
    return {"logits_equal": torch.equal(l_new, l_ref), "max_logit_diff": (l_new - l_ref).abs().max().item(),
            "grads_equal": g_new.keys() == g_ref.keys() and all(torch.equal(g_new[n], g_ref[n]) for n in g_ref),
            "grads": len(g_ref), "layers": case.model.num_layers,
            "mscale": model.decoder.layers[0].self_attention._yarn_concentration_factor,
            "dtype": str(case.model.params_dtype)}, seen


@contextlib.contextmanager
def _counting(calls: dict, patches: list):
    """Replace ``(module, attribute, name)`` functions with ones that count their calls into ``calls[name]``."""
    saved = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in patches]

    def counted(fn, name):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    for (mod, attr, name), (_, _, fn) in zip(patches, saved):
        setattr(mod, attr, counted(fn, name))
    try:
        yield calls
    finally:
        for mod, attr, fn in saved:
            setattr(mod, attr, fn)


def check_sync_free_rope(out: dict) -> None:
    """Packed THD logits and gradients with the sync-free RoPE vs megatron's per-document RoPE."""
    from megatron.core.models.common.embeddings import rope_utils

    from nosa_layers.megatron.self_attention import NOSAMegatronSelfAttention

    @contextlib.contextmanager
    def sync_free(model, on: bool):
        NOSAMegatronSelfAttention.sync_free_rope = on
        try:
            with _counting({"thd": 0}, [(rope_utils, "_apply_rotary_pos_emb_thd", "thd")]) as calls:
                yield calls
        finally:
            NOSAMegatronSelfAttention.sync_free_rope = True

    def run(case, docs):
        r, seen = _run_both(case, docs, 5, sync_free)
        return {**r, "thd_calls_new": seen[True]["thd"], "thd_calls_megatron": seen[False]["thd"]}

    _record_cases(out, "sync_free_rope", (("docs", ROPE_DOCS), ("one_doc", [SEQ])), run)


def check_fused_rope(out: dict) -> None:
    """The fused RoPE kernel (interpreter; fp32 is bitwise there) against megatron's unfused RoPE in
    a whole model, every layer's ``fused_rope`` on and off: packed THD rows and plain rows, plain RoPE
    and LongRoPE (``mscale`` != 1); counts the kernel's launches and megatron's unfused RoPE calls."""
    from megatron.core.models.common.embeddings import rope_utils

    from nosa_layers.megatron import self_attention
    from nosa_layers.ops import rope as rope_ops

    @contextlib.contextmanager
    def fused(model, on: bool):
        for layer in model.decoder.layers:
            layer.self_attention.fused_rope = on
        with _counting({"kernel": 0, "megatron": 0}, [
                (rope_ops, "_launch", "kernel"), (rope_utils, "_apply_rotary_pos_emb_bshd", "megatron"),
                (self_attention, "_apply_rotary_pos_emb_bshd", "megatron")]) as calls:
            yield calls

    def run(case, docs):
        # two layers: the second reads what the first left (cached tables, positions); more layers only repeat
        # the interpreted kernel (about 13 CPU s per layer over the four rows)
        r, seen = _run_both(replace(case, model=replace(case.model, num_layers=2)), docs, 7, fused)
        return {**r, "calls_fused": seen[True], "calls_unfused": seen[False]}

    _record_cases(out, "fused_rope", (("docs", ROPE_DOCS), ("rows", None)), run)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["ref", "par"], required=True)
    ap.add_argument("--world", type=int, default=2, help="par role: run the layouts of this world size")
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    summary = {}
    for case_name in args.cases.split(","):
        layouts = ["ref"] if args.role == "ref" else [
            lay for lay in CASES[case_name].layouts if LAYOUTS[lay].world == args.world]
        for layout in layouts:
            init_state = None
            if args.role == "par":
                init_state = torch.load(os.path.join(args.out, case_name, "ref", "rank0.pt"))["init"]
            try:
                run_one(case_name, layout, args.out, init_state)
                summary[f"{case_name}/{layout}"] = "ok"
            except Exception:  # recorded per case so one failure does not hide the others
                summary[f"{case_name}/{layout}"] = traceback.format_exc()
                print(summary[f"{case_name}/{layout}"], file=sys.stderr, flush=True)
            dist.barrier()
    if args.role == "ref":
        for check in (check_core_attention, check_layer_vs_reference, check_mup, check_longrope,
                      check_sync_free_rope, check_fused_rope):
            try:
                check(summary)
            except Exception:
                summary[check.__name__] = traceback.format_exc()
                print(summary[check.__name__], file=sys.stderr, flush=True)
    if dist.get_rank() == 0:
        role = args.role if args.role == "ref" else f"par{args.world}"
        with open(os.path.join(args.out, f"summary_{role}.json"), "w") as fh:
            json.dump(summary, fh, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
