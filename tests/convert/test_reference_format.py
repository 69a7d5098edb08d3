"""Interoperation with the released NOSA checkpoints (``thunlp/NOSA`` layout), on tiny checkpoints
built here: ``from_hf`` imports them as they are (reference geometry, or ``--geometry``), the
Megatron forward of the import, the ``to_hf`` export (``--format nosa`` and ``--format reference``)
and the source loaded with the shipped modeling file all give the same logits on a sequence long
enough to be sparse; bad checkpoints and geometries are one-line errors; sparse exports have their
own ``model_type`` so stock transformers refuses them without remote code."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from checkpoints_convert.common import load_safetensors_dir, max_abs, read_model_config, rel_err
from checkpoints_convert.from_hf import configs_from_hf
from checkpoints_convert.from_hf import main as from_hf_main
from checkpoints_convert.hf_modeling.configuration_nosa import REFERENCE_GEOMETRY, reference_settings
from checkpoints_convert.mapping import ConversionError
from checkpoints_convert.reference_format import to_reference_config
from checkpoints_convert.to_hf import export
from checkpoints_convert.verify import main as verify_main
from checkpoints_convert.verify import shipped_model_class
from nosa_layers.config import NOSAConfig
from tests.convert._reference_ckpt import (
    KV_HEADS,
    LAYERS,
    ORIGINAL_MAX_POS,
    VOCAB,
    reference_config,
    reference_weights,
    write_reference_checkpoint,
)
from tests.convert.conftest import HERE, RESULTS, run, tail

LONG_T = 4608  # 72 blocks of 64 > the 64-block budget: the reference geometry is really sparse
SHORT_T = 200
TINY = dict(block_size=16, kernel_size=8, kernel_stride=4, init_blocks=1, local_blocks=2, select_blocks=2, topk=6)
TINY_ARG = ",".join(f"{k}={v}" for k, v in TINY.items())
QUIET = dict(log=lambda *_: None)
FP32_REL = 1e-5


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference_format")
    ref = write_reference_checkpoint(root / "ref")
    work = root / "work"
    work.mkdir()
    gen = torch.Generator().manual_seed(7)
    tokens = {"reference": torch.randint(0, VOCAB, (1, LONG_T), generator=gen),
              "tiny": torch.randint(0, VOCAB, (1, SHORT_T), generator=gen)}
    torch.save(tokens, work / "tokens.pt")
    log = root / "worker.log"
    rc = run([sys.executable, str(HERE / "_reference_worker.py"), "--ref", str(ref), "--out", str(work),
              "--tiny-geometry", TINY_ARG], log, 300)
    assert rc == 0, tail(log)
    return SimpleNamespace(root=root, ref=ref, work=work, tokens=tokens, cls=shipped_model_class(),
                           megatron=torch.load(work / "megatron_logits.pt"))


def _record(name: str, got, want) -> float:
    """Relative L2 error, also reported with the parity figures at the end of the session."""
    rel = rel_err(got, want)
    RESULTS[name] = {"rel": rel, "max_abs": max_abs(got, want), "T": int(want.shape[1])}
    return rel


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits.float()


def _load_remote(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=True, dtype=torch.float32).eval()


def test_reference_checkpoint_round_trip(pipeline):
    """reference checkpoint -> from_hf -> Megatron -> to_hf: logits equal to the source (the source run by
    the shipped modeling file, which reads the reference config with the reference geometry) at 4608
    tokens, where the selection is sparse; --format reference gives back the source's weights and keys."""
    p = pipeline
    tokens = p.tokens["reference"]
    src = p.cls.from_pretrained(str(p.ref), dtype=torch.float32).eval()
    src.record(True)
    want = _logits(src, tokens)
    sel = src.selections()[1][0]  # layer 1, sequence 0: [Hkv, T, blocks]
    causal = torch.arange(LONG_T) // REFERENCE_GEOMETRY["block_size"] + 1
    chosen = sel.sum(-1)
    assert (chosen < causal).any() and int(chosen.max()) <= REFERENCE_GEOMETRY["topk"]

    imported = json.loads((p.work / "reference" / "iter_0000000" / "nosa_config.json").read_text())
    assert imported["source_format"] == "reference"
    assert imported["attention"]["nosa"] == NOSAConfig(**REFERENCE_GEOMETRY, eviction_head="ed_dma").__dict__
    assert _record("reference: Megatron import", p.megatron["reference"], want) <= FP32_REL
    report = json.loads((p.work / "verify.json").read_text())  # verify --hf <reference checkpoint> --ckpt <import>
    assert report["ok"] and report["tensor_roundtrip"] == "ok" and report["logits_vs_megatron"]["rel"] <= FP32_REL
    # 300 tokens are dense at the reference geometry (budget 64 blocks of 64): verify says so
    assert report["sparse"] == {"share": 0.0, "from_position": 4096, "sparse_layers": LAYERS, "layers": LAYERS}
    log = (p.root / "worker.log").read_text()
    assert ("0.0% of them attend sparsely (positions >= 4096 in 2 of 2 layers; --long checks 2 x 8192 tokens, "
            "50% sparse)") in log
    # the import says what config.json did not: the geometry the reference code hard-codes
    assert (f"assumed (not in {p.ref / 'config.json'}): NOSA geometry block_size=64,kernel_size=32,kernel_stride=16,"
            "init_blocks=1,local_blocks=16,select_blocks=16,topk=64, eviction head ed_dma (reference format, "
            "recognised by its architectures; its code hard-codes them; --geometry overrides)") in log

    out = export(str(p.work / "reference"), str(p.root / "hf_nosa"), **QUIET)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "nosa_llama" and cfg["architectures"] == ["NOSALlamaForCausalLM"]
    assert cfg["auto_map"]["AutoConfig"] == "configuration_nosa.NOSALlamaConfig"
    model = _load_remote(out)
    assert type(model.config).__name__ == "NOSALlamaConfig"
    assert _record("reference: to_hf nosa", _logits(model, tokens), want) <= FP32_REL

    lines = []
    back = export(str(p.work / "reference"), str(p.root / "hf_ref"), dtype="fp32", fmt="reference", log=lines.append)
    assert lines[-1].startswith("note: --format reference ships no modeling code: add the authors' "
                                "modeling_llama_nosa.py and cis_pooling.py") and "dense Llama" in lines[-1]
    src_cfg, back_cfg = json.loads((p.ref / "config.json").read_text()), json.loads((back / "config.json").read_text())
    for key in ("architectures", "auto_map", "model_type", "num_hidden_layers", "num_key_value_heads", "head_dim",
                "rope_theta", "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert back_cfg[key] == src_cfg[key], key
    gen = json.loads((back / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (src_cfg["bos_token_id"], src_cfg["eos_token_id"])
    for key, value in src_cfg["rope_scaling"].items():
        assert back_cfg["rope_scaling"][key] == pytest.approx(value), key
    assert back_cfg["original_max_position_embeddings"] == ORIGINAL_MAX_POS and "nosa_config" not in back_cfg
    assert not list(back.glob("*.py"))  # the reference's own modeling code is added by the user
    a, b = load_safetensors_dir(p.ref), load_safetensors_dir(back)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    again = p.cls.from_pretrained(str(back), dtype=torch.float32).eval()
    assert _record("reference: to_hf --format reference", _logits(again, tokens), want) <= FP32_REL
    bf16 = export(str(p.work / "reference"), str(p.root / "hf_ref_bf16"), fmt="reference", **QUIET)  # the default
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert all(torch.equal(t, a[k].to(t.dtype)) and t.dtype == (torch.float32 if k.endswith(".A") else torch.bfloat16)
               for k, t in load_safetensors_dir(bf16).items())  # A, the eviction scale, stays fp32


def test_sparse_exports_need_remote_code_dense_stay_llama(pipeline):
    """Without trust_remote_code stock transformers refuses a NOSA export (its own model_type) with its
    remote-code message, instead of building a dense Llama that ignores the eviction heads."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = pipeline.root / "hf_nosa"
    if not out.exists():
        export(str(pipeline.work / "reference"), str(out), **QUIET)
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(str(out))
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoConfig.from_pretrained(str(out))


def test_geometry_override(pipeline):
    """--geometry replaces fields of the reference geometry: the import records them, the export runs them
    (sparse at 200 tokens), its logits equal the Megatron forward and the source run with that geometry;
    --format reference refuses the export in one line naming the differing fields."""
    p = pipeline
    tokens = p.tokens["tiny"]
    imported = json.loads((p.work / "tiny" / "iter_0000000" / "nosa_config.json").read_text())
    assert {k: imported["attention"]["nosa"][k] for k in TINY} == TINY
    src = p.cls.from_pretrained(str(p.ref), dtype=torch.float32, nosa_config=reference_settings(LAYERS, **TINY)).eval()
    src.record(True)
    want = _logits(src, tokens)
    chosen = src.selections()[0][0].sum(-1)
    assert (chosen < torch.arange(SHORT_T) // TINY["block_size"] + 1).any()
    dense = _logits(p.cls.from_pretrained(str(p.ref), dtype=torch.float32).eval(), tokens)  # 200 < 4096: dense
    assert rel_err(dense, want) > 1e-3  # the override changes the model

    out = export(str(p.work / "tiny"), str(p.root / "hf_tiny"), **QUIET)
    got = _logits(_load_remote(out), tokens)
    assert _record("--geometry tiny: to_hf nosa", got, want) <= FP32_REL
    # verify's default length is the selection budget (6 blocks of 16 tokens) + 2 blocks: its last quarter is sparse
    report = p.root / "verify_tiny.json"
    assert verify_main(["--hf", str(out), "--random", "1", "--decode-steps", "4", "--json", str(report)]) == 0
    rep = json.loads(report.read_text())
    assert rep["tokens"] == [1, 128] and rep["sparse"]["share"] == 0.25 and rep["sparse"]["from_position"] == 96
    assert rep["decode_vs_forward"]["rel"] <= 1e-4
    assert _record("--geometry tiny: Megatron import", p.megatron["tiny"], want) <= FP32_REL
    with pytest.raises(ConversionError) as e:
        export(str(p.work / "tiny"), str(p.root / "hf_tiny_ref"), fmt="reference", **QUIET)
    msg = str(e.value)
    assert "\n" not in msg and "block_size=16" in msg and "topk=6" in msg
    assert not (p.root / "hf_tiny_ref").exists()


def test_unfold_mup_of_a_checkpoint_without_record(pipeline):
    """--mup unfold --mup-constants: the import runs muP with those constants; the export folds them back
    (weights equal to the source within about one ulp)."""
    p = pipeline
    m, _, _ = read_model_config(p.work / "mup" / "iter_0000000")
    assert m.use_mup and (m.scale_emb, m.scale_depth, m.dim_model_base) == (12.0, 1.4, 16)
    back = load_safetensors_dir(export(str(p.work / "mup"), str(p.root / "hf_mup"), dtype="fp32", fmt="reference",
                                       **QUIET))
    src = load_safetensors_dir(p.ref)
    assert set(back) == set(src)
    for k in src:
        torch.testing.assert_close(back[k], src[k], rtol=3e-7, atol=0)


def _refused(tmp_path, capsys, cfg=None, weights=None, extra=()):
    ref = write_reference_checkpoint(tmp_path / "bad", cfg, weights)
    rc = from_hf_main(["--hf", str(ref), "--out", str(tmp_path / "out"), *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("from_hf: error: "), err
    assert not (tmp_path / "out").exists()
    return err


def test_bad_reference_checkpoints_are_one_line_errors(tmp_path, capsys):
    w = reference_weights()
    wrong = dict(w, **{"model.layers.1.self_attn.A": torch.zeros(KV_HEADS + 1)})
    assert "model.layers.1.self_attn.A: shape (3,), expected (2,)" in _refused(tmp_path / "a", capsys, weights=wrong)
    delta = dict(w, **{"model.layers.0.self_attn.delta.weight": torch.zeros(KV_HEADS, 7)})
    assert "model.layers.0.self_attn.delta.weight: shape (2, 7)" in _refused(tmp_path / "b", capsys, weights=delta)
    partial = {k: v for k, v in w.items() if not k.startswith("model.layers.1.self_attn.") or "_proj" in k}
    err = _refused(tmp_path / "c", capsys, weights=partial)
    assert "model.layers.1.self_attn.A" in err and "model.layers.1.self_attn.delta.weight" in err
    unknown = {k: v for k, v in reference_config().items() if k != "auto_map"}
    unknown["architectures"] = ["MysteryForCausalLM"]
    err = _refused(tmp_path / "d", capsys, cfg=unknown)
    assert "model.layers.0.self_attn.A" in err and "MysteryForCausalLM" in err
    err = _refused(tmp_path / "e", capsys, extra=["--geometry", "block_size=16,window=3"])
    assert "--geometry" in err and "block_size" in err
    err = _refused(tmp_path / "f", capsys, extra=["--geometry", "topk=8"])
    assert "topk" in err
    err = _refused(tmp_path / "h", capsys, extra=["--mup", "unfold"])
    assert "--mup-constants" in err
    err = _refused(tmp_path / "i", capsys, extra=["--mup", "unfold", "--mup-constants", "scale_emb=12"])
    assert "--mup-constants" in err
    differ = reference_config(long=[2.0 + i for i in range(8)])
    err = _refused(tmp_path / "g", capsys, cfg=differ)
    assert "--longrope short" in err and "--longrope switch" in err


def test_config_fields_non_finite_weights_and_out_are_checked_first(tmp_path, capsys, monkeypatch):
    """Missing or ill-typed config fields name the field; NaN/inf weights need --allow-non-finite; a budget
    that covers the whole context is a warning; --out never lies inside --hf. One line each, nothing written."""
    base = reference_config()
    no_hidden = {k: v for k, v in base.items() if k != "hidden_size"}
    assert "config.json has no hidden_size (needed to build the model)" in _refused(tmp_path / "a", capsys,
                                                                                   cfg=no_hidden)
    no_long = {**base, "rope_scaling": {k: v for k, v in base["rope_scaling"].items() if k != "long_factor"}}
    assert "config.json rope_scaling (longrope) has no long_factor list" in _refused(tmp_path / "b", capsys,
                                                                                    cfg=no_long)
    err = _refused(tmp_path / "c", capsys, cfg={**base, "num_hidden_layers": "four"})
    assert err.endswith("config.json num_hidden_layers is 'four' (str); expected a whole number")
    err = _refused(tmp_path / "d", capsys, cfg={**base, "rope_scaling": {**base["rope_scaling"],
                                                                         "short_factor": [1.0, "x"]}})
    assert err.endswith("config.json rope_scaling.short_factor[1] is 'x' (str); expected a number")

    w = reference_weights()
    w["model.norm.weight"] = w["model.norm.weight"].clone().index_fill_(0, torch.tensor([3]), float("nan"))
    short_context = {**base, "max_position_embeddings": 4096}  # = the reference budget: 64 blocks of 64
    err = _refused(tmp_path / "e", capsys, cfg=short_context, weights=w)
    assert "1 tensor(s) hold NaN/inf (e.g. model.norm.weight)" in err and "--allow-non-finite" in err
    ref = write_reference_checkpoint(tmp_path / "g" / "ref", short_context, w)
    assert from_hf_main(["--hf", str(ref), "--out", str(ref / "imported")]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == (f"from_hf: error: --out {ref / 'imported'} lies inside the source {ref} "
                                    f"(--hf): writing there would replace or mix with what it reads; choose an --out "
                                    f"outside it")
    assert from_hf_main(["--hf", str(ref), "--out", str(tmp_path / "g" / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.out.strip() == ("warning: the selection budget (topk 64 x block_size 64 = 4096 tokens) is not "
                                    "below the model's context (max_position_embeddings 4096): every position attends "
                                    "to all its keys, so this sparse model runs densely; pass --geometry topk=... for "
                                    "a budget that selects")
    assert "hold NaN/inf" in captured.err and not (tmp_path / "g" / "out").exists()

    from checkpoints_convert import megatron_io
    from checkpoints_convert.from_hf import import_hf

    def written(tensors, out, *a, **k):  # what the import would save: with the flag, the NaN goes through
        raise AssertionError(sum(int(torch.isnan(t).sum()) for t in tensors.values()))

    monkeypatch.setattr(megatron_io, "save_dist_checkpoint", written)
    with pytest.raises(AssertionError, match="^1$"):
        import_hf(str(ref), str(tmp_path / "g" / "out"), allow_non_finite=True, **QUIET)


def test_longrope_choice_on_import_and_export():
    """Different short/long factor lists: --longrope short imports the short-factor model at every length
    (the reference's behaviour), switch keeps both (transformers'); the reference export needs the choice."""
    long = [2.0 + i for i in range(8)]
    cfg = reference_config(long=long)
    m_short, _ = configs_from_hf(cfg, longrope_choice="short")
    m_switch, _ = configs_from_hf(cfg, longrope_choice="switch")
    assert m_short.longrope.long_factor == m_short.longrope.short_factor == cfg["rope_scaling"]["short_factor"]
    assert m_switch.longrope.long_factor == long
    m_same, attn = configs_from_hf(reference_config())  # equal lists: no choice needed
    assert attn.layer_variants(LAYERS) == ["nosa"] * LAYERS and attn.nosa.eviction_head == "ed_dma"

    from checkpoints_convert.to_hf import hf_config

    nosa_cfg = hf_config(m_switch, attn, torch.float32)
    assert nosa_cfg["rope_scaling"]["long_factor"] == long  # nosa format: transformers' switch by default
    with pytest.raises(ConversionError, match="--longrope short"):
        to_reference_config(nosa_cfg)
    ref_cfg = to_reference_config(nosa_cfg, "short")
    assert ref_cfg["rope_scaling"]["long_factor"] == ref_cfg["rope_scaling"]["short_factor"]
    assert hf_config(m_switch, attn, torch.float32, longrope="short")["rope_scaling"]["long_factor"] != long


def test_reference_geometry_is_the_framework_default():
    """The geometry the shipped config file gives reference checkpoints is NOSAConfig's released default."""
    assert NOSAConfig(**REFERENCE_GEOMETRY, eviction_head="ed_dma") == NOSAConfig()
    assert Path(__file__).with_name("_reference_ckpt.py").is_file()


def test_verify_default_length_and_progress(capsys):
    """verify's default is one row of the budget + 2 blocks (4224 tokens at the released geometry, so its last
    128 positions attend sparsely and the selection drops blocks), ``--long`` twice the budget, named by the
    coverage line; each forward prints a line with an ETA."""
    import torch

    from checkpoints_convert.verify import Progress, default_seq_len, sparse_line, sparse_share
    from nosa_layers.megatron.config import AttentionConfig, ModelConfig

    model, nosa = ModelConfig(max_position_embeddings=32768, num_layers=2), AttentionConfig(variant="nosa")
    assert default_seq_len(model, nosa) == 4224 and default_seq_len(model, nosa, long=True) == 8192
    assert default_seq_len(ModelConfig(max_position_embeddings=4200), nosa) == 4200
    assert default_seq_len(model, AttentionConfig(variant="nosa", nosa=NOSAConfig(**TINY))) == 128  # 96 + 2 x 16
    assert default_seq_len(model, AttentionConfig()) == 256  # dense
    row = torch.zeros(1, 4224)
    line = sparse_line(sparse_share(model, nosa, 4224), row, long_len=8192)
    assert line == ("verify: 1 x 4224 tokens checked; 3.0% of them attend sparsely (positions >= 4096 in 2 of 2 "
                    "layers; --long checks 2 x 8192 tokens, 50% sparse)")
    assert sparse_line(sparse_share(model, nosa, 8192), torch.zeros(2, 8192), long_len=None).endswith("2 layers)")
    progress = Progress(3)
    progress.clock = iter([10.0, 40.0, 70.0, 130.0]).__next__
    progress.start = progress.clock()
    for what in ("a", "b", "c"):
        progress.step(what)
    assert capsys.readouterr().err.splitlines() == [
        "verify: [1/3] a (30s so far; ETA 1m00s)", "verify: [2/3] b (1m00s so far; ETA 30s)",
        "verify: [3/3] c (2m00s so far)"]


def test_verify_compares_logits_a_chunk_of_positions_at_a_time():
    """The chunked comparison (memory: a few copies of one chunk, not of ``[T, vocab]`` in fp64) gives what the
    whole-tensor formulas give."""
    import torch

    from checkpoints_convert.common import max_abs, rel_err
    from checkpoints_convert.verify import compare_logits

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(2, 150, 97, generator=gen)
    b = a + 0.01 * torch.randn(2, 150, 97, generator=gen)
    la, lb = torch.log_softmax(a.double(), -1), torch.log_softmax(b.double(), -1)
    want = {"rel": rel_err(a, b), "max_abs": max_abs(a, b), "kl": float((lb.exp() * (lb - la)).sum(-1).mean()),
            "top1": float((a.argmax(-1) == b.argmax(-1)).double().mean())}
    got = compare_logits(a, b, chunk=64)  # 300 positions: 4 whole chunks and a partial one
    assert got.keys() == want.keys() and 0.9 < got["top1"] < 1.0
    assert all(abs(got[k] - want[k]) <= 1e-12 * max(1.0, abs(want[k])) for k in want), (got, want)


def test_verify_reports_layers_within_a_long_forward(capsys):
    """Within a forward, verify prints the layer reached and the forward's ETA at most every ``every_s`` seconds
    (a 6-minute forward of a 135M model otherwise prints nothing); the hooks go with the context."""
    import torch

    from checkpoints_convert.verify import LayerProgress

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))

        def forward(self, x):
            for layer in self.model.layers:
                x = layer(x)
            return x

    net = Net()
    ticks = iter([0.0, 0.0, 10.0, 30.0, 50.0, 55.0, 100.0, 110.0, 160.0, 170.0])
    progress = LayerProgress(net, every_s=20.0)
    progress.clock = ticks.__next__
    with progress:
        progress.begun = progress.last = progress.clock()  # 0.0
        net(torch.ones(1, 4))  # begin 0; layers 1-3 end at 10, 30, 50: lines after layers 2 (30 s) and 3 (50 s)
        net(torch.ones(1, 4))  # begin 55; layers 1-3 end at 100 (a line: 50 s since the last), 110, 160 (a line)
    assert capsys.readouterr().err.splitlines() == [
        "verify:   layer 2 of 4 of this forward (30s; ETA 30s)",
        "verify:   layer 3 of 4 of this forward (50s; ETA 17s)",
        "verify:   layer 1 of 4 of this forward (45s; ETA 2m15s)",
        "verify:   layer 3 of 4 of this forward (1m45s; ETA 35s)"]
    net(torch.ones(1, 4))  # hooks removed: no line, no clock read
    assert capsys.readouterr().err == "" and next(ticks) == 170.0
