"""Peak GPU memory of one training step, from shapes alone: the formula ``dry_run=true`` plans with.

Everything is bytes on one GPU (the most loaded pipeline stage), for the layers this project builds on
a GPU (``train.fusions``, local layer spec; the Transformer Engine spec is planned like it). Symbols:
``a`` bytes of an activation (bf16 / fp16: 2, fp32: 4); ``h`` hidden size; ``f`` FFN size; ``D`` head
dim; ``Hq`` / ``Hkv`` query / KV heads; ``q = Hq D``, ``kv = Hkv D``; ``V`` padded vocabulary; TP /
PP / CP / DP the layout; ``/tp`` for the TP-split tensors (``Hkv`` at least 1 per rank), ``/sp`` for
the hidden-sized ones (``sp`` = TP with sequence parallelism, else 1); ``t`` tokens of one micro-batch
on one rank (``micro_batch_size x seq_length / CP``). Counted per token (``* t``) unless said.

Static (:func:`static_bytes`): weights (bf16 / fp16: 2 B, fp32: 4 B per parameter), the fp32 gradient
buffer (4 B: ``grad_reduce_in_fp32``), fp32 master weights (bf16 / fp16 only: 4 B) and the two Adam
moments (8 B), the last two sharded over DP x CP by the distributed optimizer. Parameters are counted
exactly from the shapes (:func:`parameter_counts`).

What one decoder layer keeps for its backward (:func:`layer_bytes`), per ``train.recompute``:

* ``none``, fused layers: residual stream ``2 a h/sp`` (the attention block's sum, kept by the second
  norm, and the layer output, kept by the next norm), norm outputs ``2 a h/sp`` (the QKV and FC1
  inputs) and their fp32 inverse RMS ``2 x 4/sp``; rotated queries ``a q/tp`` and keys ``a kv/tp``; the
  attention output ``a q/tp`` (also the projection's input); the FC1 output ``2 a f/tp`` (the fused
  SwiGLU's input) and the SwiGLU output ``a f/tp`` (FC2's input).
  Unfused layers (``train.fusions=false``) instead keep per norm an fp32 copy of its input, the
  normalised and the weighted output ``4 h + 2 a h + 4`` (no residual stream), RoPE's cos / sin of q
  and k ``4 a D``, and SwiGLU's silu output, the copy of the up half and the product ``3 a f/tp``.
* dense attention (FlashAttention / cuDNN): the value is a view of the fused QKV projection, so all
  of it stays ``a (q + 2 kv)/tp``, plus the log-sum-exp ``4 Hq/tp`` (fp32).
* NOSA / InfLLM-V2 attention (Triton / Hopper kernels): a contiguous value copy ``a kv/tp``, the
  log-sum-exp ``4 Hq/tp``, the block-sparse index (:func:`sparse_index_bytes`; the selection itself is
  freed after the forward) and, on Hopper, the key-major bias ``4 Hkv/tp`` (NOSA's bias only).
  The eviction head of NOSA layers (all KV heads, replicated over TP), value-gated heads: the compact
  value copy ``a kv`` and the fp32 pre-activation and score ``2 x 4 Hkv`` (``dma`` / ``s_dma`` one more
  ``4 Hkv``; unfused: an fp32 value copy ``4 kv`` and three fp32 ``4 Hkv``); ``locret``: its input
  ``a (q + 2 kv)``, two hidden activations ``2 a 1024`` and the score ``4 Hkv``.
* ``selective`` (core attention recomputed): the checkpoint keeps q, k and the value view, hence the
  whole QKV projection ``a (q + 2 kv)/tp`` instead of the value copy, drops the log-sum-exp (and the
  Hopper bias) and, for NOSA / InfLLM-V2, keeps the selection ``Hkv/tp x ceil(seq/block)`` (bool)
  for the recompute.
* ``full`` (each layer recomputed): its output ``a h/sp`` only (the next checkpoint's input).
* context parallelism: :func:`context_parallel_kv_bytes` per layer and token of the rank.

Per micro-batch (:func:`micro_batch_bytes`): the embedding output ``a h/sp`` (first stage; kept by the
first fused norm or the first checkpoint), RoPE's angles ``4 D`` (fp32), the fused RoPE's cos / sin
tables ``2 a D`` and packed positions ``8``, the sparse kernels' KV block table ``16/block``, and on the
last stage the final norm's output and statistics ``a h/sp + 4/sp`` (unfused: ``4 h + 2 a h + 4``, per sp).

The peak of a step is reached at one of two moments, whichever is larger:

* the loss on the last stage (:func:`loss_bytes`), every layer's activations still kept. The whole-logit
  losses (``train.loss_impl`` fused / standard) at the cross entropy's backward, per token
  (:func:`logits_bytes`): ``10 V/tp`` for ``fused`` in bf16 (megatron-core's compiled fused cross entropy:
  its fp32 softmax, the fp32 buffer its compiled backward writes the gradient into before the bf16 cast,
  and the bf16 logit gradient), ``6`` for ``standard`` in bf16 and in fp16 (16-bit logits + fp32 copy in
  the forward, fp32 softmax + 16-bit gradient in the backward), ``4`` in fp32 (the logits are the
  softmax); plus ``21`` B per token of loss bookkeeping. The chunked loss during its forward (which also
  computes its gradients): per token the hidden-state gradient ``a h`` (and, with sequence parallelism, the
  gathered hidden states ``a h``) and ``16`` B of bookkeeping; the fp32 weight gradient ``4 h V/tp``; one
  chunk's logits ``min(loss_chunk_tokens, t') x V/tp x`` (``10`` with megatron-core's fused helpers in bf16
  under ``train.fusions``, ``6`` in bf16 without, ``4`` in fp32), ``t'`` the micro-batch's tokens on the
  rank after the sequence-parallel gather;
* a layer's backward (:func:`backward_working_bytes`): the MLP's gradient buffers ``a (h/sp + 3 f/tp)``
  (incoming, FC2-input and FC1-output gradients) and, with ``full`` recompute, the recomputed layer's
  ``none`` set. NOSA's dK/dV fp32 partials depend on the selections and are not counted.

Pipeline stages keep ``min(PP, micro-batches)`` micro-batches in flight on the first stage (1F1B;
interleaving adds ``(PP-1)/(PP*VPP)``). ``WORKSPACE`` adds the cuBLAS workspaces and the caching
allocator's rounding of every block, which ``torch.cuda.max_memory_allocated`` counts. The estimate is
of that allocated peak; what the allocator reserves beyond it (fragmentation: 1-2% at 16K, ~12% at
32K on an H200) and the CUDA context are the verdict's headroom (``train/dry_run.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from train.config import RunConfig

GIB = 2 ** 30
# cuBLAS workspaces (32 MiB per stream on Hopper) and the allocator's rounding of each block (512 B, and
# up to 1 MiB of an unsplit large block): the measured H200 peaks run 0.04-0.35 GiB above the tensors
# this module counts (docs/BENCHMARKS.md, "Memory planner"); 0.2 GiB sits in the middle of that range
WORKSPACE = 0.2 * GIB
PARTS = ("weights", "grads", "optimizer", "activations", "loss", "backward", "workspace")
SPARSE = ("nosa", "infllm_v2")
VALUE_GATED = ("ed_dma", "dma", "s_dma")
LOCRET_HIDDEN = 1024  # nosa_layers.eviction.LocretHead's default hidden size (the layer spec keeps it)
QUERY_TILE_ROWS = 64  # rows of a kernel query tile on every GPU (nosa_layers.ops.attention_op.CONFIG)
DKDV_MIN_CHUNK_UNITS = 256  # smallest dK/dV piece, in units of 64 query rows x one block (sparse_index)
LOSS_BOOKKEEPING = 21  # per token: int64 target copies (2 x 8), fp32 predicted logit (4), bool mask (1)
# per token of the chunked loss: its int64 labels in token order (8), the fp32 mask (4) and the gradient
# weights mask x logit scale (4)
CHUNK_BOOKKEEPING = 16


@dataclass
class StageMemory:
    """Bytes per GPU of one pipeline stage (``name``: only / first / last) by part (``PARTS``)."""

    name: str
    parts: dict

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def eviction_head_parameters(head: str, num_q_heads: int, num_kv_heads: int, head_dim: int, bias: bool) -> int:
    """Parameters of one layer's eviction head (``nosa_layers.eviction``; replicated over TP)."""
    if head in VALUE_GATED:
        return num_kv_heads * num_kv_heads * head_dim + num_kv_heads * (2 if bias else 1)  # delta.weight, A, bias
    if head == "locret":
        return (num_q_heads + 2 * num_kv_heads) * head_dim * LOCRET_HIDDEN + LOCRET_HIDDEN * num_kv_heads
    return 0


