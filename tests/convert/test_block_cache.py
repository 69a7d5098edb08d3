"""The exported model's fast paths against its reference path (CPU, tiny random models, fp64).

* the batched decode selection equals the reference selection of that row (``select_rows``);
* block-cache decode (batch > 1, different lengths, left padding, chunked prefill) gives the logits
  and the per-step selections of the reference decode path (``DynamicCache``);
* the offloaded cache returns exactly what the GPU-resident block cache does, moving only the
  blocks a step adds;
* ``generate`` (greedy at batch > 1, beam search) with the default block cache;
* the packed Triton prefill (interpreter, tiny shapes) equals the reference prefill;
* the Triton decode attention (blocks read in place: cache pool, slots, host store) equals the
  gathered PyTorch ``attend``, alone and inside the cache; the selection kernel inside the cache decodes as
  the PyTorch selection.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch

from nosa_layers.config import tiny_geometry
from nosa_layers.megatron.config import AttentionConfig, ModelConfig
from nosa_layers.selection import (
    block_window_index,
    compressed_keys,
    select_rows,
    window_scores,
)


def _model_cfg(head_dim: int = 8, heads: int = 4, layers: int = 2) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=32, num_attention_heads=heads, num_kv_heads=2,
                       head_dim=head_dim, ffn_hidden_size=64, vocab_size=97, rope_theta=10000.0)


@pytest.fixture(scope="module")
def export_dirs(tmp_path_factory):
    from checkpoints_convert.random_export import write_random_export

    root = tmp_path_factory.mktemp("block_cache")
    geo = tiny_geometry()
    return {
        "nosa": write_random_export(root / "nosa", _model_cfg(),
                                    AttentionConfig(variant="nosa", nosa=geo, backend="reference")),
        "mixed": write_random_export(root / "mixed", _model_cfg(), AttentionConfig(
            variant="nosa", layer_pattern=["dense", "infllm_v2"], nosa=geo, backend="reference")),
        "triton": write_random_export(root / "triton", _model_cfg(head_dim=16, heads=8, layers=1),
                                      AttentionConfig(variant="nosa", nosa=geo, backend="triton")),
        # S-DMA: a bias of its own (s - stopgrad(s)), stored apart from the score
        "s_dma": write_random_export(root / "s_dma", _model_cfg(), AttentionConfig(
            variant="nosa", nosa=dataclasses.replace(geo, eviction_head="s_dma"), backend="reference")),
    }


def _load(path, dtype=torch.float64):
    from checkpoints_convert.random_export import load_random_model

    torch.manual_seed(7)
    return load_random_model(path, dtype, eviction_scale=0.8)


def _cache_of(out):
    return getattr(out, "cache", None) or out.past_key_values


def _batch(lens, vocab=97, seed=3):
    g = torch.Generator().manual_seed(seed)
    P = max(lens)
    ids = torch.zeros(len(lens), P, dtype=torch.long)
    mask = torch.zeros(len(lens), P, dtype=torch.long)
    for b, n in enumerate(lens):
        ids[b, P - n:] = torch.randint(1, vocab, (n,), generator=g)
        mask[b, P - n:] = 1
    return ids, mask


def _run(model, cache, ids, mask, new_tokens, chunk=None, record=True):
    """Prefill (optionally in two chunks) then decode ``new_tokens [B, S]``; returns the step logits
    ``[B, S, V]``, the per-step selections (empty without ``record``) and the cache."""
    model.record(record)
    with torch.no_grad():
        if chunk:
            out = model(ids[:, :chunk], attention_mask=mask[:, :chunk], cache=cache, use_cache=True)
            out = model(ids[:, chunk:], attention_mask=mask, cache=_cache_of(out), use_cache=True)
        else:
            out = model(ids, attention_mask=mask, cache=cache, use_cache=True)
        cache = _cache_of(out)
        logits, sels = [], []
        for j in range(new_tokens.shape[1]):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(new_tokens[:, j:j + 1], attention_mask=mask, cache=cache, use_cache=True)
            cache = _cache_of(out)
            logits.append(out.logits[:, -1])
            if record:
                sels.append({i: [s.clone() for s in per_seq] for i, per_seq in model.selections().items()})
    model.record(False)
    return torch.stack(logits, 1), sels, cache


@pytest.mark.parametrize("G,seed", [(1, 0), (3, 3), (4, 1), (8, 2)])
def test_batched_decode_selection_equals_select_rows(export_dirs, G, seed):
    """``select_decode_batched`` on capacity-sized state = ``select_rows`` on each sequence's prefix."""
    mod = _shipped(_load(export_dirs["nosa"]), "nosa_decode_select")
    g = torch.Generator().manual_seed(seed)
    cfg = tiny_geometry()
    B, Hkv, D, cap = 3, 2, 8, 256
    lens = [int(x) for x in torch.randint(1, cap, (B,), generator=g)]
    lens[0] = 7  # no full window yet
    k = torch.randn(B, cap, Hkv, D, generator=g, dtype=torch.float64)
    q = torch.randn(B, 1, Hkv * G, D, generator=g, dtype=torch.float64)
    score = torch.randn(B, cap, Hkv, generator=g, dtype=torch.float64)
    NW, NB = cfg.num_windows(cap), cap // cfg.block_size
    kc = torch.zeros(B, Hkv, NW, D, dtype=torch.float64)
    wsc = torch.zeros(B, Hkv, NW, dtype=torch.float64)
    for b, n in enumerate(lens):
        nw = cfg.num_windows(n)
        if not nw:
            continue
        kc[b, :, :nw] = compressed_keys(k[b:b + 1, :n], cfg)[0, :nw].transpose(0, 1)
        wsc[b, :, :nw] = window_scores(score[b:b + 1, :n], cfg)[0]
    pos = torch.tensor(lens) - 1
    index = block_window_index(cfg, NB, NW)
    for with_score in (True, False):
        blocks, ok = mod.select_decode_batched(q[:, 0].view(B, Hkv, G, D), kc, wsc if with_score else None, pos,
                                               cfg, index, D ** -0.5)
        for b, n in enumerate(lens):
            want = select_rows(q[b:b + 1], k[b:b + 1, :n], score[b:b + 1, :n] if with_score else None,
                               torch.tensor([n - 1]), cfg)[0, :, 0]  # [Hkv, nb]
            got = torch.zeros(Hkv, NB + 1, dtype=torch.bool)
            got.scatter_(-1, torch.where(ok[b], blocks[b], NB), True)
            assert torch.equal(got[:, :want.shape[-1]], want) and not got[:, want.shape[-1]:NB].any(), \
                f"G={G} seq {b} (len {n}) score={with_score}"


