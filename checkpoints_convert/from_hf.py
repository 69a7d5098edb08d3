"""Hugging Face Llama / NOSA directory, or a Llama GGUF file -> Megatron distributed checkpoint the
trainer can start from, with the model config group and tokenizer it needs.

    python -m checkpoints_convert.from_hf --hf <dir> --out <ckpt dir> [--dtype fp32|bf16]
        [--target-length 16384] [--mup keep|unfold] [--make-vocab-size-divisible-by 8]
        [--family llama3|minicpm4] [--geometry block_size=64,topk=64,...] [--longrope short|switch]
        [--mup-constants ...]
    python -m checkpoints_convert.from_hf --gguf <file.gguf> --out <ckpt dir> [--target-length 16384]

Writes ``<out>/iter_0000000/`` (megatron-core ``torch_dist``; the model's tensors under key
``model``, global shapes, so any TP/PP layout can load them), its ``nosa_config.json`` and a
``<out>/latest`` pointer: ``train/main.py ... init_from=<out>`` starts a stage from it (a dense
Llama checkpoint becomes a NOSA model there: the new eviction-head parameters keep their init).
Next to it: ``<out>/model/<name>.yaml``, the imported model as a ``model`` config group (with
``--target-length N``: the LongRoPE factors of the extension from the source's context to N tokens,
computed from its rope theta), used as ``hydra.searchpath=[file://<out>] model=<name>``; and
``<out>/tokenizer/``, the source's tokenizer (``data.tokenizer=<out>/tokenizer``). ``--gguf`` reads
llama.cpp files (quantized ones are dequantized; needs ``pip install 'nosa-train[gguf]'``).

Accepted: dense ``LlamaForCausalLM`` checkpoints (``model_type: llama``, SiLU, no biases,
default or ``longrope`` RoPE), this framework's NOSA / InfLLM-V2 exports (``model_type: nosa_llama``,
``nosa_config``) and the released NOSA checkpoints as they are (``SparseLlamaForCausalLM``, no
``nosa_config``: imported with the reference geometry, ``--geometry`` overrides fields of it).
When LongRoPE's ``short_factor`` and ``long_factor`` differ, ``--longrope short`` imports the
short-factor model at every length (what the reference code runs) and ``--longrope switch`` keeps
transformers' switch to ``long_factor`` past ``original_max_position_embeddings``; a reference
checkpoint needs the choice, other checkpoints default to ``switch``.

muP: MiniCPM4 exports (and the released NOSA-8B) carry their muP multipliers folded into the
weights. ``--mup keep`` (the default) imports them as they are (a plain Llama parametrisation;
bitwise round trip); ``--mup unfold`` divides the folds back out and records ``use_mup`` (needed to
continue with a muP recipe such as ``nosa_8b_*``; the round trip is then exact to about one ulp).
Our exports record the constants; for a checkpoint without the record give them with
``--mup-constants`` (NOSA-8B / MiniCPM4: ``scale_emb=12,scale_depth=1.4,dim_model_base=256``).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    """The command line (defined before the heavy imports: ``--help`` answers without torch)."""
    ap = argparse.ArgumentParser(prog="python -m checkpoints_convert.from_hf", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", "--hf", dest="hf", default=None,
                    help="Hugging Face model directory (config.json + safetensors; --hf: the same)")
    ap.add_argument("--gguf", default=None, help="a Llama GGUF file instead of --ckpt (needs the gguf package)")
    ap.add_argument("--target-length", type=int, default=None, metavar="TOKENS",
                    help="write the model group with LongRoPE factors extending the source's context to TOKENS")
    ap.add_argument("--attention", default=None, choices=["nosa", "infllm_v2"],
                    help="a dense source imported as this sparse model at 0 steps (new eviction heads at A = 0: "
                         "the same function below the selection budget; --geometry sets the geometry)")
    ap.add_argument("--out", required=True, help="output checkpoint dir (gets iter_0000000/ and latest)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--mup", default="keep", choices=["keep", "unfold"])
    ap.add_argument("--make-vocab-size-divisible-by", type=int, default=None)
    ap.add_argument("--family", default=None, choices=["llama3", "minicpm4"])
    ap.add_argument("--geometry", default=None, metavar="FIELD=INT,...",
                    help="reference-format checkpoints: override fields of the reference geometry (block_size, "
                         "kernel_size, kernel_stride, init_blocks, local_blocks, select_blocks, topk)")
    ap.add_argument("--longrope", default=None, choices=["short", "switch"],
                    help="when short_factor != long_factor: short everywhere (the reference code) or switch to "
                         "long_factor past original_max_position_embeddings (transformers)")
    ap.add_argument("--allow-non-finite", action="store_true", help="import weights that hold NaN/inf")
    ap.add_argument("--mup-constants", default=None, metavar="scale_emb=S,scale_depth=S,dim_model_base=N",
                    help="with --mup unfold: the muP constants a checkpoint without a record was folded with "
                         "(released NOSA-8B / MiniCPM4: scale_emb=12,scale_depth=1.4,dim_model_base=256)")
    return ap


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors exit here, before torch is imported

import torch

from checkpoints_convert.common import DTYPES, check_out_apart, check_out_dir, geometry, load_safetensors_dir
from checkpoints_convert.common import read_json, safetensors_names
from checkpoints_convert.hf_modeling.configuration_nosa import MODEL_TYPE, REFERENCE_ARCHITECTURE, reference_settings
from checkpoints_convert.mapping import ConversionError, hf_to_megatron
from checkpoints_convert.model_group import extend_context, group_name, write_model_group
from checkpoints_convert.reference_format import TOKEN_ID_KEYS, checkpoint_format, longrope_factors, parse_geometry
from runtime.cli import run_cli
from runtime.outputs import atomic_dir


def configs_from_hf(cfg: dict, mup: str = "keep", make_vocab_size_divisible_by: int | None = None,
                    family: str | None = None, geometry_override: dict | None = None,
                    longrope_choice: str | None = None, mup_constants: dict | None = None):
    """HF ``config.json`` dict -> (ModelConfig, AttentionConfig). ``geometry_override`` overrides fields of
    the reference geometry (reference-format checkpoints only); ``longrope_choice``: see the module doc."""
    from nosa_layers.config import NOSAConfig, eviction_head_name
    from nosa_layers.megatron.config import AttentionConfig, ModelConfig
    from nosa_layers.rope.longrope import LongRoPEConfig

    problems = []
    if cfg.get("model_type") not in ("llama", MODEL_TYPE):
        problems.append(f"model_type={cfg.get('model_type')!r} (only 'llama' and {MODEL_TYPE!r} layouts are supported)")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={cfg.get('hidden_act')!r} (SwiGLU with silu only)")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            problems.append(f"{key}=true (biases are not supported)")
    if problems:
        raise ConversionError("unsupported Hugging Face config: " + "; ".join(problems))
    fmt = checkpoint_format(cfg)
    if geometry_override and fmt != "reference":
        raise ConversionError("--geometry applies to reference-format NOSA checkpoints (no nosa_config); this "
                              "checkpoint " + ("records its geometry in nosa_config" if fmt == "nosa" else "is dense"))
    check_config_fields(cfg)
    export = cfg.get("nosa_export") or {}
    hq = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // hq
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    longrope = None
    if rope_type == "longrope":
        orig = int(rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings"))
        factor = rope.get("factor")
        if factor is not None and math.isclose(float(factor), max_pos / orig):
            factor = None
        short, long = longrope_factors([float(x) for x in rope["short_factor"]],
                                       [float(x) for x in rope["long_factor"]], longrope_choice,
                                       fmt == "reference", "reference-format checkpoint")
        longrope = LongRoPEConfig(short_factor=short, long_factor=long,
                                  original_max_position_embeddings=orig,
                                  attention_factor=rope.get("attention_factor"), factor=factor)
    elif rope_type not in ("default", None):
        raise ConversionError(f"unsupported rope type {rope_type!r}; use default or longrope")
    folded = export.get("mup_folded")
    if mup not in ("keep", "unfold"):
        raise ConversionError(f"--mup {mup!r}; use keep or unfold")
    if mup_constants:
        if folded or mup != "unfold":
            raise ConversionError("--mup-constants goes with --mup unfold, for a checkpoint that records no folded muP")
        folded = mup_constants
    if mup == "unfold" and not folded:
        raise ConversionError("--mup unfold: this checkpoint records no folded muP (nosa_export.mup_folded); "
                              "give the constants it was folded with: "
                              "--mup-constants scale_emb=S,scale_depth=S,dim_model_base=N")
    use_mup = mup == "unfold"
    fam = family or export.get("family") or "llama3"
    model = ModelConfig(
        family=fam, size=str(export.get("size", "hf")), num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=int(cfg["hidden_size"]), num_attention_heads=hq,
        num_kv_heads=int(cfg.get("num_key_value_heads") or hq), head_dim=int(head_dim),
        ffn_hidden_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
        make_vocab_size_divisible_by=int(make_vocab_size_divisible_by or export.get("make_vocab_size_divisible_by", 8)),
        max_position_embeddings=max_pos, rope_theta=theta, rope_type="longrope" if longrope else "default",
        longrope=longrope, norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=(bool(cfg.get("tie_word_embeddings", False))
                        or (use_mup and export.get("tied_in_megatron", False))),
        init_std=float(cfg.get("initializer_range", 0.02)), use_mup=use_mup,
        scale_emb=float(folded["scale_emb"]) if use_mup else 1.0,
        scale_depth=float(folded["scale_depth"]) if use_mup else 1.0,
        dim_model_base=int(folded["dim_model_base"]) if use_mup else None)
    n = cfg.get("nosa_config") if fmt == "nosa" else None
    if fmt == "reference":
        try:
            n = reference_settings(model.num_layers, **(geometry_override or {}))
        except ValueError as e:
            raise ConversionError(f"--geometry: {e}") from None
    if n is None:
        attn = AttentionConfig(variant="dense")
    else:
        variants = list(n["layer_variants"])
        if len(variants) != model.num_layers:
            raise ConversionError(f"nosa_config.layer_variants has {len(variants)} entries for "
                                  f"{model.num_layers} layers")
        # an export without NOSA layers records the head "none"; the trainer's config keeps its default there
        head = eviction_head_name(variants, n.get("eviction_head"), absent=NOSAConfig().eviction_head)
        nosa = NOSAConfig.from_fields(n, eviction_head=head)
        same = len(set(variants)) == 1
        attn = AttentionConfig(variant=variants[0] if same else "nosa" if "nosa" in variants else variants[-1],
                               layer_pattern=None if same else variants, nosa=nosa,
                               eviction_bias=bool(n.get("eviction_bias", False)))
    from nosa_layers.megatron.config import validate

    validate(model, attn)
    return model, attn


def assumed_fields(cfg: dict, fmt: str, model, attn, longrope_choice: str | None) -> list[str]:
    """What the import took that ``config.json`` does not say, as ``field=value (why)`` items:
    defaults of absent fields, LongRoPE values derived, the reference geometry of a reference-format
    checkpoint, and token ids it lacks."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    taken = {"num_key_value_heads": (model.num_kv_heads, "= num_attention_heads"),
             "head_dim": (model.kv_channels, "= hidden_size / num_attention_heads"),
             "rope_theta": (model.rope_theta, "default"), "max_position_embeddings": (model.max_position_embeddings,
                                                                                       "default"),
             "rms_norm_eps": (model.norm_eps, "default"), "tie_word_embeddings": (model.tie_embeddings, "default"),
             "hidden_act": ("silu", "default")}
    out = [f"{key}={value} ({why})" for key, (value, why) in taken.items()
           if cfg.get(key) is None and not (key == "rope_theta" and "rope_theta" in rope)]
    if model.longrope is not None:
        lr = model.longrope
        if "original_max_position_embeddings" not in rope:
            out.append(f"rope_scaling.original_max_position_embeddings={lr.original_max_position_embeddings} "
                       f"(the top-level key)")
        if rope.get("attention_factor") is None:
            factor = lr.resolved_attention_factor(model.max_position_embeddings)
            out.append(f"rope_scaling.attention_factor={factor:.6g} (derived from the length ratio)")
        if list(rope["short_factor"]) != list(rope["long_factor"]) and longrope_choice is None:
            out.append("--longrope switch (default: long_factor past original_max_position_embeddings)")
    if fmt == "reference":
        n = attn.nosa
        geo = ",".join(f"{k}={getattr(n, k)}" for k in ("block_size", "kernel_size", "kernel_stride", "init_blocks",
                                                          "local_blocks", "select_blocks", "topk"))
        names = "architectures" if REFERENCE_ARCHITECTURE in (cfg.get("architectures") or []) else "auto_map"
        out.append(f"NOSA geometry {geo}, eviction head {n.eviction_head} (reference format, recognised by its "
                   f"{names}; its code hard-codes them; --geometry overrides)")
    missing = [k for k in ("bos_token_id", "eos_token_id") if cfg.get(k) is None]
    if missing:
        out.append(f"{' and '.join(missing)} absent (an export gets them from to_hf --tokenizer)")
    return out