def parameter_counts(cfg: RunConfig) -> dict:
    """Exact parameter counts of the whole model from its shapes: ``total``, ``embedding``, ``output``
    (0 when tied), ``layers`` (decoder layers, eviction heads included) and ``eviction``."""
    m, a = cfg.model, cfg.attention
    h, d, hq, hkv, f = m.hidden_size, m.kv_channels, m.num_attention_heads, m.num_kv_heads, m.ffn_hidden_size
    dense_layer = h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * f + 2 * h  # QKV, projection, FC1 (gate|up), FC2, norms
    head = eviction_head_parameters(a.nosa.eviction_head, hq, hkv, d, a.eviction_bias)
    n_nosa = variant_counts(cfg, 0, m.num_layers).get("nosa", 0)
    embedding = m.padded_vocab_size * h
    output = 0 if m.tie_embeddings else embedding
    layers = m.num_layers * dense_layer + n_nosa * head
    return {"total": layers + embedding + output + h, "embedding": embedding, "output": output,
            "layers": layers, "eviction": n_nosa * head}


def variant_counts(cfg: RunConfig, start: int, stop: int) -> dict:
    """How many of the layers ``start .. stop-1`` run each attention variant (without listing the layers
    when every layer runs ``attention.variant``: any number of layers costs the same)."""
    a = cfg.attention
    if a.layer_pattern is None:
        return {a.variant: stop - start} if stop > start else {}
    out: dict = {}
    for v in a.layer_pattern[start:stop]:
        out[v] = out.get(v, 0) + 1
    return out


