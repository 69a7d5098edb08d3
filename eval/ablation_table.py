"""The eviction-head ablation's table: one row of numbers per variant (training, perplexity, RULER ±
standard error, locality, offload cost), the verdicts of the proof run's targets, markdown and bar plots.
Input: the ``collect()`` dict of ``eval.ablate`` (``{"preset", "variants": {name: row}}``)."""

from __future__ import annotations

from typing import Optional

from eval.report import fmt, markdown_table


def _row_numbers(row: dict) -> dict:
    """The numbers of one variant's table row (None where not measured)."""
    r = row["result"] or {}
    loc, ppl, ruler = r.get("locality") or {}, (r.get("ppl") or {}).get("buckets") or [], r.get("ruler") or {}
    by_len = ruler.get("by_length_detail") or {}
    return {"train_loss": row["train_loss"], "val_loss": row["val_loss"],
            **{f"ppl {b['range']}": b["ppl"] for b in ppl},
            **{f"RULER {_length_label(int(n))}": _pm(d) for n, d in by_len.items()},
            "ruler": ruler.get("average"), "ruler_se": ruler.get("average_stderr"),
            "needles": (ruler.get("needles") or {}).get("score"),
            "token_match": (ruler.get("graded") or {}).get("token_match"),
            "gamma_mean": loc.get("gamma_mean"), "gamma_p5": loc.get("gamma_p5"), "gamma_min": loc.get("gamma_min"),
            "fetched": loc.get("fetched_per_step"),
            "mb_per_token": None if loc.get("bytes_per_token") is None else loc["bytes_per_token"] / 1e6,
            "tok_s": loc.get("decode_tokens_per_s"), "vs_dense": loc.get("throughput_ratio_vs_dense")}


def _length_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _pm(d: dict) -> Optional[str]:
    return None if d.get("score") is None else f"{d['score']:.1f} ± {d['stderr']:.1f}"


def verdicts(table: dict) -> list[str]:
    """The proof run's targets, judged from the table: ed_dma's RULER average within two standard
    errors of dense's and not below none's by more than two; its locality above none's."""
    n = {v: _row_numbers(row) for v, row in table["variants"].items() if row["result"]}
    out = []

    def diff(a: str, b: str):
        x, y = n[a], n[b]
        return x["ruler"] - y["ruler"], 2 * ((x["ruler_se"] or 0) ** 2 + (y["ruler_se"] or 0) ** 2) ** 0.5

    if "ed_dma" in n and "dense" in n and n["ed_dma"]["ruler"] is not None and n["dense"]["ruler"] is not None:
        d, two = diff("ed_dma", "dense")
        out.append(f"ed_dma - dense RULER average: {d:+.1f} (two standard errors of the difference: {two:.1f}): "
                   f"{'within' if abs(d) <= two else 'NOT within'} two standard errors")
    if "ed_dma" in n and "none" in n and n["ed_dma"]["ruler"] is not None and n["none"]["ruler"] is not None:
        d, two = diff("ed_dma", "none")
        out.append(f"ed_dma - none RULER average: {d:+.1f} (two standard errors: {two:.1f}): "
                   f"{'not below by more than two standard errors' if d >= -two else 'BELOW by more than two'}")
        if n["ed_dma"]["gamma_mean"] is not None and n["none"]["gamma_mean"] is not None:
            better = n["ed_dma"]["gamma_mean"] > n["none"]["gamma_mean"]
            out.append(f"locality: gamma mean {n['ed_dma']['gamma_mean']:.3f} (ed_dma) vs "
                       f"{n['none']['gamma_mean']:.3f} (none): {'above' if better else 'NOT above'} none's")
    if table["preset"].get("model_from_init"):
        out += import_targets(table)
    return out


def _by_length(row: dict) -> dict:
    """RULER score per task length of a row (``{length: score}``)."""
    by_length = (((row.get("result") or {}).get("ruler") or {}).get("by_length")) or {}
    return {int(k): float(v) for k, v in by_length.items() if v is not None}


def import_targets(table: dict) -> list[str]:
    """The targets of an imported model's ablation (``model_from_init`` presets): dense CPT at least 60 at
    the longest length, ed_dma's mean over the lengths within 3 points of dense's and at least none's at
    the longest length."""
    rows = {v: row for v, row in table["variants"].items() if row["result"]}
    out = []
    per = {v: _by_length(row) for v, row in rows.items()}
    longest = max((n for d in per.values() for n in d), default=None)
    if longest is None:
        return out
    label = _length_label(longest)
    if longest in per.get("dense", {}):
        x = per["dense"][longest]
        verdict = "met" if x >= 60 else f"MISSED by {60 - x:.1f}"
        out.append(f"dense RULER {label}: {x:.1f} (target at least 60): {verdict}")
    if per.get("ed_dma") and per.get("dense"):
        common = sorted(set(per["ed_dma"]) & set(per["dense"]))
        d = sum(per["ed_dma"][n] - per["dense"][n] for n in common) / len(common)
        out.append(f"ed_dma - dense, mean over {[_length_label(n) for n in common]}: {d:+.1f} (target within 3): "
                   f"{'met' if abs(d) <= 3 else f'MISSED by {abs(d) - 3:.1f}'}")
    if longest in per.get("ed_dma", {}) and longest in per.get("none", {}):
        d = per["ed_dma"][longest] - per["none"][longest]
        out.append(f"ed_dma - none RULER {label}: {d:+.1f} (target at least 0): "
                   f"{'met' if d >= 0 else f'MISSED by {-d:.1f}'}")
    return out


