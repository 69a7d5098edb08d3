"""Triton decode attention over the block KV cache of ``inference``: one new token per sequence attends to
its selected blocks where they lie. Shipped into sparse exports (a copy next to ``modeling_nosa.py``, which
runs without this package): there Triton may be missing, then ``available()`` is False and the cache gathers
the blocks and runs ``inference.decode_select.attend``.

The PyTorch path gathers every selected block into new ``[B, Hkv, K * bs, D]`` tensors, converts
them to fp32 and runs two batched matmuls: about 16 bytes of temporary device memory per selected
key element and three passes over the data. This kernel reads each selected block once, in place:
from the cache's block pool (GPU-resident cache or offload slots) or, for a block without a slot,
straight from the pinned host store (unified addressing). The math of ``attend``: logits
``q @ k^T * scale + bias``, keys past the position or not ``ok`` masked, fp32 softmax, ``p @ v``,
split over ``PER_PROG``-block chunks of the key axis and combined in fp32. fp32 inputs: IEEE fp32
products (no tf32), so only the summation order differs from ``attend``. bf16 / fp16 inputs:
tensor-core products (exact for ``q @ k^T``) with fp32 accumulation, and the probabilities rounded to
the input dtype for ``p @ v``, as FlashAttention does (``attend`` keeps them in fp32: relative
differences of the order of the input dtype's rounding, 2^-9 for bf16).

Shapes: ``B`` sequences, ``Hkv`` KV heads, ``G`` query heads per KV head, ``K`` selected blocks of
``bs`` tokens, head dim ``D``; pools are ``[rows, bs, D]`` with one block of one KV head per row,
and the additive bias (fp32) is ``[rows, bs]`` at the same rows (it travels with its block).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # an export's copy also runs with torch + transformers alone
    triton = None

PER_PROG = 8  # selected blocks per program (the split of the key axis)
_KERNELS: dict = {}


def available() -> bool:
    return triton is not None


def supported(q: Tensor, block_size: int) -> bool:
    """Shapes the kernel takes: power-of-two head dim and block size of at least 16 (``tl.dot``)."""
    D = q.shape[-1]
    return all(n >= 16 and not n & (n - 1) for n in (D, block_size)) and q.dtype in (
        torch.float32, torch.bfloat16, torch.float16)


def define_kernels() -> None:
    """Define the Triton kernels now (no-op without Triton): a ``torch.compile``-d caller must find them
    defined, it cannot trace their definition."""
    _build()


def _build() -> dict:
    if _KERNELS or triton is None:
        return _KERNELS

    @triton.jit
    def decode_attn(Q, PK, PV, PB, HK, HV, HB, ROWS, HROWS, BLOCKS, OK, POS, M_OUT, L_OUT, ACC_OUT, scale,
                    Hkv, K, n_split, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                    PER: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_HOST: tl.constexpr, FP32: tl.constexpr):
        """Program ``(bh, s)``: query rows ``[G, D]`` of sequence-head ``bh`` against selected blocks
        ``s * PER ... s * PER + PER - 1``; writes the split's running max, sum and ``p @ v``."""
        bh = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        b = bh // Hkv
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        t = tl.arange(0, BS)
        q = tl.load(Q + (bh * G + g[:, None]) * D + d[None, :], mask=g[:, None] < G, other=0.0)
        pos = tl.load(POS + b)
        tile = t[:, None] * D + d[None, :]
        m = tl.full([GP], float("-inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for i in range(PER):
            j = s * PER + i
            jj = tl.minimum(j, K - 1)
            ok = (tl.load(OK + bh * K + jj) != 0) & (j < K)
            if ok:
                blk = tl.load(BLOCKS + bh * K + jj)
                r = tl.load(ROWS + bh * K + jj)
                # a block's bias row lies with its keys and values: in the pool or in the host store
                bias = tl.zeros([BS], tl.float32)
                if HAS_HOST:
                    if r >= 0:
                        k = tl.load(PK + r * (BS * D) + tile)
                        v = tl.load(PV + r * (BS * D) + tile)
                        if HAS_BIAS:
                            bias = tl.load(PB + r * BS + t)
                    else:
                        h = tl.load(HROWS + bh * K + jj)
                        k = tl.load(HK + h * (BS * D) + tile)
                        v = tl.load(HV + h * (BS * D) + tile)
                        if HAS_BIAS:
                            bias = tl.load(HB + h * BS + t)
                else:
                    k = tl.load(PK + r * (BS * D) + tile)
                    v = tl.load(PV + r * (BS * D) + tile)
                    if HAS_BIAS:
                        bias = tl.load(PB + r * BS + t)
                if FP32:
                    x = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [GP, BS]
                else:
                    x = tl.dot(q, tl.trans(k)) * scale
                tok = blk * BS + t
                if HAS_BIAS:
                    x = x + bias[None, :]
                x = tl.where((tok <= pos)[None, :], x, float("-inf"))
                m_new = tl.maximum(m, tl.max(x, 1))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m - m_use)
                p = tl.exp(x - m_use[:, None])
                l = l * alpha + tl.sum(p, 1)
                if FP32:
                    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m = m_new
        out = bh * n_split + s
        tl.store(M_OUT + out * GP + g, m)
        tl.store(L_OUT + out * GP + g, l)
        tl.store(ACC_OUT + (out * GP + g[:, None]) * D + d[None, :], acc)

    _KERNELS["attn"] = decode_attn
    return _KERNELS


def decode_attention(q: Tensor, pool_k: Tensor, pool_v: Tensor, rows: Tensor, blocks: Tensor, ok: Tensor,
                     pos: Tensor, scale: float, pool_bias: Tensor | None = None, host_k: Tensor | None = None,
                     host_v: Tensor | None = None, host_rows: Tensor | None = None,
                     host_bias: Tensor | None = None, per_prog: int = PER_PROG, num_warps: int = 4) -> Tensor:
    """Attention of one query token per sequence over its selected blocks, read in place.
    ``q`` and the pools share one dtype (fp32, bf16 or fp16).

    ``q [B, Hkv, G, D]``; ``pool_k / pool_v [R, bs, D]``; ``rows [B, Hkv, K]`` (int64) the pool row of
    each selected block, or -1 where it is read from ``host_k / host_v [R', bs, D]`` at
    ``host_rows [B, Hkv, K]`` (pinned host memory on a GPU); ``blocks [B, Hkv, K]`` the block index
    in the sequence (its tokens ``blocks * bs + [0, bs)``); ``ok [B, Hkv, K]`` bool (False: skipped);
    keys past ``pos [B]`` are masked; ``pool_bias [R, bs]`` / ``host_bias [R', bs]`` fp32 additive bias
    rows, at the same rows as the blocks' keys (``host_bias`` is needed with ``pool_bias`` and host rows).
    ``per_prog`` selected blocks per program and ``num_warps`` are launch settings (results change only
    in summation order). Returns ``[B, Hkv, G, D]`` fp32 (a row with no key left is NaN, as in ``attend``).
    """
    B, Hkv, G, D = q.shape
    if q.dtype != pool_k.dtype or (host_k is not None and host_k.dtype != q.dtype):
        raise ValueError(f"q ({q.dtype}) and the block pools ({pool_k.dtype}) must share one dtype")
    K, bs = rows.shape[-1], pool_k.shape[1]
    GP = max(16, 1 << (G - 1).bit_length())  # plain Python (traceable): next power of two
    n_split = -(-K // per_prog)
    dev = q.device
    m = torch.empty(B * Hkv, n_split, GP, dtype=torch.float32, device=dev)
    lsum = torch.empty_like(m)
    acc = torch.empty(B * Hkv, n_split, GP, D, dtype=torch.float32, device=dev)
    has_host = host_k is not None
    has_bias = pool_bias is not None
    bias_rows = [pool_bias] + ([host_bias] if has_host else [])
    if has_bias and any(b is None or b.shape[-1] != bs or not b.is_contiguous() for b in bias_rows):
        raise ValueError("bias rows: contiguous [rows, block_size] fp32, for the pool and (with host rows) the host")
    _build()["attn"][(B * Hkv, n_split)](
        q.contiguous(), pool_k, pool_v, pool_bias if has_bias else m,
        host_k if has_host else pool_k, host_v if has_host else pool_v,
        host_bias if has_bias and has_host else m,
        rows.contiguous(), host_rows.contiguous() if has_host else rows, blocks.contiguous(),
        ok.contiguous().view(torch.uint8), pos.contiguous(), m, lsum, acc, scale,
        Hkv, K, n_split, G=G, GP=GP, D=D, BS=bs, PER=per_prog,
        HAS_BIAS=has_bias, HAS_HOST=has_host, FP32=q.dtype == torch.float32, num_warps=num_warps)
    top = m.amax(dim=1, keepdim=True)
    w = torch.exp(m - top).nan_to_num(0.0)  # splits with no key: exp(-inf - x) = 0 (or NaN: -inf - -inf)
    out = (w[..., None] * acc).sum(dim=1) / (w * lsum).sum(dim=1)[..., None]
    return out[:, :G].view(B, Hkv, G, D)


__all__ = ["available", "define_kernels", "supported", "decode_attention", "PER_PROG"]
