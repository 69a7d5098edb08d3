"""Triton block selection of a decode step: one kernel launch per layer for what
``inference.decode_select.select_decode_fast`` does in about 20 small launches (fp32 casts, matmul, scale,
``where``, softmax, sum, gather by ``index`` + ``amax``, ``where``, a stable descending sort for the
query-aware stage, ``zeros_like`` + ``scatter``, ``where``s, a second sort, slice, compare). A decode step in
a CUDA graph is bound by its kernel count rather than by this work; the effect on a step is measured on a GPU
by ``python -m bench.inference --only decode`` (no timing is claimed here: written and tested without a GPU,
under the Triton interpreter, and compiled for sm80 / sm90 by the tests). Shipped into sparse exports (a
copy next to ``modeling_nosa.py``, which runs without this package): there Triton may be missing, then
``available()`` is False and the cache runs ``select_decode_fast``.

One program per (sequence, KV head) returns exactly what ``select_decode_fast`` returns: ``(blocks [B, Hkv,
K] int64, ok [B, Hkv, K] bool)`` with ``K = min(topk, NB)``, the same blocks in the same order (the
reference's stable descending sort: equal scores keep the lower block index first).

1. Softmax statistics: the query rows ``[G, D]`` (``G`` padded to a power of two of at least 16 and masked)
   against the complete windows of ``kc`` in chunks of ``BW`` (both in fp32, IEEE products: no tf32), per query
   head the running max and sum of ``exp`` over the windows complete at ``pos`` (``decode_masks``' hidden
   windows, the sink column among them, are left out).
2. The same logits again (``kc`` read twice), ``exp(x - max) / sum`` summed over the group: the query-aware
   window scores, to a fp32 scratch row ``[NW + 1]`` of the program (only the complete windows are written;
   the others read as ``-inf``), read back after a barrier.
3. Per block, the max over its windows (``index [NB, WPB]``) of those scores and of the window score means
   ``wsc``; the forced blocks (sink, the query's own block and the ``local_blocks`` before it) pinned to
   ``+inf`` and the future ones to ``-inf``, from ``pos`` and the ``NOSAConfig`` alone.
4. Ranking: each score becomes the int64 key ``(ordered << 32) | (2**31 - 1 - block)`` (``ordered``: the fp32
   bits as an int32 whose order is the float order; ``-0.0`` as ``+0.0``, every NaN above ``+inf`` as torch's
   sort has it), so the descending order of these unique keys is torch's stable descending sort exactly,
   infinities included. The top ``KP`` keys (``K`` rounded up to a power of two) are kept in registers: a
   bitonic top-k of each chunk of ``CHUNK_BLOCKS`` blocks, merged into the running top (one chunk up to 16K
   tokens at the released geometry; the kernel's code, and its compile time, does not grow with ``NB``). With
   ``wsc`` the query-aware stage gives the ``min(query_aware_blocks, NB)``-th largest key, and the second
   stage ranks the blocks whose first key is at least that (and the forced ones) ``+inf``, the others by
   their pooled ``wsc``; its first ``K`` keys are the blocks, ``ok`` = block ``<= pos // block_size``.

Scores are fp32 as in the reference; the summation order differs from torch's in the last bits, so a block
whose score is within a rounding of the one at the budget's cut may be swapped for it (exact ties, pinned
blocks and the order by index among equal scores are exact). Inputs are finite (NaN keys rank as torch's
sort ranks them, but a NaN is not propagated through the max-pooling as ``amax`` would).
"""

from __future__ import annotations

import torch
from torch import Tensor

from nosa_layers.config import NOSAConfig

try:
    import triton
    import triton.language as tl
except ImportError:  # an export's copy also runs with torch + transformers alone
    triton = None

CHUNK_BLOCKS = 256  # blocks ranked at a time (one chunk up to 16K tokens at 64-token blocks)
MAX_GROUP = 64  # query heads per KV head held in registers
MAX_WINDOWS_PER_BLOCK = 64
_KERNELS: dict = {}


def available() -> bool:
    return triton is not None