def ablation_markdown(table: dict) -> str:
    p = table["preset"]
    variants = table["variants"]
    nums = {v: _row_numbers(row) for v, row in variants.items()}
    keys = list(dict.fromkeys(k for n in nums.values() for k in n))
    buckets = sorted((k for k in keys if k.startswith("ppl ")),
                     key=lambda k: int(k.split()[1].split("-")[0].rstrip("K") or 0))
    lengths = [k for k in keys if k.startswith("RULER ") and k != "RULER avg"]
    head = ["variant", "status", "train loss", "val loss", *buckets, *lengths, "RULER avg", "needles",
            "answer tokens matched", "gamma mean", "gamma p5", "gamma min", "fetched blocks/step", "MB/token H2D",
            "decode tok/s (PCIe)", "x dense"]
    rows = []
    for v, row in variants.items():
        n = nums[v]
        status = row["status"] if row["status"] != "failed" else f"failed ({row['log'] or row['error']})"
        avg = None if n["ruler"] is None else f"{n['ruler']:.1f} ± {n['ruler_se'] or 0:.1f}"
        rows.append([_variant_label(v), status, n["train_loss"], n["val_loss"], *[n.get(b) for b in buckets],
                     *[n.get(k) for k in lengths], avg, n["needles"], n["token_match"], n["gamma_mean"],
                     n["gamma_p5"], n["gamma_min"], n["fetched"], n["mb_per_token"], n["tok_s"], n["vs_dense"]])
    lines = [f"# Eviction-head ablation: preset {p['name']}", "", p["description"], "",
             (f"Pretraining {p['pretrain']['recipe']} ({p['pretrain']['steps']} steps)" if p.get("pretrain") else
              "No pretraining: the imported model (row base, before any step)") + f", CPT {p['cpt']['recipe']} "
             f"({p['cpt']['steps']} steps per variant); evaluation on held-out documents of {p['eval_length']} "
             f"tokens (validation part of split {p['split']}), RULER-style tasks at {p['task_lengths']} "
             f"({p['task_samples']} samples per task and length, another seed than the training documents; "
             f"strict score ± standard error). Locality and offload numbers over the sparse "
             f"decode steps; bytes and throughput for bf16 KV blocks over PCIe at 55 GB/s.", "",
             markdown_table(head, rows)]
    tasks = sorted({t for row in variants.values()
                    for t in ((row["result"] or {}).get("ruler") or {}).get("by_task", {})})
    if tasks:
        def task_cell(row, t):
            d = (((row["result"] or {}).get("ruler") or {}).get("by_task_detail") or {}).get(t)
            return _pm(d) if d else ((row["result"] or {}).get("ruler") or {}).get("by_task", {}).get(t)

        lines += ["", "RULER-style task scores (mean over lengths ± standard error):", "", markdown_table(
            ["variant", *tasks], [[_variant_label(v), *[task_cell(row, t) for t in tasks]]
                                  for v, row in variants.items()])]
    judged = verdicts(table)
    if judged:
        lines += ["", "Targets:", ""] + [f"- {x}" for x in judged]
    return "\n".join(lines) + "\n"


def _variant_label(v: str) -> str:
    return {"ed_dma": "ed_dma (NOSA)", "none": "none (InfLLM-V2)"}.get(v, v)


def ablation_plot(fig, table: dict) -> None:
    names = list(table["variants"])
    nums = [_row_numbers(table["variants"][v]) for v in names]
    panels = [("RULER average", "ruler"), ("gamma mean (sparse steps)", "gamma_mean"),
              ("fetched blocks / step / KV head", "fetched"), ("decode throughput vs dense (PCIe bound)", "vs_dense")]
    for i, (title, key) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        vals = [n[key] if n[key] is not None else 0.0 for n in nums]
        errs = [n["ruler_se"] or 0 for n in nums] if key == "ruler" else None
        ax.bar(range(len(names)), vals, yerr=errs, color=["C0" if n[key] is not None else "lightgray" for n in nums])
        ax.set_xticks(range(len(names)), names, rotation=30)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
        for x, n in enumerate(nums):
            if n[key] is not None:
                ax.text(x, vals[x], fmt(n[key], 2), ha="center", va="bottom", fontsize=7)
