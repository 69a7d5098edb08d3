"""Fused top-k kernel of the selection (``nosa_layers/ops/topk.py``) == its PyTorch reference, bit for bit."""

import pytest
import torch

from nosa_layers import NOSAConfig
from tests.nosa.common import random_qkvs, tiny_cfg

SPECIAL = torch.tensor([float("inf"), float("-inf"), -0.0, 0.0])


def _tie_scores(shape, g, special=0.15):
    """Integer scores 0..3 (many ties) with a fraction of +-inf, -0.0 and +0.0 entries."""
    x = torch.randint(0, 4, shape, generator=g).float()
    pick = torch.rand(shape, generator=g) < special
    return torch.where(pick, SPECIAL[torch.randint(0, 4, shape, generator=g)], x)


def _inputs(B, Hkv, L, cfg, evict, seed, forced_inf=True, device="cpu"):
    """Random ``b_qa`` (forced +inf and future -inf as ``block_scores_triton`` writes them, if
    ``forced_inf``), ``static`` and ``prev_part``."""
    g = torch.Generator().manual_seed(seed)
    nb = cfg.num_blocks(L)
    b_qa = _tie_scores((B, Hkv, L, nb), g)
    if forced_inf:
        blk = torch.arange(nb)
        qb = (torch.arange(L) // cfg.block_size)[:, None]
        forced = (blk < cfg.init_blocks) | ((blk >= qb - cfg.local_blocks) & (blk <= qb))
        b_qa = b_qa.masked_fill(forced, float("inf")).masked_fill(blk > qb, float("-inf"))
    static = prev = None
    if evict:
        static = _tie_scores((B, Hkv, nb), g)
        prev = _tie_scores((B, Hkv, L), g)
        prev[:, :, :cfg.block_size] = float("-inf")  # qb == 0: no previous block
    to = lambda x: None if x is None else x.to(device)  # noqa: E731
    return to(b_qa), to(static), to(prev)


def _check(b_qa, static, prev, cfg):
    from nosa_layers.ops.topk import select_from_block_scores, select_from_block_scores_torch

    got = select_from_block_scores(b_qa, static, prev, cfg)
    ref = select_from_block_scores_torch(b_qa, static, prev, cfg)
    assert got.dtype == torch.bool and got.shape == ref.shape
    assert torch.equal(got, ref), f"{(got != ref).any(-1).sum().item()} rows differ"
    n_valid = torch.minimum(torch.arange(b_qa.shape[2], device=b_qa.device) // cfg.block_size + 1,
                            torch.tensor(cfg.topk, device=b_qa.device))
    assert torch.equal(got.sum(-1), n_valid.expand(got.shape[:3]))
    return got


CASES = [
    pytest.param(tiny_cfg(), 2, 2, 97, id="tiny-B2-odd"),
    pytest.param(tiny_cfg(), 1, 1, 150, id="tiny-Hkv1"),
    pytest.param(tiny_cfg(local_blocks=0, select_blocks=3), 1, 2, 130, id="local0"),
    pytest.param(tiny_cfg(init_blocks=0, local_blocks=0, select_blocks=1, topk=3), 2, 1, 161, id="init0-local0-k3"),
    pytest.param(tiny_cfg(topk=40, select_blocks=6), 1, 2, 200, id="k-above-nb"),
    pytest.param(NOSAConfig(topk=6, local_blocks=2, select_blocks=2), 1, 1, 700, id="default-geom"),
    pytest.param(tiny_cfg(topk=12, select_blocks=5), 1, 1, 1000, id="nb63"),
]


@pytest.mark.parametrize("cfg,B,Hkv,L", CASES)
@pytest.mark.parametrize("evict", [True, False], ids=["evict", "no-evict"])
@pytest.mark.usefixtures("interp")
def test_kernel_matches_torch_on_ties(cfg, B, Hkv, L, evict):
    _check(*_inputs(B, Hkv, L, cfg, evict, seed=L + B + Hkv), cfg)


@pytest.mark.usefixtures("interp")
def test_kernel_matches_torch_with_raw_forced_and_future_values(monkeypatch):
    """Forced blocks not +inf, future blocks not -inf (ranked nowhere), several row tiles per head."""
    import nosa_layers.ops.topk as topk

    monkeypatch.setattr(topk, "TILE", 128)  # 16 rows per program, last program partial
    cfg = tiny_cfg()
    for evict in (True, False):
        _check(*_inputs(2, 2, 109, cfg, evict, seed=3, forced_inf=False), cfg)


@pytest.mark.usefixtures("interp")
def test_wide_rows_fall_back_to_torch(monkeypatch):
    import nosa_layers.ops.topk as topk

    monkeypatch.setattr(topk, "MAX_BLOCKS", 4)
    monkeypatch.setattr(topk, "_select_kernel", None)  # must not be launched
    cfg = tiny_cfg()
    _check(*_inputs(1, 2, 90, cfg, True, seed=1), cfg)


@pytest.mark.usefixtures("interp")
def test_select_rows_triton_equals_torch_path():
    from nosa_layers.ops.selection import select_rows_triton
    from nosa_layers.ops.topk import select_from_block_scores_torch

    cfg = tiny_cfg(local_blocks=0, select_blocks=3)
    q, k, _, s = random_qkvs(2, 140, 4, 2, 16, dtype=torch.float32, seed=4)
    for sc in (s, None):
        assert torch.equal(select_rows_triton(q, k, sc, cfg),
                           select_rows_triton(q, k, sc, cfg, topk=select_from_block_scores_torch))


@pytest.mark.gpu
@pytest.mark.parametrize("evict", [True, False], ids=["evict", "no-evict"])
def test_gpu_kernel_matches_torch(cuda, evict):
    cfg = NOSAConfig()
    _check(*_inputs(2, 2, 8192 + 37, cfg, evict, seed=11, device=cuda), cfg)  # nb = 129
    cfg = tiny_cfg(topk=80, local_blocks=8, select_blocks=16)
    _check(*_inputs(1, 1, 16 * 2100 - 5, cfg, evict, seed=12, device=cuda), cfg)  # nb = 2100


@pytest.mark.gpu
def test_gpu_select_rows_triton_equals_torch_path(cuda):
    from nosa_layers.ops.selection import select_rows_triton
    from nosa_layers.ops.topk import select_from_block_scores_torch

    cfg = NOSAConfig()
    g = torch.Generator(device=cuda).manual_seed(5)
    q = torch.randn(1, 8192, 16, 128, generator=g, device=cuda, dtype=torch.bfloat16)
    k = torch.randn(1, 8192, 2, 128, generator=g, device=cuda, dtype=torch.bfloat16)
    s = torch.randn(1, 8192, 2, generator=g, device=cuda)
    for sc in (s, None):
        assert torch.equal(select_rows_triton(q, k, sc, cfg),
                           select_rows_triton(q, k, sc, cfg, topk=select_from_block_scores_torch))
