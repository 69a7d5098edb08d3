"""Per-document loss starts of an indexed dataset: ``<prefix>.loss_from.npy`` (int32, one entry per
document) says from which token of each document the loss applies; the tokens before it are context
only (e.g. the prompt of a retrieval document whose answer is the target). Read by
``data.packing=best_fit`` (the megatron-core GPT datasets of the other packings cannot apply it, so
a path that has one needs best_fit)."""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

LOSS_FROM = ".loss_from.npy"


def write_loss_from(prefix: str, starts: list[int]) -> str:
    """Write ``<prefix>.loss_from.npy`` (through a temp name); returns the path."""
    path = prefix + LOSS_FROM
    tmp = f"{path}.tmp-{os.getpid()}.npy"
    np.save(tmp, np.asarray(starts, dtype=np.int32))
    os.replace(tmp, path)
    return path


def read_loss_from(prefix: str, num_docs: int) -> Optional[np.ndarray]:
    """The loss starts of ``prefix`` (None when it has none); one line when they do not fit the data."""
    path = prefix + LOSS_FROM
    if not os.path.isfile(path):
        return None
    starts = np.load(path, allow_pickle=False)
    if starts.ndim != 1 or starts.shape[0] != num_docs or (starts < 0).any():
        raise ValueError(f"{path}: {starts.shape[0] if starts.ndim == 1 else starts.shape} loss starts for "
                         f"{num_docs} documents; rebuild it with the dataset")
    return starts.astype(np.int64)


def has_loss_from(prefix: str) -> bool:
    return os.path.isfile(prefix + LOSS_FROM)
