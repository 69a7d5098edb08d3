"""Declarative Megatron <-> Hugging Face name tables and the tensor transforms between them.

Megatron side: the *global* tensors of a distributed checkpoint (TP shards already concatenated by
the checkpoint format, layers stacked on a leading axis as megatron-core's ``decoder.layers.*``
sharded keys store them). HF side: the public NOSA layout (``model.layers.{i}.self_attn.q_proj``,
``self_attn.A``, ``self_attn.delta.weight``, ``mlp.gate_proj`` ...), one tensor per layer.

Every rule names one Megatron tensor and the HF tensor(s) it becomes; ``*`` is the layer index.
Transforms:

* ``copy``   1:1;
* ``qkv``    megatron's fused ``linear_qkv`` (per KV group: G query heads, then k, then v) <->
  ``q_proj``, ``k_proj``, ``v_proj``;
* ``gated``  megatron's ``linear_fc1`` (gate rows stacked over up rows) <-> ``gate_proj``, ``up_proj``;
* ``vocab``  embedding / output rows: megatron pads the vocabulary, HF has exactly ``vocab_size``.

The eviction-head rules are not written here: they come from the registered head module itself
(:func:`eviction_parameters`), so a new head converts with no edit of this file.

MiniCPM4 muP is *folded* into the HF weights (its multipliers are constants, so a plain Llama
forward with folded weights equals the muP forward): embeddings x ``scale_emb``, every ``o_proj`` /
``down_proj`` x ``scale_depth / sqrt(num_layers)``, ``lm_head`` x ``dim_model_base / hidden_size``;
the exported config is plain Llama.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor

from nosa_layers.eviction import EVICTION_HEADS

# Keys of a trainer checkpoint that belong to the model (everything else: optimizer, RNG, ...).
NON_MODEL_PREFIXES = ("optimizer", "rng_state", "common_state")


class ConversionError(ValueError):
    """One message that lists every offending name (missing, unexpected, wrong shape, ...)."""


@dataclass(frozen=True)
class Rule:
    megatron: str  # "*" = layer index (stacked leading axis on the megatron side)
    hf: Tuple[str, ...]
    kind: str = "copy"  # copy | qkv | gated | vocab
    alt: Tuple[str, ...] = ()  # other megatron names of the same tensor (TE-fused norms / local spec)
    mup: Optional[str] = None  # emb | residual | logits
    optional: bool = False  # present only in some models (biases, untied output layer)

    @property
    def per_layer(self) -> bool:
        return "*" in self.megatron


# --- tables -------------------------------------------------------------------------------------

LLAMA_RULES: Tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", mup="emb"),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",), "vocab", mup="logits", optional=True),
    Rule("decoder.layers.*.self_attention.linear_qkv.layer_norm_weight", ("model.layers.*.input_layernorm.weight",),
         alt=("decoder.layers.*.input_layernorm.weight",)),
    Rule("decoder.layers.*.self_attention.linear_qkv.weight",
         ("model.layers.*.self_attn.q_proj.weight", "model.layers.*.self_attn.k_proj.weight",
          "model.layers.*.self_attn.v_proj.weight"), "qkv"),
    Rule("decoder.layers.*.self_attention.linear_proj.weight", ("model.layers.*.self_attn.o_proj.weight",),
         mup="residual"),
    Rule("decoder.layers.*.mlp.linear_fc1.layer_norm_weight", ("model.layers.*.post_attention_layernorm.weight",),
         alt=("decoder.layers.*.pre_mlp_layernorm.weight",)),
    Rule("decoder.layers.*.mlp.linear_fc1.weight",
         ("model.layers.*.mlp.gate_proj.weight", "model.layers.*.mlp.up_proj.weight"), "gated"),
    Rule("decoder.layers.*.mlp.linear_fc2.weight", ("model.layers.*.mlp.down_proj.weight",), mup="residual"),
)



def eviction_parameters(head: str, num_heads: int, num_kv_heads: int,
                        head_dim: int) -> Dict[str, Tuple[Tuple[int, ...], bool]]:
    """``{name: (shape, optional)}`` of an eviction head's parameters, read from the registry's own
    module (``nosa_layers.eviction``, built on the meta device): the names megatron saves under
    ``self_attention.eviction_head.`` and HF under ``self_attn.`` (as in the public NOSA checkpoints).
    A parameter that exists only with ``bias=True`` is optional."""
    if head not in EVICTION_HEADS:
        raise ConversionError(f"unknown eviction head {head!r}; known: {sorted(EVICTION_HEADS)}")
    return _parameter_shapes(EVICTION_HEADS[head], num_heads, num_kv_heads, head_dim)


@functools.lru_cache(maxsize=None)
def _parameter_shapes(cls: type, num_heads: int, num_kv_heads: int, head_dim: int):
    def shapes(bias: bool) -> Dict[str, Tuple[int, ...]]:
        with torch.device("meta"):
            module = cls(num_q_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, bias=bias)
        return {n: tuple(p.shape) for n, p in module.named_parameters()}

    required = shapes(False)
    return {n: (s, n not in required) for n, s in shapes(True).items()}


# --- geometry -----------------------------------------------------------------------------------

@dataclass
class Geometry:
    """What the transforms need to know about the model."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    padded_vocab_size: int
    tie_embeddings: bool = False
    layer_variants: List[str] = field(default_factory=list)  # dense | infllm_v2 | nosa, per layer
    eviction_head: str = "none"
    mup: Optional[Dict[str, float]] = None  # {"emb": s, "residual": s, "logits": s} when folding

    def eviction_parameters(self) -> Dict[str, Tuple[Tuple[int, ...], bool]]:
        """The eviction head's ``{name: (shape, optional)}`` (empty without NOSA layers)."""
        if "nosa" not in self.layer_variants:
            return {}
        return eviction_parameters(self.eviction_head, self.num_heads, self.num_kv_heads, self.head_dim)

    def rules(self) -> List[Rule]:
        return list(LLAMA_RULES) + [
            Rule(f"decoder.layers.*.self_attention.eviction_head.{n}", (f"model.layers.*.self_attn.{n}",),
                 optional=optional) for n, (_, optional) in self.eviction_parameters().items()]

    def layer_has(self, rule: Rule, layer: int) -> bool:
        """Eviction parameters exist only in NOSA layers (per-layer patterns may mix variants)."""
        if ".eviction_head." in rule.megatron:
            return self.layer_variants[layer] == "nosa"
        return True


