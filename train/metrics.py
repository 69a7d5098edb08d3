"""Run metrics: console progress, ``metrics.jsonl``, Weights & Biases, TensorBoard, loss-curve PNG,
FLOPs/MFU, and the interval statistics a logged row reports.

Only the rank that owns the loss (last pipeline stage, first TP/DP rank) writes; the JSONL file
has one JSON object per logged step with at least ``step, loss, lr, grad_norm, tokens_per_s``.
``loss`` is the mean over the steps since the previous logged row (the loss of each step is
already the per-token mean over the whole global batch, i.e. over all DP ranks), ``step_time_s``
and ``tokens_per_s`` are interval means, ``eta_s`` is the remaining steps times the mean step time,
``peak_mem_gib`` is the largest peak of any rank (all-reduce MAX), ``attention_work`` the interval
mean of :func:`causal_attention_work` of the loss-owning rank's micro-batches (what makes step
times of packed-document runs vary).
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
from pathlib import Path

import torch
import torch.distributed as dist

from nosa_layers.megatron.config import AttentionConfig, ModelConfig
from runtime.outputs import NotARegularFile, atomic_path, not_a_file, open_in_place, write_atomic
from runtime.run_metrics import METRICS, read_metrics

# Dense bf16 peak TFLOP/s of common training GPUs (tensor cores, no sparsity).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A800": 312.0, "A100": 312.0, "L40S": 362.0}


def peak_flops(device: torch.device) -> float | None:
    """Peak FLOP/s of one device, or None where MFU is not meaningful (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


def attended_keys_per_query(seq_len: int, budget_tokens: int | None) -> float:
    """Mean number of keys a causal query attends to (all causal keys, or at most the budget)."""
    if budget_tokens is None or budget_tokens >= seq_len:
        return (seq_len + 1) / 2
    b = budget_tokens
    return (b * (b + 1) / 2 + (seq_len - b) * b) / seq_len


def train_flops_per_token(model: ModelConfig, attn: AttentionConfig, seq_len: int) -> float:
    """Useful training FLOPs per token (forward + backward = 3x forward), Megatron-style count.

    Matmuls: 6 * (weights touched per token). Attention: 6 * 2 * Hq * D * (keys attended) per layer,
    with NOSA layers attending at most ``topk * block_size`` keys.
    """
    h, d, hq, hkv = model.hidden_size, model.kv_channels, model.num_attention_heads, model.num_kv_heads
    per_layer_weights = h * (hq * d) * 2 + h * (hkv * d) * 2 + 3 * h * model.ffn_hidden_size
    flops = 6 * (model.num_layers * per_layer_weights + h * model.padded_vocab_size)
    for variant in attn.layer_variants(model.num_layers):
        budget = None if variant == "dense" else attn.nosa.topk * attn.nosa.block_size
        flops += 6 * 2 * hq * d * attended_keys_per_query(seq_len, budget)
    return float(flops)


def causal_attention_work(batches: list[dict]) -> float:
    """The causal attention work of a step's CPU micro-batches relative to one document per row: the
    mean over rows of ``sum_d len_d**2 / S**2`` (1.0 for rows without ``cu_seqlens``, i.e. EOD packing;
    ``1 / n`` for ``n`` equal documents). Dense attention with document masking costs about this
    share of a full causal pass, so step times of packed-document runs follow it. One vectorised pass per
    micro-batch: the right padding of ``cu_seqlens`` repeats S, so its zero-length segments add nothing."""
    shares = []
    for batch in batches:
        rows, S = batch["tokens"].shape
        if "cu_seqlens" not in batch:
            shares += [1.0] * rows
            continue
        lens = batch["cu_seqlens"].diff(dim=1).double()
        shares += ((lens * lens).sum(dim=1) / S**2).tolist()
    return math.fsum(shares) / max(len(shares), 1)


class IntervalStats:
    """Per-step values between two logged rows; :meth:`flush` returns their means and starts anew."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.times: list[float] = []
        self.work: list[float] = []

    def add(self, loss: float, step_time_s: float, attention_work: float | None = None) -> None:
        """One optimizer step: its loss (non-finite losses are left out of the mean), wall time (s) and
        :func:`causal_attention_work` of its batches (where known)."""
        if math.isfinite(loss):
            self.losses.append(loss)
        self.times.append(step_time_s)
        if attention_work is not None:
            self.work.append(attention_work)

    def flush(self, tokens_per_step: int, steps_left: int) -> dict:
        """``loss`` (mean over finite steps; NaN if none), ``step_time_s``, ``tokens_per_s``, ``eta_s``
        and, where recorded, ``attention_work`` (their means)."""
        n = max(len(self.times), 1)
        dt = math.fsum(self.times) / n
        out = {"loss": math.fsum(self.losses) / len(self.losses) if self.losses else float("nan"),
               "step_time_s": dt, "tokens_per_s": tokens_per_step / dt if dt > 0 else float("nan"),
               "eta_s": dt * steps_left}
        if self.work:
            out["attention_work"] = math.fsum(self.work) / len(self.work)
        self.losses, self.times, self.work = [], [], []
        return out


def local_peak_memory_gib(device: torch.device) -> float:
    """This process's peak memory in GiB: CUDA ``max_memory_allocated`` on a GPU, peak RSS on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def max_over_ranks(value: float, device: torch.device, group=None) -> float:
    """The largest ``value`` of all ranks of ``group`` (all-reduce MAX; every rank must call it). With one rank
    it is ``value`` itself: no device round trip (the per-step preemption agreement would otherwise wait for
    the GPU's queue every step)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t[0])


def format_eta(seconds: float) -> str:
    """``1d02h03m`` / ``2h03m`` / ``3m04s`` / ``5s``."""
    if not math.isfinite(seconds):
        return "-"
    s = round(seconds)
    d, h, m = s // 86400, s // 3600 % 24, s // 60 % 60
    if d:
        return f"{d}d{h:02d}h{m:02d}m"
    if h:
        return f"{h}h{m:02d}m"
    return f"{m}m{s % 60:02d}s" if m else f"{s}s"


WANDB_ID_FILE = "wandb_id"


def format_row(r: dict, max_steps: int) -> str:
    """The console line of one logged step (``r``: the row the metrics logger writes)."""
    parts = [f"step {r['step']:>6}/{max_steps}", f"loss {r['loss']:.4f}" if r.get("loss") is not None else "loss -",
             f"lr {r['lr']:.3e}"]
    if r.get("grad_norm") is not None:
        parts.append(f"grad_norm {r['grad_norm']:.3f}")
    parts.append(f"{r['tokens_per_s']:.0f} tok/s")
    if r.get("eta_s") is not None:
        parts.append(f"ETA {format_eta(r['eta_s'])}")
    if r.get("mfu") is not None:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    if r.get("peak_mem_gib") is not None:
        parts.append(f"peak {r['peak_mem_gib']:.1f} GiB")
    if r.get("val_loss") is not None:
        parts.append(f"val_loss {r['val_loss']:.4f}")
    if r.get("nosa_gamma_mean") is not None:
        parts.append(f"NOSA gamma {r['nosa_gamma_mean']:.3f} (min {r['nosa_gamma_min']:.3f}, "
                     f"{r['nosa_fetched_per_step']:.2f} fetches/step)")
    if r.get("skipped"):
        parts.append("SKIPPED")
    return " | ".join(parts)


def wandb_run_id(run_dir: str, name: str, resumed: bool) -> str:
    """The W&B run id of ``run_dir``: kept in ``<run_dir>/wandb_id`` and reused when the run resumes
    from its own checkpoint (``resumed``); otherwise a new unique id ``<name>-<8 hex>`` is written, so
    sweeps, resubmissions into new run dirs and restarts from scratch are separate W&B runs."""
    path = Path(run_dir) / WANDB_ID_FILE
    if resumed and path.is_file():
        rid = path.read_text().strip()
        if rid:
            return rid
    rid = f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)[:48]}-{secrets.token_hex(4)}"
    write_atomic(path, rid + "\n")
    return rid


WANDB_OUTPUT_ENV = ("WANDB_SILENT", "WANDB_QUIET", "WANDB_SHOW_INFO")


def wandb_silent(mode: str) -> bool:
    """Whether an offline W&B session runs silent (no banner, run history or summary: about 20 lines per job,
    none asking for anything; W&B's warnings and errors still show) with :func:`wandb_offline_line` instead:
    not online (the run's page is W&B's own line) and not when the user set how W&B prints (``WANDB_SILENT``,
    ``WANDB_QUIET``, ``WANDB_SHOW_INFO``)."""
    return mode == "offline" and not any(k in os.environ for k in WANDB_OUTPUT_ENV)


def wandb_offline_line(sync_dir: str) -> str:
    """The one line left of an offline W&B session: where the run lives and how to upload it."""
    return f"wandb: offline run in {sync_dir} (upload it with: wandb sync {sync_dir})"


def tensorboard_missing() -> str | None:
    """Why ``logging.tensorboard=true`` cannot work here (one line), or None."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        return ("logging.tensorboard=true but the tensorboard package is not installed; pip install tensorboard, "
                "or set logging.tensorboard=false")
    return None


class RunFileError(RuntimeError):
    """A file the trainer writes in the run dir is something else: a symbolic link (never written through), a
    directory, or not the trainer's format (one-line message)."""


def check_metrics_file(run_dir: str) -> list[dict]:
    """The rows of ``<run_dir>/metrics.jsonl`` the trainer may rewrite; :class:`RunFileError` when it is not a
    metrics file of this trainer (a link, a directory, another file under that name)."""
    path = Path(run_dir) / METRICS
    what = not_a_file(path)
    if what is not None:
        raise RunFileError(f"{path} is {what}, not the metrics file this trainer writes (it never writes through a "
                           f"link or into anything else): remove it, or choose another run.dir")
    try:
        return read_metrics(run_dir)
    except ValueError as e:
        raise RunFileError(f"{e}: move it away, or choose another run.dir") from None


class MetricsLogger:
    """Writes metrics on the owning rank; a no-op elsewhere."""

    def __init__(self, run_dir: str, enabled: bool, wandb_mode: str = "disabled",
                 wandb_project: str = "nosa-train", run_name: str = "run", config: dict | None = None,
                 resume_step: int = 0, tensorboard: bool = False):
        self.enabled = enabled
        self.path = Path(run_dir) / METRICS
        self.history: list[dict] = []
        self._wandb = None
        self._tb = None
        self.wandb_id = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        rows = check_metrics_file(run_dir)
        if self.path.exists():  # a resumed run keeps what was logged up to its checkpoint
            self.history = [r for r in rows if r.get("step", 0) <= resume_step]
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in self.history))
        if wandb_mode != "disabled":
            import wandb

            self.wandb_id = wandb_run_id(run_dir, run_name, resumed=resume_step > 0)
            silent = wandb_silent(wandb_mode)
            self._wandb = wandb.init(project=wandb_project, name=f"{run_name} ({Path(run_dir).name})",
                                     mode=wandb_mode, dir=run_dir, config=config, resume="allow", id=self.wandb_id,
                                     settings=wandb.Settings(silent=True) if silent else None)
            if silent:
                print(wandb_offline_line(self._wandb.settings.sync_dir), flush=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), purge_step=resume_step + 1)

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        row = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self.history.append(row)
        try:
            fd = open_in_place(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        except NotARegularFile as e:  # replaced by something else while the run went on
            raise RunFileError(f"{e}: the trainer never writes through a link or into anything else") from None
        with os.fdopen(fd, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=row["step"])
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None:
                    self._tb.add_scalar(k, v, global_step=row["step"])

    def plot(self, out: Path | None = None) -> Path | None:
        """Loss curve (train, and validation where logged) as a PNG next to metrics.jsonl."""
        if not self.enabled or not self.history:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        out = out or self.path.with_name("loss.png")
        train = [(r["step"], r["loss"]) for r in self.history if r.get("loss") is not None]
        valid = [(r["step"], r["val_loss"]) for r in self.history if r.get("val_loss") is not None]
        fig, ax = plt.subplots(figsize=(7, 4))
        if train:
            ax.plot(*zip(*train), label="train loss")
        if valid:
            ax.plot(*zip(*valid), "o-", label="validation loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(str(self.path.parent))
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        with atomic_path(out) as tmp:  # a rename: never written through a link at ``out``
            fig.savefig(tmp, dpi=110)
        plt.close(fig)
        return out

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()
