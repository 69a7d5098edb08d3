"""Perplexity by position bucket on held-out long documents.

    python -m eval.ppl --ckpt <run dir | checkpoint | HF model dir> --data <prefix | jsonl> --length 16384 \\
        [--docs 8] [--split 95,5,0] --out DIR

Each document of ``length`` tokens is scored in one forward pass; the loss of predicting token
``p`` (``p >= 1``) goes to the bucket holding ``p``. Buckets are ``[0, L/4)``, ``[L/4, L/2)``,
``[L/2, L)`` (0-4K, 4-8K, 8-16K at L = 16K). A NOSA model is sparse from ``topk * block_size``
tokens on, so the later buckets show what the sparse attention keeps. Writes ``ppl.json``, ``ppl.md``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Optional

from eval.report import markdown_table
from runtime.outputs import write_atomic, write_json


def bucket_edges(length: int) -> list[tuple[int, int]]:
    """``[(0, L/4), (L/4, L/2), (L/2, L)]`` in token positions."""
    q = length // 4
    return [(0, q), (q, 2 * q), (2 * q, length)]


def bucket_label(lo: int, hi: int) -> str:
    k = lambda n: f"{n // 1024}K" if n % 1024 == 0 and n else str(n)  # noqa: E731
    return f"{k(lo)}-{k(hi)}"


def perplexity_by_bucket(model, docs: list, length: int, log=print) -> dict:
    """``{"buckets": [{range, tokens, nll, ppl}], "overall": {...}}`` over ``docs`` (``[length]`` ids)."""
    edges = bucket_edges(length)
    sums = [0.0] * len(edges)
    counts = [0] * len(edges)
    for d, doc in enumerate(docs):
        lp, _ = model.token_logprobs(doc)  # lp[i]: log p(token i+1)
        for b, (lo, hi) in enumerate(edges):
            seg = lp[max(lo, 1) - 1:hi - 1]
            sums[b] -= float(seg.double().sum())
            counts[b] += seg.numel()
        log(f"  ppl document {d + 1}/{len(docs)}")
    buckets = [{"range": bucket_label(lo, hi), "lo": lo, "hi": hi, "tokens": n, "nll": s / n, "ppl": math.exp(s / n)}
               for (lo, hi), s, n in zip(edges, sums, counts)]
    total = sum(sums) / sum(counts)
    return {"length": length, "docs": len(docs), "buckets": buckets,
            "overall": {"tokens": sum(counts), "nll": total, "ppl": math.exp(total)}}


def markdown(r: dict, title: str) -> str:
    rows = [[b["range"], b["tokens"], b["nll"], b["ppl"]] for b in r["buckets"]]
    rows.append(["all", r["overall"]["tokens"], r["overall"]["nll"], r["overall"]["ppl"]])
    return f"# {title}\n\n{r['docs']} document(s) of {r['length']} tokens.\n\n" + markdown_table(
        ["positions", "tokens", "NLL", "perplexity"], rows) + "\n"


def run(ckpt: str, data: str, out: str, length: int, docs: int = 8, split: Optional[str] = None,
        tokenizer: Optional[str] = None, dtype: str = "auto", log=print) -> dict:
    from eval.documents import load_documents
    from eval.load import check_length, load_model, load_tokenizer, resolve_source

    src = resolve_source(ckpt, tokenizer)
    check_length(src, length)
    tok = load_tokenizer(src)
    texts = load_documents(data, tok, length, docs, src.model.vocab_size, split)
    r = perplexity_by_bucket(load_model(src, dtype=dtype), texts, length, log)
    r["model"] = {"path": str(src.path), "label": src.label}
    write_json(Path(out) / "ppl.json", r)
    write_atomic(Path(out) / "ppl.md", markdown(r, f"Perplexity by position: {src.label}"))
    log("ppl " + ", ".join(f"{b['range']}: {b['ppl']:.2f}" for b in r["buckets"]) + f"; wrote {out}")
    return r


def main(argv=None) -> int:
    from eval import CKPT_HELP
    from runtime.cli import run_cli

    ap = argparse.ArgumentParser(prog="python -m eval.ppl", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help=CKPT_HELP)
    ap.add_argument("--data", required=True, help="indexed dataset prefix or JSONL (text field)")
    ap.add_argument("--length", type=int, required=True)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--split", default=None, help="the trainer's data.split: use only its held-out documents")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    return run_cli("eval.ppl", run, a.ckpt, a.data, a.out, a.length, a.docs, a.split, a.tokenizer, a.dtype)


if __name__ == "__main__":
    sys.exit(main())
