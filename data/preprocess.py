"""``python -m data.preprocess``: text (JSONL / parquet / HF dataset dir) -> megatron ``.bin/.idx``.

Reads with :mod:`data.sources` (``datasets`` for parquet/HF dirs), tokenizes in batches with the
Rust tokenizer (long documents in pieces, so memory stays bounded), appends EOD to every
document and writes with megatron-core's ``IndexedDatasetBuilder`` under temporary names that
replace ``--out`` only on success. Prints a progress line and a summary (documents, tokens, skipped rows
by reason); the summary is also saved as ``<prefix>.summary.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from typing import Optional

import numpy as np

from data import disk_space
from data.sources import ReadStats, iter_texts
from data.third_party_noise import quiet_third_party
from data.tokenizer import Tokenizer

PIECE_CHARS = 1 << 18  # longest text handed to the tokenizer at once (it needs ~200 bytes per char)


def preprocess(
    input_path: str,
    tokenizer_dir: str,
    out_prefix: str,
    text_key: str = "text",
    split: str = "train",
    batch_docs: int = 256,
    max_docs: Optional[int] = None,
    model_vocab_size: Optional[int] = None,
    strict: bool = False,
    progress: bool = True,
    piece_chars: int = PIECE_CHARS,
) -> dict:
    """Tokenize ``input_path`` into ``out_prefix.bin/.idx``; returns the summary dict.

    Writes ``<out_prefix>.tmp-<pid>.*`` and renames them over ``out_prefix.*`` only when at least one
    document was written, so a failed or interrupted run leaves an existing dataset untouched.
    Documents longer than ``piece_chars`` are tokenized in pieces (:func:`split_for_encoding`), which
    bounds memory. Units: ``tokens`` counts stored tokens including one EOD per document;
    ``tokens_per_s`` is wall-clock over read + tokenize + write.
    """
    from data.indexed import IndexedWriter, id_range_record

    tok = Tokenizer(tokenizer_dir)
    tok.check_model_vocab(model_vocab_size)
    stats = ReadStats()
    tmp_prefix = f"{out_prefix}.tmp-{os.getpid()}"
    try:
        writer = IndexedWriter(tmp_prefix, tok.vocab_size)
    except OSError as e:  # a read-only file system, no permission, a missing parent that cannot be made
        raise ValueError(f"--out {out_prefix}: cannot write {e.filename or tmp_prefix + '.bin'} ({e.strerror or e}); "
                         f"give an --out where files can be written") from None
    t0 = time.perf_counter()
    chars = 0
    bar = None
    if progress:
        from tqdm import tqdm

        plain_jsonl = os.path.isfile(input_path) and not input_path.endswith((".gz", ".parquet"))
        bar = tqdm(total=os.path.getsize(input_path) if plain_jsonl else None, unit="B" if plain_jsonl else "doc",
                   unit_scale=True, desc="preprocess", file=sys.stderr, mininterval=1.0)

    def flush(batch: list[str]) -> None:
        for ids in encode_documents(tok, batch, piece_chars):
            writer.add(np.append(ids, tok.eod))
        if bar is not None:
            bar.update((stats.bytes_read if bar.unit == "B" else writer.documents) - bar.n)
            bar.set_postfix(docs=writer.documents, tokens=f"{writer.tokens / 1e6:.1f}M",
                            tok_s=f"{writer.tokens / (time.perf_counter() - t0) / 1e3:.0f}K", refresh=False)

    try:
        batch: list[str] = []
        batch_chars = 0
        for text in iter_texts(input_path, text_key, stats, split=split, strict=strict):
            batch.append(text)
            chars += len(text)
            batch_chars += len(text)
            if len(batch) >= batch_docs or batch_chars >= piece_chars:
                flush(batch)
                batch, batch_chars = [], 0
            if max_docs is not None and stats.kept >= max_docs:
                break
        if batch:
            flush(batch)
        writer.close()
        if bar is not None:
            bar.close()  # before the summary
        if writer.documents == 0:
            raise ValueError(f"no usable documents in {input_path!r} ({'; '.join(stats.summary_lines())}); "
                             f"check --text-key (nothing was written to {out_prefix}.*)")
        elapsed = time.perf_counter() - t0
        summary = {
            "input": input_path, "tokenizer": tok.path, "out": out_prefix, "vocab_size": tok.vocab_size,
            "dtype": writer.dtype.__name__, "documents": writer.documents, "tokens": writer.tokens, "chars": chars,
            "seconds": round(elapsed, 3), "tokens_per_s": round(writer.tokens / max(elapsed, 1e-9), 1),
            "read": stats.as_dict(), **id_range_record(tmp_prefix + ".bin", writer.id_range),
        }
        with open(tmp_prefix + ".summary.json", "w") as f:
            json.dump(summary, f, indent=2)
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # all three or none
        try:
            for ext in (".bin", ".idx", ".summary.json"):  # the index after the data it describes
                os.replace(tmp_prefix + ext, out_prefix + ext)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return summary
    except OSError as e:
        where = os.path.dirname(os.path.abspath(out_prefix))
        if not disk_space.is_disk_full(e, where):
            raise
        written = sum(disk_space.tree_bytes(tmp_prefix + ext) for ext in (".bin", ".idx"))
        plain = os.path.isfile(input_path) and not input_path.endswith((".gz", ".parquet"))
        share = stats.bytes_read / max(os.path.getsize(input_path), 1) if plain else 0  # of the input read
        need = f"about {disk_space.human(int(written / share))} in all" if share > 0 else "more than that"
        raise ValueError(f"disk full writing {out_prefix}.bin in {where} "
                         f"({disk_space.human(disk_space.free_bytes(where))} free) after {disk_space.human(written)}"
                         f" of it: the temporary files were removed and an existing {out_prefix}.* is untouched; "
                         f"free {need} there and run again") from None
    finally:
        if bar is not None:
            bar.close()  # before any error line
        try:
            writer.discard()
        except OSError:  # closing flushes: on a full disk that fails too
            pass
        for ext in (".bin", ".idx", ".summary.json"):
            if os.path.exists(tmp_prefix + ext):
                os.remove(tmp_prefix + ext)


def split_for_encoding(text: str, piece_chars: int = PIECE_CHARS) -> list[str]:
    """Cut ``text`` into pieces of at most ``piece_chars`` chars, each cut (where possible) at the
    start of a whitespace run that follows a non-space char. GPT-2 style byte-level pre-tokenizers
    end a pre-token there and tokenize what follows from that point alone, so the pieces' token ids
    concatenate to those of the whole text (tested); text without whitespace is cut anywhere."""
    pieces, start, n = [], 0, len(text)
    while n - start > piece_chars:
        lo, hi = start + piece_chars // 2, start + piece_chars
        last = None
        for last in _WORD_END.finditer(text, lo - 1, hi):
            pass
        cut = last.end() - 1 if last is not None else hi
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


_WORD_END = re.compile(r"\S\s")


def encode_documents(tok: Tokenizer, texts: list[str], piece_chars: int = PIECE_CHARS) -> list[np.ndarray]:
    """Token ids (int64 arrays, no EOD) of each text; long texts are encoded piece by piece."""
    spans, pieces = [], []
    for t in texts:
        parts = split_for_encoding(t, piece_chars)
        spans.append((len(pieces), len(pieces) + len(parts)))
        pieces += parts
    ids, group, size = [], [], 0
    for i, piece in enumerate(pieces):  # groups of at most piece_chars chars (or one piece)
        group.append(piece)
        size += len(piece)
        if size >= piece_chars or i == len(pieces) - 1 or size + len(pieces[i + 1]) > piece_chars:
            ids += [np.asarray(x, dtype=np.int64) for x in tok.encode_plain(group)]
            group, size = [], 0
    return [np.concatenate(ids[a:b]) if b - a > 1 else ids[a] for a, b in spans]


def print_summary(s: dict) -> None:
    print(f"[preprocess] wrote {s['out']}.bin/.idx ({s['dtype']}): {s['documents']} documents, {s['tokens']} tokens "
          f"(incl. EOD), {s['chars']} chars, {s['seconds']:.1f}s, {s['tokens_per_s'] / 1e3:.0f}K tokens/s")
    st = ReadStats(rows=s["read"]["rows"], kept=s["read"]["kept"])
    st.rejected.update(s["read"]["rejected"])
    st.first_at.update(s["read"]["first_at"])
    for line in st.summary_lines():
        print(f"[preprocess] {line}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data.preprocess", description=__doc__.splitlines()[0])
    ap.add_argument("--input", required=True, help="JSONL[.gz] file, parquet file, or HF dataset dir")
    ap.add_argument("--tokenizer", required=True, help="local HF tokenizer dir (tokenizer.json)")
    ap.add_argument("--out", required=True, help="output prefix: writes <out>.bin, <out>.idx, <out>.summary.json")
    ap.add_argument("--text-key", default="text")
    ap.add_argument("--split", default="train", help="split of an HF dataset dir")
    ap.add_argument("--batch-docs", type=int, default=256)
    ap.add_argument("--max-docs", type=int, default=None)
    ap.add_argument("--model-vocab-size", type=int, default=None,
                    help="refuse tokenizers larger than the model's vocabulary")
    ap.add_argument("--strict", action="store_true", help="stop at the first bad row instead of skipping and counting")
    args = ap.parse_args(argv)
    quiet_third_party()  # megatron-core's import warnings (the indexed writer): one note
    previous = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM unwinds like Ctrl-C: temp files go
    try:
        s = preprocess(args.input, args.tokenizer, args.out, args.text_key, args.split, args.batch_docs,
                       args.max_docs, args.model_vocab_size, args.strict)
    except (ValueError, OSError) as e:  # OSError: an input or output the process cannot read or write
        print(f"[preprocess] error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        how = e.args[0] if e.args else "Ctrl-C"
        print(f"[preprocess] interrupted ({how}): the temporary files were removed and an existing {args.out}.* "
              f"is untouched", file=sys.stderr)
        return 143 if how == "SIGTERM" else 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print_summary(s)
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


if __name__ == "__main__":
    sys.exit(main())