_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
_OPTIONAL_INT = ("num_key_value_heads", "head_dim", "max_position_embeddings", "original_max_position_embeddings")
_OPTIONAL_NUMBER = ("rms_norm_eps", "rope_theta", "initializer_range")


def check_config_fields(cfg: dict) -> None:
    """Refuse, naming the field, a ``config.json`` without a field the model needs or with one of the wrong
    type (the LongRoPE block's too), before anything reads them."""
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer()

    def is_number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    missing = [k for k in _REQUIRED if cfg.get(k) is None]
    if missing:
        raise ConversionError(f"config.json has no {', '.join(missing)} (needed to build the model)")
    checks = [(k, cfg[k], is_int, "a whole number") for k in _REQUIRED + _OPTIONAL_INT if cfg.get(k) is not None]
    checks += [(k, cfg[k], is_number, "a number") for k in _OPTIONAL_NUMBER if cfg.get(k) is not None]
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if rope is not None and not isinstance(rope, dict):
        raise ConversionError(f"config.json rope_scaling is {rope!r}, expected an object")
    if rope and rope.get("rope_type", rope.get("type")) == "longrope":
        for key in ("short_factor", "long_factor"):
            if not isinstance(rope.get(key), list):
                raise ConversionError(f"config.json rope_scaling (longrope) has no {key} list"
                                      + (f" (it is {rope[key]!r})" if key in rope else ""))
            checks += [(f"rope_scaling.{key}[{i}]", v, is_number, "a number") for i, v in enumerate(rope[key])]
        if rope.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings")) is None:
            raise ConversionError("config.json rope_scaling (longrope) has no original_max_position_embeddings")
        for key in ("original_max_position_embeddings", "attention_factor", "factor"):
            if rope.get(key) is not None:
                checks.append((f"rope_scaling.{key}", rope[key], is_int if key.startswith("orig") else is_number,
                               "a whole number" if key.startswith("orig") else "a number"))
    for key, value, ok, what in checks:
        if not ok(value):
            raise ConversionError(f"config.json {key} is {value!r} ({type(value).__name__}); expected {what}")


