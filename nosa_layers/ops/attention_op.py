"""Autograd wrapper of the block-sparse NOSA attention kernels."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from ._common import LOG2E, check_device, padded_heads
from .attention_kernels import _bwd_delta_kernel, _bwd_dkdv_kernel, _bwd_dq_kernel, _dkdv_reduce_kernel, _fwd_kernel
from .launch import CONFIG, arch, hopper_device, launch_config, sm90_kernels, triton_settings
from .sparse_index import SparseIndex, largest_divisor, query_tile


def hopper_kernel(q: Tensor, idx: SparseIndex, hp: int, cfg: dict, kind: str = "query") -> bool:
    """Whether a kernel (``cfg``: its launch settings; ``kind``: "query" for the forward and dQ, "dkdv")
    takes the hand-scheduled Hopper kernel (``attention_sm90``): asked for by ``impl = "gluon"``,
    compiled on an sm90 GPU (wgmma is Hopper-only), and a shape it is written for; anything else
    takes the Triton kernel, which computes the same."""
    if cfg["impl"] not in ("triton", "gluon"):
        raise ValueError(f"nosa_layers.ops: impl must be 'triton' or 'gluon', got {cfg['impl']!r}")
    if cfg["impl"] != "gluon" or not hopper_device(q.device) or idx.subset:  # query chunks: the Triton kernels
        return False
    return _hopper_covers(q, idx.block, padded_heads(hp) * idx.qt, idx.kb, kind)


def _hopper_covers(q: Tensor, block: int, rows: int, kb: int, kind: str) -> bool:
    """Whether the Hopper kernel of ``kind`` ("query": forward and dQ, "dkdv") is written for tiles of ``rows``
    rows (padded heads x tokens) over ``block``-key blocks (``kb`` per dK/dV group) and ``q``'s dtype / D."""
    sm90 = sm90_kernels()
    return sm90.supported_dkdv(q, block, rows, kb) if kind == "dkdv" else sm90.supported(q, block, rows)


def _launch_for(q: Tensor, idx: SparseIndex) -> dict:
    """The launch settings of an attention call: ``launch_config``'s, the Triton kernels' own for an index
    of query chunks (the Hopper kernels do not take them)."""
    return triton_settings(CONFIG[arch(q.device)]) if idx.subset else launch_config(q.device, q, idx.block)


POISON_OUTPUTS = False  # tests: fill every output buffer with NaN before the kernels write it


def _empty_like(x: Tensor) -> Tensor:
    out = torch.empty_like(x)
    return out.fill_(float("nan")) if POISON_OUTPUTS else out


def _empty(*shape, **kw) -> Tensor:
    out = torch.empty(*shape, **kw)
    return out.fill_(float("nan")) if POISON_OUTPUTS else out