def _shipped(model, name: str):
    """A module shipped with the export of ``model`` (the remote-code package transformers imported)."""
    return importlib.import_module(type(model).__module__.rsplit(".", 1)[0] + "." + name)


@pytest.mark.parametrize("kind", ["nosa", "mixed"])
def test_block_cache_decode_equals_reference_decode(export_dirs, kind):
    """3 sequences of different lengths (left padded), prefilled whole or in two chunks, decode 24 tokens
    (past the 6-block budget): logits and selections equal the DynamicCache reference path."""
    model = _load(export_dirs[kind])
    ids, mask = _batch([130, 77, 41])
    new = torch.randint(1, 97, (3, 24), generator=torch.Generator().manual_seed(5))
    ref_logits, ref_sels, _ = _run(model, model.new_cache(dynamic=True), ids, mask, new)
    for chunk in (None, 100):
        logits, sels, cache = _run(model, model.new_cache(), ids, mask, new, chunk=chunk)
        assert type(cache).__name__ == "NOSABlockCache"
        # the eviction head scores in fp32 (reference): a GEMM over [B, 1] vs [B, L] rows may round differently
        torch.testing.assert_close(logits, ref_logits, rtol=1e-6, atol=1e-6)
        for j, (got, want) in enumerate(zip(sels, ref_sels)):
            for layer in want:
                for b in range(3):
                    assert torch.equal(got[layer][b], want[layer][b]), f"step {j} layer {layer} seq {b}"
    assert cache.lens.tolist() == [154, 101, 65] and cache.get_seq_length() == 154


