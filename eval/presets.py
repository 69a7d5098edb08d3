"""Typed presets of the ablation sweep (``python -m eval.ablate --preset NAME``).

A preset fixes the data (the offline demo corpus plus synthetic retrieval documents generated
from it by ``eval.tasks``), the dense pretraining stage, the long-context CPT stage every variant
runs from the same pretrained checkpoint, and the evaluation (task lengths, documents).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Dict, List, Optional

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
    """The data, both stages and the evaluation of one ablation.

    Training data per stage: the demo corpus blended with synthetic retrieval documents of the
    RULER-style tasks (``eval.tasks.training_data``: ``*_retrieval_tokens`` tokens, the same share for
    every task and length of ``*_doc_lengths``, drawn with another seed than the evaluation set),
    ``retrieval_share`` of the tokens, packed with ``packing`` (``best_fit`` keeps documents whole).
    Learning curves: ``curve_points_*`` checkpoints along each stage scored on ``curve_samples``
    samples per task (pretraining at ``curve_length_pretrain``, CPT at ``curve_length_cpt``)."""

    name: str
    description: str
    pretrain: Optional[Stage]  # None: no pretraining, CPT starts from ``--init`` (an imported model)
    cpt: Stage
    variants: List[str]
    # CPT trains the ``--init`` model as imported (``from_hf``'s model group, with LongRoPE to the CPT's
    # ``cpt_length``), on data tokenized with its own tokenizer; the imported model is scored as the base row
    model_from_init: bool = False
    cpt_length: int = 16384
    demo: str = "full"  # demo corpus spec: full (cached under .cache/demo_data) | small (under <out>/data)
    split: str = "95,5,0"  # data.split of both stages: the corpus' validation documents are the held-out set
    task_lengths: List[int] = field(default_factory=lambda: [4096, 8192, 16384])
    task_samples: int = 20
    packing: str = "best_fit"
    retrieval_share: float = 0.6  # token share of the retrieval documents in each stage's blend
    pretrain_doc_lengths: List[int] = field(default_factory=lambda: [512, 1024, 2048, 4095])
    pretrain_retrieval_tokens: int = 1_000_000
    cpt_doc_lengths: List[int] = field(default_factory=lambda: [1024, 4096, 8192, 16383])
    cpt_retrieval_tokens: int = 1_000_000
    curve_points_pretrain: int = 0
    curve_points_cpt: int = 0
    curve_samples: int = 8
    curve_length_pretrain: int = 4096
    curve_length_cpt: int = 16384
    eval_length: int = 16384  # tokens of the locality and perplexity documents
    decode_budget_batch: int = 16  # --stage decode: the device budget = the dense export's cache of this many
    decode_mem_limit_gib: float = 12.0  # --stage decode without a dense variant: the device budget
    locality_docs: int = 4
    ppl_docs: int = 8

    def validate(self, variants: List[str]) -> None:
        bad = [v for v in variants if v not in VARIANTS]
        if bad:
            raise EvalError(f"unknown variant(s) {bad}; choose from {list(VARIANTS)}")
        if self.demo not in ("full", "small"):
            raise EvalError(f"preset {self.name}: demo={self.demo!r}; use full or small")
        if not 0 < self.retrieval_share < 1:
            raise EvalError(f"preset {self.name}: retrieval_share={self.retrieval_share} must be in (0, 1)")

    @property
    def needs_init(self) -> bool:
        """Whether the preset starts from an imported model (``--init``) instead of pretraining its own."""
        return self.pretrain is None

    def with_settings(self, settings: List[str], train_overrides: List[str]) -> "AblationPreset":
        """The preset with ``FIELD=VALUE`` settings of its own fields (``pretrain.steps`` / ``cpt.steps``
        too; lists as ``512,1024``) and ``STAGE:KEY=VALUE`` overrides added to a stage's ``train/main.py``
        command (``pretrain:train.global_batch_size=8``)."""
        out = self
        for item in settings:
            key, sep, value = item.partition("=")
            if not sep:
                raise EvalError(f"--set {item!r}: give FIELD=VALUE")
            if key in ("pretrain.steps", "cpt.steps"):
                stage = key.split(".")[0]
                if getattr(out, stage) is None:
                    raise EvalError(f"--set {key}: preset {self.name} has no {stage} stage")
                out = replace(out, **{stage: replace(getattr(out, stage), steps=_parse(key, value, int))})
                continue
            kinds = {f.name: f.type for f in fields(self) if f.name not in ("name", "pretrain", "cpt")}
            if key not in kinds:
                raise EvalError(f"--set {key}: not a preset field; choose from {sorted(kinds)} or pretrain.steps / "
                                f"cpt.steps")
            kind = str(kinds[key])
            conv = int if kind == "int" else float if kind == "float" else str
            parsed = ([_parse(key, v, int) for v in value.split(",")] if kind.startswith("List[int]")
                      else value.split(",") if kind.startswith("List[str]") else _parse(key, value, conv))
            out = replace(out, **{key: parsed})
        for item in train_overrides:
            stage, sep, override = item.partition(":")
            if not sep or stage not in ("pretrain", "cpt") or "=" not in override:
                raise EvalError(f"--train-override {item!r}: give pretrain:KEY=VALUE or cpt:KEY=VALUE")
            if override.split("=")[0] == "train.max_steps":
                raise EvalError(f"--train-override {item!r}: set the steps with --set {stage}.steps=N")
            st = getattr(out, stage)
            if st is None:
                raise EvalError(f"--train-override {item!r}: preset {self.name} has no {stage} stage")
            out = replace(out, **{stage: replace(st, overrides=[*st.overrides, override])})
        return out

    def scaled(self, factor: float) -> "AblationPreset":
        """Step counts (and the retrieval tokens generated for them) multiplied by ``factor`` (at least
        2 steps each)."""
        if factor <= 0:
            raise EvalError(f"--scale {factor}: give a positive factor")
        step = lambda s: s and replace(s, steps=max(2, round(s.steps * factor)))  # noqa: E731
        return replace(self, pretrain=step(self.pretrain), cpt=step(self.cpt),
                       pretrain_retrieval_tokens=max(1, round(self.pretrain_retrieval_tokens * factor)),
                       cpt_retrieval_tokens=max(1, round(self.cpt_retrieval_tokens * factor)))


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
        retrieval_share=0.5, pretrain_doc_lengths=[384, 512], pretrain_retrieval_tokens=20_000,
        cpt_doc_lengths=[512], cpt_retrieval_tokens=20_000, curve_points_pretrain=2, curve_samples=1,
        curve_length_pretrain=512, curve_length_cpt=512, eval_length=512, locality_docs=2, ppl_docs=2),
    # The H200 proof run: a 19M-parameter model, 4K dense pretraining, 16K CPT per variant; every
    # stage is one command of at most ~9 minutes on one H200 (docs/RESULTS.md).
    "proof_h200": AblationPreset(
        name="proof_h200",
        description="19M-parameter Llama (8 x 384, GQA 6/2, head_dim 64), 4K dense pretraining on the demo "
                    "corpus + synthetic retrieval documents (80% of the tokens, whole documents, loss on their "
                    "answers), 16K CPT per variant (released NOSA geometry)",
        pretrain=Stage("proof_pretrain", 900),
        cpt=Stage("proof_cpt", 160),
        variants=["ed_dma", "none", "dense", "dma", "s_dma", "locret"],  # the key comparison runs first
        task_samples=40, retrieval_share=0.8,
        pretrain_doc_lengths=[256, 512, 1024, 2048, 4095], pretrain_retrieval_tokens=95_000_000,
        cpt_doc_lengths=[1024, 4096, 8192, 16383], cpt_retrieval_tokens=17_000_000,
        curve_points_pretrain=4, curve_points_cpt=3, curve_samples=12),
    # The import path of smollm2_135m at CPU size (tests, smoke runs): --init a small Llama GGUF or HF directory
    # whose context is under 1024 tokens; its model, tokenizer and a 1024-token CPT with the tiny geometry.
    "tiny_import": AblationPreset(
        name="tiny_import", description="an imported small Llama (--init), 1024-token CPT per variant (CPU)",
        pretrain=None,
        cpt=Stage("import_cpt_16k", 3, ["train.seq_length=1024", "train.global_batch_size=2",
                                        "train.precision=fp32", "train.locality_interval=0", "train.log_interval=1",
                                        *_QUIET,
                                        "optim.warmup_steps=1", *_TINY_GEOMETRY]),
        variants=["ed_dma", "dense"], model_from_init=True, cpt_length=1024, demo="small", split="90,10,0",
        task_lengths=[512], task_samples=2, retrieval_share=0.5, cpt_doc_lengths=[512], cpt_retrieval_tokens=20_000,
        eval_length=512, locality_docs=2, ppl_docs=2, decode_budget_batch=2,
        decode_mem_limit_gib=0.001),
    # A real pretrained model made sparse: SmolLM2-135M-Instruct (30 x 576, GQA 9 / 3 heads of 64, 8K context,
    # rope theta 1e5; scripts/fetch_smollm2.sh), imported with its tokenizer (--init FILE.gguf), 16K CPT per
    # variant from the same import on the same data order; each variant's CPT is a few minutes on one H100.
    "smollm2_135m": AblationPreset(
        name="smollm2_135m",
        description="SmolLM2-135M-Instruct imported from GGUF (30 x 576, GQA 9/3, head_dim 64, 8K context), LongRoPE "
                    "8K -> 16K, 16K CPT per variant (released NOSA geometry; 80 x 8 x 16K tokens, lr 2e-4 WSD) on "
                    "the demo corpus + synthetic retrieval documents (60% of the tokens, whole documents, loss on "
                    "their answers), all tokenized with the model's tokenizer",
        pretrain=None,
        cpt=Stage("import_cpt_16k", 80),
        variants=["ed_dma", "none", "dense", "dma", "s_dma", "locret"],  # the key comparison runs first
        model_from_init=True, cpt_length=16384,
        task_samples=40, retrieval_share=0.6,
        cpt_doc_lengths=[1024, 4096, 8192, 16383], cpt_retrieval_tokens=6_500_000,
        curve_points_cpt=2, curve_samples=8),
}


def _parse(key: str, value: str, conv):
    try:
        return conv(value)
    except ValueError:
        raise EvalError(f"--set {key}={value}: not a {conv.__name__}") from None


def get_preset(name: str) -> AblationPreset:
    if name not in PRESETS:
        raise EvalError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name]
