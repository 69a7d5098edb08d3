"""Score a model on a RULER-style task set, directly on the Megatron model or through lm-eval.

    python -m eval.ruler --ckpt <run dir | checkpoint | HF model dir> --tasks DIR [--lengths 4096,8192]
        [--harness direct | lm-eval] [--limit N] --out DIR

``direct`` runs one forward pass per sample on the Megatron model (any checkpoint form) and scores
every answer item from it; ``lm-eval`` runs lm-evaluation-harness (``HFLM``, ``trust_remote_code``)
with the task set's local YAML configs on the HF dir (any other form is exported to a temporary
one). Both score an item as lm-eval's ``acc`` of a loglikelihood request (greedy decoding
reproduces the item's tokens) and give the same numbers (tested). A task's score is 100 x the mean
over its items; the average is over tasks and lengths.
Writes ``ruler.json``, ``ruler.md`` and ``items.jsonl`` (one line per item: loglikelihood, greedy).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from eval.errors import EvalError
from eval.report import markdown_table
from runtime.outputs import write_atomic, write_json

HARNESSES = ("direct", "lm-eval")


@dataclass
class ItemResult:
    """One answer item: ``loglik`` (sum over its ``tokens`` answer tokens), ``greedy`` (every token is
    the greedy choice: the strict score) and ``matched`` (answer tokens that are the greedy choice;
    None where the harness does not report it, as lm-eval)."""

    task: str
    length: int
    sample: int
    item: int
    loglik: float
    greedy: bool
    tokens: int = 0
    matched: Optional[int] = None


def score_direct(model, tok, ts, lengths: list[int], tasks: list[str], limit: Optional[int] = None,
                 log=print) -> list[ItemResult]:
    """Every item of the chosen (task, length) pairs from one forward per sample."""
    import torch

    from eval.tasks import encoder

    enc, out, t0 = encoder(tok), [], time.perf_counter()
    for length in lengths:
        for task in tasks:
            rows = ts.samples(task, length)[:limit]
            for row in rows:
                text = row["prompt"] + "".join((" " if j == 0 else ", ") + a for j, a in enumerate(row["answers"]))
                ids = enc(text)
                if len(ids) != row["tokens"]:
                    raise EvalError(f"tokenizer mismatch: sample {task}/{length}/{row['index']} has {len(ids)} tokens "
                                    f"with the model's tokenizer, {row['tokens']} when generated")
                lp, greedy = model.token_logprobs(torch.tensor(ids))
                target = torch.tensor(ids[1:])
                for j, (a, b) in enumerate(row["item_spans"]):
                    hit = greedy[a - 1:b - 1] == target[a - 1:b - 1]
                    out.append(ItemResult(task, length, row["index"], j, float(lp[a - 1:b - 1].double().sum()),
                                          bool(hit.all()), b - a, int(hit.sum())))
            log(f"  {task} @ {length}: {len(rows)} samples ({time.perf_counter() - t0:.1f} s)")
    return out


def score_lm_eval(hf_dir: Optional[str], ts, lengths: list[int], tasks: list[str], limit: Optional[int] = None,
                  device: Optional[str] = None, dtype: str = "auto", log=print, lm=None) -> list[ItemResult]:
    """The same items through lm-evaluation-harness on the HF export ``hf_dir`` (or on ``lm``, an
    ``lm_eval.api.model.LM`` instance, instead of lm-eval's Hugging Face model)."""
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from eval.tasks.lm_eval_tasks import task_name

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype == "auto":
        dtype = "bf16" if device.startswith("cuda") else "fp32"
    dtype = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    names = {task_name(t, n): (t, n) for n in lengths for t in tasks}
    picked = None
    if limit is not None:  # the items of the first `limit` samples of each task
        picked = {}
        for name, (t, n) in names.items():
            items = [json_line for json_line in (ts.root / f"{t}_{n}.items.jsonl").read_text().splitlines()
                     if json_line]
            picked[name] = [i for i, line in enumerate(items) if _sample_of(line) < limit]
    model_args = {"pretrained": str(hf_dir), "trust_remote_code": True, "dtype": dtype, "device": device}
    res = simple_evaluate(
        model=lm if lm is not None else "hf", model_args=None if lm is not None else model_args,
        tasks=list(names), task_manager=TaskManager(include_path=str(ts.root), include_defaults=False),
        batch_size=1, log_samples=True, samples=picked, bootstrap_iters=0)
    out = []
    for name, (t, n) in names.items():
        spans = {row["index"]: row["item_spans"] for row in ts.samples(t, n)}
        for s in res["samples"][name]:
            ll, is_greedy = _loglik_response(s)
            sample, item = int(s["doc"]["sample"]), int(s["doc"]["item"])
            a, b = spans[sample][item]
            out.append(ItemResult(t, n, sample, item, ll, is_greedy, b - a))
    out.sort(key=lambda r: (lengths.index(r.length), tasks.index(r.task), r.sample, r.item))
    log(f"  lm-eval: {len(out)} items over {len(names)} task(s)")
    return out


def _sample_of(line: str) -> int:
    import json

    return int(json.loads(line)["sample"])


def _loglik_response(s: dict) -> tuple[float, bool]:
    """``(loglikelihood, is_greedy)`` of one logged lm-eval sample."""
    resp = s["filtered_resps"][0] if s.get("filtered_resps") else s["resps"][0][0]
    while isinstance(resp, (list, tuple)) and len(resp) == 1:
        resp = resp[0]
    return float(resp[0]), bool(resp[1])


def _graded(rs: list[ItemResult]) -> dict:
    """The graded signals of some items: mean log-likelihood per answer token (nats) and the share of
    answer tokens that are the greedy choice (None when the harness does not report tokens)."""
    toks = sum(r.tokens for r in rs)
    known = [r for r in rs if r.matched is not None]
    return {"loglik_per_token": sum(r.loglik for r in rs) / toks if toks else None,
            "token_match": sum(r.matched for r in known) / sum(r.tokens for r in known)
            if known and sum(r.tokens for r in known) else None}


def summarize(items: list[ItemResult]) -> dict:
    """Per (task, length): score = 100 x mean greedy match (RULER's strict score), its standard error,
    counts, and the graded signals (:func:`_graded`); the same by task, by length and over all cells
    (averages of cells; the standard error of an average assumes independent cells)."""
    groups: dict[tuple[str, int], list[ItemResult]] = {}
    for r in items:
        groups.setdefault((r.task, r.length), []).append(r)
    cells = []
    for (task, length), rs in groups.items():
        p = sum(r.greedy for r in rs) / len(rs)
        cells.append({"task": task, "length": length, "score": 100 * p,
                      "stderr": 100 * math.sqrt(p * (1 - p) / len(rs)), "items": len(rs),
                      "samples": len({r.sample for r in rs}), "mean_loglik": sum(r.loglik for r in rs) / len(rs),
                      **_graded(rs)})
    tasks = list(dict.fromkeys(c["task"] for c in cells))
    lengths = sorted({c["length"] for c in cells})

    def avg(cs: list[dict], key: str = "score"):
        vals = [c[key] for c in cs if c[key] is not None]
        return sum(vals) / len(vals) if vals else None

    def stderr(cs: list[dict]):
        return math.sqrt(sum(c["stderr"] ** 2 for c in cs)) / len(cs) if cs else None

    def block(cs: list[dict]) -> dict:
        return {"score": avg(cs), "stderr": stderr(cs), "token_match": avg(cs, "token_match"),
                "loglik_per_token": avg(cs, "loglik_per_token")}

    by_task = {t: [c for c in cells if c["task"] == t] for t in tasks}
    by_length = {str(n): [c for c in cells if c["length"] == n] for n in lengths}
    return {"cells": cells, "tasks": tasks, "lengths": lengths,
            "by_task": {t: avg(cs) for t, cs in by_task.items()},
            "by_length": {n: avg(cs) for n, cs in by_length.items()},
            "average": avg(cells), "average_stderr": stderr(cells),
            "graded": {"token_match": avg(cells, "token_match"), "loglik_per_token": avg(cells, "loglik_per_token")},
            "by_task_detail": {t: block(cs) for t, cs in by_task.items()},
            "by_length_detail": {n: block(cs) for n, cs in by_length.items()},
            "needles": block([c for c in cells if c["task"].startswith("niah_")])}


def _pm(score, se) -> str:
    return "-" if score is None else f"{score:.1f} ± {se:.1f}"


def markdown(summary: dict, title: str) -> str:
    """Strict scores (± standard error) by task and length, then the graded signals by length."""
    cell = {(c["task"], c["length"]): c for c in summary["cells"]}
    lengths, detail = summary["lengths"], summary.get("by_task_detail", {})
    rows = [[t] + [_pm(cell[(t, n)]["score"], cell[(t, n)]["stderr"]) if (t, n) in cell else "-" for n in lengths]
            + [_pm(detail[t]["score"], detail[t]["stderr"]) if t in detail else summary["by_task"][t]]
            for t in summary["tasks"]]
    by_len = summary.get("by_length_detail", {})
    rows.append(["**average**"] + [_pm(by_len[str(n)]["score"], by_len[str(n)]["stderr"]) for n in lengths]
                + [_pm(summary["average"], summary["average_stderr"])])
    graded = [[name] + [by_len[str(n)][key] for n in lengths] + [summary["graded"][key]]
              for name, key in (("answer tokens matched (share)", "token_match"),
                                ("log-likelihood per answer token", "loglik_per_token"))]
    head = ["task"] + [str(n) for n in lengths] + ["mean"]
    return (f"# {title}\n\nStrict score (100 x share of answer items whose every token is the greedy choice, "
            f"± standard error):\n\n" + markdown_table(head, rows) + "\n\nGraded signals (every task):\n\n"
            + markdown_table(["signal"] + head[1:], graded) + "\n")


def run(ckpt: str, tasks_dir: str, out: str, lengths: Optional[list[int]] = None, harness: str = "direct",
        limit: Optional[int] = None, tokenizer: Optional[str] = None, dtype: str = "auto", log=print) -> dict:
    from eval.load import lm_eval_dir, load_model, load_tokenizer, resolve_source
    from eval.tasks import load_task_set

    if harness not in HARNESSES:
        raise EvalError(f"--harness {harness!r}; choose one of {HARNESSES}")
    src = resolve_source(ckpt, tokenizer)
    tok = load_tokenizer(src)
    ts = load_task_set(tasks_dir)
    ts.check_tokenizer(tok.path)
    chosen = ts.pick_lengths(lengths, src.model.max_position_embeddings)
    log(f"ruler ({harness}): {src.label} from {src.path}, {len(ts.tasks)} task(s) x {chosen}")
    if harness == "direct":
        items = score_direct(load_model(src, dtype=dtype), tok, ts, chosen, ts.tasks, limit, log)
    else:
        with lm_eval_dir(src, log) as hf_dir:
            items = score_lm_eval(str(hf_dir), ts, chosen, ts.tasks, limit, dtype=dtype, log=log)
    result = write_outputs(items, Path(out), src, harness, {"tasks_dir": str(ts.root), "limit": limit})
    g = result["graded"]
    log(f"RULER average {result['average']:.1f} ± {result['average_stderr']:.1f} over {len(result['cells'])} "
        f"(task, length) cell(s); answer tokens matched {_share(g['token_match'])}, log-likelihood per answer "
        f"token {g['loglik_per_token']:.3f}; wrote {out}")
    return result


def _share(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def write_outputs(items: list[ItemResult], out: Path, src, harness: str, extra: Optional[dict] = None) -> dict:
    """``ruler.json`` (summary), ``ruler.md`` and ``items.jsonl`` under ``out``; returns the summary."""
    import json

    summary = summarize(items)
    result = {"model": {"path": str(src.path), "label": src.label, "kind": src.kind}, "harness": harness,
              **(extra or {}), **summary}
    write_json(out / "ruler.json", result)
    write_atomic(out / "ruler.md", markdown(summary, f"RULER-style tasks: {src.label} ({harness})"))
    write_atomic(out / "items.jsonl", "".join(json.dumps(asdict(r)) + "\n" for r in items))
    return result


def main(argv=None) -> int:
    from eval import CKPT_HELP
    from runtime.cli import run_cli

    ap = argparse.ArgumentParser(prog="python -m eval.ruler", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help=CKPT_HELP)
    ap.add_argument("--tasks", required=True, help="task set dir (python -m eval.tasks)")
    ap.add_argument("--lengths", default=None, help="comma-separated subset of the set's lengths")
    ap.add_argument("--harness", default="direct", choices=HARNESSES)
    ap.add_argument("--limit", type=int, default=None, help="first N samples per (task, length)")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")] if a.lengths else None
    return run_cli("eval.ruler", run, a.ckpt, a.tasks, a.out, lengths, a.harness, a.limit, a.tokenizer, a.dtype)


if __name__ == "__main__":
    sys.exit(main())