def supported(q: Tensor, kc: Tensor, wsc: Tensor | None, index: Tensor) -> bool:
    """Shapes and dtypes the kernel takes: ``q [B, Hkv, G, D]`` and ``kc [B, Hkv, NW + 1, D]`` fp32 / bf16 /
    fp16 with a power-of-two head dim of 16 to 256 (``tl.dot``), ``G <= MAX_GROUP``, ``wsc`` None or fp32,
    ``index [NB, WPB]``. The device is the caller's business (CUDA, or a CPU under
    ``TRITON_INTERPRET=1``)."""
    if triton is None or q.dim() != 4 or kc.dim() != 4 or index.dim() != 2:
        return False
    D, G, NB = q.shape[-1], q.shape[2], index.shape[0]
    floats = (torch.float32, torch.bfloat16, torch.float16)
    return (16 <= D <= 256 and not D & (D - 1) and kc.shape[-1] == D and 1 <= G <= MAX_GROUP
            and 1 <= NB < 2 ** 31 and 1 <= index.shape[1] <= MAX_WINDOWS_PER_BLOCK
            and q.dtype in floats and kc.dtype in floats and (wsc is None or wsc.dtype == torch.float32))


def define_kernels() -> None:
    """Define the Triton kernels now (no-op without Triton): a ``torch.compile``-d caller must find them
    defined, it cannot trace their definition."""
    _build()


