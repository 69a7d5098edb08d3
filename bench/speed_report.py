"""Where NOSA training stands against its speed targets: one table from the benchmarks' JSON files.

The targets are those of NOSA training's speed work (issue 13): the sparse attention kernels against the
ideal (dense cuDNN time x key density) and against FlexAttention with a bias gradient, real (smooth)
selections per useful FLOP against P1 key sets, the selection's share of the sparse forward, the index
build's GPU time, and end to end NOSA against dense tokens/s at 16K and 32K with steady steps and no more
memory. Each row says the target, the measured value and whether it is met.

Either from files already measured (any of them; each file gives the rows it can)::

    python -m bench.speed_report --out DIR --attention A.json [A2.json ...] [--selection S.json ...] \\
        [--train-16k T16.json] [--train-32k T32.json] [--strict]

(``A``: ``bench.attention`` default mode, ``S``: its ``--selection`` mode, ``T``: ``bench.train_throughput``
with one NOSA and one dense run), or measuring first on one GPU (about 10 minutes on an H200)::

    python -m bench.speed_report --out DIR --run [--strict]

Writes ``DIR/speed_report.json`` and prints the table; ``--strict`` exits 1 when a target is not met.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from data.demo_corpus import DEFAULT_OUT
from runtime.outputs import write_json

ROOT = Path(__file__).resolve().parent.parent

FWD_X_IDEAL, BWD_X_IDEAL, SMOOTH_OVER_P1 = 1.35, 1.8, 1.3
SELECTION_SHARE, SELECTION_SHAPE, INDEX_GPU_MS = 0.20, (32768, 32), 0.3
E2E = {"16K": (1.1, 1.25), "32K": (1.4, 1.7)}  # NOSA / dense tokens/s: target, stretch
P90_OVER_MEDIAN = 1.10

DEMO_CORPUS = Path(DEFAULT_OUT) / "corpus_text_document"  # bench.train_throughput's default data
# what --run measures (python's arguments, run in this checkout; relative output folders)
RUN_STEPS = [
    ("attention", ["-m", "bench.attention", "--shapes", "32768x32,16384x16"], "attention_bench.json"),
    ("selection", ["-m", "bench.attention", "--shapes", "32768x32,16384x16", "--selection", "--no-flex"],
     "attention_selection.json"),
    ("train_16k", ["-m", "bench.train_throughput", "--steps", "25", "--warmup", "5", "--runs",
                   "nosa_1gpu_nr,dense_doc_1gpu_nr", "--extra", "train.log_interval=5"], "train_throughput.json"),
    ("train_32k", ["-m", "bench.train_throughput", "--global-batch", "8", "--steps", "9", "--warmup", "3",
                   "--layers", "14", "--seq", "32768", "--runs", "dense_1gpu_nr,nosa_1gpu_nr", "--extra",
                   "model.max_position_embeddings=32768"], "train_throughput.json"),
]


def check(target: str, where: str, value: str, met: bool | None, stretch: bool = False) -> dict:
    """One row: ``met`` None where the value is shown without a target; a stretch target's row is not counted
    as a target not met."""
    return {"target": target, "where": where, "value": value, "met": met, "stretch": stretch}


def shape_name(T: int, HQ: int) -> str:
    return f"{T // 1024}K/{HQ}"


def load_rows(path: str | Path) -> list[dict]:
    """The ``rows`` of a ``bench.attention`` JSON file (``{"meta": ..., "rows": [...]}``)."""
    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise ValueError(f"{path}: not a bench.attention result (no 'rows' list)")
    return doc["rows"]


def _by_shape(rows: list[dict], kind: str) -> dict[tuple[int, int], list[dict]]:
    out: dict[tuple[int, int], list[dict]] = {}
    for r in rows:
        if r.get("kind") == kind:
            out.setdefault((r["T"], r["HQ"]), []).append(r)
    return out


def kernel_checks(rows: list[dict]) -> list[dict]:
    """Against the ideal and FlexAttention on P1 key sets, and smooth selections per useful FLOP against P1."""
    out = []
    p1, flex = _by_shape(rows, "ours_p1_db"), _by_shape(rows, "flex_p1_bias_grad")
    smooth = _by_shape(rows, "ours_nosa_smooth_db")
    for shape, (r, *_) in sorted(p1.items(), reverse=True):
        where = shape_name(*shape)
        out.append(check(f"forward <= {FWD_X_IDEAL}x ideal (P1)", where, f"{r['fwd_x_ideal']:.3f}x",
                         r["fwd_x_ideal"] <= FWD_X_IDEAL))
        out.append(check(f"backward with d(bias) <= {BWD_X_IDEAL}x ideal (P1)", where, f"{r['bwd_x_ideal']:.3f}x",
                         r["bwd_x_ideal"] <= BWD_X_IDEAL))
        if shape in flex:
            f = flex[shape][0]
            for d in ("fwd", "bwd"):
                out.append(check(f"{'forward' if d == 'fwd' else 'backward'} faster than FlexAttention with a "
                                 f"bias gradient", where, f"{r[d + '_ms']:.3f} vs {f[d + '_ms']:.3f} ms",
                                 r[d + "_ms"] < f[d + "_ms"]))
        if shape in smooth:
            s = smooth[shape][0]
            for d in ("fwd", "bwd"):
                ratio = s[d + "_x_ideal"] / r[d + "_x_ideal"]
                out.append(check(f"smooth selections per useful FLOP <= {SMOOTH_OVER_P1}x P1 "
                                 f"({'forward' if d == 'fwd' else 'backward'})", where, f"{ratio:.3f}x",
                                 ratio <= SMOOTH_OVER_P1))
    return out


def selection_checks(rows: list[dict]) -> list[dict]:
    """The selection's share of the sparse forward (target at 32K/32) and the index build's GPU time."""
    out = []
    p1 = _by_shape(rows, "ours_p1_db")
    for shape, sels in sorted(_by_shape(rows, "selection_breakdown").items(), reverse=True):
        where = shape_name(*shape)
        shares = [s["selection_over_p1_forward"] for s in sels if "selection_over_p1_forward" in s]
        if not shares and shape in p1:  # the default mode: one breakdown, the P1 forward of the same run
            shares = [s["total_ms"] / p1[shape][0]["fwd_ms"] for s in sels]
        if shares:
            share = max(shares)
            out.append(check(f"selection <= {SELECTION_SHARE:.0%} of the sparse forward", where, f"{share:.1%}",
                             share <= SELECTION_SHARE if shape == SELECTION_SHAPE else None))
        gpu = [s["index_gpu_ms"] for s in sels if "index_gpu_ms" in s]
        if gpu:
            free = all(s.get("prepare_sync_free") is True for s in sels)
            out.append(check(f"index build <= {INDEX_GPU_MS} ms of GPU time, no host sync", where,
                             f"{max(gpu):.4f} ms, {'sync-free' if free else 'SYNCS'}",
                             max(gpu) <= INDEX_GPU_MS and free))
    return out


def train_checks(doc: dict, label: str) -> list[dict]:
    """NOSA against dense of one ``bench/train_throughput.py`` result (one NOSA run, one dense run)."""
    runs = [r for r in doc.get("results", []) if "tokens_per_s" in r]
    nosa = [r for r in runs if r["run"].startswith("nosa")]
    dense = [r for r in runs if r["run"].startswith("dense")]
    if len(nosa) != 1 or len(dense) != 1:
        raise ValueError(f"{label}: needs one measured NOSA run and one dense run, got "
                         f"{[r['run'] for r in runs]}")
    n, d = nosa[0], dense[0]
    floor, stretch = E2E[label]
    ratio = n["tokens_per_s"] / d["tokens_per_s"]
    where = f"{label} ({n['run']} / {d['run']})"
    out = [check(f"NOSA >= {floor}x dense tokens/s (total tokens / total time)", where,
                 f"{ratio:.3f}x ({n['tokens_per_s']:,.0f} / {d['tokens_per_s']:,.0f})", ratio >= floor),
           check(f"stretch: NOSA >= {stretch}x dense", where, f"{ratio:.3f}x", ratio >= stretch, stretch=True)]
    if n.get("p90_over_median") is not None:
        out.append(check(f"NOSA step time p90 / median <= {P90_OVER_MEDIAN}", where, f"{n['p90_over_median']:.3f}",
                         n["p90_over_median"] <= P90_OVER_MEDIAN))
    if n.get("peak_mem_gib") is not None and d.get("peak_mem_gib") is not None:
        out.append(check("NOSA peak memory <= dense", where, f"{n['peak_mem_gib']:.1f} vs {d['peak_mem_gib']:.1f} GiB",
                         n["peak_mem_gib"] <= d["peak_mem_gib"]))
    return out


def table(checks: list[dict]) -> str:
    lines = ["| target | where | measured | met |", "|---|---|---|---|"]
    for c in checks:
        met = {True: "yes", False: "**no**", None: "-"}[c["met"]]
        lines.append(f"| {c['target']} | {c['where']} | {c['value']} | {met} |")
    return "\n".join(lines)


def report(attention: list[str], selection: list[str], train: dict[str, str]) -> list[dict]:
    """Every row the given files give (attention and selection files may be several)."""
    checks = []
    att_rows = [r for p in attention for r in load_rows(p)]
    checks += kernel_checks(att_rows)
    sel_rows = [r for p in selection for r in load_rows(p)] or att_rows
    checks += selection_checks(sel_rows)
    for label, path in train.items():
        checks += train_checks(json.loads(Path(path).read_text()), label)
    return checks


def measure(out: Path) -> dict[str, Path]:
    """Run the benchmarks of ``RUN_STEPS`` into ``out/<name>`` (this checkout, this GPU); their JSON paths."""
    paths = {}
    t0 = time.time()
    for name, cmd, result in RUN_STEPS:
        folder = out / name
        print(f"[{name}] python {' '.join(cmd)} ({time.time() - t0:.0f} s)", flush=True)
        with open(out / f"{name}.log", "w") as log:
            rc = subprocess.run([sys.executable, *cmd, "--out", str(folder)], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT, check=False).returncode
        if rc != 0 or not (folder / result).exists():
            raise RuntimeError(f"{name} failed (rc {rc}); see {out / f'{name}.log'}")
        paths[name] = folder / result
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for speed_report.json (and the runs of --run)")
    ap.add_argument("--run", action="store_true", help="measure first (one GPU), then report")
    ap.add_argument("--attention", nargs="+", default=[], help="bench.attention default-mode JSON files")
    ap.add_argument("--selection", nargs="+", default=[], help="bench.attention --selection JSON files")
    ap.add_argument("--train-16k", help="bench/train_throughput.py JSON of a 16K NOSA / dense pair")
    ap.add_argument("--train-32k", help="bench/train_throughput.py JSON of a 32K NOSA / dense pair")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target is not met")
    a = ap.parse_args(argv)
    given = a.attention or a.selection or a.train_16k or a.train_32k
    if a.run == bool(given):
        ap.error("give --run, or result files (--attention / --selection / --train-16k / --train-32k), not both")
    out = Path(a.out)
    train = {k: v for k, v in (("16K", a.train_16k), ("32K", a.train_32k)) if v}
    missing = [p for p in [*a.attention, *a.selection, *train.values()] if not Path(p).is_file()]
    if missing:
        ap.error(f"no such file: {', '.join(missing)}")
    if a.run and not DEMO_CORPUS.with_suffix(".idx").is_file():  # the training pairs' data
        ap.error(f"--run trains on the demo corpus, not built yet ({DEMO_CORPUS}.idx): run python -m data.demo_corpus")
    taken = [name for name, _, _ in RUN_STEPS if (out / name).exists()] if a.run else []
    if taken:  # the benchmarks would mix their runs with what is there
        ap.error(f"--out {out} already holds {', '.join(taken)}: choose a new folder for --run")
    out.mkdir(parents=True, exist_ok=True)
    if a.run:
        try:
            paths = measure(out)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        a.attention, a.selection = [str(paths["attention"])], [str(paths["selection"])]
        train = {"16K": str(paths["train_16k"]), "32K": str(paths["train_32k"])}
    try:
        checks = report(a.attention, a.selection, train)
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    targets = [c for c in checks if not c["stretch"]]
    doc = {"inputs": {"attention": a.attention, "selection": a.selection, "train": train}, "checks": checks,
           "met": sum(c["met"] is True for c in targets), "not_met": sum(c["met"] is False for c in targets),
           "stretch_met": sum(c["met"] is True for c in checks if c["stretch"]),
           "stretch": sum(c["stretch"] for c in checks)}
    write_json(out / "speed_report.json", doc)
    print(table(checks))
    print(f"\ntargets: {doc['met']} met, {doc['not_met']} not met; stretch targets: {doc['stretch_met']} of "
          f"{doc['stretch']} met ({len(checks)} rows)")
    return 1 if a.strict and doc["not_met"] else 0


if __name__ == "__main__":
    sys.exit(main())
