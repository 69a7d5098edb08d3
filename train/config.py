"""Typed run configuration of ``train/main.py`` and its single cross-field validation.

Hydra composes YAML from ``recipes/``; :func:`train.compose.load_config` turns the result into a
:class:`RunConfig` (unknown keys are errors) and :func:`validate` checks every cross-field rule
with one-line messages that name the fix. Builders downstream take these dataclasses only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from data.config import DataConfig, SFTConfig
from nosa_layers.megatron.config import AttentionConfig, ModelConfig, ParallelConfig
from nosa_layers.megatron.config import validate as validate_model

STAGES = ("pretrain", "cpt", "sft")
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("bf16", "fp16", "fp32")
RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("wsd", "cosine", "constant")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
NAN_POLICIES = ("stop", "skip")
WANDB_MODES = ("online", "offline", "disabled")
RESUME = ("auto", "none")


@dataclass
class RunSection:
    """Where the run lives and how it is seeded. ``dir`` defaults to ``runs/<recipe>``."""

    dir: Optional[str] = None
    seed: int = 1234
    device: str = "auto"  # auto: cuda when available, else cpu (gloo + megatron CPU shim)
    cpu_init: bool = False  # initialise weights on the CPU: identical initial weights for every TP/PP size


@dataclass
class ParallelSection:
    """megatron-core layout; data parallel = world size / (TP * PP * CP)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = True
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False

    def model_parallel(self) -> ParallelConfig:
        return ParallelConfig(tensor_parallel=self.tensor_model_parallel_size,
                              pipeline_parallel=self.pipeline_model_parallel_size,
                              virtual_pipeline=self.virtual_pipeline_model_parallel_size,
                              context_parallel=self.context_parallel_size,
                              sequence_parallel=self.sequence_parallel)

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size


@dataclass
class StageSection:
    """``pretrain`` / ``cpt`` read indexed data (``data``), ``sft`` reads chat data (``sft``)."""

    kind: str = "pretrain"


@dataclass
class TrainSection:
    """Step budget and per-step shapes. One step = one optimizer update of ``global_batch_size``
    sequences of ``seq_length`` tokens, split into micro-batches of ``micro_batch_size``."""

    max_steps: int = 100
    exit_after_steps: Optional[int] = None  # stop cleanly (with a checkpoint) after N steps of this launch
    global_batch_size: int = 8
    micro_batch_size: int = 1
    seq_length: int = 4096
    log_interval: int = 1
    eval_interval: int = 0  # 0: validation only at the end
    eval_iters: int = 2
    precision: str = "bf16"  # fp32 is used on CPU whatever this says
    recompute: str = "none"
    nan_policy: str = "stop"
    locality_interval: int = 0  # log NOSA locality stats every N steps (0: off)


@dataclass
class OptimSection:
    """AdamW (megatron-core optimizer) and the LR schedule (megatron-core scheduler), in steps."""

    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    schedule: str = "wsd"
    warmup_steps: int = 0
    wsd_decay_fraction: float = 0.1  # WSD: share of max_steps spent in the final decay
    wsd_decay_style: str = "linear"


@dataclass
class CheckpointSection:
    """Distributed checkpoints under ``<run.dir>/checkpoints/iter_XXXXXXX`` with a ``latest`` pointer."""

    interval: int = 0  # every N steps (0: only at the end)
    resume: str = "auto"  # auto: continue from <run.dir>/checkpoints/latest if present
    keep_last: int = 2  # older complete checkpoints are deleted (0: keep all)
    save: bool = True  # false: never write checkpoints (benchmarks)


@dataclass
class LoggingSection:
    wandb: str = "disabled"
    wandb_project: str = "nosa-train"
    plot: bool = True


@dataclass
class RunConfig:
    recipe: str = "default"
    run: RunSection = field(default_factory=RunSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    stage: StageSection = field(default_factory=StageSection)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    init_from: Optional[str] = None  # weights-only start (previous stage); dense -> NOSA allowed
    print_config: bool = False
    dry_run: bool = False

    @property
    def run_dir(self) -> str:
        return self.run.dir or f"runs/{self.recipe}"


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _choice(value: str, choices: tuple, name: str) -> None:
    _need(value in choices, f"{name}={value!r} is not one of {choices}")


ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "kv_channels",
                       "ffn_hidden_size", "padded_vocab_size", "tie_embeddings", "use_mup")