def budget_warning(model, attn) -> str | None:
    """A warning when the NOSA selection budget (``topk`` blocks of ``block_size`` tokens) covers the whole
    context: every position then attends to all of its keys and the sparse model runs densely."""
    if "nosa" not in attn.layer_variants(model.num_layers) and "infllm_v2" not in attn.layer_variants(model.num_layers):
        return None
    n = attn.nosa
    budget = n.topk * n.block_size
    if budget < model.max_position_embeddings:
        return None
    return (f"the selection budget (topk {n.topk} x block_size {n.block_size} = {budget} tokens) is not below the "
            f"model's context (max_position_embeddings {model.max_position_embeddings}): every position attends to "
            f"all its keys, so this sparse model runs densely; pass --geometry topk=... for a budget that selects")


def parse_mup_constants(text: str | None) -> dict:
    """``"scale_emb=12,scale_depth=1.4,dim_model_base=256"`` -> the dict of all three (MiniCPM4: these values)."""
    if not text:
        return {}
    keys = ("scale_emb", "scale_depth", "dim_model_base")
    out = {}
    for item in text.split(","):
        key, _, value = item.strip().partition("=")
        try:
            out[key] = float(value) if key != "dim_model_base" else int(value)
        except ValueError:
            key = None
        if key not in keys:
            break
    if set(out) != set(keys) or len(text.split(",")) != 3:
        raise ConversionError(f"--mup-constants {text!r}: expected "
                              f"scale_emb=FLOAT,scale_depth=FLOAT,dim_model_base=INT")
    return out


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json")