@pytest.mark.parametrize("offload", [False, True])
def test_compressed_keys_stored_in_cache_dtype_rounded_once(export_dirs, offload):
    """A bf16 cache keeps ``kc`` in bf16: every window mean taken in fp32 over the cached keys and
    rounded once, both for windows written at prefill and for those completed by decode steps."""
    model = _load(export_dirs["nosa"], torch.bfloat16)
    ids, mask = _batch([130, 77, 41])
    new = torch.randint(1, 97, (3, 40), generator=torch.Generator().manual_seed(11))
    _, _, cache = _run(model, model.new_cache(offload=offload, gpu_blocks=3), ids, mask, new, record=False)
    checked = 0
    for st in cache.states:
        if st.spec.cfg is None:
            continue
        assert st.kc.dtype == torch.bfloat16
        for b, n in enumerate(cache.lens.tolist()):
            k, _ = st.read(b, n, cache.batch, cache.device)
            nw = st.spec.cfg.num_windows(n)
            want = compressed_keys(k[None].float(), st.spec.cfg)[0].transpose(0, 1).to(torch.bfloat16)
            assert torch.equal(st.kc[b, :, :nw], want), f"sequence {b}"
            checked += nw
    assert checked > 0


def test_offloaded_cache_equals_full_cache(export_dirs):
    """Offloaded (host store + GPU slots) vs GPU-resident block cache: identical logits and selections;
    the first step fetches whole selections, later steps only the blocks a selection adds. Both transfer
    paths: host copies, and the Triton kernels on the host store (interpreter on CPU). With fewer slots
    than the selection budget (4 of topk 7), the blocks without a slot are read from the host every step
    and the results stay identical."""
    model = _load(export_dirs["nosa"])
    ids, mask = _batch([170, 130])
    new = torch.randint(1, 97, (2, 40), generator=torch.Generator().manual_seed(6))
    full_logits, full_sels, _ = _run(model, model.new_cache(), ids, mask, new)
    topk = tiny_geometry().topk
    fetched = {}
    for gpu_blocks, fetch in ((None, "copy"), (9, "copy"), (None, "uva"), (4, "copy"), (4, "uva")):
        if fetch == "uva":
            pytest.importorskip("triton")
            if torch.cuda.is_available():  # CPU tensors under the interpreter; the gpu test covers CUDA
                continue
        cache = model.new_cache(offload=True, gpu_blocks=gpu_blocks, fetch=fetch)
        logits, sels, cache = _run(model, cache, ids, mask, new)
        assert cache.fetch == fetch
        assert torch.equal(logits, full_logits)
        assert all(torch.equal(a[i][b], c[i][b]) for a, c in zip(sels, full_sels) for i in a for b in range(2))
        fetched[(gpu_blocks, fetch)] = cache.fetched_blocks()
        # the per-token scores (this model's bias) live in the host store with their blocks; the slots
        # hold the bias rows of the resident blocks
        nosa_states = [st for st in cache.states if st.cpu_k is not None]
        assert nosa_states and all(st.bias is st.score and st.gpu_b is not None for st in nosa_states)
        assert cache.memory_bytes()["host"] == sum(2 * st.cpu_k.nbytes + st.score.nbytes for st in nosa_states)
        if fetch == "copy":
            st = cache.stats
            steps = st.per_step_h2d
            block_bytes = 2 * 16 * 8 * 8 + 16 * 8  # K and V of one 16-token block (D = 8) and its bias row, fp64
            assert steps[0] == 2 * 2 * 2 * topk * block_bytes  # layers x seqs x heads x whole selection
            if gpu_blocks is None or gpu_blocks >= topk:
                assert all(s < steps[0] for s in steps[1:]) and sum(steps[1:]) > 0
            else:  # at least the selected blocks beyond the slots, every step
                assert all(s >= 2 * 2 * 2 * (topk - gpu_blocks) * block_bytes for s in steps[1:])
            assert st.h2d_bytes == sum(steps) == st.fetched_blocks * block_bytes and st.decode_steps == 40
        assert cache.fetched_block_bytes() == 2 * 16 * 8 * 8 + 16 * 8  # the same on both transfer paths
        # device -> host per decode token: K, V (D = 8, fp64) and the score, per layer and KV head
        assert cache.token_d2h_bytes() == 2 * 2 * (2 * 8 * 8 + 8)
        assert cache.stats.d2h_bytes == 40 * 2 * cache.token_d2h_bytes()  # eager steps: 40 x 2 sequences
    if not torch.cuda.is_available():
        assert fetched[(None, "uva")] == fetched[(None, "copy")] >= fetched[(9, "copy")]
        assert fetched[(4, "uva")] == fetched[(4, "copy")] > fetched[(None, "copy")]


