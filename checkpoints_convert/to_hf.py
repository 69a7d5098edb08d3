"""Megatron distributed checkpoint (any TP/PP/DP layout) -> Hugging Face directory.

    python -m checkpoints_convert.to_hf --ckpt runs/demo/sft --out runs/demo/hf \
        [--dtype fp32|bf16|fp16] [--tokenizer DIR] [--max-shard-size 4GB] [--format nosa|reference]
        [--longrope short|switch]

``--ckpt`` is a run dir, its ``checkpoints/`` dir (``latest`` pointer) or one ``iter_*`` dir. The
model is described by the ``nosa_config.json`` the trainer writes next to the tensors. Output:

* ``config.json`` (``model_type: nosa_llama`` for sparse models, so stock transformers refuses them
  without remote code, ``llama`` for dense ones; LongRoPE ``rope_scaling`` with explicit factors and
  ``attention_factor``; NOSA settings in ``nosa_config``; provenance in ``nosa_export``);
* ``model.safetensors`` or shards + ``model.safetensors.index.json``;
* sparse models (NOSA / InfLLM-V2 layers): ``modeling_nosa.py``, ``configuration_nosa.py`` + the
  reference modules it imports, and ``auto_map`` (``AutoConfig``, ``AutoModelForCausalLM``) so
  ``AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)`` runs them; dense models are
  stock ``LlamaForCausalLM`` (no remote code);
* ``--format reference``: the layout of the released NOSA checkpoints instead (``SparseLlamaForCausalLM``,
  ``auto_map`` to ``modeling_llama_nosa``, no ``nosa_config``, bf16 by default, no modeling code: add
  the reference's ``modeling_llama_nosa.py`` and ``cis_pooling.py``, or it loads as a dense Llama; the
  export says so in one line); refused when the geometry is not the reference's;
* the tokenizer files of ``--tokenizer`` (a tokenizer dir or a model dir: its config, weights and code
  are not copied), by default the checkpoint's own: the one it records (each stage carries it on),
  else its run's ``data.tokenizer`` / ``sft.tokenizer``, else the Hugging Face dir a ``from_hf``
  import came from; ``generation_config.json``. Token ids (``bos/eos/pad_token_id``, in both
  ``config.json`` and ``generation_config.json``) are the tokenizer's, else those of the Hugging Face
  source a ``from_hf`` import recorded (carried through every stage).

Any mismatch (missing / extra tensors, shapes, unknown variant) raises one error listing the names;
the output directory is written to a temp dir and renamed at the end, so it is never partial (a full
disk is one line). An existing ``--out`` is replaced only if it is empty or an earlier export
(``--overwrite`` for anything else); an ``--out`` that is, contains or lies inside the source run is
refused even then. The checkpoint is verified against its manifest and weights holding NaN/inf are
refused (``--allow-non-finite``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Optional


def build_parser() -> argparse.ArgumentParser:
    """The command line (defined before the heavy imports: ``--help`` answers without torch)."""
    ap = argparse.ArgumentParser(prog="python -m checkpoints_convert.to_hf", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="run dir, checkpoints/ dir or iter_* dir")
    ap.add_argument("--out", required=True,
                    help="output directory: new, empty or an earlier export (replaced atomically)")
    ap.add_argument("--overwrite", action="store_true", help="replace --out even if it is not an earlier export")
    ap.add_argument("--allow-non-finite", action="store_true", help="export weights that hold NaN/inf")
    ap.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                    help="default: fp32 (--format nosa), bf16 (--format reference, as the released checkpoints)")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer directory to copy into the export (default: the checkpoint's own: recorded with "
                         "it, its run's data.tokenizer, or an import's source)")
    ap.add_argument("--max-shard-size", default="4GB")
    ap.add_argument("--format", default="nosa", choices=["nosa", "reference"],  # reference_format.FORMATS
                    help="nosa: this project's layout + modeling code; reference: the released NOSA checkpoints' "
                         "layout (thunlp/NOSA remote code; reference geometry only)")
    ap.add_argument("--longrope", default=None, choices=["short", "switch"],
                    help="when short_factor != long_factor: write long_factor := short_factor (short everywhere, "
                         "what the reference code runs) or keep both (switch past the original length; "
                         "the default for --format nosa)")
    return ap


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors exit here, before torch is imported

import torch

from checkpoints_convert.common import (
    DTYPES,
    cast,
    check_out_apart,
    check_out_dir,
    geometry,
    load_megatron_tensors,
    read_model_config,
    resolve_checkpoint,
    save_safetensors_sharded,
    source_run,
)
from checkpoints_convert.hf_modeling import AUTO_MAP, MODEL_CLASS, write_modeling_files
from checkpoints_convert.hf_modeling.configuration_nosa import MODEL_TYPE
from checkpoints_convert.mapping import ConversionError, megatron_to_hf
from checkpoints_convert.reference_format import FORMATS, TOKEN_ID_KEYS, longrope_factors, to_reference_config
from nosa_layers.config import eviction_head_name
from runtime.cli import run_cli
from runtime.outputs import atomic_dir

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def is_sparse(attn, num_layers: int) -> bool:
    return any(v != "dense" for v in attn.layer_variants(num_layers))


def hf_config(model, attn, dtype: torch.dtype, extra: Optional[dict] = None, tokens: Optional[dict] = None,
              longrope: Optional[str] = None) -> dict:
    """The ``config.json`` of an export (plain dict; transformers 4.4x-5.x read it as ``LlamaConfig``, or as
    the shipped ``NOSALlamaConfig`` for sparse models). ``longrope="short"``: ``long_factor := short_factor``."""
    variants = attn.layer_variants(model.num_layers)
    bad = sorted({v for v in variants if v not in ("dense", "infllm_v2", "nosa")})
    if bad:
        raise ConversionError(f"unknown attention variant(s) {bad}; the exporter knows dense, infllm_v2, nosa")
    sparse = is_sparse(attn, model.num_layers)
    cfg = {
        "architectures": [MODEL_CLASS if sparse else "LlamaForCausalLM"],
        "model_type": MODEL_TYPE if sparse else "llama",
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_kv_heads,
        "head_dim": model.kv_channels,
        "hidden_act": "silu",
        "max_position_embeddings": model.max_position_embeddings,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": model.init_std,
        "tie_word_embeddings": bool(model.tie_embeddings and not model.use_mup),
        "use_cache": True,
        "torch_dtype": _DTYPE_NAMES[dtype],
    }
    if model.rope_type == "longrope":
        lr = model.longrope
        short, long = longrope_factors([float(x) for x in lr.short_factor], [float(x) for x in lr.long_factor],
                                       longrope, False, "--longrope")
        cfg["rope_scaling"] = {
            "rope_type": "longrope", "type": "longrope", "short_factor": short, "long_factor": long,
            "original_max_position_embeddings": int(lr.original_max_position_embeddings),
            "attention_factor": float(lr.resolved_attention_factor(model.max_position_embeddings)),
            "factor": float(lr.factor if lr.factor is not None
                            else model.max_position_embeddings / lr.original_max_position_embeddings),
        }
    if tokens:
        cfg.update(tokens)
    if sparse and "rope_scaling" in cfg:
        # rope_theta inside rope_scaling (transformers 5 reads it there; the shipped config class reads it for
        # 4.x): next to a top-level rope_theta, transformers 5's generic config, which AutoTokenizer falls back
        # to without trust_remote_code, fails on the longrope block, so the export's tokenizer would not load
        cfg["rope_scaling"]["rope_theta"] = cfg.pop("rope_theta")
    if sparse:
        n = attn.nosa
        head = eviction_head_name(variants, n.eviction_head)
        cfg["auto_map"] = dict(AUTO_MAP)
        cfg["nosa_config"] = {"layer_variants": variants, **dataclasses.asdict(n), "eviction_head": head,
                              "eviction_bias": bool(attn.eviction_bias), "backend": "auto"}
    export = {"family": model.family, "size": model.size,
              "variant": attn.variant if attn.layer_pattern is None else "pattern",
              "padded_vocab_size": model.padded_vocab_size,
              "make_vocab_size_divisible_by": model.make_vocab_size_divisible_by,
              "tied_in_megatron": bool(model.tie_embeddings)}
    if model.use_mup:  # folded into the weights; recorded only so that from_hf can unfold it
        export["mup_folded"] = {"scale_emb": model.scale_emb, "scale_depth": model.scale_depth,
                                "dim_model_base": model.dim_model_base}
    if extra:
        export.update({k: extra[k] for k in ("recipe", "step") if k in extra})
    cfg["nosa_export"] = export
    return cfg



def tokenizer_ids(tokenizer_dir: Path) -> dict:
    """bos / eos / pad ids of a tokenizer directory (``<|im_end|>`` joins eos for chat models)."""
    try:
        from data.tokenizer import load_hf_tokenizer

        tok = load_hf_tokenizer(str(tokenizer_dir))
    except Exception as e:  # noqa: BLE001 - a tokenizer we cannot parse is still copied
        print(f"warning: could not read token ids from {tokenizer_dir}: {e}", file=sys.stderr)
        return {}
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    im_end = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else None
    if im_end is not None and im_end not in eos:
        eos.append(im_end)
    out = {"bos_token_id": tok.bos_token_id, "pad_token_id": tok.pad_token_id}
    out["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
    return out


MODEL_FILES = ("config.json", "generation_config.json")
MODEL_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".py", ".index.json")


def is_model_file(name: str) -> bool:
    """A file of a model dir that is not part of its tokenizer (``--tokenizer`` may name a model dir)."""
    return name in MODEL_FILES or name.endswith(MODEL_SUFFIXES)


def token_ids(extra: dict, tokenizer_ids: dict) -> dict:
    """The token ids of the export: those the checkpoint recorded from its Hugging Face source
    (``from_hf``), each replaced by the tokenizer's where the tokenizer defines one."""
    source = {k: v for k, v in (extra.get("token_ids") or {}).items() if k in TOKEN_ID_KEYS and v is not None}
    return {**source, **{k: v for k, v in tokenizer_ids.items() if v is not None}}


