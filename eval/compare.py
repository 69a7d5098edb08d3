"""Side by side: the eval outputs and training runs of any number of models, e.g. a NOSA model against a
dense baseline trained separately.

    python -m eval.compare [NAME=]DIR[,DIR...] [NAME=]DIR[,DIR...] ... [--out DIR]

Each argument is one column; its dirs (a run dir, an eval output dir, or both, comma-separated) are
read for ``metrics.jsonl`` (a training run: steps, final loss, validation loss, tokens/s, peak
memory), ``ruler.json`` (RULER average, per task and per length), ``ppl.json`` (perplexity per
position bucket and overall), ``locality.json`` (gamma, fetches, offload cost) and ``result.json``
(``eval.suite``: its locality, RULER and perplexity). The column's name is ``NAME`` or the last dir's
name. Rows a column has no file for are ``-``; the best value of a row is in bold where lower or
higher is better. Prints the markdown; with ``--out`` writes ``compare.md``, ``compare.json`` and
``compare.png`` (training loss curves, RULER per task, perplexity per bucket) there.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from eval.errors import EvalError
from eval.report import fmt, save_plot
from runtime.outputs import write_atomic, write_json
from runtime.run_metrics import METRICS, read_metrics, run_figures

FILES = (METRICS, "ruler.json", "ppl.json", "locality.json", "result.json")
LOWER, HIGHER = "lower", "higher"


@dataclass
class Column:
    """One model: its name, its dirs and what was read from them (``files``: the paths used)."""

    name: str
    dirs: list[str]
    files: list[str] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)
    figures: dict = field(default_factory=dict)  # runtime.run_metrics.run_figures of the metrics
    ruler: Optional[dict] = None
    ppl: Optional[dict] = None
    locality: Optional[dict] = None  # the summary block, plus "dense"


def parse_column(arg: str) -> tuple[Optional[str], list[Path]]:
    """``[NAME=]DIR[,DIR...]`` -> (name or None, dirs)."""
    name, sep, rest = arg.partition("=")
    if not sep or "/" in name or not name:
        name, rest = None, arg
    dirs = [Path(d) for d in rest.split(",") if d]
    return name, dirs


def read_column(arg: str) -> Column:
    """Everything the dirs of one argument hold; one-line errors for missing dirs or no known file."""
    name, dirs = parse_column(arg)
    if not dirs:
        raise EvalError(f"{arg!r}: give a dir (NAME=DIR[,DIR...])")
    col = Column(name or dirs[-1].resolve().name, [str(d) for d in dirs])
    for d in dirs:
        if not d.is_dir():
            raise EvalError(f"{d}: no such directory")
        if (d / METRICS).is_file():
            col.metrics = read_metrics(d)
            col.figures = run_figures(col.metrics)
            col.files.append(str(d / METRICS))
        suite = _load(d / "result.json", col)
        if suite:
            col.ruler = col.ruler or suite.get("ruler")
            col.ppl = col.ppl or suite.get("ppl")
            col.locality = col.locality or {**(suite.get("locality") or {}), "dense": suite.get("dense")}
        col.ruler = _load(d / "ruler.json", col) or col.ruler
        col.ppl = _load(d / "ppl.json", col) or col.ppl
        loc = _load(d / "locality.json", col)
        if loc:
            col.locality = {**loc["summary"], "dense": loc.get("dense")}
    if not col.files:
        raise EvalError(f"{arg}: none of {', '.join(FILES)} there (give a run dir or an eval output dir)")
    return col


def _load(path: Path, col: Column) -> Optional[dict]:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise EvalError(f"{path}: not JSON ({e})") from None
    col.files.append(str(path))
    return data


def rows(cols: list[Column]) -> list[dict]:
    """``{section, metric, better, values}`` rows: the union over the columns, in a fixed order."""
    out: list[dict] = []

    def add(section: str, metric: str, better: Optional[str], get) -> None:
        values = [get(c) for c in cols]
        if any(v is not None for v in values):
            out.append({"section": section, "metric": metric, "better": better, "values": values})

    for key, label, better in (("steps", "steps", None), ("loss", "final loss", LOWER),
                               ("val_loss", "validation loss", LOWER), ("tokens_per_s", "tokens/s", HIGHER),
                               ("peak_mem_gib", "peak memory GiB", LOWER), ("nosa_gamma_mean", "NOSA gamma", HIGHER)):
        add("training", label, better, lambda c, k=key: c.figures.get(k))
    add("RULER", "average", HIGHER, lambda c: (c.ruler or {}).get("average"))
    for task in _union(list((c.ruler or {}).get("by_task") or {}) for c in cols):
        add("RULER", task, HIGHER, lambda c, t=task: ((c.ruler or {}).get("by_task") or {}).get(t))
    for n in _union(list((c.ruler or {}).get("by_length") or {}) for c in cols):
        add("RULER", f"at {n} tokens", HIGHER, lambda c, n=n: ((c.ruler or {}).get("by_length") or {}).get(n))
    add("perplexity", "overall", LOWER, lambda c: ((c.ppl or {}).get("overall") or {}).get("ppl"))
    for rng in _union([b["range"] for b in (c.ppl or {}).get("buckets", [])] for c in cols):
        add("perplexity", f"positions {rng}", LOWER, lambda c, r=rng: next(
            (b["ppl"] for b in (c.ppl or {}).get("buckets", []) if b["range"] == r), None))
    for key, label, better in (("gamma_mean", "gamma mean", HIGHER), ("gamma_min", "gamma min", HIGHER),
                               ("fetched_per_step", "blocks fetched/step/head", LOWER),
                               ("sim_hit_rate", "simulated cache hit rate", HIGHER),
                               ("bytes_per_token", "host->device bytes/token", LOWER),
                               ("throughput_ratio_vs_dense", "decode throughput x dense", HIGHER)):
        add("locality", label, better, lambda c, k=key: (c.locality or {}).get(k))
    return out


def _union(lists) -> list:
    return list(dict.fromkeys(x for xs in lists for x in xs))


def _best(values: list, better: Optional[str]) -> Optional[int]:
    nums = [(v, i) for i, v in enumerate(values) if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if better is None or len(nums) < 2 or len({v for v, _ in nums}) < 2:
        return None
    return (min(nums) if better == LOWER else max(nums))[1]


def markdown(cols: list[Column], table: list[dict]) -> str:
    head = "| | " + " | ".join(c.name for c in cols) + " |"
    lines = ["# Comparison", "", "Columns: " + "; ".join(f"**{c.name}** ({', '.join(c.dirs)})" for c in cols), "",
             "↑ higher is better, ↓ lower is better; the best value of a row is in bold."]
    for section in dict.fromkeys(r["section"] for r in table):
        lines += ["", f"## {section}", "", head, "|" + " --- |" * (len(cols) + 1)]
        for r in (r for r in table if r["section"] == section):
            best = _best(r["values"], r["better"])
            cells = [f"**{fmt(v)}**" if i == best else fmt(v) for i, v in enumerate(r["values"])]
            note = {LOWER: " ↓", HIGHER: " ↑"}.get(r["better"], "")
            lines.append(f"| {r['metric']}{note} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(cols: list[Column], table: list[dict], path: Path) -> Optional[Path]:
    """Training loss curves, RULER per task and perplexity per position bucket (the panels with data)."""
    panels = []
    if any(c.metrics for c in cols):
        panels.append("loss")
    for section in ("RULER", "perplexity"):
        if any(r["section"] == section for r in table):
            panels.append(section)
    if not panels:
        return None

    def draw(fig):
        for k, panel in enumerate(panels):
            ax = fig.add_subplot(1, len(panels), k + 1)
            if panel == "loss":
                for c in cols:
                    pts = [(r["step"], r["loss"]) for r in c.metrics if r.get("loss") is not None]
                    if pts:
                        ax.plot(*zip(*pts), label=c.name)
                ax.set_xlabel("step")
                ax.set_ylabel("training loss")
            else:
                sel = [r for r in table if r["section"] == panel and (panel != "RULER" or r["metric"] != "average")
                       and not r["metric"].startswith("at ")]
                width = 0.8 / len(cols)
                for i, c in enumerate(cols):
                    ys = [r["values"][i] if r["values"][i] is not None else 0 for r in sel]
                    ax.bar([j + i * width for j in range(len(sel))], ys, width, label=c.name)
                ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sel))])
                ax.set_xticklabels([r["metric"].replace("positions ", "") for r in sel], rotation=30, ha="right",
                                   fontsize=8)
                ax.set_ylabel("score" if panel == "RULER" else "perplexity")
            ax.set_title(panel if panel != "loss" else "training")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)

    return save_plot(path, draw, figsize=(5 * len(panels), 4.2))


def compare(args: list[str], out: Optional[str] = None, log=print) -> dict:
    """Read every column, print the markdown; with ``out`` write compare.{md,json,png}; returns the JSON."""
    if not args:
        raise EvalError("give at least one dir (python -m eval.compare [NAME=]DIR[,DIR...] ...)")
    cols = [read_column(a) for a in args]
    names = [c.name for c in cols]
    if len(set(names)) != len(names):
        raise EvalError(f"two columns are named {next(n for n in names if names.count(n) > 1)!r}; "
                        f"name them: NAME=DIR")
    table = rows(cols)
    if not table:
        raise EvalError("the dirs hold no numbers to compare")
    text = markdown(cols, table)
    result = {"columns": [{"name": c.name, "dirs": c.dirs, "files": c.files} for c in cols], "rows": table}
    log(text.rstrip())
    if out:
        out_dir = Path(out)
        write_json(out_dir / "compare.json", result)
        write_atomic(out_dir / "compare.md", text)
        plot(cols, table, out_dir / "compare.png")
        log(f"wrote {out_dir}/compare.md, compare.json, compare.png")
    return result


def main(argv=None) -> int:
    from runtime.cli import run_cli

    ap = argparse.ArgumentParser(prog="python -m eval.compare", description=__doc__.split("\n\n")[0],
                                 epilog="each DIR: a run dir (metrics.jsonl) and / or an eval output dir")
    ap.add_argument("dirs", nargs="+", metavar="[NAME=]DIR[,DIR...]", help="one column per argument")
    ap.add_argument("--out", default=None, help="write compare.md, compare.json and compare.png here")
    a = ap.parse_args(argv)
    return run_cli("eval.compare", compare, a.dirs, a.out)

if __name__ == "__main__":
    sys.exit(main())