if triton is not None:
    # Reductions: ``tl.reduce`` with tl.standard's own combine functions (``tl.max`` / ``tl.sum`` call them): the
    # same code on a GPU, and one numpy call each under the interpreter, where a call of a jitted function such
    # as ``tl.max`` or ``tl.sort`` costs milliseconds and a combine function of our own runs element by element.
    # Named in full in the kernels (no module-level alias): ``torch.compile`` copies the kernels' source with
    # the jitted functions they name, each under its own name.

    @triton.jit
    def _rank_keys(x, blk, valid):
        """fp32 scores of blocks ``blk`` -> unique int64 keys: descending key order is torch's stable descending
        sort (float order, ties to the lower block); invalid columns get the smallest key."""
        bits = x.to(tl.int32, bitcast=True)
        bits = tl.where(x == 0.0, 0, bits)  # -0.0 ranks as +0.0
        bits = tl.where(x != x, 0x7FC00000, bits)  # every NaN above +inf (torch's sort)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # int32 order == float order
        ordered = tl.where(valid, ordered, -2147483648)  # below -inf (0x807FFFFF)
        return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - blk).to(tl.int64)

    @triton.jit
    def _topk(x, LOG_N: tl.constexpr, LOG_K: tl.constexpr, ASC: tl.constexpr):
        """The ``2 ** LOG_K`` largest of ``x [2 ** LOG_N]``, sorted (descending, or ascending with ``ASC``): a
        bitonic top-k (``tl.topk`` of recent Triton) on the hypercube view ``[2] * LOG_N``, each compare-exchange
        a max and a min over one axis of size 2. Runs of ``2 ** LOG_K`` are sorted in alternating directions,
        then halved until one is left: the elementwise max of two neighbouring runs holds their top
        ``2 ** LOG_K`` as a bitonic sequence, which a merge sorts again."""
        h = tl.reshape(x, [2] * LOG_N)
        i = tl.reshape(tl.arange(0, 2 ** LOG_N), [2] * LOG_N)
        for s in tl.static_range(1, LOG_K + 1):
            flip = ((i >> s) & 1) ^ ASC  # runs of 2 ** s alternate (all one way when s == LOG_N)
            for u in tl.static_range(s):  # partners differ in bit s - 1 - u: axis LOG_N - s + u
                hi = tl.reduce(h, LOG_N - s + u, tl.standard._elementwise_max, keep_dims=True)
                lo = tl.reduce(h, LOG_N - s + u, tl.standard._elementwise_min, keep_dims=True)
                h = tl.where((((i >> (s - 1 - u)) & 1) ^ flip) != 0, lo, hi)
        for r in tl.static_range(1, LOG_N - LOG_K + 1):  # rank LOG_N - r after halving over bit LOG_K
            h = tl.reduce(h, LOG_N - r - LOG_K, tl.standard._elementwise_max)
            i = tl.reshape(tl.arange(0, 2 ** (LOG_N - r)), [2] * (LOG_N - r))
            flip = ((i >> LOG_K) & 1) ^ ASC
            for u in tl.static_range(LOG_K):
                hi = tl.reduce(h, LOG_N - r - LOG_K + u, tl.standard._elementwise_max, keep_dims=True)
                lo = tl.reduce(h, LOG_N - r - LOG_K + u, tl.standard._elementwise_min, keep_dims=True)
                h = tl.where((((i >> (LOG_K - 1 - u)) & 1) ^ flip) != 0, lo, hi)
        return tl.reshape(h, [2 ** LOG_K])

    @triton.jit
    def _block_keys(scores_row, wsc_row, sw_w, INDEX, blk, NB, w_end, qb, cut, second, WPB: tl.constexpr,
                    INIT: tl.constexpr, LOCAL: tl.constexpr, HAS_WSC: tl.constexpr):
        """Ranking keys of blocks ``blk``: the query-aware stage's (pooled window scores, forced ``+inf``,
        future ``-inf``) or, where ``second``, the final stage's (``+inf`` also where the first key is
        ``>= cut``: the query-aware picks; the others by their pooled ``wsc``)."""
        real = blk < NB
        b_qa = tl.full(blk.shape, float("-inf"), tl.float32)
        b_qg = tl.full(blk.shape, float("-inf"), tl.float32)
        for j in tl.static_range(WPB):  # max over each block's windows; an incomplete window is -inf
            idx = tl.load(INDEX + blk * WPB + j, mask=real, other=0)
            seen = real & (idx < w_end)
            b_qa = tl.maximum(b_qa, tl.load(scores_row + idx, mask=seen, other=float("-inf")))
            if HAS_WSC:
                b_qg = tl.maximum(b_qg, tl.load(wsc_row + idx * sw_w, mask=seen, other=float("-inf")).to(tl.float32))
        future = blk > qb
        forced = (blk < INIT) | ((blk >= qb - LOCAL) & (blk <= qb))
        key = _rank_keys(tl.where(future, float("-inf"), tl.where(forced, float("inf"), b_qa)), blk, real)
        if HAS_WSC:
            final = _rank_keys(tl.where(future, float("-inf"), tl.where(forced | (key >= cut), float("inf"), b_qg)),
                               blk, real)
            key = tl.where(second, final, key)
        return key

    @triton.jit
    def _top_blocks(scores_row, wsc_row, sw_w, INDEX, NB, w_end, qb, cut, second, WPB: tl.constexpr,
                    INIT: tl.constexpr, LOCAL: tl.constexpr, HAS_WSC: tl.constexpr, CB: tl.constexpr,
                    LOG_CB: tl.constexpr, LOG_KP: tl.constexpr):
        """The ``2 ** LOG_KP`` largest keys of a stage, descending: the top of each chunk of ``CB`` blocks
        (ascending) merged into the running top (descending; their elementwise max is the top of both as a
        bitonic sequence, sorted by one merge)."""
        blk = tl.arange(0, CB)
        i = tl.reshape(tl.arange(0, 2 ** LOG_KP), [2] * LOG_KP)
        best = tl.full([2 ** LOG_KP], -9223372036854775807, tl.int64)
        for c0 in range(0, NB, CB):
            top = _topk(_block_keys(scores_row, wsc_row, sw_w, INDEX, c0 + blk, NB, w_end, qb, cut, second, WPB,
                                    INIT, LOCAL, HAS_WSC), LOG_CB, LOG_KP, 1)
            h = tl.reshape(tl.maximum(best, top), [2] * LOG_KP)
            for u in tl.static_range(LOG_KP):  # partners differ in bit LOG_KP - 1 - u: axis u
                hi = tl.reduce(h, u, tl.standard._elementwise_max, keep_dims=True)
                lo = tl.reduce(h, u, tl.standard._elementwise_min, keep_dims=True)
                h = tl.where(((i >> (LOG_KP - 1 - u)) & 1) != 0, lo, hi)
            best = tl.reshape(h, [2 ** LOG_KP])
        return best