def _read_source(hf: str | None, gguf: str | None, out: str, log):
    """``(path, config dict, state dict or None, tokenizer writer, name)`` of the import's source."""
    if (hf is None) == (gguf is None):
        raise ConversionError("give the source as --ckpt <HF dir> or --gguf <file> (one of them)")
    if gguf is not None:
        from checkpoints_convert.gguf_source import load_gguf

        check_out_apart(out, Path(gguf), "--gguf")
        g = load_gguf(gguf, log=log)
        return Path(gguf), g.config, g.state_dict, g.tokenizer.save_pretrained, g.name
    src = Path(hf)
    check_out_apart(out, src, "--hf")
    if not (src / "config.json").is_file():
        raise ConversionError(f"--hf {hf}: no config.json there")
    cfg = read_json(src / "config.json")

    def copy_tokenizer(dst: str) -> None:
        import shutil

        names = [n for n in TOKENIZER_FILES if (src / n).is_file()]
        if names:
            Path(dst).mkdir(parents=True, exist_ok=True)
            for n in names:
                shutil.copy2(src / n, Path(dst) / n)

    return src, cfg, None, copy_tokenizer, src.resolve().name


def import_hf(hf: str | None, out: str, dtype: str = "fp32", mup: str = "keep", make_vocab_size_divisible_by=None,
              family=None, log=print, geometry_override: str | None = None, longrope: str | None = None,
              mup_constants: str | None = None, allow_non_finite: bool = False, gguf: str | None = None,
              target_length: int | None = None, attention: str | None = None) -> Path:
    t0 = time.time()
    src, cfg, gguf_sd, write_tokenizer, name = _read_source(hf, gguf, out, log)
    fmt = checkpoint_format(cfg, safetensors_names(src) if gguf is None else [])
    model, attn = configs_from_hf(cfg, mup, make_vocab_size_divisible_by, family,
                                  None if attention else parse_geometry(geometry_override),
                                  longrope, parse_mup_constants(mup_constants))
    if attention is not None:
        attn = sparse_attention_config(attn, attention, parse_geometry(geometry_override), model)
    if model.size == "hf":  # a source that is not our export: the group takes the source's name
        model.size = group_name(name)
    train_model = model
    if target_length is not None:
        try:
            train_model = extend_context(model, int(target_length))
        except ValueError as e:
            raise ConversionError(f"--target-length {target_length}: {e}") from None
    assumed = assumed_fields(cfg, fmt, model, attn, longrope)
    if dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype!r}; use fp32, bf16 or fp16")
    torch_dtype = DTYPES[dtype]
    model.params_dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[torch_dtype]
    geo = geometry(model, attn, fold_mup=True)
    if not model.use_mup:
        geo.mup = None
    warning = budget_warning(model, attn) if fmt == "reference" else None
    if warning:
        log(f"warning: {warning}")
    hf_sd = load_safetensors_dir(src) if gguf_sd is None else gguf_sd
    if attention is not None:
        hf_sd = {**hf_sd, **new_eviction_heads(model, attn)}
    bad = [k for k, v in hf_sd.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad and not allow_non_finite:
        raise ConversionError(f"--hf {hf}: {len(bad)} tensor(s) hold NaN/inf (e.g. {bad[0]}); import a finite "
                              f"checkpoint, or pass --allow-non-finite to import it anyway")
    if model.tie_embeddings and "lm_head.weight" in hf_sd and not model.use_mup:
        if not torch.equal(hf_sd["lm_head.weight"], hf_sd["model.embed_tokens.weight"]):
            raise ConversionError("tie_word_embeddings=true but lm_head.weight differs from model.embed_tokens.weight")
        hf_sd = {k: v for k, v in hf_sd.items() if k != "lm_head.weight"}
    tensors = hf_to_megatron(hf_sd, geo, unfold_mup=model.use_mup)
    tensors = {k: v.to(torch_dtype) for k, v in tensors.items()}
    from checkpoints_convert.megatron_io import save_dist_checkpoint

    need = sum(t.numel() * t.element_size() for t in tensors.values())
    with atomic_dir(check_out_dir(out), need_bytes=need) as tmp:
        save_dist_checkpoint(tensors, tmp, model, attn, extra={
            "source": str(src.resolve()), "source_format": "gguf" if gguf is not None else fmt, "longrope": longrope,
            "token_ids": {k: cfg[k] for k in TOKEN_ID_KEYS if cfg.get(k) is not None}})
        write_tokenizer(str(Path(tmp) / "tokenizer"))
        group = write_model_group(tmp, train_model, src.name, _group_note(model, train_model))
    final = Path(out).resolve()
    n_params = sum(t.numel() for t in tensors.values())
    log(f"imported {src} ({'gguf' if gguf is not None else fmt} format; {model.family}, {attn.variant}, "
        f"{n_params / 1e6:.2f}M params incl. vocab padding, {dtype}, muP "
        f"{'unfolded' if model.use_mup else 'as stored'}) -> {final} in {time.time() - t0:.1f}s")
    if assumed:
        log(f"assumed (not in {src / 'config.json' if gguf is None else src}): " + "; ".join(assumed))
    tok = final / "tokenizer"
    log(f"model group: {final / 'model' / group.name} ({_group_note(model, train_model) or 'the source model'}); "
        f"train it with: hydra.searchpath=[file://{final}] model={group.stem} init_from={final}"
        + (f" data.tokenizer={tok}" if tok.is_dir() else " (the source has no tokenizer files: give data.tokenizer)"))
    return final


def sparse_attention_config(attn, variant: str, geometry_fields: dict, model):
    """``--attention``: the sparse config a dense source becomes (the released geometry, ``--geometry`` fields
    over it); a source that is already sparse is refused in one line."""
    from dataclasses import replace

    from nosa_layers.config import NOSAConfig
    from nosa_layers.megatron.config import AttentionConfig, validate

    if attn.variant != "dense" or attn.layer_pattern is not None:
        raise ConversionError(f"--attention {variant}: the source is already sparse ({attn.variant}); import it "
                              f"without --attention")
    try:
        nosa = replace(NOSAConfig(), **geometry_fields).validate()
    except (TypeError, ValueError) as e:
        raise ConversionError(f"--geometry: {e}") from None
    out = AttentionConfig(variant=variant, nosa=nosa)
    validate(model, out)
    return out


def new_eviction_heads(model, attn) -> dict:
    """The eviction-head parameters of every layer for a dense source imported as NOSA (HF names): the head's
    own initialisation (seeded), ``A = 0``, so every score and bias is 0 and the selection alone makes the
    model sparse (none for InfLLM-V2)."""
    if attn.variant != "nosa":
        return {}
    from nosa_layers.eviction import build_eviction_head

    torch.manual_seed(0)
    out = {}
    for i in range(model.num_layers):
        head = build_eviction_head(attn.nosa.eviction_head, num_q_heads=model.num_attention_heads,
                                   num_kv_heads=model.num_kv_heads, head_dim=model.kv_channels)
        out.update({f"model.layers.{i}.self_attn.{n}": p.detach().float() for n, p in head.named_parameters()})
    return out


def _group_note(model, train_model) -> str:
    """What the model group changes against the imported model (the LongRoPE extension), or ''."""
    if train_model is model:
        return ""
    lr = train_model.longrope
    return (f"LongRoPE {model.max_position_embeddings} -> {train_model.max_position_embeddings} tokens "
            f"(rope theta {model.rope_theta:g}, head dim {model.kv_channels}; short = long factors: the model "
            f"changes at every length, attention factor {lr.attention_factor})")


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    return run_cli("from_hf", import_hf, args.hf, args.out, args.dtype, args.mup, args.make_vocab_size_divisible_by,
                   args.family, print, args.geometry, args.longrope, args.mup_constants, args.allow_non_finite,
                   args.gguf, args.target_length, args.attention)


if __name__ == "__main__":
    sys.exit(main())
