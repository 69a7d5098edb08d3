"""The block table of packed batches: built from host values the caller hands over, without reading
``cu_seqlens`` back from the device; from the tensor otherwise."""

from __future__ import annotations

import pytest
import torch

from nosa_layers.ops.layout import block_layout, remember_host_values


def _no_device_reads(monkeypatch):
    def refuse(self):
        raise AssertionError("cu_seqlens was read back from the device")

    monkeypatch.setattr(torch.Tensor, "tolist", refuse)


def test_remembered_values_build_the_same_table_without_a_read(monkeypatch):
    cu_vals = [0, 37, 37, 101, 200]
    want = block_layout(1, 200, torch.tensor(cu_vals, dtype=torch.int32), 16, "cpu")
    cu = torch.tensor(cu_vals, dtype=torch.int32)
    remember_host_values(cu, cu_vals)
    with monkeypatch.context() as m:
        _no_device_reads(m)
        got = block_layout(1, 200, cu, 16, "cpu")
    assert torch.equal(got.blocks, want.blocks) and (got.n_blocks, got.max_doc_blocks) == (want.n_blocks,
                                                                                           want.max_doc_blocks)


def test_an_in_place_change_invalidates_the_remembered_values(monkeypatch):
    cu = torch.tensor([0, 50, 100], dtype=torch.int32)
    remember_host_values(cu, [0, 50, 100])
    cu[1] = 20  # the remembered values are stale now: the tensor is read
    got = block_layout(1, 100, cu, 16, "cpu")
    assert got.blocks[:, 3].tolist()[0] == 20
    with pytest.raises(ValueError, match="host values"):
        remember_host_values(cu, [0, 100])


def test_trainer_microbatch_hands_over_its_cu_seqlens(monkeypatch):
    from data.packing import assemble_row, collate
    from train.forward_step import to_microbatch

    rows = [assemble_row([torch.arange(30).numpy(), torch.arange(50).numpy()], None, 96, 0) for _ in range(2)]
    mb = to_microbatch(collate(rows), torch.device("cpu"))
    with monkeypatch.context() as m:
        _no_device_reads(m)
        layout = block_layout(1, 192, mb["cu_seqlens"], 16, "cpu")
    assert layout.n_blocks == 2 * (2 + 4 + 1)  # per row: 30, 50 and 16 padding tokens


def test_layout_is_cached_per_tensor_and_forgotten_with_it(monkeypatch):
    import gc

    from nosa_layers.ops import layout as layout_mod

    cu = torch.tensor([0, 40, 100], dtype=torch.int32)
    remember_host_values(cu, [0, 40, 100])
    first = block_layout(1, 100, cu, 16, "cpu")
    with monkeypatch.context() as m:
        _no_device_reads(m)
        assert block_layout(1, 100, cu, 16, "cpu") is first  # the other layers of the micro-batch
    assert block_layout(1, 100, cu, 32, "cpu") is not first  # another block size: another table
    ident = id(cu)
    assert ident in layout_mod._KNOWN
    del cu
    gc.collect()
    assert ident not in layout_mod._KNOWN


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_trainer_microbatch_copies_do_not_wait_for_the_gpu_queue():
    """The next step's batches go to the GPU while the previous step's work still runs: a copy from
    pageable memory would wait for the whole queue (here a long sleep kernel) before returning."""
    from data.packing import assemble_row, collate
    from train.forward_step import to_microbatch

    # 16K-token rows: 128 KiB per int64 tensor (a copy of a few KiB from pageable memory is staged without waiting)
    rows = [assemble_row([torch.arange(7000).numpy(), torch.arange(9000).numpy()], None, 16384, 0) for _ in range(2)]
    batch = collate(rows)
    dev = torch.device("cuda")
    to_microbatch(batch, dev)  # warm the pinned-memory cache
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued ahead of the copies
    mb = to_microbatch(batch, dev)
    assert not torch.cuda.current_stream().query(), "to_microbatch waited for the GPU's queue"
    torch.cuda.synchronize()
    for k in ("tokens", "labels", "loss_mask", "position_ids"):
        assert torch.equal(mb[k].cpu(), batch[k].reshape(1, -1))
    assert mb["cu_seqlens"].is_cuda
