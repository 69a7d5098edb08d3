"""Typed run configuration of ``train/main.py`` and its single cross-field validation.

Hydra composes YAML from ``recipes/``; :func:`train.compose.load_config` turns the result into a
:class:`RunConfig` (unknown keys are errors) and :func:`validate` checks every cross-field rule
with one-line messages that name the fix. Builders downstream take these dataclasses only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from data.config import DataConfig, SFTConfig
from nosa_layers.megatron.config import AttentionConfig, ModelConfig, ParallelConfig
from nosa_layers.megatron.config import validate as validate_model

STAGES = ("pretrain", "cpt", "sft")
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("bf16", "fp16", "fp32")
STEP_READS = ("each_step", "at_log")
RECOMPUTE = ("none", "selective", "full")
TRANSFORMER_IMPLS = ("local", "te")
LOSS_IMPLS = ("chunked", "fused", "standard")
SCHEDULES = ("wsd", "cosine", "constant")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
NAN_POLICIES = ("stop", "skip")
WANDB_MODES = ("online", "offline", "disabled")
RESUME = ("auto", "none")
ON_CORRUPT = ("fallback", "fail")


@dataclass
class RunSection:
    """Where the run lives and how it is seeded. ``dir`` defaults to ``runs/<recipe>``."""

    dir: Optional[str] = None
    seed: int = 1234
    device: str = "auto"  # auto: cuda when available, else cpu (gloo + megatron CPU shim)
    # initialise on the CPU from (seed, layer, parameter): the same weights for every TP/PP/DP layout
    cpu_init: bool = False


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
    world_size: Optional[int] = None  # processes of the run; null: torchrun's WORLD_SIZE (dry_run: TP*PP*CP)

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
    transformer_impl: str = "local"  # layer spec: local (megatron-core local layers) | te (Transformer Engine)
    # GPU runs: fused RMSNorm, RoPE and eviction score (Triton), megatron-core's fused SwiGLU and, in the chunked
    # loss, its fused cross-entropy helpers (same formulas, fewer passes over memory) and its gradient accumulation
    # fusion (weight gradient GEMMs add
    # into the fp32 main grads; runtime.megatron_compat gives it a torch GEMM where Apex is missing);
    # CPU runs always take the unfused reference path
    fusions: bool = True
    # The language-model loss (the output layer and the cross entropy): chunked (the logits of loss_chunk_tokens
    # tokens at a time, each chunk's gradients computed while its logits exist: no [tokens, vocab] tensor and
    # no logit computed twice; megatron-core's fused cross entropy per chunk on bf16 GPU runs with
    # train.fusions), fused (megatron-core's output layer and its compiled fused cross entropy over the whole
    # logits; bf16 GPU runs, elsewhere the standard one) or standard (megatron-core's output layer and its
    # vocab-parallel cross entropy over the whole logits). The same loss and gradients up to rounding.
    loss_impl: str = "chunked"
    loss_chunk_tokens: int = 4096  # tokens per chunk of loss_impl=chunked (peak ~ 10 B x chunk x vocab / TP in bf16)
    # When the host reads a step's loss, gradient norm and finite-gradient verdict: each_step (before the
    # update: every step waits for the GPU twice), or at_log (the update is clipped and, for a non-finite step,
    # skipped on the GPU; the values are read at the next log, evaluation, checkpoint or stop point and the
    # nan_policy applied there, so the host can queue the next steps meanwhile; with several ranks a save
    # signal is acted on at those points too; needs optim.fused, not fp16)
    step_reads: str = "each_step"
    nan_policy: str = "stop"  # a non-finite loss or gradient: stop, or skip the update (see nan_skip_limit)
    nan_skip_limit: int = 5  # nan_policy=skip: stop (exit 3) after this many consecutive skipped steps
    locality_interval: int = 0  # log NOSA locality stats every N steps (0: off)
    # Python garbage collection: 0 = Python's automatic GC; N > 0 = manual (as Megatron-LM's
    # --manual-gc): automatic GC off while training, one full collection every N steps at the same
    # step on every rank (an automatic gen-2 pass can stall one rank's kernel launches for ~1 s)
    gc_interval: int = 0


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
    # the eviction heads' learning rate (peak and floor) as a multiple of lr / min_lr: their gate ``A``
    # starts at 0 and moves by about lr per step, so a short CPT barely trains it at the model's lr
    eviction_lr_mult: float = 1.0
    # torch's fused AdamW kernel (megatron-core uses torch's AdamW without Transformer Engine or Apex):
    # one kernel per parameter group instead of the multi-tensor passes, same update up to rounding
    # (about 50 ms less per 16K step of the 1B-shaped model on an H200); a resumed run may switch it
    fused: bool = True


@dataclass
class CheckpointSection:
    """Distributed checkpoints under ``<run.dir>/checkpoints/iter_XXXXXXX`` with a ``latest`` pointer."""

    interval: int = 0  # every N steps (0: only at the end)
    resume: str = "auto"  # auto: continue from <run.dir>/checkpoints/latest if present
    keep_last: int = 2  # checkpoints older than the keep_last newest verified ones are deleted (0: keep all)
    on_corrupt: str = "fallback"  # resume from a damaged checkpoint: fallback (to the newest verified one) | fail
    allow_config_change: bool = False  # resume although settings that change the trajectory differ from config.yaml
    # resume / init_from a checkpoint another tool wrote (no manifest.json, no nosa_config.json), unverified
    allow_unverified: bool = False
    save: bool = True  # false: never write checkpoints (benchmarks)


@dataclass
class LoggingSection:
    """Where metrics go besides ``<run.dir>/metrics.jsonl`` and the console. W&B: the run id is
    unique per run dir, kept in ``<run.dir>/wandb_id`` and reused when the run resumes."""

    wandb: str = "disabled"
    wandb_project: str = "nosa-train"
    plot: bool = True
    tensorboard: bool = False  # scalars of every logged row under <run.dir>/tensorboard (needs the tensorboard package)


@dataclass
class ProfileSection:
    """torch.profiler record of chosen steps on the first rank: steps ``start_step`` (1-based; 0: off)
    to ``start_step + num_steps - 1``; writes ``<run.dir>/profile/trace.json`` (Chrome trace) and
    ``summary.json`` (GPU time per step by part: attention forward / backward, NOSA selection, index,
    eviction head, everything else)."""

    start_step: int = 0
    num_steps: int = 2
    with_stack: bool = False  # record Python stacks too (names the Python code behind GPU idle gaps)


@dataclass
class ClusterSection:
    """Running on a shared cluster: preemption, collective timeouts, the GPU a layout must fit.

    A signal of ``save_signals`` (SIGTERM: preemption and SLURM's time limit; SIGUSR1: SLURM's
    ``--signal=USR1@<seconds>``) makes every rank save a checkpoint at the next step boundary and
    exit cleanly; the next launch resumes from it (``checkpoint.resume=auto``).
    """

    save_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])  # [] : default signal behaviour
    dist_timeout_minutes: float = 30.0  # a collective (NCCL/gloo) waiting longer than this fails the run
    gpu_memory_gib: float = 80.0  # dry_run: the per-GPU memory the layout must fit (H100/A800: 80, H200: 141)


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
    profile: ProfileSection = field(default_factory=ProfileSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    init_from: Optional[str] = None  # weights-only start (previous stage); dense -> NOSA allowed
    # model.* / attention.* fields this stage changes on purpose from what init_from's checkpoint records
    # (e.g. [model.rope_theta]); any other difference is refused
    init_changes: list[str] = field(default_factory=list)
    print_config: bool = False
    dry_run: bool = False

    @property
    def run_dir(self) -> str:
        return self.run.dir or f"runs/{self.recipe}"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _choice(value: str, choices: tuple, name: str) -> None:
    _need(value in choices, f"{name}={value!r} is not one of {choices}")


ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "kv_channels",
                       "ffn_hidden_size", "padded_vocab_size", "tie_embeddings", "use_mup")


def _architecture_diff(cfg: RunConfig, saved) -> list[str]:
    """Differences in shapes, tying and muP between a checkpoint's ``ModelConfig`` and the recipe."""
    return [f"{f}: checkpoint {getattr(saved, f)} vs recipe {getattr(cfg.model, f)}"
            for f in ARCHITECTURE_FIELDS if getattr(saved, f) != getattr(cfg.model, f)]


