"""Autograd wrapper of the block-sparse NOSA attention kernels."""

from __future__ import annotations

import functools
import warnings

import torch
import triton
from packaging.version import Version
from torch import Tensor

from ._common import LOG2E, check_device, interpreting
from .attention_kernels import _bwd_delta_kernel, _bwd_dkdv_kernel, _bwd_dq_kernel, _dkdv_reduce_kernel, _fwd_kernel
from .sparse_index import SparseIndex, largest_divisor

# Launch parameters per GPU architecture (compute capability major version; the interpreter uses
# sm90's). ``tile.rows``: rows of a query tile (``qt`` tokens x the heads of a KV group, see
# ``sparse_index.query_tile``); per kernel: ``rows`` (M of its programs: heads packed per program =
# rows // qt, at most G), warps, pipeline stages. Forward and dQ take one KV block per list entry
# (128-key entries were slower on the H200 in every case measured). dK/dV: ``blocks`` KV blocks per
# key group (keys resident in one program, see ``sparse_index``), ``CHUNK`` units of work per list
# piece (a unit = 64 query rows x one KV block; an entry is qt x G rows x ``blocks``; "auto": about
# ``CHUNK_WAVES`` pieces per SM of the attention's estimated work, see ``sparse_index.chunk_units``)
# and ``SLOTS``, the budget of one-block fp32 partials (64 KiB each at D = 128; a group's partial
# takes ``blocks`` of them) for the pieces of split lists; the backward allocates only the slots an
# index uses. Real NOSA selections share their query-agnostic blocks across all later queries, so
# their inverse lists are long; lists past the budget run whole in one program and the kernel waits
# on them (bench/attention.py --balance-sweep on the H200: budget 512 -> 16384 and "auto" chunks took
# the backward on smooth selections from 33.2 to 25.2 ms at 32K/32 and 7.29 to 6.16 ms at 16K/16).
# Two-block groups made the Triton dK/dV up to 22% faster on the H200 (they need 8 warps, with 4 the
# accumulators spill); the warp-specialised Hopper kernel prefers one-block groups (below). sm80 (A100 / A800,
# 164 KB shared memory per SM) keeps one-block groups, the configuration measured there, and every
# kernel under 100 KB of shared memory and its measured piece settings (the balance sweep ran on the
# H200 only); ``test_arch`` compiles every kernel for both targets.
# ``impl = "gluon"``: on sm90 GPUs the kernel is the hand-scheduled Hopper one (``attention_sm90``;
# forward, dQ: TMA ring of ``num_stages`` K/V slots, overlapped wgmma, the A operands Q / dO in
# registers with ``regs``) for the shapes it covers (16-bit, D 64 / 128, 64-key blocks, 64-row tiles);
# other GPUs and shapes take the Triton kernel, which computes the same (bit for bit in the H200 runs, except the
# two-entry forward below: one softmax step per 128 keys rounds differently, within the reference tolerances).
# bench/attention.py --fwd-sweep on the H200 (session 15, after the per-entry loads moved one entry
# ahead): 3 forward slots were 3-5% faster at 16K/16 in all three cases (P1, iid, smooth) and within the
# sweep's 4% noise at 32K/32; dQ with Q / dO in shared memory (245 registers, no spill, against 255
# and a small spill) was at or below the others in 5 of the 6 cases. dK/dV ``impl = "gluon"``: warp-specialised
# (a TMA producer warp, a consumer warpgroup per key block, no CTA-wide barrier per step);
# bench/attention.py --dkdv-sweep on the H200: one-block groups, 32 rows per step, 3 slots, two programs
# per SM, are the fastest on real selections (smooth / iid: 20-25% below the Triton kernel's two-block
# groups) and within 3% of two-block groups on P1 lists. Where the Hopper kernels cannot run
# (``hopper_device``) or do not cover the shape (head dim 256, fp32, 16- / 32-key blocks; the index
# builder is told the queries), the Triton dK/dV keeps its two-block groups (``dkdv["triton"]``).
# The Hopper forward takes two list entries per step (``keys_per_step = 128``, ``attention_sm90_pairs``:
# one 128-key score product and one P V product per pair, 64-row tiles) where it covers the tile; 64 is
# the one-entry kernel above (``num_stages``, ``regs`` are its settings). bench/attention.py --fwd-sweep
# on the H200 (session 22): 128 keys per step 6% faster at 32K/32 on P1 lists (1.31x ideal), 3-5% on real
# selections, within 3% either way at 16K/16; two 64-key products per pair and two warpgroups taking
# turns at the tensor cores (FlashAttention-3's ping-pong) were slower and are not kept.
# Override for experiments (bench/attention.py --sweep, --dkdv-sweep).
CONFIG = {
    "sm90": {
        "tile": dict(rows=64),
        "fwd": dict(rows=64, num_warps=4, num_stages=3, impl="gluon", regs=True, keys_per_step=128,
                    triton=dict(num_stages=2)),
        "dq": dict(rows=64, num_warps=4, num_stages=2, impl="gluon", regs=False),
        "dkdv": dict(rows=32, num_warps=8, num_stages=3, CHUNK="auto", SLOTS=16384, blocks=1, impl="gluon",
                     triton=dict(blocks=2, num_stages=4)),
    },
    "sm80": {
        "tile": dict(rows=64),
        "fwd": dict(rows=64, num_warps=4, num_stages=2, impl="triton", regs=False),
        "dq": dict(rows=64, num_warps=4, num_stages=2, impl="triton", regs=False),
        "dkdv": dict(rows=64, num_warps=4, num_stages=2, CHUNK=1024, SLOTS=512, blocks=1, impl="triton"),
    },
}


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    """Compute capability of CUDA device ``index`` (asked once: a launch consults it several times)."""
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of the CUDA ``device``."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def arch(device: torch.device) -> str:
    """``sm90`` for Hopper and newer data-center GPUs (and the interpreter), ``sm80`` otherwise."""
    if device.type != "cuda" or interpreting():
        return "sm90"
    major, minor = capability(device)
    return "sm90" if major in (9, 10) else "sm80"