def heads_per_program(G: int, qt: int, rows: int) -> int:
    """Query heads packed into one program: the largest divisor of G with ``padded_heads(heads) * qt <= rows``
    (at least 1, and at least 16 rows for ``tl.dot`` where G allows)."""
    hp = largest_divisor(G, rows // qt)
    while padded_heads(hp) * qt < 16 and hp < G:
        hp = next(d for d in range(hp + 1, G + 1) if G % d == 0)
    return hp


def attention_plan(G: int, head_dim: int, block: int, dtype: torch.dtype, device: torch.device) -> list[str]:
    """Which attention kernels serve KV groups of ``G`` query heads on ``device`` (a CUDA GPU), said before
    a run starts: a line on the padded query tiles of a group that is not a power of two, and one naming the
    kernels that take the Triton path where the Hopper kernels are asked for but do not cover the shape."""
    q = torch.empty(1, 1, 1, head_dim, dtype=dtype, device="meta")  # what the launch checks read: dtype, D
    launch = launch_config(device, q, block)
    qt = query_tile(G, block, launch["tile"]["rows"])[0]
    notes = []
    if padded_heads(G) != G:
        hp = heads_per_program(G, qt, launch["fwd"]["rows"])
        rows = padded_heads(hp) * qt
        notes.append(f"NOSA kernels: KV groups of {G} query heads run in query tiles of {qt} tokens x "
                     f"{padded_heads(hp)} head rows ({hp} real: {100 * (rows - hp * qt) // rows}% of the rows are "
                     f"padding)")
    if not hopper_device(device):
        return notes
    cfg = CONFIG[arch(device)]
    missed = []
    for name in ("fwd", "dq", "dkdv"):
        if cfg[name]["impl"] != "gluon":
            continue
        rows = padded_heads(heads_per_program(G, qt, launch[name]["rows"])) * qt
        if not _hopper_covers(q, block, rows, launch[name].get("blocks", 1), "dkdv" if name == "dkdv" else "query"):
            missed.append(name)
    if missed:
        notes.append(f"NOSA kernels: the Triton {', '.join(missed)} kernels serve instead of the Hopper ones, which "
                     f"cover 16-bit inputs, head dims 64 / 128 and 64-token blocks (this model: "
                     f"{str(dtype).replace('torch.', '')}, head dim {head_dim}, {block}-token blocks)")
    return notes


HEAD_DIMS = (16, 32, 64, 128, 256)
BLOCK_SIZES = (16, 32, 64)


def supports_attention(head_dim: int, block: int) -> bool:
    """Whether the attention kernels cover this head dim and block size."""
    return head_dim in HEAD_DIMS and block in BLOCK_SIZES


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, block: int) -> None:
    D = q.shape[-1]
    if D not in HEAD_DIMS:
        raise ValueError(f"nosa_layers.ops: head dim must be a power of two in 16..256, got {D}")
    if block not in BLOCK_SIZES:
        raise ValueError(f"nosa_layers.ops: block_size must be 16, 32 or 64, got {block}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("nosa_layers.ops: q, k, v need a contiguous last dimension")


def _strides_bias(bias: Tensor | None):
    return (0, 0, 0) if bias is None else bias.stride()


def attention_forward(q, k, v, bias, idx: SparseIndex, scale: float):
    """Output ``o`` ``[B, T, Hq, D]``, log2-sum-exp ``lse`` fp32 ``[B, Hq, T]`` and the key-major bias the
    Hopper forward read (``attention_sm90.key_major_bias``; ``None`` where it did not run or without a
    bias), which the backward's dQ takes instead of building it again."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    o = _empty_like(q)
    lse = _empty(B, Hq, T, dtype=torch.float32, device=q.device)
    cfg = _launch_for(q, idx)["fwd"]
    hp = heads_per_program(G, idx.qt, cfg["rows"])
    grid = (idx.n_tiles * Hkv * (G // hp),)
    kbias = None
    if grid[0] and hopper_kernel(q, idx, hp, cfg):
        sm90 = sm90_kernels()
        kbias = sm90.key_major_bias(bias, idx.block)
        if cfg.get("keys_per_step", 64) == 128 and sm90.supported_pairs(padded_heads(hp) * idx.qt):
            sm90.launch_forward_pairs(q, k, v, kbias, o, lse, idx, grid[0], hp, scale * LOG2E)
        else:
            sm90.launch_forward(q, k, v, kbias, o, lse, idx, grid[0], hp, scale * LOG2E, cfg["num_stages"],
                                cfg["regs"], cfg.get("maxnreg"))
    elif grid[0]:
        _fwd_kernel[grid](q, k, v, q if bias is None else bias, o, lse, idx.layout.blocks, idx.fwd_count, idx.fwd_ks,
                          idx.fwd_word, *idx.query_args(q.device), idx.n_tiles, idx.cap,
                          *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *_strides_bias(bias),
                          *o.stride()[:3], lse.stride(0), lse.stride(1), scale * LOG2E,
                          HKV=Hkv, G=G, HP=hp, HPP=padded_heads(hp), QT=idx.qt, BS=idx.block, D=D,
                          HAS_BIAS=bias is not None,
                          SUBSET=idx.subset, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return o, lse, kbias


def attention_backward(q, k, v, bias, o, lse, do, idx: SparseIndex, scale: float, need_db: bool, kbias=None):
    """``dq, dk, dv`` (inputs' dtypes) and ``db`` fp32 ``[B, T, Hkv]`` (``None`` unless ``need_db``);
    ``kbias``: the forward's key-major bias, if it made one (else the Hopper dQ builds it)."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    BS = idx.block
    if do.stride(-1) != 1:  # the kernels need a contiguous head dim
        do = do.contiguous()
    delta = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    if T:
        _bwd_delta_kernel[(triton.cdiv(T, 64), B * Hq)](o, do, delta, T, Hq, *o.stride()[:3], *do.stride()[:3],
                                                        delta.stride(0), delta.stride(1), BM=64, D=D)
    dq = _empty_like(q)
    dk = _empty_like(k)
    dv = _empty_like(v)
    db = _empty(B, k.shape[1], Hkv, dtype=torch.float32, device=q.device) if need_db else None
    if idx.n_tiles == 0:
        return dq, dk, dv, db
    bias_arg = q if bias is None else bias
    launch = _launch_for(q, idx)
    cfg = launch["dq"]
    hp = heads_per_program(G, idx.qt, cfg["rows"])
    if hopper_kernel(q, idx, hp, cfg):
        sm90 = sm90_kernels()
        if kbias is None:
            kbias = sm90.key_major_bias(bias, idx.block)
        sm90.launch_dq(q, k, v, kbias, do, lse, delta, dq, idx,
                       idx.n_tiles * Hkv * (G // hp), hp, scale * LOG2E, scale, cfg["num_stages"], cfg["regs"])
    else:
        _bwd_dq_kernel[(idx.n_tiles * Hkv * (G // hp),)](
            q, k, v, bias_arg, do, lse, delta, dq, idx.layout.blocks, idx.fwd_count, idx.fwd_ks, idx.fwd_word,
            *idx.query_args(q.device), idx.n_tiles, idx.cap,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *_strides_bias(bias),
            *do.stride()[:3], lse.stride(0), lse.stride(1), scale * LOG2E, scale,
            HKV=Hkv, G=G, HP=hp, HPP=padded_heads(hp), QT=idx.qt, BS=BS, D=D, HAS_BIAS=bias is not None,
            SUBSET=idx.subset,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    cfg = launch["dkdv"]
    hp = heads_per_program(G, idx.qt, cfg["rows"])
    dbs = db.stride() if need_db else (0, 0, 0)
    db_arg = dk if db is None else db
    n_ws, N = idx.workspace_shape()  # N: keys of a dK/dV key group
    wdk = torch.empty(n_ws, N, D, dtype=torch.float32, device=q.device)
    wdv = torch.empty_like(wdk)
    wdb = torch.empty(n_ws, N, dtype=torch.float32, device=q.device)
    args = (q, k, v, bias_arg, do, lse, delta, dk, dv, db_arg, wdk, wdv, wdb, idx.layout.blocks, idx.inv_ptr,
            idx.inv_qs, idx.inv_word, idx.piece_ptr, idx.piece_list, idx.slot_ptr, idx.n_lists, idx.chunk,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *_strides_bias(bias),
            *do.stride()[:3], lse.stride(0), lse.stride(1), *dbs, scale * LOG2E, scale)
    if hopper_kernel(q, idx, hp, cfg, kind="dkdv"):
        sm90_kernels().launch_dkdv(args, hp, idx.kb, need_db, bias is not None, idx, cfg["num_stages"])
    else:
        _bwd_dkdv_kernel[(idx.max_pieces,)](
            *args, idx.query_args(q.device)[1], HKV=Hkv, G=G, HP=hp, HPP=padded_heads(hp), QT=idx.qt, BS=BS,
            KB=idx.kb, D=D,
            HAS_BIAS=bias is not None, NEED_DB=need_db, SUBSET=idx.subset, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])
    _dkdv_reduce_kernel[(idx.n_lists,)](
        wdk, wdv, wdb, dk, dv, db_arg, idx.layout.blocks, idx.piece_ptr, idx.slot_ptr, *k.stride()[:3],
        *v.stride()[:3], *dbs, scale, HKV=Hkv, N=N, D=D, NEED_DB=need_db, num_warps=4)
    return dq, dk, dv, db


class _NosaSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, idx, scale):
        o, lse, kbias = attention_forward(q, k, v, bias, idx, scale)
        ctx.save_for_backward(q, k, v, bias, o, lse)
        ctx.idx, ctx.scale, ctx.has_bias, ctx.kbias = idx, scale, bias is not None, kbias
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, bias, o, lse = ctx.saved_tensors
        need_db = ctx.has_bias and ctx.needs_input_grad[3]
        dq, dk, dv, db = attention_backward(q, k, v, bias, o, lse, do, ctx.idx, ctx.scale, need_db, ctx.kbias)
        ctx.kbias = None
        if db is not None:
            db = db.to(bias.dtype)
        return dq, dk, dv, db, None, None


def _prep(x: Tensor) -> Tensor:
    """Contiguous input: the gradient buffers (``empty_like``) reuse the input strides in the kernels,
    which only matches for dense layouts (megatron hands over strided views of the fused QKV)."""
    return x if x.is_contiguous() else x.contiguous()


def sparse_attention(q: Tensor, k: Tensor, v: Tensor, index: SparseIndex, bias: Tensor | None = None,
                     softmax_scale: float | None = None) -> Tensor:
    """Block-sparse attention over the selection that ``index`` (``build_sparse_index``) encodes.

    q ``[B, T, Hq, D]``, k/v ``[B, T, Hkv, D]``, bias ``[B, T, Hkv]`` (additive logit bias per key,
    full scale) or ``None``; returns ``[B, T, Hq, D]``, differentiable in q, k, v and bias. An index built
    with query chunks takes only their rows, ``q [B, Tq, Hq, D]`` (output ``[B, Tq, Hq, D]``)."""
    check_device(q, k, v, bias)
    _check_shapes(q, k, v, index.block)
    rows = index.num_rows if index.subset else k.shape[1]
    if q.shape[1] != rows or k.shape[1] != index.layout.seq_len:
        raise ValueError(f"nosa_layers.ops: q {tuple(q.shape)} / k {tuple(k.shape)} do not fit an index of {rows} "
                         f"query rows over {index.layout.seq_len} keys")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    if bias is not None and bias.dtype != torch.float32 and bias.dtype != q.dtype:
        bias = bias.float()
    return _NosaSparseAttention.apply(_prep(q), _prep(k), _prep(v), bias, index, float(scale))