# Fields of the checkpoint's model config that init_from does not compare: a label, and the initialisation
# of parameters the checkpoint does not hold (new eviction heads)
INIT_UNCOMPARED = ("model.size", "model.init_std")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def init_differences(cfg: RunConfig, saved, saved_attn) -> list[tuple[str, str]]:
    """``(field, "checkpoint X, recipe Y")`` for every field init_from's checkpoint records that the recipe
    changes, besides the shapes (:data:`ARCHITECTURE_FIELDS`). A dense checkpoint may become sparse (the
    next stage's purpose); between sparse models the layer variants and the NOSA geometry are compared."""
    out = []

    def compare(name: str, a, b) -> None:
        if a != b and name not in INIT_UNCOMPARED:
            out.append((name, f"checkpoint {_short(a)}, recipe {_short(b)}"))

    old, new = dataclasses.asdict(saved), dataclasses.asdict(cfg.model)
    for f in old:
        if f not in ARCHITECTURE_FIELDS:
            compare(f"model.{f}", old[f], new.get(f))
    layers = cfg.model.num_layers
    if saved_attn.has_sparse_layers(saved.num_layers):
        compare("attention.layer_pattern" if cfg.attention.layer_pattern or saved_attn.layer_pattern
                else "attention.variant", saved_attn.layer_variants(saved.num_layers),
                cfg.attention.layer_variants(layers))
        if cfg.attention.has_sparse_layers(layers):
            old_n, new_n = dataclasses.asdict(saved_attn.nosa), dataclasses.asdict(cfg.attention.nosa)
            for f in old_n:
                compare(f"attention.nosa.{f}", old_n[f], new_n.get(f))
            compare("attention.eviction_bias", saved_attn.eviction_bias, cfg.attention.eviction_bias)
    return out