def _layer_name(pattern: str, i: int) -> str:
    return pattern.replace("*", str(i))


# --- fused-tensor helpers -----------------------------------------------------------------------

def split_qkv(w: Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> Tuple[Tensor, Tensor, Tensor]:
    """megatron ``linear_qkv`` rows -> (q ``[Hq*D]``, k ``[Hkv*D]``, v ``[Hkv*D]``) rows.

    The rows are ``ng`` groups of ``(Hq/ng query heads, 1 k head ... , v ...)``; normally
    ``ng = Hkv``. When TP exceeded ``Hkv`` megatron replicates KV heads (``ng = tp``); then the
    replicas are checked equal and dropped.
    """
    rows = w.shape[0]
    if rows % head_dim:
        raise ConversionError(f"linear_qkv has {rows} rows, not a multiple of head_dim={head_dim}")
    heads = rows // head_dim
    ng2 = heads - num_heads
    if ng2 <= 0 or ng2 % 2 or num_heads % (ng2 // 2) or (ng2 // 2) % num_kv_heads:
        raise ConversionError(f"linear_qkv has {rows} rows; expected (num_heads + 2*num_kv_heads)*head_dim = "
                              f"{(num_heads + 2 * num_kv_heads) * head_dim}")
    ng = ng2 // 2
    qpg = num_heads // ng
    g = w.reshape(ng, qpg + 2, head_dim, *w.shape[1:])
    q = g[:, :qpg].reshape(num_heads * head_dim, *w.shape[1:])
    k, v = g[:, qpg], g[:, qpg + 1]  # [ng, D, ...]
    rep = ng // num_kv_heads
    if rep > 1:
        k4, v4 = k.reshape(num_kv_heads, rep, *k.shape[1:]), v.reshape(num_kv_heads, rep, *v.shape[1:])
        if not (torch.equal(k4, k4[:, :1].expand_as(k4)) and torch.equal(v4, v4[:, :1].expand_as(v4))):
            raise ConversionError("linear_qkv holds replicated KV heads whose replicas differ")
        k, v = k4[:, 0], v4[:, 0]
    return (q.contiguous(), k.reshape(num_kv_heads * head_dim, *w.shape[1:]).contiguous(),
            v.reshape(num_kv_heads * head_dim, *w.shape[1:]).contiguous())


def merge_qkv(q: Tensor, k: Tensor, v: Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> Tensor:
    """(q, k, v) rows -> megatron's GQA-interleaved ``linear_qkv`` rows (``ng = Hkv``)."""
    qpg = num_heads // num_kv_heads
    rest = q.shape[1:]
    qg = q.reshape(num_kv_heads, qpg, head_dim, *rest)
    kg = k.reshape(num_kv_heads, 1, head_dim, *rest)
    vg = v.reshape(num_kv_heads, 1, head_dim, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape((num_heads + 2 * num_kv_heads) * head_dim, *rest).contiguous()


def split_gated(w: Tensor) -> Tuple[Tensor, Tensor]:
    """megatron ``linear_fc1`` ``[2I, H]`` (gate rows, then up rows) -> (gate, up)."""
    if w.shape[0] % 2:
        raise ConversionError(f"linear_fc1 has an odd number of rows ({w.shape[0]}); expected gate and up stacked")
    gate, up = w.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


def merge_gated(gate: Tensor, up: Tensor) -> Tensor:
    return torch.cat([gate, up], dim=0).contiguous()


def _scale(t: Tensor, s: float) -> Tensor:
    """``t * s`` computed in fp64 and rounded once to t's dtype (exact for powers of two)."""
    if s == 1.0:
        return t
    return (t.double() * s).to(t.dtype)


def _unscale(t: Tensor, s: float) -> Tensor:
    if s == 1.0:
        return t
    return (t.double() / s).to(t.dtype)


# --- expected shapes ----------------------------------------------------------------------------

def hf_shapes(geo: Geometry, optional: bool = True) -> Dict[str, Tuple[int, ...]]:
    """Every HF tensor name of the model and its shape (the contract of an export); without the
    optional ones (an eviction bias) when ``optional=False``."""
    H, D, Hq, Hkv, I, V = (geo.hidden_size, geo.head_dim, geo.num_heads, geo.num_kv_heads,
                           geo.ffn_hidden_size, geo.vocab_size)
    per_layer = {
        "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (Hq * D, H), "self_attn.k_proj.weight": (Hkv * D, H),
        "self_attn.v_proj.weight": (Hkv * D, H), "self_attn.o_proj.weight": (H, Hq * D),
        "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
    }
    ev = {f"self_attn.{n}": s for n, (s, opt) in geo.eviction_parameters().items() if optional or not opt}
    out: Dict[str, Tuple[int, ...]] = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not geo.tie_embeddings or geo.mup:
        out["lm_head.weight"] = (V, H)
    for i in range(geo.num_layers):
        for k, s in (per_layer | ev if geo.layer_variants[i] == "nosa" else per_layer).items():
            out[f"model.layers.{i}.{k}"] = s
    return out


# --- Megatron -> HF -----------------------------------------------------------------------------

def _pick(sd: Dict[str, Tensor], rule: Rule) -> Optional[str]:
    for name in (rule.megatron, *rule.alt):
        key = name.replace(".*.", ".")  # stacked checkpoint key
        if key in sd:
            return key
    return None


def megatron_to_hf(sd: Dict[str, Tensor], geo: Geometry) -> Dict[str, Tensor]:
    """Global megatron tensors (layers stacked) -> HF state dict. Raises one ConversionError that
    lists every missing / unexpected / misshapen name."""
    sd = {k: v for k, v in sd.items() if not k.startswith(NON_MODEL_PREFIXES) and "_extra_state" not in k}
    out: Dict[str, Tensor] = {}
    used, missing, bad = set(), [], []
    mup = geo.mup or {}
    for rule in geo.rules():
        key = _pick(sd, rule)
        if key is None:
            if not rule.optional:
                missing.append(rule.megatron.replace(".*.", "."))
            continue
        used.add(key)
        t = sd[key]
        layers = [None]
        if rule.per_layer:
            if t.dim() < 1 or t.shape[0] != geo.num_layers:
                bad.append(f"{key}: leading (layer) axis {tuple(t.shape)} != num_layers={geo.num_layers}")
                continue
            layers = [i for i in range(geo.num_layers) if geo.layer_has(rule, i)]
        for i in layers:
            x = t if i is None else t[i]
            names = rule.hf if i is None else tuple(_layer_name(n, i) for n in rule.hf)
            try:
                if rule.kind == "qkv":
                    parts = split_qkv(x, geo.num_heads, geo.num_kv_heads, geo.head_dim)
                elif rule.kind == "gated":
                    parts = split_gated(x)
                elif rule.kind == "vocab":
                    if x.shape[0] < geo.vocab_size:
                        raise ConversionError(f"{key} has {x.shape[0]} rows < vocab_size={geo.vocab_size}")
                    parts = (x[:geo.vocab_size],)
                else:
                    parts = (x,)
            except ConversionError as e:
                bad.append(f"{key}[{i}]: {e}" if i is not None else f"{key}: {e}")
                continue
            s = mup.get(rule.mup, 1.0) if rule.mup else 1.0
            for n, p in zip(names, parts):
                out[n] = _scale(p.contiguous(), s)
    if geo.tie_embeddings and "lm_head.weight" not in out:
        if geo.mup:  # a tied muP model unties in HF: embed and lm_head get different folds
            emb = sd.get("embedding.word_embeddings.weight")
            if emb is not None:
                out["lm_head.weight"] = _scale(emb[:geo.vocab_size].contiguous(), mup.get("logits", 1.0))
    unexpected = sorted(set(sd) - used)
    want = hf_shapes(geo)
    for n, s_ in want.items():
        if n in out and tuple(out[n].shape) != s_:
            bad.append(f"{n}: shape {tuple(out[n].shape)}, expected {s_}")
    if not missing:  # consistency guard: every HF tensor of the contract was produced
        missing = [n for n in hf_shapes(geo, optional=False) if n not in out]
    _raise_if(missing, unexpected, bad, "megatron checkpoint")
    return out


# --- HF -> Megatron -----------------------------------------------------------------------------

def hf_to_megatron(hf: Dict[str, Tensor], geo: Geometry, unfold_mup: bool = False) -> Dict[str, Tensor]:
    """HF state dict -> global megatron tensors (layers stacked, vocab padded with zeros).

    ``unfold_mup``: divide the muP folds back out (``geo.mup``), for a megatron model that runs
    muP itself; otherwise the weights are taken as they are (a plain Llama parametrisation).
    """
    want = hf_shapes(geo)
    missing = sorted(n for n in hf_shapes(geo, optional=False) if n not in hf
                     and not (n == "lm_head.weight" and geo.tie_embeddings))
    unexpected = sorted(n for n in hf if n not in want)
    bad = [f"{n}: shape {tuple(hf[n].shape)}, expected {want[n]}" for n in hf
           if n in want and tuple(hf[n].shape) != want[n]]
    _raise_if(missing, unexpected, bad, "Hugging Face checkpoint")
    mup = (geo.mup or {}) if unfold_mup else {}
    out: Dict[str, Tensor] = {}
    for rule in geo.rules():
        if rule.megatron == "output_layer.weight" and geo.tie_embeddings:
            continue
        s = mup.get(rule.mup, 1.0) if rule.mup else 1.0
        if not rule.per_layer:
            if rule.hf[0] not in hf:
                continue
            x = hf[rule.hf[0]]
            if rule.kind == "vocab":
                pad = x.new_zeros(geo.padded_vocab_size - x.shape[0], *x.shape[1:])
                x = torch.cat([x, pad], dim=0)
            out[rule.megatron] = _unscale(x.contiguous(), s)
            continue
        layers = [i for i in range(geo.num_layers) if geo.layer_has(rule, i)]
        if not layers:
            continue
        if len(layers) != geo.num_layers:
            raise ConversionError(f"{rule.megatron}: only layers {layers} have it; megatron stacks one tensor "
                                  f"per layer, so mixed per-layer eviction heads cannot be imported")
        per = []
        for i in layers:
            names = [_layer_name(n, i) for n in rule.hf]
            if any(n not in hf for n in names):
                break
            parts = [hf[n] for n in names]
            if rule.kind == "qkv":
                x = merge_qkv(*parts, geo.num_heads, geo.num_kv_heads, geo.head_dim)
            elif rule.kind == "gated":
                x = merge_gated(*parts)
            else:
                x = parts[0]
            per.append(_unscale(x.contiguous(), s))
        else:
            out[rule.megatron.replace(".*.", ".")] = torch.stack(per, dim=0)
    return out


def _raise_if(missing: Iterable[str], unexpected: Iterable[str], bad: Iterable[str], what: str) -> None:
    missing, unexpected, bad = list(missing), list(unexpected), list(bad)
    if not (missing or unexpected or bad):
        return
    parts = []
    if missing:
        parts.append(f"missing {len(missing)}: {', '.join(missing)}")
    if unexpected:
        parts.append(f"unexpected {len(unexpected)}: {', '.join(unexpected)}")
    if bad:
        parts.append(f"wrong shape {len(bad)}: {'; '.join(bad)}")
    raise ConversionError(f"{what} does not match the model config: " + " | ".join(parts))


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def num_hf_layers(names: Iterable[str]) -> int:
    idx = [int(m.group(1)) for n in names if (m := _LAYER_RE.match(n))]
    return max(idx) + 1 if idx else 0
