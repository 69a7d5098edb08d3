"""Whole-document packing of indexed datasets (``data.packing=best_fit``).

Megatron's GPT datasets (``packing=document`` / ``eod``) cut the concatenated token stream every
``S`` tokens, so a document usually straddles two samples: a retrieval document whose question and
answer land in another sample than its needle teaches the model to answer without the evidence.
Best-fit packing (Ding et al., 2024, "Fewer Truncations Improve Language Modeling") keeps every
document of at most ``S`` tokens whole: each epoch the documents are shuffled and placed by
:func:`data.packing.best_fit` into rows of ``S`` tokens (the rest of a row is padding with no loss);
longer documents are cut into pieces of ``S`` tokens first. Rows carry ``cu_seqlens`` (attention
and positions restart per document), exactly like ``packing=document`` batches.

Blends: ``data.weights`` are token shares, as in a megatron blend. An epoch holds as many tokens as
one pass over the training parts of all paths; path ``p`` fills ``share_p`` of them, i.e. each of its
documents appears ``r_p = share_p * total / tokens_p`` times (the fractional part: a random subset,
drawn anew every epoch). Without weights every document appears once per epoch.
A path with ``<prefix>.loss_from.npy`` (:mod:`data.loss_spans`) trains each of its documents only
from that token on (e.g. the answers of retrieval documents); the rest is context.
``data.split`` is applied per path by document index, as megatron-core does (the validation part is
the same range of documents, so evaluation tools find the same held-out documents).

State (exact resume): ``epoch`` and the rows consumed in it; a step takes ``B * D`` consecutive
rows (micro-batch ``m`` of DP rank ``r`` holds rows ``m*B*D + r*B + j``), the tail of an epoch that
does not fill a step is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data.epoch_rows import EpochRows
from data.indexed import SPLIT_NAMES, split_ranges  # noqa: F401 (re-exported)
from data.packing import assemble_row, best_fit

@dataclass
class Pieces:
    """The packable units of one split part: ``(path, document, offset, length)`` per piece; a
    document longer than ``S`` is several pieces. ``tokens[p]``: tokens of path ``p``."""

    path: np.ndarray
    doc: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    tokens: list[int]


def document_pieces(datasets: list, part: str, split: str, seq_length: int) -> Pieces:
    """Cut the documents of split part ``part`` of every dataset into pieces of at most ``seq_length``."""
    cols: list[list[np.ndarray]] = [[], [], [], []]
    tokens = []
    for p, ds in enumerate(datasets):
        r = split_ranges(split, len(ds.sequence_lengths))[part]
        lens = np.asarray(ds.sequence_lengths[r.start:r.stop], dtype=np.int64)
        docs = np.arange(r.start, r.stop, dtype=np.int64)
        tokens.append(int(lens.sum()))
        n_pieces = np.maximum(1, -(-lens // seq_length))
        doc = np.repeat(docs, n_pieces)
        first = np.repeat(np.cumsum(n_pieces) - n_pieces, n_pieces)
        k = np.arange(doc.size) - first  # piece number inside its document
        offset = k * seq_length
        length = np.minimum(seq_length, np.repeat(lens, n_pieces) - offset)
        keep = length > 0
        for c, v in zip(cols, (np.full(doc.size, p), doc, offset, length)):
            c.append(v[keep])
    cat = [np.concatenate(c) if c else np.zeros(0, np.int64) for c in cols]
    return Pieces(*cat, tokens=tokens)


def repetitions(tokens: list[int], weights: list[float] | None) -> list[float]:
    """Times each path's documents appear per epoch for token shares ``weights`` (None: once each)."""
    if weights is None:
        return [1.0] * len(tokens)
    total, wsum = sum(tokens), float(sum(weights))
    return [0.0 if t == 0 else (w / wsum) * total / t for w, t in zip(weights, tokens)]