def _declared(name: str, changes: list[str]) -> bool:
    return any(name == c or name.startswith(c + ".") for c in changes)


def _field_exists(path: str) -> bool:
    """``model.x`` / ``attention.nosa.y``: a field of the model or attention config."""
    node, parts = RunConfig(), path.split(".")
    if parts[0] not in ("model", "attention"):
        return False
    for part in parts:
        if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
            return False
        node = getattr(node, part)
    return True


def init_from_checkpoint(cfg: RunConfig):
    """The checkpoint ``init_from`` names (None if there is none or it records no model config) and its
    ``(model, attention, extra)`` configs."""
    from runtime.checkpoint_files import find_checkpoint, read_configs

    src = find_checkpoint(cfg.init_from)
    return src, (read_configs(src) if src is not None else None)


def _check_init_from(cfg: RunConfig) -> None:
    """``init_from`` must hold the same architecture (shapes, tying, muP) as the model being built, and every
    other field its checkpoint records must equal the recipe's unless ``init_changes`` names it."""
    bad = [c for c in cfg.init_changes if not _field_exists(c)]
    _need(not bad, f"init_changes has {bad}: name fields of the model or attention config, e.g. "
                   f"[model.rope_theta, attention.nosa.topk]")
    ckpt, got = init_from_checkpoint(cfg)
    _need(ckpt is not None, f"init_from={cfg.init_from!r} holds no complete checkpoint (give a run dir, its "
                            f"checkpoints/ dir, or an iter_* dir)")
    if got is None:
        return  # another tool's checkpoint (checkpoint.allow_unverified): nothing recorded to compare
    diff = _architecture_diff(cfg, got[0])
    _need(not diff, f"init_from={str(ckpt)!r} has another architecture ({'; '.join(diff)}); "
                    f"use the same model.* settings as the stage that wrote it")
    changed = [(n, d) for n, d in init_differences(cfg, got[0], got[1]) if not _declared(n, cfg.init_changes)]
    names = [n for n, _ in changed]
    _need(not changed, f"init_from={str(ckpt)!r}: the recipe changes what the checkpoint records: "
                       f"{'; '.join(f'{n} ({d})' for n, d in changed)}; set them to the checkpoint's values, or "
                       f"train with the change on purpose: init_changes=[{','.join(names)}]")