def _build() -> dict:
    if _KERNELS or triton is None:
        return _KERNELS

    @triton.jit
    def decode_select(Q, KC, WSC, POS, INDEX, SCORES, BLOCKS, OK, scale, Hkv, NW1, NB,
                      sq_b, sq_h, sq_g, sq_d, sk_b, sk_h, sk_w, sk_d, sw_b, sw_h, sw_w,
                      G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BW: tl.constexpr, CB: tl.constexpr,
                      LOG_CB: tl.constexpr, KP: tl.constexpr, LOG_KP: tl.constexpr, WPB: tl.constexpr,
                      QA: tl.constexpr, K: tl.constexpr, BLOCK_SIZE: tl.constexpr, KERNEL_SIZE: tl.constexpr,
                      KERNEL_STRIDE: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr, HAS_WSC: tl.constexpr):
        """Program ``bh`` (sequence ``bh // Hkv``, KV head ``bh % Hkv``): its ``K`` selected blocks, best first."""
        bh = tl.program_id(0).to(tl.int64)
        b = bh // Hkv
        h = bh % Hkv
        pos = tl.load(POS + b)
        n = pos + 1
        nw = tl.where(n >= KERNEL_SIZE, (n - KERNEL_SIZE) // KERNEL_STRIDE + 1, 0)  # complete windows
        w_end = tl.minimum(nw, NW1)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        q = tl.load(Q + b * sq_b + h * sq_h + g[:, None] * sq_g + d[None, :] * sq_d, mask=g[:, None] < G,
                    other=0.0).to(tl.float32)
        kc_row = KC + b * sk_b + h * sk_h
        # 1. per query head: max and sum of exp over the complete windows
        m = tl.full([GP], float("-inf"), tl.float32)
        lsum = tl.zeros([GP], tl.float32)
        for w0 in range(0, w_end, BW):
            w = w0 + tl.arange(0, BW)
            vis = w < w_end
            k = tl.load(kc_row + w[:, None] * sk_w + d[None, :] * sk_d, mask=vis[:, None], other=0.0)
            x = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale  # [GP, BW]
            x = tl.where(vis[None, :], x, float("-inf"))
            m_new = tl.maximum(m, tl.reduce(x, 1, tl.standard._elementwise_max))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            lsum = lsum * tl.exp(m - m_use) + tl.reduce(tl.exp(x - m_use[:, None]), 1, tl.standard._sum_combine)
            m = m_new
        # 2. the group-summed probabilities of the complete windows, to the program's scratch row
        m_use = tl.where(m == float("-inf"), 0.0, m)
        inv = tl.where((g < G) & (lsum > 0), 1.0 / tl.maximum(lsum, 1e-30), 0.0)  # padded query rows add nothing
        scores_row = SCORES + bh * NW1
        for w0 in range(0, w_end, BW):
            w = w0 + tl.arange(0, BW)
            vis = w < w_end
            k = tl.load(kc_row + w[:, None] * sk_w + d[None, :] * sk_d, mask=vis[:, None], other=0.0)
            x = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
            p = tl.exp(x - m_use[:, None]) * inv[:, None]
            tl.store(scores_row + w, tl.reduce(p, 0, tl.standard._sum_combine), mask=vis)
        tl.debug_barrier()  # the row is read back below at other windows (other threads)
        # 3. the two stages (one code path: its compile time), over chunks of CB blocks: the top KP >= K keys
        qb = pos // BLOCK_SIZE
        wsc_row = WSC + b * sw_b + h * sw_h
        j = tl.arange(0, KP)
        cut = tl.full([], -9223372036854775807, tl.int64)
        order = tl.full([KP], -9223372036854775807, tl.int64)
        for stage in range(0, 1 + HAS_WSC):
            order = _top_blocks(scores_row, wsc_row, sw_w, INDEX, NB, w_end, qb, cut, stage > 0, WPB, INIT, LOCAL,
                                HAS_WSC, CB, LOG_CB, LOG_KP)
            # the QA-th largest key: the cut of the query-aware stage
            cut = tl.reduce(tl.where(j == QA - 1, order, -9223372036854775807), 0, tl.standard._elementwise_max)
        chosen = 0x7FFFFFFF - (order - ((order >> 32) << 32))
        tl.store(BLOCKS + bh * K + j, chosen, mask=j < K)
        tl.store(OK + bh * K + j, (chosen <= qb).to(tl.uint8), mask=j < K)

    _KERNELS["select"] = decode_select
    return _KERNELS


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()  # plain Python (traceable)


def select_decode_kernel(q: Tensor, kc: Tensor, wsc: Tensor | None, pos: Tensor, cfg: NOSAConfig, index: Tensor,
                         softmax_scale: float, chunk_blocks: int = CHUNK_BLOCKS,
                         num_warps: int = 4) -> tuple[Tensor, Tensor]:
    """``select_decode_fast(q, kc, wsc, cfg, index, softmax_scale, decode_masks(pos, cfg, NB, NW + 1))`` in one
    launch (check :func:`supported` first).

    ``q [B, Hkv, G, D]`` post-RoPE; ``kc [B, Hkv, NW + 1, D]`` compressed keys and ``wsc [B, Hkv, NW + 1]``
    fp32 window score means (or None: no query-agnostic stage) with the cache's sink column last (any finite
    values, hidden); ``pos [B]`` int64 each new token's position; ``index [NB, WPB]`` =
    ``block_window_index(cfg, NB, NW)``. Returns ``(blocks [B, Hkv, K] int64, ok [B, Hkv, K] bool)``,
    ``K = min(topk, NB)``. No host synchronisation; every shape is known from the inputs' shapes.
    ``chunk_blocks`` (a power of two) blocks are ranked at a time and ``num_warps`` are launch settings: the
    result does not depend on them.
    """
    if chunk_blocks < 1 or chunk_blocks & (chunk_blocks - 1):
        raise ValueError(f"chunk_blocks must be a power of two, got {chunk_blocks}")
    B, Hkv, G, D = q.shape
    NW1 = kc.shape[2]
    NB, WPB = index.shape
    K, QA = min(cfg.topk, NB), min(cfg.query_aware_blocks, NB)
    KP = max(16, _pow2(K))  # the top KP >= K of each stage, <= the padded block count
    CB = max(KP, min(chunk_blocks, _pow2(NB)))
    dev = q.device
    scores = torch.empty(B * Hkv, NW1, dtype=torch.float32, device=dev)  # query-aware window scores
    blocks = torch.empty(B, Hkv, K, dtype=torch.int64, device=dev)
    ok = torch.empty(B, Hkv, K, dtype=torch.bool, device=dev)
    has_wsc = wsc is not None
    ws = wsc if has_wsc else scores
    ws_strides = (ws.stride(0), ws.stride(1), ws.stride(2)) if has_wsc else (0, 0, 0)
    _build()["select"][(B * Hkv,)](
        q, kc, ws, pos, index.contiguous(), scores, blocks, ok.view(torch.uint8), softmax_scale, Hkv, NW1, NB,
        *q.stride(), *kc.stride(), *ws_strides,
        G=G, GP=max(16, _pow2(G)), D=D, BW=64 if D <= 128 else 32, CB=CB, LOG_CB=CB.bit_length() - 1, KP=KP,
        LOG_KP=KP.bit_length() - 1, WPB=WPB, QA=QA, K=K, BLOCK_SIZE=cfg.block_size, KERNEL_SIZE=cfg.kernel_size,
        KERNEL_STRIDE=cfg.kernel_stride, INIT=cfg.init_blocks, LOCAL=cfg.local_blocks, HAS_WSC=has_wsc,
        num_warps=num_warps)
    return blocks, ok


__all__ = ["available", "define_kernels", "supported", "select_decode_kernel", "CHUNK_BLOCKS"]