def test_offloaded_cache_with_a_separate_bias_equals_full_cache(export_dirs):
    """An eviction head whose bias is not its score (S-DMA): the offloaded cache keeps both in the host
    store and the bias rows in the slots; logits equal the GPU-resident cache with both transfer paths."""
    model = _load(export_dirs["s_dma"])
    ids, mask = _batch([150, 90])
    new = torch.randint(1, 97, (2, 30), generator=torch.Generator().manual_seed(9))
    full_logits, _, _ = _run(model, model.new_cache(), ids, mask, new, record=False)
    for gpu_blocks, fetch in ((None, "copy"), (4, "copy"), (4, "uva")):
        if fetch == "uva" and (importlib.util.find_spec("triton") is None or torch.cuda.is_available()):
            continue
        logits, _, cache = _run(model, model.new_cache(offload=True, gpu_blocks=gpu_blocks, fetch=fetch), ids, mask,
                                new, record=False)
        states = [st for st in cache.states if st.cpu_k is not None]
        assert states and all(st.bias_mode == "own" and st.bias is not st.score for st in states)
        assert cache.memory_bytes()["host"] == sum(2 * st.cpu_k.nbytes + 2 * st.score.nbytes for st in states)
        assert torch.equal(logits, full_logits), (gpu_blocks, fetch)


def test_generate_batch_equals_single_prompts_and_beam_search(export_dirs):
    model = _load(export_dirs["nosa"], torch.float32)
    ids, mask = _batch([90, 33])
    kw = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        both = model.generate(ids, attention_mask=mask, **kw)
        for b, n in enumerate([90, 33]):
            one = model.generate(ids[b:b + 1, -n:], **kw)
            assert torch.equal(both[b, -12:], one[0, -12:])
        beam_fast = model.generate(ids, attention_mask=mask, num_beams=3, **kw)
        beam_ref = model.generate(ids, attention_mask=mask, num_beams=3, cache=model.new_cache(dynamic=True), **kw)
    assert torch.equal(beam_fast, beam_ref)