def init_changes_line(cfg: RunConfig) -> Optional[str]:
    """The one line naming what this stage changes from ``init_from``'s checkpoint (``init_changes``), or None."""
    if not cfg.init_from:
        return None
    try:
        ckpt, got = init_from_checkpoint(cfg)
    except (ValueError, OSError):
        return None
    if got is None:
        return None
    changed = [f"{n} ({d})" for n, d in init_differences(cfg, got[0], got[1]) if _declared(n, cfg.init_changes)]
    if not changed:
        return None
    lr = cfg.model.longrope if cfg.model.rope_type == "longrope" else None
    short = lr is not None and got[0].rope_type != "longrope" and (
        any(f != 1.0 for f in lr.short_factor) or lr.resolved_attention_factor(cfg.model.max_position_embeddings) != 1)
    note = (f"; the LongRoPE short_factor / attention_factor change the model below "
            f"{lr.original_max_position_embeddings} tokens too (python -m train.longrope_init --short original keeps "
            f"it there)") if short else ""
    return f"init_from {ckpt}: changed on purpose (init_changes): {'; '.join(changed)}{note}"


# Settings a resumed run may change (said in one line); any other change alters the training
# trajectory and needs checkpoint.allow_config_change=true.
RESUME_FREE = ("train.max_steps", "train.exit_after_steps", "train.log_interval", "train.eval_interval",
               "train.step_reads", "train.eval_iters", "train.nan_policy", "train.nan_skip_limit",
               "train.locality_interval", "train.gc_interval", "train.fusions", "train.loss_impl",
               "train.loss_chunk_tokens", "optim.fused", "checkpoint.",
               "logging.", "profile.", "parallel.", "cluster.", "run.device", "init_from", "init_changes",
               "print_config", "dry_run", "data.num_builder_threads", "data.cache_dir", "sft.cache_dir", "run.dir",
               "recipe")


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(cfg: RunConfig) -> tuple[list[str], list[str]]:
    """``(free, refused)``: settings that differ from the ``config.yaml`` a resumed run was started with."""
    from pathlib import Path

    import yaml

    path = Path(cfg.run_dir) / "config.yaml"
    if cfg.checkpoint.resume != "auto" or not path.is_file():
        return [], []
    try:
        old = _flatten(yaml.safe_load(path.read_text()) or {})
    except yaml.YAMLError:
        return [], []
    new = _flatten(dataclasses.asdict(cfg))
    free, refused = [], []
    for k in sorted(set(old) & set(new)):  # keys added or removed since are not changes of the run
        if old[k] != new[k]:
            line = f"{k} {old[k]!r} -> {new[k]!r}"
            (free if k.startswith(RESUME_FREE) else refused).append(line)
    return free, refused


