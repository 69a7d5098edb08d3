"""A command's start on a CPU imports only what it uses, with unchanged results: pretraining reads its tokenizer
without transformers, megatron-core's lazy wandb survives scans of ``sys.modules``, torch's optimizers run
without ``torch._dynamo``, a checkpoint save starts no helper process, and the exit still finalizes garbage."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from data.tokenizer import EOD_TOKEN, PAD_TOKEN, Tokenizer, load_hf_tokenizer, plain_backend, train_bpe
from tests.subproc import REPO, child_env

TEXTS = [f"document {i}: the quick brown fox {i * 7} jumps over the lazy dog; def f(x): return x + {i}"
         for i in range(60)]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    return train_bpe(TEXTS, 300, str(tmp_path_factory.mktemp("tok") / "bpe"), min_frequency=1)


def _reference(path: str) -> tuple[int, int, int]:
    """(vocab_size, eod, pad) as transformers' tokenizer gives them (what Tokenizer read before)."""
    hf = load_hf_tokenizer(path)
    backend = hf.backend_tokenizer
    eod = backend.token_to_id(EOD_TOKEN)
    eod = hf.eos_token_id if eod is None else eod
    pad = backend.token_to_id(PAD_TOKEN)
    pad = hf.pad_token_id if pad is None else pad
    return backend.get_vocab_size(with_added_tokens=True), eod, pad if pad is not None and pad != eod else -1


def _edit_config(path: str, **changes) -> None:
    cfg_path = f"{path}/tokenizer_config.json"
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


def test_pretraining_reads_a_plain_tokenizer_without_transformers(bpe_dir):
    script = f"""
import sys
from data.tokenizer import Tokenizer
t = Tokenizer({bpe_dir!r})
print(t.vocab_size, t.eod, t.pad, "transformers" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=child_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(v) for v in (*_reference(bpe_dir), False)]


def test_tokenizer_values_and_encodings_match_transformers(bpe_dir):
    tok = Tokenizer(bpe_dir)
    assert plain_backend(bpe_dir) is not None
    assert (tok.vocab_size, tok.eod, tok.pad) == _reference(bpe_dir)
    hf = load_hf_tokenizer(bpe_dir)  # the encodings are transformers' backend's, loaded on first use
    text = f"the lazy fox {EOD_TOKEN} <|im_start|>user\nhi<|im_end|>"
    ids = hf.encode(text, add_special_tokens=False)
    assert tok.encode_with_offsets(text)[0] == ids and tok.eod in ids
    assert tok.decode(ids) == text
    plain = tok.encode_plain([text])[0]  # special-token strings stay plain text
    assert tok.eod not in plain and tok.decode(plain) == text


@pytest.mark.parametrize("change", ["token_missing_from_vocab", "no_pad_no_eod_in_vocab", "class"])
def test_tokenizers_that_transformers_changes_are_read_by_transformers(bpe_dir, tmp_path, change):
    import shutil

    path = str(tmp_path / "tok")
    shutil.copytree(bpe_dir, path)
    if change == "token_missing_from_vocab":  # transformers adds it: one more row
        _edit_config(path, additional_special_tokens=["<|im_start|>", "<|im_end|>", "<|brand_new|>"])
    elif change == "no_pad_no_eod_in_vocab":  # eos / pad named by the config, not the conventional tokens
        with open(f"{path}/tokenizer.json") as f:
            data = json.load(f)
        for t in data["added_tokens"]:
            t["content"] = {EOD_TOKEN: "</eos>", PAD_TOKEN: "</pad>"}.get(t["content"], t["content"])
        for old, new in ((EOD_TOKEN, "</eos>"), (PAD_TOKEN, "</pad>")):
            data["model"]["vocab"][new] = data["model"]["vocab"].pop(old)
        with open(f"{path}/tokenizer.json", "w") as f:
            json.dump(data, f)
        _edit_config(path, eos_token="</eos>", pad_token="</pad>")
        (tmp_path / "tok" / "special_tokens_map.json").unlink()
    else:
        _edit_config(path, tokenizer_class="SomeModelTokenizerFast")
    tok = Tokenizer(path)
    assert (tok.vocab_size, tok.eod, tok.pad) == _reference(path)
    if change == "token_missing_from_vocab":
        assert plain_backend(path) is None and tok.vocab_size == Tokenizer(bpe_dir).vocab_size + 1


SCRIPT = r"""
import gc, inspect, multiprocessing, os, sys
from runtime.megatron_cpu import apply_cpu_shim, lean_megatron_import
print("lean", lean_megatron_import())
import megatron.core  # noqa: F401
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor

# torch's operator registrations scan sys.modules through inspect.getmodule: wandb stays unloaded
inspect.getframeinfo(sys._getframe())  # as torch.library does for every operator it registers
print("wandb loaded by a scan", "wandb.sdk" in sys.modules)

# an optimizer's life without torch._dynamo, and its updates as torch's own step wrapper gives them
torch.manual_seed(0)
w0, g0 = torch.randn(5, 3), torch.randn(5, 3)
ws = [w0.clone().requires_grad_() for _ in range(2)]
grads = [g0, g0]
opts = [torch.optim.AdamW([w], lr=0.1, weight_decay=0.01) for w in ws]
for w, g, opt in zip(ws, grads, opts):
    w.grad = g.clone()
opts[0].step()
opts[0].zero_grad()
opts[0].load_state_dict(opts[0].state_dict())
print("dynamo", "torch._dynamo" in sys.modules)
type(opts[1]).step._dynamo_on_demand(opts[1])  # torch's wrapper (imports dynamo)
print("same update", torch.equal(ws[0], ws[1]), "grad mode kept", torch.is_grad_enabled())
ws[0].grad = grads[0].clone()
opts[0].step()  # with dynamo imported: torch's wrapper itself
print("after dynamo", torch.compiler.is_compiling() is False)

# a checkpoint save on one gloo rank: no helper process, same tensors back
apply_cpu_shim()
store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
os.makedirs(sys.argv[1])
x = torch.arange(12.0).reshape(3, 4)
dist_checkpointing.save({"x": ShardedTensor.from_rank_offsets("x", x)}, sys.argv[1])
back = dist_checkpointing.load({"x": ShardedTensor.from_rank_offsets("x", torch.zeros(3, 4))}, sys.argv[1])
print("saved", torch.equal(back["x"], x), "helpers", len(multiprocessing.active_children()))
dist.destroy_process_group()

# the exit still finalizes garbage cycles
from runtime.process_exit import freeze_at_exit
freeze_at_exit()
freeze_at_exit()
class Cycle:
    def __del__(self):
        with open(sys.argv[2], "w") as f:
            f.write("finalized")
c = Cycle()
c.self = c
del c
gc.disable()
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the lean start applies only without CUDA")
def test_cpu_command_start_skips_unused_imports_and_helpers(tmp_path):
    marker = tmp_path / "finalized.txt"
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ckpt"), str(marker)], cwd=REPO,
                         env=child_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == [
        "lean True", "wandb loaded by a scan False", "dynamo False", "same update True grad mode kept True",
        "after dynamo True", "saved True helpers 0"], out.stdout
    assert marker.read_text() == "finalized"


def test_local_results_queue_refuses_a_put_from_another_process():
    import os

    from runtime.megatron_cpu import _LocalResultsQueue

    q = _LocalResultsQueue()
    q.put(1)
    assert q.get_nowait() == 1
    q._pid = os.getpid() + 1  # as a forked writer process would see it
    with pytest.raises(RuntimeError, match="asynchronous dist-checkpoint saves"):
        q.put(2)


HELP = """
import runpy, sys
heavy = ("torch", "transformers", "megatron")
for module in sys.argv[1:]:
    sys.argv = [module, "--help"]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
    print("IMPORTED", module, *sorted(m for m in heavy if m in sys.modules))
"""
FAST_HELP = ("checkpoints_convert.from_hf", "checkpoints_convert.to_hf", "eval.ablate", "bench.inference", "eval.ppl",
             "eval.ruler", "eval.suite", "eval.locality")


def test_help_imports_neither_torch_nor_transformers():
    """``--help`` of the converters, the evals and the inference benchmark answers before torch, transformers or
    megatron-core is imported (they took 8-13 s to print it); the model argument is --ckpt everywhere."""
    out = subprocess.run([sys.executable, "-c", HELP, *FAST_HELP], cwd=REPO, env=child_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert [ln for ln in out.stdout.splitlines() if ln.startswith("IMPORTED")] == [f"IMPORTED {m}" for m in FAST_HELP]
    text = " ".join(out.stdout.split())
    assert text.count("--ckpt CKPT") >= 5 and text.count("a run dir, its checkpoints/ dir, one iter_* dir") == 4
    assert "--ckpt HF, --hf HF" in text and "--ckpt MODEL, --model MODEL" in text