def _act(cfg: RunConfig) -> int:
    return 4 if cfg.train.precision == "fp32" else 2


def _tokens(cfg: RunConfig) -> float:
    return cfg.train.micro_batch_size * cfg.train.seq_length / cfg.parallel.context_parallel_size


def _local(cfg: RunConfig) -> tuple[int, int, float, int, float, float]:
    """``tp, sp, hq_local, hkv_local, q_local, kv_local`` of one TP rank (KV heads replicated when TP > Hkv)."""
    p, m = cfg.parallel, cfg.model
    tp = p.tensor_model_parallel_size
    sp = tp if p.sequence_parallel else 1
    hq = m.num_attention_heads / tp
    hkv = max(1, m.num_kv_heads // tp)
    return tp, sp, hq, hkv, hq * m.kv_channels, hkv * m.kv_channels


def query_tile(group: int, block: int, rows: int = QUERY_TILE_ROWS) -> int:
    """Tokens per kernel query tile for ``group`` query heads per KV head (``sparse_index.query_tile``)."""
    heads = max(d for d in range(1, min(group, rows) + 1) if group % d == 0)
    qt = 1 << (max(1, min(block, rows // heads)).bit_length() - 1)
    while qt * heads < 16 and qt < block:
        qt *= 2
    return qt


def sparse_index_bytes(cfg: RunConfig, key_group_blocks: int = 1) -> float:
    """Bytes per token of the block-sparse index one NOSA / InfLLM-V2 layer keeps for its backward
    (``nosa_layers.ops.sparse_index.SparseIndex``), for a document as long as the sequence (the widest
    selection, hence the peak over steps). ``qt`` tokens per query tile (:func:`query_tile`), ``cap =
    min(ceil(seq / block), qt * topk)`` list entries per (tile, KV head): per token ``Hkv/tp * cap / qt``
    entries of ``fwd_ks`` (4 B), ``fwd_word`` (``w`` = 4 B, 8 B for tiles over 32 tokens), ``inv_qs`` (4 B)
    and ``inv_word`` (``w`` per block of a dK/dV key group, ``key_group_blocks``: 1 on GPUs, 2 for the
    Triton dK/dV on Hopper without Gluon and under the interpreter); ``fwd_count`` (4 B per tile and KV
    head), three list pointers (4 B per block and KV head) and the dK/dV piece list (at most one 4 B
    entry per list and per ``DKDV_MIN_CHUNK_UNITS`` units of work)."""
    n = cfg.attention.nosa
    _, _, hq, hkv, _, _ = _local(cfg)
    group = max(1, round(hq / hkv))
    qt = query_tile(group, n.block_size)
    blocks = math.ceil(cfg.train.seq_length / n.block_size)
    cap = max(1, min(blocks, qt * n.topk))
    word = 8 if qt > 32 else 4
    entries = hkv * cap / qt  # per token
    chunk = max(1, DKDV_MIN_CHUNK_UNITS * 64 // (qt * group * key_group_blocks))
    lists = hkv / n.block_size  # per token
    return (entries * (4 + word + 4 + word * key_group_blocks) + 4 * hkv / qt + 3 * 4 * lists
            + 4 * (lists + entries / chunk))


def _eviction_bytes(cfg: RunConfig) -> float:
    """Per token: what a NOSA layer's eviction head keeps (all KV heads; see the module docstring)."""
    m, head, a = cfg.model, cfg.attention.nosa.eviction_head, _act(cfg)
    kv, hkv = m.num_kv_heads * m.kv_channels, m.num_kv_heads
    if head in VALUE_GATED:
        extra = 4 * hkv if head in ("dma", "s_dma") else 0
        return (a * kv + 8 * hkv if cfg.train.fusions else 4 * kv + 12 * hkv) + extra
    if head == "locret":
        return a * (m.num_attention_heads * m.kv_channels + 2 * kv) + 2 * a * LOCRET_HIDDEN + 4 * hkv
    return 0.0


def layer_bytes(cfg: RunConfig, variant: str, recompute: str | None = None, key_group_blocks: int = 1,
                hopper: bool = True) -> dict:
    """Bytes per token that one decoder layer of ``variant`` (dense | nosa | infllm_v2) keeps for its
    backward on one GPU under ``recompute`` (default ``train.recompute``), by term (module docstring);
    ``key_group_blocks`` / ``hopper``: the kernels' dK/dV key groups and the Hopper forward's bias."""
    recompute = recompute or cfg.train.recompute
    a, m, fused = _act(cfg), cfg.model, cfg.train.fusions
    tp, sp, hq, hkv, q, kv = _local(cfg)
    h, f, d = m.hidden_size, m.ffn_hidden_size / tp, m.kv_channels
    if recompute == "full":
        return {"layer output": a * h / sp}
    t = {}
    if fused:
        t["residual stream"] = 2 * a * h / sp
        t["norm outputs"] = 2 * a * h / sp
        t["norm statistics"] = 2 * 4 / sp
        t["mlp"] = 3 * a * f
    else:
        t["norms"] = 2 * (4 * h + 2 * a * h + 4) / sp
        t["rope tables"] = 4 * a * d
        t["mlp"] = 5 * a * f
    t["rotated q, k"] = a * (q + kv)
    t["attention output"] = a * q
    qkv = a * (q + 2 * kv)
    selective = recompute == "selective"
    if variant == "dense":
        t["qkv projection"] = qkv
        if not selective:
            t["log-sum-exp"] = 4 * hq
    else:
        t["sparse index"] = sparse_index_bytes(cfg, key_group_blocks)
        if selective:
            t["qkv projection"] = qkv
            t["selection"] = hkv * math.ceil(cfg.train.seq_length / cfg.attention.nosa.block_size)
        else:
            t["value copy"] = a * kv
            t["log-sum-exp"] = 4 * hq
            if hopper and variant == "nosa":
                t["hopper bias"] = 4 * hkv
        if variant == "nosa":
            t["eviction head"] = _eviction_bytes(cfg)
    cp_kv = context_parallel_kv_bytes(cfg)
    if cp_kv:
        t["context-parallel k, v"] = cp_kv
    return t


def context_parallel_kv_bytes(cfg: RunConfig) -> float:
    """Bytes per layer and per token of this rank that context parallelism adds: the keys and values of
    the other ``CP - 1`` ranks' sequence chunks, gathered for the attention and kept for its backward,
    ``2 a kv/tp (CP - 1)`` (0 at CP = 1). The rest of a layer's activations scale with the rank's
    ``seq_length / CP`` tokens (:func:`layer_bytes` is per token of the rank)."""
    cp = cfg.parallel.context_parallel_size
    if cp <= 1:
        return 0.0
    _, _, _, _, _, kv = _local(cfg)
    return 2 * _act(cfg) * kv * (cp - 1)


def micro_batch_bytes(cfg: RunConfig, first: bool, last: bool) -> float:
    """Bytes per token a micro-batch keeps outside the layers: the embedding output (first stage),
    RoPE's angles, tables and positions, the final norm (last stage)."""
    a, m, fused = _act(cfg), cfg.model, cfg.train.fusions
    _, sp, _, _, _, _ = _local(cfg)
    h, d = m.hidden_size, m.kv_channels
    out = 4 * d + 8 + (2 * a * d if fused else 0)
    if any(v in SPARSE for v in variant_counts(cfg, 0, m.num_layers)):
        out += 16 / cfg.attention.nosa.block_size  # the KV block table the sparse kernels walk
    if first and (fused or cfg.train.recompute == "full"):
        out += a * h / sp
    if last:
        out += (a * h + 4 if fused else 4 * h + 2 * a * h + 4) / sp
    return out


def logit_entry_bytes(cfg: RunConfig) -> int:
    """Bytes per logit entry (one token, one vocabulary entry of this rank) at the loss's peak: ``10 / 6 / 4``
    (module docstring)."""
    t = cfg.train
    if t.precision == "fp32":
        return 4
    if t.precision == "bf16" and (t.loss_impl == "fused" or (t.loss_impl == "chunked" and t.fusions)):
        return 10
    return 6


def logits_bytes(cfg: RunConfig) -> float:
    """Bytes per token at the cross entropy's backward of a whole-logit loss (``train.loss_impl`` fused /
    standard): ``10 / 6 / 4`` per vocabulary entry on this rank (module docstring) plus the loss bookkeeping."""
    return logit_entry_bytes(cfg) * cfg.model.padded_vocab_size / cfg.parallel.tensor_model_parallel_size + \
        LOSS_BOOKKEEPING


def loss_bytes(cfg: RunConfig) -> float:
    """Bytes of one micro-batch's loss at its peak on the last stage (module docstring): the whole-logit
    losses ``t x`` :func:`logits_bytes`; the chunked loss its kept gradients, bookkeeping and one chunk."""
    t = _tokens(cfg)
    if cfg.train.loss_impl != "chunked":
        return t * logits_bytes(cfg)
    tp, sp, _, _, _, _ = _local(cfg)
    a, h = _act(cfg), cfg.model.hidden_size
    vocab = cfg.model.padded_vocab_size / tp
    per_token = a * h * (2 if sp > 1 else 1) + CHUNK_BOOKKEEPING
    chunk = min(cfg.train.loss_chunk_tokens, t)
    return t * per_token + 4 * h * vocab + chunk * vocab * logit_entry_bytes(cfg)


def backward_working_bytes(cfg: RunConfig, variants) -> float:
    """Bytes per token of one layer's backward beyond what is kept: the MLP's gradient buffers and, with
    full recompute, the recomputed layer's ``none`` set (the largest of the ``variants`` present)."""
    a, m = _act(cfg), cfg.model
    tp, sp, _, _, _, _ = _local(cfg)
    grads = a * (m.hidden_size / sp + 3 * m.ffn_hidden_size / tp)
    if cfg.train.recompute != "full":
        return grads
    return grads + max(sum(layer_bytes(cfg, v, "none").values()) for v in variants)


def bytes_per_parameter(cfg: RunConfig) -> dict:
    """Weights, gradient buffer and optimizer state per parameter before any sharding (bytes)."""
    low = cfg.train.precision in ("bf16", "fp16")
    return {"weights": 2 if low else 4, "grads": 4, "optimizer": (4 if low else 0) + 8}


def static_bytes(cfg: RunConfig, params: float, world_size: int) -> dict:
    """Weights, gradient buffer and optimizer state of ``params`` parameters on one GPU (the optimizer
    state sharded over DP x CP by the distributed optimizer)."""
    p = cfg.parallel
    dp = world_size // p.model_parallel_size
    shard = dp * p.context_parallel_size if p.use_distributed_optimizer else 1
    per = bytes_per_parameter(cfg)
    return {"weights": params * per["weights"], "grads": params * per["grads"],
            "optimizer": params * per["optimizer"] / shard}


def estimate_memory(cfg: RunConfig, counts: dict, world_size: int) -> list[StageMemory]:
    """Peak bytes per GPU of each kind of pipeline stage (one entry at PP=1; first and last otherwise)."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    tp, pp, vpp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    dp = world_size // p.model_parallel_size
    per_layer = counts["layers"] / m.num_layers
    output = counts["output"] or (counts["embedding"] if pp > 1 else 0)  # tied: the last stage keeps a copy
    microbatches = t.global_batch_size // (t.micro_batch_size * dp)
    tokens = _tokens(cfg)
    n_layers = m.num_layers // pp
    stages = [("only", True, True)] if pp == 1 else [("first", True, False), ("last", False, True)]
    out = []
    for name, first, last in stages:
        mine = variant_counts(cfg, 0, n_layers) if first else variant_counts(cfg, m.num_layers - n_layers, m.num_layers)
        params = (n_layers * per_layer + (counts["embedding"] if first else 0) + (output if last else 0)) / tp
        in_flight = 1.0
        if first and pp > 1:
            in_flight = min(pp, microbatches) * (1 + (pp - 1) / (pp * vpp) if vpp else 1)
        layers = sum(sum(layer_bytes(cfg, v).values()) * n for v, n in mine.items())
        parts = dict(static_bytes(cfg, params, world_size))
        parts["activations"] = in_flight * tokens * (layers + micro_batch_bytes(cfg, first, last))
        loss = loss_bytes(cfg) if last else 0.0
        backward = tokens * backward_working_bytes(cfg, mine)
        parts["loss" if loss >= backward else "backward"] = max(loss, backward)
        parts["workspace"] = WORKSPACE
        out.append(StageMemory(name, parts))
    return out
