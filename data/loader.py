"""Stateful, DP-sharded loaders yielding training batches; exact resume via ``state_dict``.

Batch keys (B = micro_batch_size, S = seq_length): ``tokens, labels, position_ids [B,S] int64``,
``loss_mask [B,S] float32``; packed/document mode adds ``cu_seqlens [B,K] int32`` (right-padded with
S), ``cu_seqlens_len [B] int32`` and ``max_seqlen`` (int) -- see :mod:`data.packing`. Blends add
``dataset_id [B] int64``.

Sharding: micro-batch m of DP rank r holds global samples ``m*B*D + r*B + j`` (D = dp_size, j < B),
so the D ranks of one step together read one contiguous global batch of B*D samples.
State = the number of *global* samples consumed, so a resume (even with another D) continues at
exactly the next unread sample.
"""

from __future__ import annotations

import random
from typing import Optional

import torch

from data.config import DataConfig, SFTConfig, validate
from data.epoch_rows import EpochRows
from data.packing import assemble_row, best_fit, collate


def _check_rank(dp_rank: int, dp_size: int) -> None:
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")


class PretrainLoader:
    """Iterates a megatron-core GPT/Blended dataset (map-style) in micro-batches for one DP rank.

    Wraps around (modulo dataset length) when the indexed samples run out; size ``train_samples``
    to cover the run for a fresh shuffle per epoch.
    """

    def __init__(self, dataset, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 fingerprint: Optional[dict] = None):
        _check_rank(dp_rank, dp_size)
        if len(dataset) == 0:
            raise ValueError("the dataset split has no samples: use more data, a shorter seq_length or another split")
        self.dataset = dataset
        self.B, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.consumed_samples = 0
        self.fingerprint = dict(fingerprint or {}, num_samples=len(dataset))

    def __iter__(self):
        return self

    def __len__(self) -> int:
        """Micro-batches per pass over the indexed samples (per rank)."""
        return len(self.dataset) // (self.B * self.dp_size)

    def sample_indices(self, consumed: int) -> list[int]:
        base = consumed + self.dp_rank * self.B
        return [(base + j) % len(self.dataset) for j in range(self.B)]

    def __next__(self) -> dict:
        rows = [self._convert(self.dataset[i]) for i in self.sample_indices(self.consumed_samples)]
        self.consumed_samples += self.B * self.dp_size
        return collate(rows)

    @staticmethod
    def _convert(s: dict) -> dict:
        row = {k: s[k] for k in ("tokens", "labels", "loss_mask", "position_ids")}
        if "cu_seqlens" in s:  # megatron pads cu_seqlens to S+1 with S; keep the valid prefix
            cu = s["cu_seqlens"]
            S = row["tokens"].shape[0]
            n = int(torch.nonzero(cu == S)[0]) + 1
            row["cu_seqlens"] = cu = cu[:n]
            if n > 2:  # a document's last token never learns the next document's first token,
                row["loss_mask"] = lm = row["loss_mask"].clone()  # even in .bin files without EOD
                lm[cu[1:-1].long() - 1] = 0.0
        return row if "dataset_id" not in s else {**row, "dataset_id": s["dataset_id"]}

    def reset(self) -> None:
        """Restart at sample 0 (e.g. before each validation pass)."""
        self.consumed_samples = 0

    def state_dict(self) -> dict:
        return {"kind": "pretrain", "consumed_samples": self.consumed_samples, "fingerprint": self.fingerprint}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("kind") != "pretrain":
            raise ValueError(f"loader state is of kind {sd.get('kind')!r}, expected 'pretrain'")
        if sd.get("fingerprint") != self.fingerprint:
            raise ValueError(f"loader state was saved for data {sd.get('fingerprint')} but this loader has "
                             f"{self.fingerprint}: same paths/weights/seq_length/seed/samples needed to resume")
        self.consumed_samples = int(sd["consumed_samples"])


def build_pretrain_loaders(cfg: DataConfig, dp_rank: int = 0, dp_size: int = 1, tokenizer=None):
    """Validate ``cfg`` and return ``(train_loader, valid_loader_or_None)``; all DP ranks must call it."""
    from data.indexed import build_gpt_splits
    from data.tokenizer import Tokenizer

    validate(cfg, dp_size)
    tok = tokenizer or Tokenizer(cfg.tokenizer)
    tok.check_model_vocab(cfg.model_vocab_size)
    if cfg.packing == "best_fit":
        from data.best_fit_loader import build_best_fit_loaders

        return build_best_fit_loaders(cfg, dp_rank, dp_size, tok)
    train, valid, _ = build_gpt_splits(cfg, tok)
    fp = {"paths": list(cfg.paths), "weights": cfg.weights, "seq_length": cfg.seq_length, "seed": cfg.seed,
          "split": cfg.split, "packing": cfg.packing}
    if train is None:
        raise ValueError(f"data.split={cfg.split!r} gives no training split")
    tl = PretrainLoader(train, cfg.micro_batch_size, dp_rank, dp_size, fp)
    vl = PretrainLoader(valid, cfg.micro_batch_size, dp_rank, dp_size, {**fp, "split_name": "valid"}) \
        if valid is not None and len(valid) > 0 else None
    return tl, vl