def export(ckpt: str, out: str, dtype: Optional[str] = None, tokenizer: Optional[str] = None,
           max_shard_bytes: int = 4 << 30, log=print, overwrite: bool = False, allow_non_finite: bool = False,
           fmt: str = "nosa", longrope: Optional[str] = None) -> Path:
    t0 = time.time()
    if fmt not in FORMATS:
        raise ConversionError(f"--format {fmt!r}; use one of {', '.join(FORMATS)}")
    dtype = dtype or ("bf16" if fmt == "reference" else "fp32")  # the released checkpoints are bf16
    if dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype!r}; use one of fp32, bf16, fp16")
    torch_dtype = DTYPES[dtype]
    check_out_apart(out, ckpt, "--ckpt")
    check_out_dir(out, overwrite)
    ck = resolve_checkpoint(ckpt)
    check_out_apart(out, source_run(ck), "the run of --ckpt")
    model, attn, extra = read_model_config(ck)
    from nosa_layers.megatron.config import validate

    validate(model, attn)
    geo = geometry(model, attn)
    tensors = load_megatron_tensors(ck)
    bad = [k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad and not allow_non_finite:
        raise ConversionError(f"{ck}: {len(bad)} tensor(s) hold NaN/inf (e.g. {bad[0]}); export a finite "
                              f"checkpoint, or pass --allow-non-finite to export it anyway")
    hf = cast(megatron_to_hf(tensors, geo), torch_dtype)
    tok_dir = Path(tokenizer) if tokenizer else None
    if tok_dir is not None and not tok_dir.is_dir():
        raise ConversionError(f"--tokenizer {tokenizer}: not a directory")
    if tok_dir is None:
        from runtime.checkpoint_files import checkpoint_tokenizer

        tok_dir, where = checkpoint_tokenizer(ck, extra)
        log(f"tokenizer: {tok_dir} ({where})" if tok_dir else
            f"warning: no tokenizer for {ck} (none recorded with it, in its run's config.yaml or an import's source): "
            f"the export has no tokenizer files; pass --tokenizer DIR")
    tokens = token_ids(extra, tokenizer_ids(tok_dir) if tok_dir is not None else {})
    if fmt == "reference":  # refuse before the (long) weight conversion
        to_reference_config(hf_config(model, attn, torch_dtype), longrope)
    cfg = hf_config(model, attn, torch_dtype, extra, tokens, None if fmt == "reference" else longrope)
    if fmt == "reference":
        cfg = to_reference_config(cfg, longrope)
    need = sum(t.numel() * t.element_size() for t in hf.values())
    with atomic_dir(check_out_dir(out, overwrite), need_bytes=need) as tmp:
        files = save_safetensors_sharded(hf, tmp, max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        gen = {k: cfg[k] for k in TOKEN_ID_KEYS if cfg.get(k) is not None}
        (tmp / "generation_config.json").write_text(json.dumps({**gen, "do_sample": False}, indent=2) + "\n")
        shipped = write_modeling_files(tmp) if "auto_map" in cfg and fmt == "nosa" else []
        if tok_dir is not None:
            for f in sorted(tok_dir.iterdir()):
                if f.is_file() and not is_model_file(f.name):
                    shutil.copy2(f, tmp / f.name)
    n_params = sum(t.numel() for t in hf.values())
    log(f"exported {ck} ({model.family}, {'/'.join(sorted(set(attn.layer_variants(model.num_layers))))}, "
        f"{n_params / 1e6:.2f}M params, {dtype}) -> {Path(out).resolve()}: {len(files)} weight file(s)"
        f"{', modeling code ' + ', '.join(shipped) if shipped else ''}"
        f"{' (stock LlamaForCausalLM)' if not shipped and fmt != 'reference' else ''}"
        f"{', tokenizer' if tok_dir else ''} in {time.time() - t0:.1f}s")
    if fmt == "reference":
        log(REFERENCE_NOTE.format(out=Path(out).resolve()))
    return Path(out).resolve()


REFERENCE_NOTE = ("note: --format reference ships no modeling code: add the authors' modeling_llama_nosa.py and "
                  "cis_pooling.py (thunlp/NOSA) to {out} and load it with trust_remote_code=True; without them, "
                  "or without trust_remote_code, transformers loads it as a dense Llama that ignores the "
                  "eviction heads")


def parse_size(s: str) -> int:
    s = s.strip().upper()
    for suf, mul in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10), ("B", 1)):
        if s.endswith(suf):
            return int(float(s[:-len(suf)]) * mul)
    return int(s)


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    return run_cli("to_hf", export, args.ckpt, args.out, args.dtype, args.tokenizer, parse_size(args.max_shard_size),
                   print, args.overwrite, args.allow_non_finite, args.format, args.longrope,
                   interrupted=f"no partial export was left; --out {args.out} is intact (an export is written "
                               f"beside it and renamed into place only when complete)")


if __name__ == "__main__":
    sys.exit(main())