class BestFitLoader(EpochRows):
    """Rows of whole documents for one DP rank; reshuffled and repacked every epoch.

    ``datasets``: megatron-core ``IndexedDataset`` objects (one per path), ``pieces`` from
    :func:`document_pieces`, ``reps`` from :func:`repetitions`. Yields the batch dict of
    :func:`data.packing.collate` (``cu_seqlens`` always present)."""

    def __init__(self, datasets: list, pieces: Pieces, reps: list[float], seq_length: int, micro_batch_size: int,
                 pad_id: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 1234, fingerprint: dict | None = None,
                 what: str = "training", loss_from: list | None = None):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        self.datasets, self.pieces, self.reps = datasets, pieces, list(reps)
        self.loss_from = loss_from or [None] * len(datasets)  # per path: first trained token of each document
        self.S, self.B, self.pad_id = seq_length, micro_batch_size, pad_id
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.fingerprint = dict(fingerprint or {}, pieces=int(pieces.length.size), reps=[round(r, 9) for r in reps])
        self._start(what, f" of {self.S} tokens")

    def _epoch_order(self, rng: np.random.Generator) -> np.ndarray:
        parts = []
        for p, r in enumerate(self.reps):
            idx = np.flatnonzero(self.pieces.path == p)
            whole, frac = int(r), r - int(r)
            parts += [idx] * whole
            if frac > 0 and idx.size:
                parts.append(rng.choice(idx, size=int(round(frac * idx.size)), replace=False))
        order = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return order[rng.permutation(order.size)]

    def _build_rows(self, epoch: int) -> list[list[int]]:
        order = self._epoch_order(np.random.default_rng([self.seed, epoch]))
        return [[int(order[j]) for j in b] for b in best_fit(self.pieces.length[order].tolist(), self.S)]

    def _piece(self, i: int) -> np.ndarray:
        pc = self.pieces
        return self.datasets[int(pc.path[i])].get(int(pc.doc[i]), offset=int(pc.offset[i]),
                                                  length=int(pc.length[i])).astype(np.int64)

    def _mask(self, i: int) -> np.ndarray:
        """Target mask of piece ``i``: 1 from its document's loss start on (all 1 without one)."""
        pc = self.pieces
        n, starts = int(pc.length[i]), self.loss_from[int(pc.path[i])]
        if starts is None:
            return np.ones(n, dtype=np.uint8)
        return (np.arange(int(pc.offset[i]), int(pc.offset[i]) + n) >= starts[int(pc.doc[i])]).astype(np.uint8)

    def _assemble(self, row: list[int]) -> dict:
        return assemble_row([self._piece(i) for i in row], [self._mask(i) for i in row], self.S, self.pad_id)

    def fill(self) -> float:
        """Share of the current epoch's row tokens that are document tokens (not padding)."""
        rows = self._epoch_rows()
        return float(sum(int(self.pieces.length[i]) for r in rows for i in r)) / max(1, len(rows) * self.S)

    def state_dict(self) -> dict:
        return {"kind": "best_fit", "epoch": self.epoch, "consumed_rows": self.consumed_rows,
                "fingerprint": self.fingerprint}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("kind") != "best_fit":
            raise ValueError(f"loader state is of kind {sd.get('kind')!r}, expected 'best_fit'")
        if sd.get("fingerprint") != self.fingerprint:
            raise ValueError(f"loader state was saved for data {sd.get('fingerprint')} but this loader has "
                             f"{self.fingerprint}: same paths/weights/split/seq_length/seed needed to resume")
        self.epoch, self.consumed_rows = int(sd["epoch"]), int(sd["consumed_rows"])


def build_best_fit_loaders(cfg, dp_rank: int, dp_size: int, tok) -> tuple[BestFitLoader, BestFitLoader | None]:
    """``(train, valid or None)`` for a validated ``DataConfig`` with ``packing=best_fit``."""
    from data.indexed import read_indexed
    from data.loss_spans import read_loss_from

    datasets = [read_indexed(p) for p in cfg.paths]
    loss_from = [read_loss_from(p, len(ds.sequence_lengths)) for p, ds in zip(cfg.paths, datasets)]
    pad = tok.pad if tok.pad >= 0 else tok.eod
    fp = {"paths": list(cfg.paths), "weights": cfg.weights, "seq_length": cfg.seq_length, "seed": cfg.seed,
          "split": cfg.split, "packing": cfg.packing}
    train_pieces = document_pieces(datasets, "train", cfg.split, cfg.seq_length)
    if train_pieces.length.size == 0:
        raise ValueError(f"data.split={cfg.split!r} gives no training documents")
    train = BestFitLoader(datasets, train_pieces, repetitions(train_pieces.tokens, cfg.weights), cfg.seq_length,
                          cfg.micro_batch_size, pad, dp_rank, dp_size, cfg.seed, fp, loss_from=loss_from)
    valid_pieces = document_pieces(datasets, "valid", cfg.split, cfg.seq_length)
    valid = None
    n_valid_rows = len(best_fit(valid_pieces.length.tolist(), cfg.seq_length)) if valid_pieces.length.size else 0
    if n_valid_rows >= cfg.micro_batch_size * dp_size:
        valid = BestFitLoader(datasets, valid_pieces, [1.0] * len(datasets), cfg.seq_length, cfg.micro_batch_size,
                              pad, dp_rank, dp_size, cfg.seed, {**fp, "split_name": "valid"}, what="validation",
                              loss_from=loss_from)
    return train, valid
