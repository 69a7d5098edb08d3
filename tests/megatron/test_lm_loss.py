"""``nosa_layers.megatron.lm_loss``: the chunked language-model loss against the plain whole-logit reference
(fp64) and megatron-core's own whole-logit loss.

In this process (one rank, the whole vocabulary): loss and gradients of the hidden states and the output weight
on random inputs of odd token counts (not multiples of the chunk), masks with zero and fractional weights,
muP's logit multiplier; the incoming gradient scales them; no tensor of more than ``chunk x vocab`` elements
is ever made; what is kept for the backward; megatron-core's ``main_grad`` accumulation (tied weight too).
At tensor parallelism 2 (2 gloo rank processes, ``_lm_loss_worker.py``): megatron-core's output layer with and
without sequence parallelism, a tied weight, bf16 with megatron-core's fused cross-entropy helpers, and a tiny
GPT whose every parameter gradient is compared. Measured (2-core CPU, fp32): relative differences <= 3e-7.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nosa_layers.megatron.lm_loss import ChunkedLMLossProcessor, chunked_lm_loss, reference_lm_loss
from tests.subproc import REPO, run_ranks

FP32_RTOL = 2e-6


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _inputs(seed: int, n: int, h: int, vocab: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(vocab, h, generator=g) * 0.5
    labels = torch.randint(0, vocab, (n,), generator=g)
    mask = (torch.rand(n, generator=g) > 0.3).float()
    mask[: n // 5] *= torch.rand(n // 5, generator=g)  # fractional weights too
    return hidden.to(dtype), weight.to(dtype), labels, mask


def _grads(fn, hidden, weight, *args, upstream: float = 1.0, **kwargs):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    loss = fn(h, w, *args, **kwargs)
    (loss * upstream).backward()
    return loss.detach(), h.grad, w.grad


# (seed, tokens, hidden, vocab, chunk, logit scale): odd counts, one chunk, one-token chunks, a partial last chunk
CASES = [(101, 37, 16, 53, 8, 1.0), (102, 53, 24, 97, 53, 1.0), (103, 5, 8, 31, 1, 1.0),
         (104, 100, 32, 211, 33, 0.37), (105, 64, 12, 40, 1000, 2.5)]


@pytest.mark.parametrize("seed,n,h,vocab,chunk,scale", CASES)
def test_chunked_loss_and_gradients_equal_the_reference_in_fp32(seed, n, h, vocab, chunk, scale):
    hidden, weight, labels, mask = _inputs(seed, n, h, vocab)
    got = _grads(chunked_lm_loss, hidden, weight, labels, mask, chunk_tokens=chunk, logit_scale=scale, upstream=1.75)
    want = _grads(reference_lm_loss, hidden.double(), weight.double(), labels, mask.double(), scale, upstream=1.75)
    assert got[0].dtype == torch.float32 and got[0].dim() == 0
    for name, a, b in zip(("loss", "hidden grad", "weight grad"), got, want):
        assert _rel(a, b) <= FP32_RTOL, (name, _rel(a, b))
    assert got[1][mask == 0].abs().max() == 0  # masked tokens get no gradient


def test_no_mask_weighs_every_token_and_no_grad_mode_computes_only_the_loss():
    hidden, weight, labels, _ = _inputs(106, 29, 8, 23)
    ref = reference_lm_loss(hidden.double(), weight.double(), labels)
    assert _rel(chunked_lm_loss(hidden, weight, labels, chunk_tokens=6), ref) <= FP32_RTOL
    h = hidden.clone().requires_grad_(True)
    with torch.no_grad():
        loss = chunked_lm_loss(h, weight, labels, chunk_tokens=6)
    assert not loss.requires_grad and _rel(loss, ref) <= FP32_RTOL


def test_the_stored_gradients_serve_one_backward():
    hidden, weight, labels, mask = _inputs(107, 21, 8, 19)
    h = hidden.clone().requires_grad_(True)
    loss = chunked_lm_loss(h, weight.requires_grad_(True), labels, mask, chunk_tokens=4)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward"):
        loss.backward()


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op makes."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _kept_bytes(fn, *args, **kwargs) -> int:
    """Bytes autograd keeps for the backward of ``fn(*args)``."""
    kept = []

    def pack(t):
        kept.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args, **kwargs)
    return sum(kept)


def test_the_logits_never_exist_whole():
    """Forward and backward make no tensor larger than one chunk's logits; the backward keeps the hidden-state
    gradient and the fp32 weight gradient, where the whole-logit loss keeps at least its ``[N, V]`` softmax."""
    n, h, vocab, chunk = 300, 16, 500, 64
    hidden, weight, labels, mask = _inputs(108, n, h, vocab)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    with _LargestTensor() as seen:
        chunked_lm_loss(hidden, weight, labels, mask, chunk_tokens=chunk).backward()
    assert seen.largest == chunk * vocab
    with _LargestTensor() as whole:
        reference_lm_loss(hidden, weight, labels, mask).backward()
    assert whole.largest == n * vocab
    assert _kept_bytes(chunked_lm_loss, hidden, weight, labels, mask, chunk_tokens=chunk) == 4 * (n * h + vocab * h)
    assert _kept_bytes(reference_lm_loss, hidden, weight, labels, mask) >= 4 * n * vocab


@pytest.mark.parametrize("tied", [False, True])
def test_the_weight_gradient_goes_into_main_grad_with_the_accumulation_fusion(tied):
    """megatron-core's ``gradient_accumulation_fusion``: the fp32 weight gradient is added into ``main_grad`` and
    autograd gets a placeholder, zeros for a weight the embedding uses too (its own gradient still arrives)."""
    hidden, weight, labels, mask = _inputs(109, 45, 12, 37)
    _, ref_h, ref_w = _grads(reference_lm_loss, hidden.double(), weight.double(), labels, mask.double())
    param = torch.nn.Parameter(weight.clone())
    before = torch.randn(weight.shape, generator=torch.Generator().manual_seed(1))
    param.main_grad = before.clone()
    param.grad_added_to_main_grad = False
    param.zero_out_wgrad = tied
    h = hidden.clone().requires_grad_(True)
    loss = chunked_lm_loss(h, param, labels, mask, chunk_tokens=10, accumulate_main_grad=True)
    lookup = torch.tensor([3, 3, 7])
    if tied:
        loss = loss + torch.nn.functional.embedding(lookup, param).sum()
    loss.backward()
    assert param.grad_added_to_main_grad
    assert _rel(param.main_grad - before, ref_w) <= FP32_RTOL and _rel(h.grad, ref_h) <= FP32_RTOL
    if tied:  # the placeholder is zeros: what autograd accumulated is the embedding's gradient alone
        emb = torch.zeros_like(weight)
        emb[3], emb[7] = 2.0, 1.0
        assert torch.equal(param.grad, emb)
    else:
        assert param.grad.shape == weight.shape  # megatron-core's DDP hook skips it (grad_added_to_main_grad)


def test_bf16_is_as_close_to_the_reference_as_the_whole_logit_bf16_loss():
    hidden, weight, labels, mask = _inputs(110, 77, 32, 150, torch.bfloat16)
    ref = _grads(reference_lm_loss, hidden.double(), weight.double(), labels, mask.double())
    whole = _grads(reference_lm_loss, hidden, weight, labels, mask)
    got = _grads(chunked_lm_loss, hidden, weight, labels, mask, chunk_tokens=20)
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    for a, b, r in zip(got, whole, ref):
        assert _rel(a, r) <= 1.5 * _rel(b, r) + 1e-6, (_rel(a, r), _rel(b, r))


def test_bad_arguments_are_refused():
    hidden, weight, labels, _ = _inputs(111, 9, 8, 11)
    with pytest.raises(ValueError, match="bf16"):
        chunked_lm_loss(hidden, weight, labels, fused=True)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_lm_loss(hidden, weight, labels, chunk_tokens=0)
    with pytest.raises(ValueError, match=r"\[N, h\]"):
        chunked_lm_loss(hidden, weight[:, :5], labels)
    with pytest.raises(ValueError, match="labels"):
        ChunkedLMLossProcessor(8)(hidden_states=hidden[:, None], output_layer=None, output_weight=weight,
                                  labels=None, loss_mask=None, config=None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fused", [False, True])
def test_on_the_gpu_the_chunked_loss_needs_a_fraction_of_the_whole_logit_memory(fused):
    """The 1B shape's output layer in bf16 on 16K tokens (``fused``: megatron-core's compiled helpers per chunk):
    the same loss and gradients as the whole-logit bf16 loss up to bf16 rounding, and a peak above the inputs
    of at most the kept gradients plus one chunk's logits at 10 bytes per entry, where the whole-logit
    loss needs more than 6 bytes per token and vocabulary entry."""
    n, h, vocab, chunk = 16384, 2048, 73448, 4096
    hidden, weight, labels, mask = (t.cuda() for t in _inputs(112, n, h, vocab, torch.bfloat16))
    weight = weight * 0.05

    def run(fn, *args, **kwargs):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        got = _grads(fn, hidden, weight, labels, mask, *args, **kwargs)
        torch.cuda.synchronize()
        return got, torch.cuda.max_memory_allocated() - base

    whole, whole_peak = run(reference_lm_loss)
    got, peak = run(chunked_lm_loss, chunk_tokens=chunk, fused=fused)
    assert abs(got[0] - whole[0]) / whole[0] < 1e-3
    assert _rel(got[1], whole[1]) < 2e-2 and _rel(got[2], whole[2]) < 2e-2
    assert whole_peak > 6 * n * vocab
    assert peak <= 2 * (2 * n * h + 2 * vocab * h) + 4 * vocab * h + 10 * chunk * vocab + 64 * 2**20, (peak, whole_peak)


# ---------------------------------------------------------------- tensor parallelism 2 (2 rank processes)

@pytest.fixture(scope="module")
def tp2(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("lm_loss")
    rc = run_ranks([sys.executable, str(REPO / "tests" / "megatron" / "_lm_loss_worker.py"), out / "out.json"], 2,
                   out / "log", timeout_s=600)
    if rc != 0 or not (out / "out.json").exists():
        pytest.fail(f"the TP=2 launch exited with {rc}:\n{(out / 'log').read_text(errors='replace')[-4000:]}")
    return json.loads((out / "out.json").read_text())


def _ranks(tp2: dict, case: str) -> list[dict]:
    got = list(tp2[case].values())
    assert len(got) == 2
    for r in got:
        assert "error" not in r, r.get("error")
    return got


@pytest.mark.parametrize("case", ["tp2", "tp2_sp", "tp2_tied_mup", "tp2_sp_one_chunk"])
def test_tp2_output_layer_equals_megatron_and_the_reference_in_fp32(tp2, case):
    """megatron-core's ``ColumnParallelLinear`` output layer: the chunked loss (through the model's output
    processor) against its whole-logit loss, and both against the fp64 reference on the whole weight (each
    rank's shard of the weight gradient; with sequence parallelism, its shard of the hidden-state gradient)."""
    ranks = _ranks(tp2, case)
    assert ranks[0]["loss_value"] == ranks[1]["loss_value"]  # every rank holds the whole loss
    for r in ranks:
        for key in ("loss", "hidden_grad", "weight_grad"):
            assert r[key] <= FP32_RTOL, (key, r[key])
            assert r["chunked_vs_ref"][key] <= FP32_RTOL, (key, r["chunked_vs_ref"])


def test_tp2_bf16_with_megatrons_fused_helpers_is_as_close_as_its_fused_loss(tp2):
    for r in _ranks(tp2, "tp2_fused_bf16"):
        assert r["loss"] <= 1e-3 and r["hidden_grad"] <= 2e-2 and r["weight_grad"] <= 2e-2, r
        for key in ("loss", "hidden_grad", "weight_grad"):
            assert r["chunked_vs_ref"][key] <= 1.5 * r["standard_vs_ref"][key] + 1e-6, (key, r)


@pytest.mark.parametrize("case", ["model_tied_mup_sp", "model_untied"])
def test_tp2_gpt_model_gradients_equal_the_whole_logit_loss(tp2, case):
    """A tiny GPT at TP=2 (tied embeddings, muP and sequence parallelism; untied without): the model's output
    processor against megatron's per-token losses, every parameter's gradient."""
    for r in _ranks(tp2, case):
        assert r["params_with_grads"] >= 14
        assert r["loss"] <= 1e-6 and r["grads_worst_tensor"] <= FP32_RTOL and r["embedding_grad"] <= FP32_RTOL, r
