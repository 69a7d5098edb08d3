"""Conversion cases shared by the torchrun worker and the pytest assertions (no megatron import).

Every family (llama3, minicpm4 with muP) x variant (dense, infllm_v2, nosa) is saved by a real
2-process Megatron run in a TP=2 and a PP=2 layout. The ``long`` cases use the released NOSA
geometry (64-token blocks, 64-block budget) at 4608 tokens (72 blocks, so selection is really
sparse) and LongRoPE past its original length: every sparse llama3 case and MiniCPM4's NOSA TP=2 one
(muP with the released geometry; the reference-format tests cover that geometry too). The others use a
tiny geometry (16-token blocks, 6-block budget) at 320 tokens: sparse too, at a fraction of the CPU time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict

from nosa_layers.config import NOSAConfig, tiny_geometry
from nosa_layers.megatron.config import AttentionConfig, ModelConfig, ParallelConfig
from nosa_layers.rope.longrope import LongRoPEConfig

LONG_SEQ = 4608  # > 4096: 72 blocks of 64 > the 64-block budget
SHORT_SEQ = 320
BATCH = 1


def tiny_model(family: str, longrope: bool = False) -> ModelConfig:
    m = ModelConfig(family=family, size="test", num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                    head_dim=8, ffn_hidden_size=64, vocab_size=250, make_vocab_size_divisible_by=128,
                    max_position_embeddings=8192, rope_theta=10000.0, norm_eps=1e-5)
    if family == "minicpm4":
        m = replace(m, use_mup=True, scale_emb=12.0, scale_depth=1.4, dim_model_base=8)
    if longrope:
        half = m.kv_channels // 2
        m = replace(m, rope_type="longrope", longrope=LongRoPEConfig(
            short_factor=[1.0 + 0.05 * i for i in range(half)], long_factor=[1.0 + 0.7 * i for i in range(half)],
            original_max_position_embeddings=2048, attention_factor=1.0763))
    return m


def attention(variant: str, long: bool) -> AttentionConfig:
    if variant == "dense":
        return AttentionConfig(variant="dense", backend="reference")
    head = "none" if variant == "infllm_v2" else "ed_dma"
    nosa = NOSAConfig(eviction_head=head) if long else tiny_geometry(eviction_head=head)
    return AttentionConfig(variant=variant, nosa=nosa, backend="reference")


@dataclass
class Case:
    family: str
    variant: str
    layout: str
    long: bool

    @property
    def name(self) -> str:
        return f"{self.family}-{self.variant}-{self.layout}" + ("-long" if self.long else "")

    @property
    def seq(self) -> int:
        return LONG_SEQ if self.long else SHORT_SEQ

    @property
    def model(self) -> ModelConfig:
        return tiny_model(self.family, longrope=self.long)

    @property
    def attn(self) -> AttentionConfig:
        return attention(self.variant, self.long)

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(tensor_parallel=2) if self.layout == "tp2" else ParallelConfig(pipeline_parallel=2)

    @property
    def seed(self) -> int:
        return sum(map(ord, self.name))


def _cases() -> Dict[str, Case]:
    out = {}
    for family in ("llama3", "minicpm4"):
        for variant in ("dense", "infllm_v2", "nosa"):
            for layout in ("tp2", "pp2"):
                long = variant != "dense" and (family == "llama3" or (variant, layout) == ("nosa", "tp2"))
                c = Case(family, variant, layout, long)
                out[c.name] = c
    return out


CASES = _cases()
