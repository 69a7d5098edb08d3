"""``bench.probes.host_syncs``: host syncs attributed to their call sites, counted only while active."""

from __future__ import annotations

import traceback
import warnings

import torch

from bench.probes import host_syncs
from tests.subproc import REPO


def _frame(path: str, line: int, name: str) -> traceback.FrameSummary:
    return traceback.FrameSummary(path, line, name, lookup_line=False)


def test_call_site_keeps_repository_and_megatron_frames_innermost_first():
    stack = [
        _frame(str(REPO / "train" / "trainer.py"), 414, "_loop"),
        _frame("/usr/lib/python3.12/site-packages/megatron/core/optimizer/optimizer.py", 356, "get_grad_norm"),
        _frame("/usr/lib/python3.12/site-packages/torch/nn/modules/module.py", 1, "_call_impl"),
        _frame(str(REPO / "runtime" / "megatron_cpu.py"), 48, "__torch_function__"),
        _frame("/usr/lib/python3.12/site-packages/megatron/core/utils.py", 1331, "local_multi_tensor_l2_norm"),
        _frame(str(REPO / "bench" / "probes" / "host_syncs.py"), 80, "_on_warning"),
    ]
    assert host_syncs.call_site(stack, 2) == ("megatron/core/utils.py:1331 local_multi_tensor_l2_norm <- "
                                     "megatron/core/optimizer/optimizer.py:356 get_grad_norm")
    assert host_syncs.call_site(stack, 5).endswith("<- train/trainer.py:414 _loop")
    assert host_syncs.call_site(stack[2:3], 3) == "(outside this repository and megatron-core)"


def _sync_here():
    warnings.warn("called a synchronizing CUDA operation", UserWarning)


def test_sync_warnings_are_counted_by_site_while_active_and_others_pass(monkeypatch):
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)  # needs a GPU otherwise
    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda msg, *a, **k: shown.append(str(msg)))
    counter = host_syncs.SyncCounter(frames=1)
    with warnings.catch_warnings():
        with counter:
            _sync_here()  # inactive (warm-up steps): neither counted nor shown
            counter.active = True
            _sync_here()
            _sync_here()
            warnings.warn("something else", UserWarning)
            counter.active = False
            _sync_here()
    assert modes == ["warn", "default"]
    site = f"tests/bench/test_host_syncs.py:{_sync_here.__code__.co_firstlineno + 1} _sync_here"
    assert dict(counter.counts) == {site: 2}
    assert shown == ["something else"]
    assert warnings.showwarning is not counter._on_warning  # restored on exit
