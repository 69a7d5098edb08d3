"""Run metrics: console progress, ``metrics.jsonl``, Weights & Biases, loss-curve PNG, FLOPs/MFU.

Only the rank that owns the loss (last pipeline stage, first TP/DP rank) writes; the JSONL file
has one JSON object per logged step with at least ``step, loss, lr, grad_norm, tokens_per_s``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from nosa_layers.megatron.config import AttentionConfig, ModelConfig

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


class MetricsLogger:
    """Writes metrics on the owning rank; a no-op elsewhere."""

    def __init__(self, run_dir: str, enabled: bool, wandb_mode: str = "disabled",
                 wandb_project: str = "nosa-train", run_name: str = "run", config: dict | None = None,
                 resume_step: int = 0):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.history: list[dict] = []
        self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():  # a resumed run keeps what was logged up to its checkpoint
            rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
            self.history = [r for r in rows if r.get("step", 0) <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in self.history))
        if wandb_mode != "disabled":
            import wandb

            self._wandb = wandb.init(project=wandb_project, name=run_name, mode=wandb_mode, dir=run_dir,
                                     config=config, resume="allow", id=run_name.replace("/", "_"))

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        row = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self.history.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=row["step"])

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
        fig.savefig(out, dpi=110)
        plt.close(fig)
        return out

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
