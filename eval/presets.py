"""Typed presets of the ablation sweep (``python -m eval.ablate --preset NAME``).

A preset fixes the data (the offline demo corpus plus synthetic retrieval documents generated
from it by ``eval.tasks``), the dense pretraining stage, the long-context CPT stage every variant
runs from the same pretrained checkpoint, and the evaluation (task lengths, documents).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List

from eval.errors import EvalError
from nosa_layers.config import tiny_geometry

# variant name -> the recipes/attention group its CPT runs with (recipe=<cpt> attention=<group>)
VARIANTS: Dict[str, str] = {
    "ed_dma": "nosa",              # NOSA
    "dma": "nosa_evict_dma",
    "s_dma": "nosa_evict_s_dma",
    "locret": "nosa_evict_locret",
    "none": "infllm_v2",           # InfLLM-V2: query-aware selection only
    "dense": "dense",
}


@dataclass
class Stage:
    """One ``train/main.py`` run: ``recipe``, ``steps`` (``train.max_steps``) and extra overrides."""

    recipe: str
    steps: int
    overrides: List[str] = field(default_factory=list)


@dataclass
class AblationPreset:
    name: str
    description: str
    pretrain: Stage
    cpt: Stage
    variants: List[str]
    demo: str = "full"  # demo corpus spec: full (cached under .cache/demo_data) | small (under <out>/data)
    split: str = "95,5,0"  # data.split of both stages: its validation documents are the held-out set
    task_lengths: List[int] = field(default_factory=lambda: [4096, 8192, 16384])
    task_samples: int = 20
    pretrain_doc_lengths: List[int] = field(default_factory=lambda: [1024, 2048, 3584])
    cpt_doc_lengths: List[int] = field(default_factory=lambda: [4096, 8192, 14336])
    train_docs: int = 40  # synthetic retrieval documents per (task, length) in the training data
    eval_length: int = 16384  # tokens of the locality and perplexity documents
    locality_docs: int = 4
    ppl_docs: int = 8

    def validate(self, variants: List[str]) -> None:
        bad = [v for v in variants if v not in VARIANTS]
        if bad:
            raise EvalError(f"unknown variant(s) {bad}; choose from {list(VARIANTS)}")
        if len(self.pretrain_doc_lengths) != len(self.cpt_doc_lengths):
            raise EvalError(f"preset {self.name}: pretrain_doc_lengths and cpt_doc_lengths need as many entries "
                            f"(both stages must hold the same number of documents: the same held-out set)")
        if self.demo not in ("full", "small"):
            raise EvalError(f"preset {self.name}: demo={self.demo!r}; use full or small")

    def scaled(self, factor: float) -> "AblationPreset":
        """Step counts multiplied by ``factor`` (at least 2 steps each)."""
        if factor <= 0:
            raise EvalError(f"--scale {factor}: give a positive factor")
        step = lambda s: replace(s, steps=max(2, round(s.steps * factor)))  # noqa: E731
        return replace(self, pretrain=step(self.pretrain), cpt=step(self.cpt))


_QUIET = ["train.eval_interval=0", "checkpoint.interval=0", "logging.plot=true"]
# The tiny CPT recipe takes its geometry from its attention group (nosa_tiny); a variant swaps the
# group (attention=<variant>), so the tiny geometry is restated for every variant.
_TINY_GEOMETRY = [f"attention.nosa.{k}={v}" for k, v in asdict(tiny_geometry()).items()
                  if k not in ("eviction_head", "detach_value")]

PRESETS: Dict[str, AblationPreset] = {
    # Seconds per stage on 2 CPU cores: the CPU test and a smoke run of the whole pipeline.
    "tiny": AblationPreset(
        name="tiny", description="tiny model, SMALL demo corpus, 256-token pretraining, 512-token CPT (CPU)",
        pretrain=Stage("tiny_pretrain", 6, ["train.global_batch_size=4", "train.micro_batch_size=2", *_QUIET,
                                            "optim.warmup_steps=1"]),
        cpt=Stage("tiny_cpt", 4, ["train.global_batch_size=2", "train.locality_interval=0", *_QUIET,
                                  "optim.warmup_steps=1", *_TINY_GEOMETRY]),
        variants=["ed_dma", "none", "dense"], demo="small", split="90,10,0", task_lengths=[512], task_samples=2,
        pretrain_doc_lengths=[512], cpt_doc_lengths=[512], train_docs=1, eval_length=512, locality_docs=2,
        ppl_docs=2),
    # The H200 proof run: a 32M-parameter model, 4K dense pretraining, 16K CPT per variant.
    "proof_h200": AblationPreset(
        name="proof_h200",
        description="32M-parameter Llama (8 x 512, GQA 8/2, head_dim 64), 4K dense pretraining on the demo "
                    "corpus + synthetic retrieval documents, 16K NOSA CPT per variant (released geometry)",
        pretrain=Stage("proof_pretrain", 500, ["train.global_batch_size=16", "train.micro_batch_size=4"]),
        cpt=Stage("proof_cpt", 80, []),
        variants=["ed_dma", "none", "dense", "dma", "s_dma", "locret"]),  # the key comparison runs first
}


def get_preset(name: str) -> AblationPreset:
    if name not in PRESETS:
        raise EvalError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name]
