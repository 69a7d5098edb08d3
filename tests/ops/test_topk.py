"""Fused top-k kernel of the selection (``nosa_layers/ops/topk.py``) == its PyTorch reference, bit
for bit, on tie-heavy scores (integers, +-inf, -0.0 / +0.0), on ``dev``."""

import pytest
import torch

from nosa_layers import NOSAConfig
from nosa_layers.ops.layout import block_layout
from tests.nosa.common import tiny_cfg

SPECIAL = torch.tensor([float("inf"), float("-inf"), -0.0, 0.0])


def _tie_scores(shape, g, special=0.15):
    """Integer scores 0..3 (many ties) with a fraction of +-inf, -0.0 and +0.0 entries."""
    x = torch.randint(0, 4, shape, generator=g).float()
    pick = torch.rand(shape, generator=g) < special
    return torch.where(pick, SPECIAL[torch.randint(0, 4, shape, generator=g)], x)


def _inputs(B, Hkv, T, cfg, evict, seed, cu=None, device="cpu", forced_inf=True):
    """Random ``b_qa`` (forced +inf as ``block_scores_triton`` writes it, if ``forced_inf``) and
    window means ``ws`` for the batch's block table."""
    g = torch.Generator().manual_seed(seed)
    layout = block_layout(B, T, None if cu is None else torch.tensor(cu), cfg.block_size, "cpu")
    nb = layout.max_doc_blocks
    b_qa = _tie_scores((B, Hkv, T, nb), g)
    if forced_inf:
        for b_, ks, ds, de in layout.blocks.tolist():
            qb = (ks - ds) // cfg.block_size
            blk = torch.arange(nb)
            forced = (blk < cfg.init_blocks) | ((blk >= qb - cfg.local_blocks) & (blk <= qb))
            b_qa[b_, :, ks:min(ks + cfg.block_size, de), forced] = float("inf")
    R = cfg.block_size // cfg.kernel_stride
    ws = _tie_scores((layout.n_blocks * R, Hkv), g) if evict else None
    layout = block_layout(B, T, None if cu is None else torch.tensor(cu, device=device), cfg.block_size, device)
    return b_qa.to(device), None if ws is None else ws.to(device), layout


def _check(b_qa, ws, layout, cfg):
    from nosa_layers.ops.topk import select_from_block_scores, select_from_block_scores_torch

    got = select_from_block_scores(b_qa, ws, layout, cfg)
    ref = select_from_block_scores_torch(b_qa, ws, layout, cfg)
    assert got.dtype == torch.bool and got.shape == ref.shape
    assert torch.equal(got, ref), f"{(got != ref).any(-1).sum().item()} rows differ"
    for _, ks, ds, de in layout.blocks.tolist():
        qb = (ks - ds) // cfg.block_size
        assert (got[:, :, ks:min(ks + cfg.block_size, de)].sum(-1) == min(qb + 1, cfg.topk)).all()
    return got


def _launch_settings(monkeypatch, **launch):
    """The top-k kernel's launch settings for this test, on a GPU and under the interpreter alike."""
    from nosa_layers.ops.launch import TOPK_CONFIG

    for kind in ("cuda", "interpreter"):
        monkeypatch.setitem(TOPK_CONFIG, kind, dict(launch))


CASES = [
    pytest.param(tiny_cfg(), 2, 2, 97, None, id="tiny-B2-odd"),
    pytest.param(tiny_cfg(), 1, 1, 150, [0, 20, 20, 150], id="tiny-Hkv1-varlen"),
    pytest.param(tiny_cfg(local_blocks=0, select_blocks=3), 1, 2, 130, None, id="local0"),
    pytest.param(tiny_cfg(init_blocks=0, local_blocks=0, select_blocks=1, topk=3), 2, 1, 161, None,
                 id="init0-local0-k3"),
    pytest.param(tiny_cfg(topk=40, select_blocks=6), 1, 2, 200, None, id="k-above-nb"),
    pytest.param(NOSAConfig(topk=6, local_blocks=2, select_blocks=2), 1, 1, 700, None, id="default-geom"),
    pytest.param(tiny_cfg(topk=12, select_blocks=5), 1, 1, 1000, None, id="nb63"),
]


@pytest.mark.parametrize("cfg,B,Hkv,T,cu", CASES)
@pytest.mark.parametrize("evict", [True, False], ids=["evict", "no-evict"])
def test_kernel_matches_torch_on_ties(dev, cfg, B, Hkv, T, cu, evict):
    _check(*_inputs(B, Hkv, T, cfg, evict, seed=T + B + Hkv, cu=cu, device=dev), cfg)


def test_kernel_matches_torch_with_raw_forced_values_and_small_tiles(dev, monkeypatch):
    """Forced blocks not +inf (ranked by value in stage 1), several row tiles per block."""
    _launch_settings(monkeypatch, TILE=256, ROW_SPLITS=1)  # 4 rows per step at 64 padded blocks
    cfg = tiny_cfg()
    for evict in (True, False):
        _check(*_inputs(2, 2, 109, cfg, evict, seed=3, device=dev, forced_inf=False), cfg)


@pytest.mark.parametrize("splits", [4])
def test_kernel_matches_torch_with_rows_split_over_programs(dev, monkeypatch, splits):
    """Each (block, KV head) ranked by several programs, each taking a slice of the block's rows, on a
    packed batch that reaches the narrower width classes."""
    _launch_settings(monkeypatch, TILE=1024, ROW_SPLITS=splits)
    cfg = tiny_cfg(topk=12, select_blocks=5)
    for evict in (True, False):
        # an 18-block document: rows of 16 and of 32 padded blocks; the 3-block one is not ranked
        _check(*_inputs(1, 1, 330, cfg, evict, seed=5 + splits, cu=[0, 42, 42, 330], device=dev), cfg)


@pytest.mark.parametrize("warps", [1, 4])
def test_kernel_matches_torch_with_the_warps_set(dev, monkeypatch, warps):
    """One warp per program (a row tile's counts without cross-warp sums) or four, instead of the rule."""
    _launch_settings(monkeypatch, TILE=256, ROW_SPLITS=2, WARPS=warps)
    cfg = tiny_cfg(topk=12, select_blocks=5)
    _check(*_inputs(1, 2, 300, cfg, True, seed=11 + warps, cu=[0, 41, 300], device=dev), cfg)


@pytest.mark.parametrize("launch", [dict(TILE=1024, ROW_SPLITS=3),  # 3 splits of a 16-row block leave a row out
                                    dict(TILE=1024, ROW_SPLITS=1, WARPS=3)], ids=["splits3", "warps3"])
def test_launch_settings_must_be_powers_of_two(dev, monkeypatch, launch):
    _launch_settings(monkeypatch, **launch)
    cfg = tiny_cfg()
    with pytest.raises(ValueError, match="powers of two"):
        _check(*_inputs(1, 1, 90, cfg, True, seed=1, device=dev), cfg)


def test_wide_rows_fall_back_to_torch(dev, monkeypatch):
    import nosa_layers.ops.topk as topk

    monkeypatch.setattr(topk, "MAX_BLOCKS", 4)
    monkeypatch.setattr(topk, "_select_kernel", None)  # must not be launched
    cfg = tiny_cfg()
    _check(*_inputs(1, 2, 90, cfg, True, seed=1, device=dev), cfg)


def test_long_rows_on_gpu(cuda):
    cfg = tiny_cfg(topk=80, local_blocks=8, select_blocks=16)
    for evict in (True, False):
        _check(*_inputs(1, 1, 16 * 2100 - 5, cfg, evict, seed=12, device=cuda), cfg)  # nb = 2100