def _check_same_architecture(cfg: RunConfig, ckpt) -> None:
    """``init_from`` must hold the same architecture (shapes, tying, muP) as the model being built."""
    from runtime.checkpoint_files import read_configs

    got = read_configs(ckpt)
    if got is None:
        return
    saved = got[0]
    diff = [f"{f}: checkpoint {getattr(saved, f)} vs recipe {getattr(cfg.model, f)}"
            for f in ARCHITECTURE_FIELDS if getattr(saved, f) != getattr(cfg.model, f)]
    _need(not diff, f"init_from={str(ckpt)!r} has another architecture ({'; '.join(diff)}); "
                    f"use the same model.* settings as the stage that wrote it")


def validate(cfg: RunConfig, world_size: int = 1, check_files: bool = True) -> RunConfig:
    """Every cross-field rule of a run, for ``world_size`` processes. Returns ``cfg``."""
    p, t, o = cfg.parallel, cfg.train, cfg.optim
    _choice(cfg.run.device, DEVICES, "run.device")
    _choice(cfg.stage.kind, STAGES, "stage.kind")
    _choice(t.precision, PRECISIONS, "train.precision")
    _choice(t.recompute, RECOMPUTE, "train.recompute")
    _choice(t.nan_policy, NAN_POLICIES, "train.nan_policy")
    _choice(o.schedule, SCHEDULES, "optim.schedule")
    _choice(o.wsd_decay_style, WSD_DECAY_STYLES, "optim.wsd_decay_style")
    _choice(cfg.logging.wandb, WANDB_MODES, "logging.wandb")
    _choice(cfg.checkpoint.resume, RESUME, "checkpoint.resume")

    _need(world_size % p.model_parallel_size == 0,
          f"world size {world_size} is not divisible by TP*PP*CP={p.model_parallel_size}; "
          f"launch a multiple of {p.model_parallel_size} processes or change parallel.*")
    dp = world_size // p.model_parallel_size
    _need(t.max_steps > 0, f"train.max_steps={t.max_steps} must be > 0")
    _need(t.exit_after_steps is None or t.exit_after_steps > 0,
          f"train.exit_after_steps={t.exit_after_steps} must be > 0 or null")
    _need(t.micro_batch_size > 0 and t.global_batch_size > 0, "train batch sizes must be > 0")
    _need(t.global_batch_size % (t.micro_batch_size * dp) == 0,
          f"train.global_batch_size={t.global_batch_size} is not divisible by micro_batch_size*DP="
          f"{t.micro_batch_size}*{dp}; pick a multiple of {t.micro_batch_size * dp}")
    _need(t.log_interval > 0, f"train.log_interval={t.log_interval} must be > 0")
    _need(t.eval_interval >= 0 and t.eval_iters >= 0, "train.eval_interval and train.eval_iters must be >= 0")
    _need(o.lr > 0 and 0 <= o.min_lr <= o.lr, f"need 0 <= optim.min_lr ({o.min_lr}) <= optim.lr ({o.lr}) and lr > 0")
    _need(0 <= o.warmup_steps < t.max_steps,
          f"optim.warmup_steps={o.warmup_steps} must be < train.max_steps={t.max_steps}")
    _need(0 < o.wsd_decay_fraction <= 1, f"optim.wsd_decay_fraction={o.wsd_decay_fraction} must be in (0, 1]")
    _need(cfg.checkpoint.interval >= 0 and cfg.checkpoint.keep_last >= 0,
          "checkpoint.interval and checkpoint.keep_last must be >= 0")
    _need(p.sequence_parallel is False or p.tensor_model_parallel_size > 1,
          "parallel.sequence_parallel=true needs tensor_model_parallel_size > 1")

    if cfg.init_from and check_files:
        from runtime.checkpoint_files import find_checkpoint

        src = find_checkpoint(cfg.init_from)
        _need(src is not None, f"init_from={cfg.init_from!r} holds no complete checkpoint (give a run dir, its "
                               f"checkpoints/ dir, or an iter_* dir)")
        _check_same_architecture(cfg, src)
    validate_model(cfg.model, cfg.attention, p.model_parallel(), seq_length=t.seq_length)
    data = cfg.sft if cfg.stage.kind == "sft" else cfg.data
    _need(data.seq_length == t.seq_length,
          f"{'sft' if cfg.stage.kind == 'sft' else 'data'}.seq_length={data.seq_length} differs from "
          f"train.seq_length={t.seq_length}; set them equal (recipes use ${{train.seq_length}})")
    _need(data.micro_batch_size == t.micro_batch_size,
          f"data micro_batch_size={data.micro_batch_size} differs from train.micro_batch_size={t.micro_batch_size}")
    from data.config import validate as validate_data

    if check_files or getattr(data, "paths", None) or getattr(data, "path", None):
        validate_data(data, dp_size=dp, check_files=check_files)
    return cfg