def _check_resume(cfg: RunConfig) -> None:
    """A resume must continue the same model, within train.max_steps, with the same trajectory settings."""
    from pathlib import Path

    from runtime.checkpoint_files import CheckpointError, complete_checkpoints, find_checkpoint, read_configs

    root = Path(cfg.run_dir) / "checkpoints"
    try:
        ckpt = find_checkpoint(root)
    except CheckpointError:  # a damaged `latest` is reported (and fallen back from) when the run resumes
        ckpt = next(iter(complete_checkpoints(root)), None)
    try:
        got = read_configs(ckpt) if ckpt is not None else None
    except (ValueError, OSError):
        return  # a damaged checkpoint is reported (and fallen back from) when the run resumes
    if got is None:
        return
    saved, attn, extra = got
    diff = _architecture_diff(cfg, saved)
    if attn.layer_variants(saved.num_layers) != cfg.attention.layer_variants(cfg.model.num_layers):
        diff.append(f"attention: checkpoint {attn.variant} vs recipe {cfg.attention.variant}")
    _need(not diff, f"run.dir={cfg.run_dir} holds checkpoints of another model ({'; '.join(diff)}); choose a new "
                    f"run.dir, or start a new stage from it with init_from={cfg.run_dir}")
    step = extra.get("step")
    _need(step is None or step <= cfg.train.max_steps,
          f"run.dir={cfg.run_dir} is at step {step}, beyond train.max_steps={cfg.train.max_steps}; raise "
          f"train.max_steps to continue, or choose a new run.dir")
    _, refused = config_changes(cfg)
    _need(not refused or cfg.checkpoint.allow_config_change,
          f"resuming run.dir={cfg.run_dir} with settings that change the training trajectory: "
          f"{'; '.join(refused[:4])}{' ...' if len(refused) > 4 else ''}; restore them, choose a new run.dir, or "
          f"set checkpoint.allow_config_change=true")


def _validate_cluster(cfg: RunConfig, world_size: int) -> None:
    """``cluster.*`` and ``parallel.world_size``: known signal names, positive timeout and memory."""
    import signal

    c = cfg.cluster
    bad = [s for s in c.save_signals if not (isinstance(s, str) and s.startswith("SIG") and
                                             isinstance(getattr(signal, s, None), signal.Signals))
           or s in ("SIGKILL", "SIGSTOP")]
    _need(not bad, f"cluster.save_signals has {bad}: give catchable signal names such as [SIGTERM, SIGUSR1], "
                   f"or [] for none")
    _need(c.dist_timeout_minutes > 0, f"cluster.dist_timeout_minutes={c.dist_timeout_minutes} must be > 0")
    _need(c.gpu_memory_gib > 0, f"cluster.gpu_memory_gib={c.gpu_memory_gib} must be > 0")
    ws = cfg.parallel.world_size
    _need(ws is None or ws >= 1, f"parallel.world_size={ws} must be >= 1 or null")
    _need(ws is None or ws == world_size,
          f"parallel.world_size={ws} but {world_size} processes were started; launch {ws} processes "
          f"(torchrun --nnodes * --nproc_per_node) or drop parallel.world_size")


