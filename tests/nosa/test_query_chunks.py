"""Query subsets (context parallelism): each rank's zigzag chunks of queries against the whole key row
give the full-row call's selection and output rows, and the ranks' gradients sum to the full-row ones."""

import pytest
import torch

from nosa_layers import nosa_attention, select_blocks
from nosa_layers.query_chunks import QueryChunks, zigzag_chunks, zigzag_permutation, zigzag_split
from tests.nosa.common import random_qkvs, tiny_cfg

# packed rows with odd document lengths that cross the chunk borders of CP = 2 and 4 (chunks of 58 / 29 tokens)
DOCS = [[232], [131, 7, 65, 29], [3, 150, 79], [33, 33, 33, 133]]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_chunks_partition_the_row(cp):
    T = 24 * cp
    rows = [zigzag_chunks(T, cp, r) for r in range(cp)]
    assert sorted(torch.cat([c.rows() for c in rows]).tolist()) == list(range(T))
    assert all(c.num_rows == T // cp for c in rows)
    c = T // (2 * cp)
    assert rows[0].spans == (((0, T),) if cp == 1 else ((0, c), (T - c, T)))  # head and tail
    assert rows[-1].spans == ((T // 2 - c, T // 2 + c),)  # the middle rank's chunks meet
    assert torch.equal(zigzag_permutation(T, cp), torch.cat([c.rows() for c in rows]))
    x = torch.arange(2 * T).view(2, T)
    assert torch.equal(zigzag_split(x, cp, cp - 1), x[:, rows[-1].rows()])


def test_query_chunk_errors():
    with pytest.raises(ValueError, match="divisible by 8"):
        zigzag_chunks(100, 4, 0)
    with pytest.raises(ValueError, match="ascending"):
        QueryChunks(((10, 20), (5, 8)))
    q, k, _, s = random_qkvs(1, 40, 4, 2, 8)
    with pytest.raises(ValueError, match="hold 20"):
        select_blocks(q[:, :10], k, s, tiny_cfg(), q_chunks=zigzag_chunks(40, 2, 0))
    with pytest.raises(ValueError, match="pass q_chunks"):
        select_blocks(q[:, :10], k, s, tiny_cfg())


@pytest.mark.parametrize("docs", DOCS, ids=lambda d: "-".join(map(str, d)))
@pytest.mark.parametrize("evict", [True, False], ids=["nosa", "infllm_v2"])
def test_chunked_rows_equal_the_full_row(docs, evict):
    """Selection, output and (summed over the ranks) gradients of q, k, v and the bias at CP = 2 and 4."""
    cfg = tiny_cfg()
    T = sum(docs)
    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()]) if len(docs) > 1 else None
    q, k, v, s = random_qkvs(1, T, 6, 2, 8, grad=True)
    score = s if evict else None
    dout = torch.randn(1, T, 6, 8, dtype=q.dtype)
    full_sel = select_blocks(q, k, score, cfg, cu_seqlens=cu)
    full = nosa_attention(q, k, v, score, cfg, cu_seqlens=cu)
    full_grads = torch.autograd.grad((full * dout).sum(), (q, k, v, s) if evict else (q, k, v))
    assert full_sel.shape[-1] > cfg.topk >= full_sel.sum(-1).max()  # really sparse
    for cp in (2, 4):
        grads = [torch.zeros_like(g) for g in full_grads]
        for r in range(cp):
            ch = zigzag_chunks(T, cp, r)
            rows = ch.rows()
            ql = q[:, rows]
            sel = select_blocks(ql, k, score, cfg, cu_seqlens=cu, q_chunks=ch)
            assert torch.equal(sel, full_sel[:, :, rows]), f"cp={cp} rank {r}: selection differs"
            out = nosa_attention(ql, k, v, score, cfg, cu_seqlens=cu, q_chunks=ch)
            torch.testing.assert_close(out, full[:, rows], rtol=1e-12, atol=1e-12)
            got = torch.autograd.grad((out * dout[:, rows]).sum(), (q, k, v, s) if evict else (q, k, v))
            for acc, g in zip(grads, got):
                acc += g
        for name, a, b in zip("qkvs", grads, full_grads):
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11, msg=f"cp={cp}: d{name} differs")


def test_chunks_of_a_batch_of_rows():
    """Unpacked batches: the same chunks of every row (megatron's per-row zigzag)."""
    cfg = tiny_cfg()
    q, k, v, s = random_qkvs(3, 136, 4, 2, 8)
    full = nosa_attention(q, k, v, s, cfg)
    ch = zigzag_chunks(136, 2, 1)
    rows = ch.rows()
    torch.testing.assert_close(nosa_attention(q[:, rows], k, v, s, cfg, q_chunks=ch), full[:, rows],
                               rtol=1e-12, atol=1e-12)
