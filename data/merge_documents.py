"""``python -m data.merge_documents --src PREFIX --out PREFIX --min-tokens N``: a long-document copy of
an indexed dataset.

Consecutive documents of ``--src`` (megatron ``.bin/.idx``) are concatenated, each keeping its EOD
token, until a merged document holds at least ``N`` tokens (the last one may hold fewer). Nothing is
dropped or reordered: the token stream is the source's, only the document boundaries change.

What it is for: with document packing (``data.packing=document``) attention is masked per document,
so its cost, and what a sparse attention saves, depends on how long the documents are. A corpus of
short files cannot show a 16K / 32K long-context training step; the merged copy has the document
lengths of a long-context continual-pretraining mix (``bench/train_throughput.py --data PREFIX``).
For real training it is a blunt instrument: merged documents attend across unrelated texts.

Writes ``<out>.tmp-<pid>.*`` and renames over ``<out>.*`` only on success; ``--out`` must differ from
``--src``. Prints a summary (documents and tokens in and out, merged length percentiles).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from data import disk_space
from data.third_party_noise import quiet_third_party


def merged_spans(lengths: np.ndarray, min_tokens: int) -> list[tuple[int, int]]:
    """``[start, end)`` document index ranges whose lengths sum to at least ``min_tokens`` (the last
    range takes what is left)."""
    spans, start, acc = [], 0, 0
    for i, n in enumerate(lengths.tolist()):
        acc += n
        if acc >= min_tokens:
            spans.append((start, i + 1))
            start, acc = i + 1, 0
    if start < len(lengths):
        spans.append((start, len(lengths)))
    return spans


def merge_documents(src: str, out: str, min_tokens: int) -> dict:
    """Write ``out.bin/.idx``: the documents of ``src`` merged into documents of >= ``min_tokens``."""
    from data.indexed import IndexedWriter, read_indexed

    if min_tokens < 1:
        raise ValueError(f"--min-tokens must be >= 1, got {min_tokens}")
    if os.path.abspath(src) == os.path.abspath(out):
        raise ValueError("--out must differ from --src (the source is read while the copy is written)")
    for ext in (".bin", ".idx"):
        if not os.path.exists(src + ext):
            raise FileNotFoundError(f"{src + ext} does not exist (pass the prefix without .bin/.idx)")
    ds = read_indexed(src)  # damaged, incomplete or empty files: one line naming them
    lengths = np.asarray(ds.sequence_lengths)
    vocab = 65536 if ds.index.dtype == np.uint16 else 1 << 31  # keeps the source's token dtype
    spans = merged_spans(lengths, min_tokens)
    tmp = f"{out}.tmp-{os.getpid()}"
    writer = IndexedWriter(tmp, vocab)
    try:
        for a, b in spans:
            writer.add(np.concatenate([ds[i] for i in range(a, b)]))
        writer.close()
    except BaseException as e:
        where = os.path.dirname(os.path.abspath(out))
        written = sum(disk_space.tree_bytes(tmp + ext) for ext in (".bin", ".idx"))
        full = isinstance(e, Exception) and disk_space.is_disk_full(e, where)
        free = disk_space.free_bytes(where)
        try:
            writer.discard()
        except OSError:  # closing flushes: on a full disk that fails too
            pass
        for ext in (".bin", ".idx"):
            if os.path.exists(tmp + ext):
                os.remove(tmp + ext)
        if full:
            need = disk_space.tree_bytes(src + ".bin") + disk_space.tree_bytes(src + ".idx")
            raise ValueError(f"disk full writing {out}.bin in {where} ({disk_space.human(free)} free) after "
                             f"{disk_space.human(written)} of it: the temporary files were removed and an existing "
                             f"{out}.* is untouched; free about {disk_space.human(need)} there and run again") from None
        raise
    for ext in (".bin", ".idx"):
        os.replace(tmp + ext, out + ext)
    merged = np.array([int(lengths[a:b].sum()) for a, b in spans])
    return {"documents_in": int(lengths.size), "documents_out": len(spans), "tokens": int(lengths.sum()),
            "tokens_out": writer.tokens, "min_tokens": min_tokens,
            "merged_length_p10_p50_p90": [int(x) for x in np.percentile(merged, [10, 50, 90])],
            "source_length_p50": int(np.percentile(lengths, 50))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--src", required=True, help="indexed dataset prefix (without .bin/.idx)")
    p.add_argument("--out", required=True, help="prefix of the merged copy")
    p.add_argument("--min-tokens", type=int, required=True, help="tokens per merged document, at least")
    a = p.parse_args(argv)
    quiet_third_party()
    try:
        s = merge_documents(a.src, a.out, a.min_tokens)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{s['documents_in']} documents -> {s['documents_out']} of >= {s['min_tokens']} tokens "
          f"(the last may be shorter); {s['tokens']} tokens; merged length p10/p50/p90 "
          f"{s['merged_length_p10_p50_p90']} (source median {s['source_length_p50']}); wrote {a.out}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
