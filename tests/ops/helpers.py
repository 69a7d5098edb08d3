"""Shared helpers of the kernel tests: reference selection stages and gradient comparison."""

import torch

from nosa_layers.reference import block_sparse_attention
from nosa_layers.selection import block_window_index, compressed_keys, pool_to_blocks


def reference_block_scores(q, k, cfg, softmax_scale=None):
    """Query-aware block scores of the reference (forced +inf, future -inf): ``[B, Hkv, T, nb]``
    for one document (positions 0..T-1), computed in fp64."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    scale = softmax_scale if softmax_scale is not None else D ** -0.5
    nb, nw = cfg.num_blocks(T), cfg.num_windows(T)
    pos = torch.arange(T)
    index = block_window_index(cfg, nb, nw)
    w = torch.arange(nw)
    visible = (w * cfg.kernel_stride + cfg.kernel_size - 1)[None, :] <= pos[:, None]
    kc = compressed_keys(k.double(), cfg)
    logits = torch.einsum("bthgd,bwhd->bhgtw", q.double().view(B, T, Hkv, G, D), kc) * scale
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    s = probs.sum(2).masked_fill(~visible, float("-inf"))
    b = pool_to_blocks(s, index)
    blk = torch.arange(nb)
    qb = (pos // cfg.block_size)[:, None]
    forced = (blk < cfg.init_blocks) | ((blk >= qb - cfg.local_blocks) & (blk <= qb))
    return b.masked_fill(forced, float("inf")).masked_fill(blk > qb, float("-inf"))


def assert_topk_tie_aware(sel_a, sel_b, scores, atol):
    """Two top-k masks over ``scores`` agree up to near ties: per row, the sorted scores of the
    chosen blocks match within ``atol`` (inf == inf)."""
    assert torch.equal(sel_a.sum(-1), sel_b.sum(-1)), "different numbers of selected blocks"
    diff = (sel_a != sel_b).any(-1)
    if not diff.any():
        return 0
    sa = scores.masked_fill(~sel_a, float("nan"))[diff]
    sb = scores.masked_fill(~sel_b, float("nan"))[diff]
    va = sa.nan_to_num(float("-1e300")).sort(-1).values
    vb = sb.nan_to_num(float("-1e300")).sort(-1).values
    same = (va == vb) | ((va - vb).abs() <= atol)
    assert same.all(), f"selections differ beyond near ties: {(~same).sum().item()} entries"
    return int(diff.sum())


def reference_grads(q, k, v, bias, sel, cfg, do, spans, scale=None, dtype=torch.float64):
    """Output and grads (q, k, v, bias) of the reference over a fixed selection, in ``dtype``."""
    xs = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
    b = None if bias is None else bias.detach().to(dtype).requires_grad_(True)
    outs = [block_sparse_attention(xs[0][:, s:e], xs[1][:, s:e], xs[2][:, s:e], sel[:, :, s:e], cfg.block_size,
                                   bias=None if b is None else b[:, s:e], softmax_scale=scale) for s, e in spans]
    out = torch.cat(outs, dim=1)
    ins = xs + ([b] if b is not None else [])
    grads = torch.autograd.grad(out, ins, do.to(dtype))
    return out, grads