def test_triton_packed_prefill_equals_reference(export_dirs):
    """Prefill of 2 left-padded prompts through the Triton kernels (one packed call; interpreter on CPU)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CPU tensors under the Triton interpreter; on GPUs tests/ops runs the compiled kernels")
    model = _load(export_dirs["triton"], torch.float32)
    ids, mask = _batch([100, 61])
    model.record(True)
    for layer in model.model.layers:
        layer.self_attn.backend = "triton"
    with torch.no_grad():
        fast = model(ids, attention_mask=mask, use_cache=True)
        sel_fast = [s.clone() for s in model.selections()[0]]
        for layer in model.model.layers:
            layer.self_attn.backend = "reference"
        ref = model(ids, attention_mask=mask, use_cache=True)
        sel_ref = model.selections()[0]
    valid = mask.bool()
    torch.testing.assert_close(fast.logits[valid], ref.logits[valid], rtol=1e-4, atol=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(sel_fast, sel_ref))


def test_decode_config_default_is_block_cache_for_plain_forward(export_dirs):
    """``use_cache=True`` without a cache makes a block cache; ``set_cache_options`` chooses offload."""
    model = _load(export_dirs["nosa"], torch.float32)
    ids, _ = _batch([20])
    with torch.no_grad():
        assert type(_cache_of(model(ids, use_cache=True))).__name__ == "NOSABlockCache"
        model.set_cache_options(offload=True)
        assert _cache_of(model(ids, use_cache=True)).offload


def _kernel_device() -> torch.device:
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA and TRITON_INTERPRET is not set (run through tests/conftest.py)")
    return torch.device("cpu")


@pytest.mark.parametrize("G,K,seed", [(1, 5, 0), (3, 9, 1), (8, 17, 2)])
def test_decode_attention_kernel_equals_attend(export_dirs, G, K, seed):
    """The kernel on random fp32 inputs vs gathering the blocks and ``attend``: selections of K blocks
    (not a multiple of the 8-block split), skipped entries, keys past the position, bias or none, and
    blocks read from a second (host) store at their own rows while the rest lie at scattered pool rows."""
    dev = _kernel_device()
    model = _load(export_dirs["nosa"])
    kern, ref = _shipped(model, "nosa_decode_attention"), _shipped(model, "nosa_decode_select")
    g = torch.Generator().manual_seed(seed)
    B, Hkv, D, bs, NB = 3, 2, 32, 16, 20
    store_k = torch.randn(B * Hkv * NB, bs, D, generator=g)
    store_v = torch.randn(B * Hkv * NB, bs, D, generator=g)
    q = torch.randn(B, Hkv, G, D, generator=g)
    sel = torch.stack([torch.randperm(NB, generator=g)[:K] for _ in range(B * Hkv)]).view(B, Hkv, K)
    pos = torch.tensor([NB * bs - 1, 9 * bs + 5, 4 * bs])
    ok = (sel <= (pos // bs)[:, None, None]) & (torch.rand(B, Hkv, K, generator=g) > 0.15)
    sel[:, :, 0], ok[:, :, 0] = 0, True  # a key in every row (else NaN rows, as in attend)
    src = torch.arange(B * Hkv).view(B, Hkv, 1) * NB + sel
    bias = torch.randn(B, Hkv, NB * bs, generator=g)
    tok = (sel[..., None] * bs + torch.arange(bs)).view(B, Hkv, K * bs)
    allowed = ok[..., None].expand(B, Hkv, K, bs).reshape(B, Hkv, K * bs) & (tok <= pos[:, None, None])
    bias_sel = bias.view(B, Hkv, NB, bs)[torch.arange(B)[:, None, None], torch.arange(Hkv)[None, :, None], sel]
    kb, vb = store_k[src].view(B, Hkv, K * bs, D), store_v[src].view(B, Hkv, K * bs, D)
    # the pool: a random row per selected block, only some of them resident (the rest: host rows)
    R = B * Hkv * K + 5
    pool_k, pool_v = torch.randn(R, bs, D, generator=g), torch.randn(R, bs, D, generator=g)
    pool_b = torch.randn(R, bs, generator=g)  # bias rows travel with their blocks
    dest = torch.randperm(R, generator=g)[:B * Hkv * K].view(B, Hkv, K)
    resident = torch.rand(B, Hkv, K, generator=g) < 0.6
    pool_k[dest[resident]], pool_v[dest[resident]] = store_k[src[resident]], store_v[src[resident]]
    store_b = bias.view(B * Hkv * NB, bs)
    pool_b[dest[resident]] = store_b[src[resident]]
    on = {"device": dev}
    args = [t.to(**on) for t in (q, pool_k, pool_v, torch.where(resident, dest, -1), sel, ok, pos)]
    for with_bias in (True, False):
        want = ref.attend(q, kb, vb, bias_sel.reshape(B, Hkv, K * bs) if with_bias else None, allowed, 0.3)
        b = store_b.to(**on) if with_bias else None
        got_in_pool = kern.decode_attention(q.to(**on), store_k.to(**on), store_v.to(**on), src.to(**on),
                                            *args[4:], 0.3, b)
        got_split = kern.decode_attention(*args, 0.3, pool_b.to(**on) if with_bias else None,
                                          host_k=store_k.to(**on), host_v=store_v.to(**on), host_rows=src.to(**on),
                                          host_bias=b)
        for got in (got_in_pool, got_split):
            assert got.dtype == torch.float32 and got.shape == (B, Hkv, G, D)
            torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
        if dev.type == "cuda":  # bf16: tensor-core products, probabilities rounded to bf16 for p @ v
            h = {"device": dev, "dtype": torch.bfloat16}
            qh, kh, vh = q.to(**h), store_k.to(**h), store_v.to(**h)
            want_h = ref.attend(qh.float().cpu(), kh.float().cpu()[src].view(B, Hkv, K * bs, D),
                                vh.float().cpu()[src].view(B, Hkv, K * bs, D),
                                bias_sel.reshape(B, Hkv, K * bs) if with_bias else None, allowed, 0.3)
            got_h = kern.decode_attention(qh, kh, vh, src.to(**on), *args[4:], 0.3, b)
            torch.testing.assert_close(got_h.cpu(), want_h, rtol=2e-2, atol=2e-2)


def test_triton_decode_attention_in_the_cache(export_dirs):
    """Decode with the attention kernel (interpreter on CPU): the logits of the PyTorch path and its
    selections, for the GPU-resident cache and the offloaded one (topk slots; 3 of 6 slots, the rest
    read from the host store by the kernel); the offloaded runs equal the GPU-resident kernel run."""
    dev = _kernel_device()
    model = _load(export_dirs["triton"], torch.float32).to(dev)
    ids, mask = (t.to(dev) for t in _batch([100, 61]))
    new = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(8)).to(dev)
    want_logits, want_sels, _ = _run(model, model.new_cache(attention="torch"), ids, mask, new)
    runs, fetched = {}, {}
    for name, opts in (("full", {}), ("offload", {"offload": True}),
                       ("offload_3slots", {"offload": True, "gpu_blocks": 3, "fetch": "uva"}),
                       ("offload_3slots_torch",
                        {"offload": True, "gpu_blocks": 3, "fetch": "uva", "attention": "torch"})):
        cache = model.new_cache(**{"attention": "triton", **opts})
        logits, sels, cache = _run(model, cache, ids, mask, new)
        assert cache.attention == opts.get("attention", "triton")
        fetched[name] = cache.fetched_blocks()
        # summation order only (~1e-7 here); a 0.1% error in the kernel's logits shows as ~1e-6
        torch.testing.assert_close(logits, want_logits, rtol=0, atol=5e-7)
        assert all(torch.equal(a[i][b], c[i][b]) for a, c in zip(sels, want_sels) for i in a for b in range(2))
        runs[name] = logits
    assert torch.equal(runs["offload"], runs["full"]) and torch.equal(runs["offload_3slots"], runs["full"])
    # the blocks the kernel reads from the host count as moved, as the gathered path's copies do
    assert fetched["offload_3slots"] == fetched["offload_3slots_torch"] > fetched["offload"] > 0
    with pytest.raises(ValueError, match="attention must be"):
        model.new_cache(attention="fast")


def test_selection_kernel_in_the_cache(export_dirs, monkeypatch):
    """attention='triton' selects the blocks with the selection kernel (one launch per layer and step) and
    decodes exactly as the same cache with the PyTorch selection (``select_decode_fast``): logits, greedy
    tokens and selections; a short sequence (below the budget) and a long one in one batch."""
    dev = _kernel_device()
    model = _load(export_dirs["triton"], torch.float32).to(dev)
    step = _shipped(model, "nosa_decode_step")
    ids, mask = (t.to(dev) for t in _batch([103, 61], seed=5))
    new = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(9)).to(dev)
    kernel, calls = step.select_decode_kernel, []
    monkeypatch.setattr(step, "select_decode_kernel", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    logits, sels, _ = _run(model, model.new_cache(attention="triton"), ids, mask, new)
    assert len(calls) == new.shape[1] * len(sels[0])  # every decode step of every NOSA layer
    monkeypatch.setattr(step, "select_kernel_supported", lambda *a: False)
    want_logits, want_sels, _ = _run(model, model.new_cache(attention="triton"), ids, mask, new)
    assert len(calls) == new.shape[1] * len(sels[0])
    assert torch.equal(logits, want_logits) and torch.equal(logits.argmax(-1), want_logits.argmax(-1))
    assert all(torch.equal(a[i][b], c[i][b]) for a, c in zip(sels, want_sels) for i in a for b in range(2))


def test_decode_streams_are_shared_by_caches(export_dirs, monkeypatch):
    """Every cache of a thread takes its graph-capture and batch-part streams from one pool per
    (device, purpose): a new cache makes no new stream (each stream that runs a matmul keeps a cuBLAS
    workspace for the life of the process). Another thread gets its own streams."""
    import threading

    model = _load(export_dirs["nosa"])
    streams = _shipped(model, "nosa_streams")
    made = []

    class FakeStream:
        def __init__(self, device=None):
            made.append(self)

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(streams, "_STREAMS", {})
    a, b = model.new_cache(decode_streams=3), model.new_cache(decode_streams=3)
    a.device = b.device = torch.device("cuda", 0)
    parts = a.part_streams(3)
    assert len(made) == 3 and len(set(map(id, parts))) == 3
    assert b.part_streams(2) == parts[:2] and b.part_streams(4)[:3] == parts and len(made) == 4
    graph = streams.shared_streams("cuda:0", "graph", 1)
    assert graph[0] not in parts and streams.shared_streams(torch.device("cuda", 0), "graph", 1) == graph
    assert streams.shared_streams("cuda:1", "graph", 1) != graph
    other = []
    t = threading.Thread(target=lambda: other.extend(streams.shared_streams("cuda:0", "part", 2)))
    t.start()
    t.join()
    assert len(other) == 2 and not set(map(id, other)) & set(map(id, parts))


def test_decode_in_batch_parts_equals_one_part(export_dirs):
    """``decode_streams`` = 2 / 3 (the batch decoded in parts over views of the cache): the logits of the
    unsplit step (GEMM rounding only), the same blocks moved and the cache left in the same state
    (selection state, slots, keys), GPU-resident and offloaded (kernels on the host store, interpreter
    on CPU). Recording selections keeps the step whole."""
    model = _load(export_dirs["nosa"])
    ids, mask = _batch([130, 77, 41, 99])
    new = torch.randint(1, 97, (4, 24), generator=torch.Generator().manual_seed(9))
    for opts in ({}, {"offload": True, "fetch": "uva", "gpu_blocks": 4}):
        if opts:
            pytest.importorskip("triton")
            if torch.cuda.is_available():
                continue  # CPU tensors under the interpreter; the gpu test covers CUDA
        # the unsplit step (an offloaded cache would decode in parts by default)
        want_logits, _, want = _run(model, model.new_cache(decode_streams=1, **opts), ids, mask, new, record=False)
        parts_seen = []
        for n in (2, 3):
            cache = model.new_cache(decode_streams=n, **opts)
            split = cache.decode_parts
            cache.decode_parts = lambda split=split: parts_seen.append(split()) or parts_seen[-1]
            logits, _, cache = _run(model, cache, ids, mask, new, record=False)
            torch.testing.assert_close(logits, want_logits, rtol=1e-10, atol=1e-10)
            assert cache.fetched_blocks() == want.fetched_blocks()
            assert torch.equal(cache.lens, want.lens)
            for st, st0 in zip(cache.states, want.states):
                for name in ("kc", "wsc", "score", "slot_of", "slot_block", "k", "gpu_k", "cpu_k"):
                    a, b = getattr(st, name), getattr(st0, name)  # floats: the keys' GEMM rounding
                    assert (a is None) == (b is None), name
                    if a is not None:
                        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)
        assert {tuple(p.part_range for p in parts) for parts in parts_seen} == {((0, 2), (2, 4)),
                                                                              ((0, 1), (1, 2), (2, 4))}
        recorded = model.new_cache(decode_streams=2, **opts)
        recorded.decode_parts = lambda: pytest.fail("a recording step was split")
        _run(model, recorded, ids[:, :50], mask[:, :50], new[:, :3])
    with pytest.raises(ValueError, match="decode_streams"):
        model.new_cache(decode_streams=0)
    # defaults: an offloaded cache decodes in OFFLOAD_DECODE_STREAMS parts (fetch / compute overlap), a
    # GPU-resident one whole; an explicit value wins
    bc = _shipped(model, "nosa_block_cache")
    assert model.new_cache(offload=True).decode_streams == bc.OFFLOAD_DECODE_STREAMS == 4
    assert model.new_cache().decode_streams == 1
    assert model.new_cache(offload=True, decode_streams=1).decode_streams == 1


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["nosa", "triton"])
def test_gpu_graph_and_offload_decode_equal_eager(export_dirs, kind):
    """On a GPU: the CUDA-graph decode step (``torch.compile``-d by default, and plain) and the offloaded
    cache (host copies; kernels on pinned host memory inside the graph, compiled too; topk slots and fewer;
    the batch in two parts on two streams) give the eager GPU-resident logits. ``nosa`` (head dim 8) decodes
    with the PyTorch attention, ``triton`` (head dim 16) with the decode-attention kernel (except with 4 slots
    and host copies: slot-less blocks then need the gathered path)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = _load(export_dirs[kind], torch.float32).cuda()
    ids, mask = _batch([130, 77, 41])
    new = torch.randint(1, 97, (3, 20), generator=torch.Generator().manual_seed(5))
    ids, mask, new = ids.cuda(), mask.cuda(), new.cuda()
    runs = {}
    for name, opts, cache_kw in (("eager", {"cuda_graphs": False}, {}), ("graph", {}, {}),
                                 ("graph_plain", {"compile": False}, {}),
                                 ("offload_uva_graph_compiled", {"compile": True}, {"offload": True, "fetch": "uva",
                                                                                     "decode_streams": 1}),
                                 ("offload", {"cuda_graphs": False}, {"offload": True, "fetch": "copy"}),
                                 ("offload_uva_graph", {}, {"offload": True, "fetch": "uva"}),
                                 ("offload_4slots", {"cuda_graphs": False},
                                  {"offload": True, "fetch": "copy", "gpu_blocks": 4}),
                                 ("offload_4slots_uva_graph", {}, {"offload": True, "fetch": "uva", "gpu_blocks": 4}),
                                 ("graph_2streams", {}, {"decode_streams": 2}),
                                 ("offload_uva_graph_2streams", {}, {"offload": True, "fetch": "uva",
                                                                     "decode_streams": 2})):
        model.set_cache_options(**opts)
        with torch.no_grad():
            out = model(ids, attention_mask=mask, cache=model.new_cache(**cache_kw), use_cache=True)
            cache, m, logits = _cache_of(out), mask, []
            for j in range(new.shape[1]):
                m = torch.cat([m, torch.ones_like(m[:, :1])], dim=1)
                out = model(new[:, j:j + 1], attention_mask=m, cache=cache, use_cache=True)
                cache = _cache_of(out)
                logits.append(out.logits[:, -1])
        if "graph" in name:  # the step was captured (a failed capture falls back to eager steps)
            assert cache.graph is not None and cache.graph.graph is not None, name
        if name == "graph":  # compiled by default (a failed compile switches it off with a warning)
            assert model.model.cache_options.get("compile", "auto") == "auto", model.model.cache_options
        runs[name] = torch.stack(logits, 1)
    torch.testing.assert_close(runs["graph"], runs["eager"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runs["graph_plain"], runs["eager"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runs["offload_uva_graph_compiled"], runs["eager"], rtol=1e-5, atol=1e-5)
    assert torch.equal(runs["offload"], runs["eager"])
    torch.testing.assert_close(runs["offload_uva_graph"], runs["eager"], rtol=1e-5, atol=1e-5)
    if kind == "nosa":  # fewer slots than topk: blocks read from the host, same attention path
        assert torch.equal(runs["offload_4slots"], runs["eager"])
    else:  # gathered PyTorch attention vs the kernel: summation order only
        torch.testing.assert_close(runs["offload_4slots"], runs["eager"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runs["offload_4slots_uva_graph"], runs["eager"], rtol=1e-5, atol=1e-5)
    for name in ("graph_2streams", "offload_uva_graph_2streams"):  # the batch in parts on two streams
        torch.testing.assert_close(runs[name], runs["eager"], rtol=1e-5, atol=1e-5)


def test_forward_with_cache_keeps_gradients(export_dirs):
    """A training-style forward (``use_cache`` on by config) gives the eviction head its gradient."""
    model = _load(export_dirs["nosa"], torch.float32)
    ids, mask = _batch([120, 90])
    grads = []
    for use_cache in (True, False):
        model.zero_grad()
        model(ids, attention_mask=mask, labels=ids, use_cache=use_cache).loss.backward()
        grads.append(model.model.layers[0].self_attn.A.grad.clone())
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1])