def validate(cfg: RunConfig, world_size: int = 1, check_files: bool = True,
             check_init: Optional[bool] = None) -> RunConfig:
    """Every cross-field rule of a run, for ``world_size`` processes. Returns ``cfg``. ``check_files``: read
    the data, the run dir and ``init_from``; ``check_init`` (default: ``check_files``): compare ``init_from``'s
    checkpoint with the recipe (the dry run does, without the other files)."""
    p, t, o = cfg.parallel, cfg.train, cfg.optim
    _choice(cfg.run.device, DEVICES, "run.device")
    _choice(cfg.stage.kind, STAGES, "stage.kind")
    _choice(t.precision, PRECISIONS, "train.precision")
    _choice(t.recompute, RECOMPUTE, "train.recompute")
    _choice(t.transformer_impl, TRANSFORMER_IMPLS, "train.transformer_impl")
    if t.transformer_impl == "te":
        from nosa_layers.megatron.spec import have_te

        _need(have_te(), "train.transformer_impl=te but Transformer Engine is not importable; install it "
                         "(pip install -e .[te]) or use train.transformer_impl=local")
    _choice(t.nan_policy, NAN_POLICIES, "train.nan_policy")
    _choice(t.loss_impl, LOSS_IMPLS, "train.loss_impl")
    _need(t.loss_chunk_tokens >= 1, f"train.loss_chunk_tokens={t.loss_chunk_tokens} must be >= 1")
    _need(t.loss_impl != "chunked" or t.precision != "fp16",
          "train.loss_impl=chunked computes the logit gradients in the forward, before fp16's loss scale applies "
          "(they would underflow in fp16); use train.loss_impl=fused or standard with train.precision=fp16, or bf16")
    _choice(o.schedule, SCHEDULES, "optim.schedule")
    _choice(o.wsd_decay_style, WSD_DECAY_STYLES, "optim.wsd_decay_style")
    _choice(cfg.logging.wandb, WANDB_MODES, "logging.wandb")
    _choice(cfg.checkpoint.resume, RESUME, "checkpoint.resume")
    _choice(cfg.checkpoint.on_corrupt, ON_CORRUPT, "checkpoint.on_corrupt")

    _validate_cluster(cfg, world_size)
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
    _need(t.nan_skip_limit > 0, f"train.nan_skip_limit={t.nan_skip_limit} must be > 0")
    _need(t.log_interval > 0, f"train.log_interval={t.log_interval} must be > 0")
    _choice(t.step_reads, STEP_READS, "train.step_reads")
    _need(t.step_reads != "at_log" or (o.fused and t.precision != "fp16"),
          "train.step_reads=at_log skips a non-finite update on the device through torch's fused AdamW: it needs "
          "optim.fused=true and a precision other than fp16 (whose loss scaler reads on the host)")
    if cfg.logging.tensorboard:
        from train.metrics import tensorboard_missing

        _need(tensorboard_missing() is None, tensorboard_missing() or "")
    _need(cfg.profile.start_step >= 0 and cfg.profile.num_steps >= 1,
          f"profile.start_step={cfg.profile.start_step} must be >= 0 (0: off) and profile.num_steps="
          f"{cfg.profile.num_steps} >= 1")
    _need(t.gc_interval >= 0, f"train.gc_interval={t.gc_interval} must be >= 0 (0: Python's automatic GC)")
    _need(t.eval_interval >= 0 and t.eval_iters >= 0, "train.eval_interval and train.eval_iters must be >= 0")
    _need(o.lr > 0 and 0 <= o.min_lr <= o.lr, f"need 0 <= optim.min_lr ({o.min_lr}) <= optim.lr ({o.lr}) and lr > 0")
    _need(0 <= o.warmup_steps < t.max_steps,
          f"optim.warmup_steps={o.warmup_steps} must be < train.max_steps={t.max_steps}")
    _need(0 < o.wsd_decay_fraction <= 1, f"optim.wsd_decay_fraction={o.wsd_decay_fraction} must be in (0, 1]")
    _need(o.eviction_lr_mult > 0, f"optim.eviction_lr_mult={o.eviction_lr_mult} must be > 0")
    _need(cfg.checkpoint.interval >= 0 and cfg.checkpoint.keep_last >= 0,
          "checkpoint.interval and checkpoint.keep_last must be >= 0")
    _need(p.sequence_parallel is False or p.tensor_model_parallel_size > 1,
          "parallel.sequence_parallel=true needs tensor_model_parallel_size > 1")

    _need(cfg.run.device != "cuda" or _cuda_available(),
          "run.device=cuda but CUDA is not available here; use run.device=cpu or auto")
    if check_files and cfg.checkpoint.resume == "auto":
        _check_resume(cfg)
    if cfg.init_from and (check_files if check_init is None else check_init):
        _check_init_from(cfg)
    validate_model(cfg.model, cfg.attention, p.model_parallel(), seq_length=t.seq_length)
    data = cfg.sft if cfg.stage.kind == "sft" else cfg.data
    _need(data.seq_length == t.seq_length,
          f"{'sft' if cfg.stage.kind == 'sft' else 'data'}.seq_length={data.seq_length} differs from "
          f"train.seq_length={t.seq_length}; set them equal (recipes use ${{train.seq_length}})")
    _need(data.micro_batch_size == t.micro_batch_size,
          f"data micro_batch_size={data.micro_batch_size} differs from train.micro_batch_size={t.micro_batch_size}")
    from data.config import validate as validate_data

    if check_files or getattr(data, "paths", None) or getattr(data, "path", None):
        validate_data(dataclasses.replace(data, model_vocab_size=cfg.model.vocab_size), dp_size=dp,
                      check_files=check_files)
    return cfg
