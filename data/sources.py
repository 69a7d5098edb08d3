"""Reading rows from JSONL, parquet and HF dataset dirs, with every rejected row counted.

JSONL is read line by line (a malformed line, or one that is not valid UTF-8, is counted with its
line number instead of aborting the whole file or being silently repaired, which is what
``datasets``' json builder does); parquet and HF dataset dirs (``save_to_disk`` output or a folder
of data files) are read with the ``datasets`` library, streaming, so nothing is cached or downloaded.
"""

from __future__ import annotations

import gzip
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

JSONL_EXTS = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".ndjson")


class BadInputError(ValueError):
    """Raised (one line) for bad input when the caller asked for strict handling."""


@dataclass
class ReadStats:
    """Counts of rows read / kept / rejected by reason, and the first location of each reason."""

    rows: int = 0
    kept: int = 0
    bytes_read: int = 0  # JSONL only (uncompressed text bytes), for progress
    rejected: Counter = field(default_factory=Counter)
    first_at: dict = field(default_factory=dict)

    def reject(self, reason: str, where: str, strict: bool = False, detail: str = "") -> None:
        if strict:
            raise BadInputError(f"{where}: {reason}{': ' + detail if detail else ''} "
                                "(rerun without --strict to skip and count such rows)")
        self.rejected[reason] += 1
        self.first_at.setdefault(reason, where)

    def summary_lines(self) -> list[str]:
        out = [f"rows read: {self.rows}, kept: {self.kept}, rejected: {sum(self.rejected.values())}"]
        for reason, n in sorted(self.rejected.items()):
            out.append(f"  skipped {n} row(s): {reason} (first at {self.first_at[reason]})")
        return out

    def as_dict(self) -> dict:
        return {"rows": self.rows, "kept": self.kept, "rejected": dict(self.rejected), "first_at": dict(self.first_at)}


def _is_jsonl(path: str) -> bool:
    return path.endswith(JSONL_EXTS)


def iter_rows(path: str, stats: ReadStats, split: str = "train", strict: bool = False) -> Iterator[tuple[str, dict]]:
    """Yield ``(location, row)`` for every well-formed row of ``path``; count malformed ones in ``stats``."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"input {path!r} does not exist")
    if os.path.isfile(path) and _is_jsonl(path):
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                stats.bytes_read += len(raw)
                if not raw.strip():
                    continue  # blank separator lines are not rows
                stats.rows += 1
                where = f"{path}:{lineno}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    stats.reject("invalid UTF-8", where, strict, f"byte {e.start}")
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    stats.reject("malformed JSON", where, strict, e.msg)
                    continue
                if not isinstance(row, dict):
                    stats.reject("JSON value is not an object", where, strict)
                    continue
                yield where, row
        return
    ds = _open_with_datasets(path, split)
    for i, row in enumerate(ds):
        stats.rows += 1
        yield f"{path}[{i}]", row


def _open_with_datasets(path: str, split: str):
    import datasets

    if os.path.isfile(path):
        if path.endswith(".parquet"):
            return datasets.load_dataset("parquet", data_files=path, split="train", streaming=True)
        raise ValueError(f"input {path!r}: unsupported file type; use .jsonl[.gz], .parquet or an HF dataset dir")
    if (os.path.isfile(os.path.join(path, "dataset_info.json"))
            or os.path.isfile(os.path.join(path, "dataset_dict.json"))):
        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"input {path!r} has splits {list(ds)}; pick one with --split")
            ds = ds[split]
        return ds
    return datasets.load_dataset(path, split=split, streaming=True)


def iter_texts(path: str, text_key: str, stats: ReadStats, split: str = "train", strict: bool = False) -> Iterator[str]:
    """Yield non-empty document strings from field ``text_key``; rejects are counted by reason."""
    for where, row in iter_rows(path, stats, split, strict):
        if text_key not in row:
            stats.reject(f"missing field {text_key!r}", where, strict)
            continue
        text = row[text_key]
        if not isinstance(text, str):
            stats.reject(f"field {text_key!r} is not a string", where, strict, type(text).__name__)
            continue
        if not text.strip():
            stats.reject("empty document", where, strict)
            continue
        stats.kept += 1
        yield text


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Strict small-file reader (demo/test assets): raises on the first malformed line."""
    stats = ReadStats()
    return [row for _, row in iter_rows(path, stats, strict=True)]


def write_jsonl(path: str, rows, key: Optional[str] = None) -> int:
    """Write rows (dicts, or strings wrapped as ``{key: s}``) atomically; returns the count."""
    tmp = path + ".tmp"
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({key: r} if key else r, ensure_ascii=False) + "\n")
            n += 1
    os.replace(tmp, path)
    return n
