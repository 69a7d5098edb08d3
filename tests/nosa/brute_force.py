"""An independent, loop-based recomputation of NOSA block selection for ONE query position.

It only ever sees the prefix ``[0, t]`` and is written from the step list of
``nosa_layers/README.md`` ("Selection, step by step") with explicit Python loops, sharing no code
with ``nosa_layers.selection``.
"""

import math



def brute_force_selection(q, k, score, cfg, b, t, scale=None):
    """Selected blocks ``{h: set(block ids)}`` for batch row ``b``, position ``t``.

    q ``[B, T, Hq, D]``, k ``[B, T, Hkv, D]``, score ``[B, T, Hkv]`` or None (float64 advised).
    """
    Hq, D = q.shape[2], q.shape[3]
    Hkv = k.shape[2]
    G = Hq // Hkv
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    bs, ks, st = cfg.block_size, cfg.kernel_size, cfg.kernel_stride
    L = t + 1
    starts = list(range(0, L - ks + 1, st)) if L >= ks else []
    nb = (L + bs - 1) // bs
    qb = t // bs
    result = {}
    for h in range(Hkv):
        kc = [k[b, s:s + ks, h].mean(dim=0) for s in starts]
        # query-aware window score: sum over the group's heads of the window softmax
        win_qa = [0.0] * len(starts)
        for i in range(h * G, (h + 1) * G):
            logits = [float(q[b, t, i] @ kc_w) * scale for kc_w in kc]
            if logits:
                mx = max(logits)
                ex = [math.exp(x - mx) for x in logits]
                tot = sum(ex)
                for w in range(len(starts)):
                    win_qa[w] += ex[w] / tot
        win_qg = [float(score[b, s:s + ks, h].mean()) for s in starts] if score is not None else None

        def pooled(win, m):
            vals = [win[w] for w, s in enumerate(starts) if s < bs * (m + 1) and s + ks > bs * m]
            return max(vals) if vals else -math.inf

        def is_forced(m):
            return m < cfg.init_blocks or qb - cfg.local_blocks <= m <= qb

        blocks = list(range(nb))  # every block of the prefix is causal
        bqa = {m: math.inf if is_forced(m) else pooled(win_qa, m) for m in blocks}
        if score is None:
            ranked = sorted(blocks, key=lambda m: (-bqa[m], m))
            result[h] = set(ranked[:min(cfg.topk, nb)])
            continue
        qa = set(sorted(blocks, key=lambda m: (-bqa[m], m))[:min(cfg.query_aware_blocks, nb)])
        bqg = {m: math.inf if (is_forced(m) or m in qa) else pooled(win_qg, m) for m in blocks}
        result[h] = set(sorted(blocks, key=lambda m: (-bqg[m], m))[:min(cfg.topk, nb)])
    return result
