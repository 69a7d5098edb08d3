"""``python -m data.preprocess``: text (JSONL / parquet / HF dataset dir) -> megatron ``.bin/.idx``.

Reads with :mod:`data.sources` (``datasets`` for parquet/HF dirs), tokenizes in batches with the
Rust tokenizer, appends EOD to every document and writes with megatron-core's
``IndexedDatasetBuilder``. Prints a progress line and a summary (documents, tokens, skipped rows
by reason); the summary is also saved as ``<prefix>.summary.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

from data.sources import ReadStats, iter_texts
from data.tokenizer import Tokenizer


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
) -> dict:
    """Tokenize ``input_path`` into ``out_prefix.bin/.idx``; returns the summary dict.

    Units: ``tokens`` counts stored tokens including one EOD per document; ``tokens_per_s`` is
    wall-clock over read + tokenize + write.
    """
    from data.indexed import IndexedWriter

    tok = Tokenizer(tokenizer_dir)
    tok.check_model_vocab(model_vocab_size)
    stats = ReadStats()
    writer = IndexedWriter(out_prefix, tok.vocab_size)
    t0 = time.perf_counter()
    chars = 0
    bar = None
    if progress:
        from tqdm import tqdm

        plain_jsonl = os.path.isfile(input_path) and not input_path.endswith((".gz", ".parquet"))
        bar = tqdm(total=os.path.getsize(input_path) if plain_jsonl else None, unit="B" if plain_jsonl else "doc",
                   unit_scale=True, desc="preprocess", file=sys.stderr, mininterval=1.0)

    def flush(batch: list[str]) -> None:
        for ids in tok.encode_plain(batch):
            ids.append(tok.eod)
            writer.add(ids)
        if bar is not None:
            bar.update((stats.bytes_read if bar.unit == "B" else writer.documents) - bar.n)
            bar.set_postfix(docs=writer.documents, tokens=f"{writer.tokens / 1e6:.1f}M",
                            tok_s=f"{writer.tokens / (time.perf_counter() - t0) / 1e3:.0f}K", refresh=False)

    batch: list[str] = []
    for text in iter_texts(input_path, text_key, stats, split=split, strict=strict):
        batch.append(text)
        chars += len(text)
        if len(batch) >= batch_docs:
            flush(batch)
            batch = []
        if max_docs is not None and stats.kept >= max_docs:
            break
    if batch:
        flush(batch)
    writer.close()
    elapsed = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    summary = {
        "input": input_path, "tokenizer": tok.path, "out": out_prefix, "vocab_size": tok.vocab_size,
        "dtype": writer.dtype.__name__, "documents": writer.documents, "tokens": writer.tokens, "chars": chars,
        "seconds": round(elapsed, 3), "tokens_per_s": round(writer.tokens / max(elapsed, 1e-9), 1),
        "read": stats.as_dict(),
    }
    with open(out_prefix + ".summary.json", "w") as f:
        json.dump(summary, f, indent=2)
    if writer.documents == 0:
        raise ValueError(f"no usable documents in {input_path!r} ({'; '.join(stats.summary_lines())}); check --text-key")
    return summary


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
    ap.add_argument("--model-vocab-size", type=int, default=None, help="refuse tokenizers larger than the model's vocabulary")
    ap.add_argument("--strict", action="store_true", help="stop at the first bad row instead of skipping and counting")
    args = ap.parse_args(argv)
    try:
        s = preprocess(args.input, args.tokenizer, args.out, args.text_key, args.split, args.batch_docs,
                       args.max_docs, args.model_vocab_size, args.strict)
    except (ValueError, FileNotFoundError) as e:
        print(f"[preprocess] error: {e}", file=sys.stderr)
        return 2
    print_summary(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