def launch_config(device: torch.device, q: Tensor | None = None, block: int | None = None) -> dict:
    """Launch settings for ``device``. Where the Hopper kernels cannot run (the interpreter, another
    sm9x / sm10x GPU, a triton without Gluon) or do not cover the attention's queries ``q`` with KV
    blocks of ``block`` keys (when given; ``attention_sm90.covers``), a kernel with Triton settings of
    its own takes them instead of the Hopper kernel's (``dkdv["triton"]``: two-block groups;
    ``fwd["triton"]``: two K/V stages, the setting measured for the Triton forward)."""
    cfg = CONFIG[arch(device)]
    hopper = hopper_device(device) and (q is None or sm90_kernels().covers(q, block))
    return cfg if hopper else triton_settings(cfg)


def triton_settings(cfg: dict) -> dict:
    """The launch table ``cfg`` as the Triton kernels run it: each kernel's own ``triton`` overrides
    applied (a copy of those kernels' entries; the others are ``cfg``'s own)."""
    return {name: dict(c, **c["triton"]) if "triton" in c else c for name, c in cfg.items()}


GLUON_MIN_TRITON = "3.6"  # the Hopper kernels' Gluon API: written and compiled with triton 3.6 and 3.8


@functools.cache
def sm90_kernels():
    """The ``attention_sm90`` module, or ``None`` (with one warning) where the installed triton is older
    than ``GLUON_MIN_TRITON`` or has no Gluon Hopper API: then every kernel takes the Triton path."""
    why = None
    if Version(triton.__version__).release < Version(GLUON_MIN_TRITON).release:
        why = f"triton {triton.__version__} is older than {GLUON_MIN_TRITON}"
    else:
        try:
            from . import attention_sm90
        except (ImportError, AttributeError) as e:
            why = str(e)
    if why is not None:
        warnings.warn(f"nosa_layers.ops: the Hopper attention kernels need Gluon (triton >= {GLUON_MIN_TRITON}): "
                      f"{why}; using the Triton kernels", stacklevel=2)
        return None
    return attention_sm90


@functools.cache
def sm90_pair_kernels():
    """The ``attention_sm90_pairs`` module (call where ``sm90_kernels()`` is not ``None``: same Gluon API)."""
    from . import attention_sm90_pairs
    return attention_sm90_pairs


def hopper_device(device: torch.device) -> bool:
    """Whether the hand-scheduled Hopper kernels can run on ``device``: an sm90 GPU (wgmma is
    Hopper-only), not the interpreter, a triton with the Gluon API they are written for."""
    if device.type != "cuda" or interpreting():
        return False
    return capability(device) == (9, 0) and sm90_kernels() is not None


def hopper_kernel(q: Tensor, idx: SparseIndex, hp: int, cfg: dict, kind: str = "query") -> bool:
    """Whether a kernel (``cfg``: its launch settings; ``kind``: "query" for the forward and dQ, "dkdv")
    takes the hand-scheduled Hopper kernel (``attention_sm90``): asked for by ``impl = "gluon"``,
    compiled on an sm90 GPU (wgmma is Hopper-only), and a shape it is written for; anything else
    takes the Triton kernel, which computes the same."""
    if cfg["impl"] not in ("triton", "gluon"):
        raise ValueError(f"nosa_layers.ops: impl must be 'triton' or 'gluon', got {cfg['impl']!r}")
    if cfg["impl"] != "gluon" or not hopper_device(q.device) or idx.subset:  # query chunks: the Triton kernels
        return False
    if kind == "dkdv":
        return sm90_kernels().supported_dkdv(q, idx.block, hp * idx.qt, idx.kb)
    return sm90_kernels().supported(q, idx.block, hp * idx.qt)


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
    """Query heads packed into one program: the largest divisor of G with ``heads * qt <= rows``
    (at least 1, and ``heads * qt >= 16`` for ``tl.dot`` where G allows)."""
    hp = largest_divisor(G, rows // qt)
    while hp * qt < 16 and hp < G:
        hp = next(d for d in range(hp + 1, G + 1) if G % d == 0)
    return hp


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
        pairs = sm90_pair_kernels()
        if cfg.get("keys_per_step", 64) == 128 and pairs.supported(hp * idx.qt):
            pairs.launch_forward(q, k, v, kbias, o, lse, idx, grid[0], hp, scale * LOG2E)
        else:
            sm90.launch_forward(q, k, v, kbias, o, lse, idx, grid[0], hp, scale * LOG2E, cfg["num_stages"],
                                cfg["regs"], cfg.get("maxnreg"))
    elif grid[0]:
        _fwd_kernel[grid](q, k, v, q if bias is None else bias, o, lse, idx.layout.blocks, idx.fwd_count, idx.fwd_ks,
                          idx.fwd_word, *idx.query_args(q.device), idx.n_tiles, idx.cap,
                          *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *_strides_bias(bias),
                          *o.stride()[:3], lse.stride(0), lse.stride(1), scale * LOG2E,
                          HKV=Hkv, G=G, HP=hp, QT=idx.qt, BS=idx.block, D=D, HAS_BIAS=bias is not None,
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
            HKV=Hkv, G=G, HP=hp, QT=idx.qt, BS=BS, D=D, HAS_BIAS=bias is not None, SUBSET=idx.subset,
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
            *args, idx.query_args(q.device)[1], HKV=Hkv, G=G, HP=hp, QT=idx.qt, BS=BS, KB=idx.kb, D=D,
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