class SFTLoader(EpochRows):
    """Packed (or one-per-row) SFT batches for one DP rank; reshuffled and repacked every epoch.

    Epoch e: conversations in ``random.Random(seed + e)`` order, best-fit packed into rows of S
    tokens; a step takes B*D consecutive rows (the tail that does not fill a step is dropped).
    ``weights`` (one per input, see ``SFTConfig``): each input's conversations appear ``w`` times per
    epoch (the fractional part a random subset, drawn anew per epoch).
    """

    def __init__(self, data, seq_length: int, micro_batch_size: int, pad_id: int, dp_rank: int = 0,
                 dp_size: int = 1, pack: bool = True, seed: int = 1234, weights: list[float] | None = None,
                 what: str = "training"):
        _check_rank(dp_rank, dp_size)
        self.data, self.S, self.B = data, seq_length, micro_batch_size
        self.pad_id, self.dp_rank, self.dp_size, self.pack, self.seed = pad_id, dp_rank, dp_size, pack, seed
        self.weights = list(weights) if weights is not None else None
        self.stats = dict(getattr(data, "stats", {}))  # truncated / dropped / skipped counts
        self._start(what)

    def _epoch_order(self, rng: random.Random) -> list[int]:
        n = len(self.data.ids)
        if self.weights is None:
            order = list(range(n))
        else:
            by_src: dict[int, list[int]] = {}
            for i, s in enumerate(self.data.sources[:n]):
                by_src.setdefault(int(s), []).append(i)
            order = []
            for s, w in enumerate(self.weights):
                idx = by_src.get(s, [])
                whole, frac = int(w), w - int(w)
                order += idx * whole + rng.sample(idx, round(frac * len(idx)))
        rng.shuffle(order)
        return order

    def _build_rows(self, epoch: int) -> list[list[int]]:
        order = self._epoch_order(random.Random(self.seed + epoch))
        if not self.pack:
            return [[i] for i in order]
        return [[order[j] for j in b] for b in best_fit([len(self.data.ids[i]) for i in order], self.S)]

    def _assemble(self, row: list[int]) -> dict:
        return assemble_row([self.data.ids[i] for i in row], [self.data.masks[i] for i in row], self.S, self.pad_id)

    def state_dict(self) -> dict:
        return {"kind": "sft", "epoch": self.epoch, "consumed_rows": self.consumed_rows,
                "fingerprint": self._fingerprint()}

    def _fingerprint(self) -> dict:
        fp = {"n": len(self.data.ids), "tokens": int(sum(len(x) for x in self.data.ids)), "S": self.S,
              "pack": self.pack, "seed": self.seed}
        return fp if self.weights is None else {**fp, "weights": self.weights}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("kind") != "sft":
            raise ValueError(f"loader state is of kind {sd.get('kind')!r}, expected 'sft'")
        if sd.get("fingerprint") != self._fingerprint():
            raise ValueError(f"SFT loader state was saved for data {sd.get('fingerprint')} "
                             f"but this loader has {self._fingerprint()}")
        self.epoch, self.consumed_rows = int(sd["epoch"]), int(sd["consumed_rows"])


def build_sft_loaders(cfg: SFTConfig, dp_rank: int = 0, dp_size: int = 1, tokenizer=None,
                      log=None) -> tuple[SFTLoader, SFTLoader | None]:
    """Validate ``cfg``, tokenize the conversations once (cached; see :mod:`data.sft_cache`) and
    return ``(train_loader, valid_loader_or_None)`` (``sft.val_fraction`` held out by ``seed``).
    Every rank of the process group must call it."""
    from data.sft import split_validation
    from data.sft_cache import load_sft_cached
    from data.tokenizer import Tokenizer

    validate(cfg, dp_size)
    tok = tokenizer or Tokenizer(cfg.tokenizer)
    train, valid = split_validation(load_sft_cached(cfg, tok, log=log), cfg.val_fraction, cfg.seed)
    pad = tok.pad if tok.pad >= 0 else tok.eod
    tl = SFTLoader(train, cfg.seq_length, cfg.micro_batch_size, pad, dp_rank, dp_size, cfg.pack, cfg.seed, cfg.weights)
    vl = SFTLoader(valid, cfg.seq_length, cfg.micro_batch_size, pad, dp_rank, dp_size, cfg.pack, cfg.seed,
                   what="validation (sft.val_fraction)") if valid is not None else None
    return tl, vl


def build_sft_loader(cfg: SFTConfig, dp_rank: int = 0, dp_size: int = 1, tokenizer=None, log=None) -> SFTLoader:
    """The training loader of :func:`build_sft_loaders`."""
    return build_sft_loaders(cfg, dp_rank, dp_size, tokenizer, log)[0]
