"""``nosa_layers.ops.launch``: scoped overrides of the launch tables (what the benchmarks' sweeps use
instead of editing the tables) and the module's place as the leaf of ``ops``."""

import ast
import threading
from pathlib import Path

import pytest

from nosa_layers.ops import launch
from nosa_layers.ops.launch import CONFIG, SEL_CONFIG, TOPK_CONFIG, overrides


def test_overrides_hold_inside_the_block_nest_and_leave_the_defaults():
    lse, topk = dict(SEL_CONFIG["lse"]), dict(TOPK_CONFIG["cuda"])
    wide = dict(lse, BW=128)
    with overrides(SEL_CONFIG, lse=wide) as table:
        assert table is SEL_CONFIG and SEL_CONFIG["lse"] == wide and dict(SEL_CONFIG.items())["lse"] == wide
        with overrides(SEL_CONFIG, block=dict(SEL_CONFIG["block"], NT=32)), overrides(TOPK_CONFIG, cuda={"TILE": 8}):
            assert SEL_CONFIG["lse"] == wide and SEL_CONFIG["block"]["NT"] == 32 and TOPK_CONFIG["cuda"] == {"TILE": 8}
        assert SEL_CONFIG["block"]["NT"] != 32 and TOPK_CONFIG["cuda"] == topk
        seen = []
        worker = threading.Thread(target=lambda: seen.append(SEL_CONFIG["lse"]))  # another thread: the defaults
        worker.start()
        worker.join()
        assert seen == [lse]
    assert SEL_CONFIG["lse"] == lse and SEL_CONFIG.defaults["lse"] == lse
    with pytest.raises(RuntimeError), overrides(SEL_CONFIG, lse=wide):
        raise RuntimeError("a failed run")
    assert SEL_CONFIG["lse"] == lse  # restored on the way out of an error too
    with pytest.raises(KeyError, match="has no entry fwd"):
        with overrides(SEL_CONFIG, fwd={}):
            pass


def test_launch_config_follows_an_override_of_the_attention_table():
    import torch

    cpu = torch.device("cpu")  # the interpreter's table (sm90's), as the Triton kernels run it
    table = CONFIG[launch.arch(cpu)]
    with overrides(table, dkdv=dict(table["dkdv"], CHUNK=256, triton={})):
        assert launch.launch_config(cpu)["dkdv"]["CHUNK"] == 256
    assert launch.launch_config(cpu)["dkdv"]["CHUNK"] == table["dkdv"]["CHUNK"]


def test_launch_is_the_leaf_of_ops():
    """``launch.py`` imports no other module of ``ops`` at its top level (``attention_sm90`` is loaded on
    first use), so every kernel module can import it without a circle."""
    tree = ast.parse(Path(launch.__file__).read_text())
    local = {node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.level == 1}
    assert local == {"_common"}


def test_the_kernel_plan_names_padding_and_every_fast_path_a_shape_misses(monkeypatch):
    """Before step 1 a run learns which kernels serve its shape: padded query tiles for a KV group that is
    not a power of two, the Triton kernels where the Hopper ones do not cover the shape, the reference where
    no kernel does (``dispatch.kernel_plan``, logged by the trainer)."""
    import torch

    from nosa_layers import NOSAConfig
    from nosa_layers.dispatch import kernel_plan
    from nosa_layers.ops import attention_op

    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert attention_op.attention_plan(8, 64, 64, bf16, cpu) == []  # a power-of-two group: nothing to say
    (line,) = attention_op.attention_plan(3, 64, 64, bf16, cpu)  # SmolLM2: 9 / 3 heads
    assert "groups of 3 query heads" in line and "16 tokens x 4 head rows" in line and "25%" in line
    (line,) = attention_op.attention_plan(9, 128, 64, bf16, cpu)
    assert "4 tokens x 16 head rows" in line and "43%" in line
    for mod in (attention_op, launch):  # an sm90 GPU where the Hopper kernels can run
        monkeypatch.setattr(mod, "hopper_device", lambda device: True)
    assert attention_op.attention_plan(3, 64, 64, bf16, cpu)[1:] == []  # padded tiles: the Hopper kernels serve
    (line,) = attention_op.attention_plan(4, 256, 64, bf16, cpu)
    assert "Triton fwd, dq, dkdv kernels serve" in line and "head dim 256" in line
    (line,) = attention_op.attention_plan(4, 64, 64, torch.float32, cpu)
    assert "float32" in line
    assert kernel_plan(16, 2, 64, NOSAConfig(), bf16, cpu) == []  # CPU runs: the reference, as the log says
    (line,) = kernel_plan(16, 2, 48, NOSAConfig(), bf16, torch.device("cuda"), backend="auto")
    assert "PyTorch reference runs attention and selection" in line and "head dim 48" in line
