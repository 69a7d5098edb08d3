"""Two versions of the code, or two settings, timed alike on one machine: an A/B of ``bench.train_throughput``.

The machine-to-machine spread of training throughput on one GPU kind (a few percent between two
starts of the same H200 image: clocks, host CPU) is as large as most changes worth measuring, so a
change is timed against its baseline on the same machine, in alternating order (A B B A ...: a slow
drift of the clocks cancels), with the same harness, data and settings. Each side is a checkout: the
baseline is ``--baseline REV`` (exported with ``git archive`` into ``OUT/baseline_src``) or an existing
``--baseline-src DIR``; the candidate is this checkout as it is (uncommitted edits included) or
``--candidate-src DIR``. To compare two settings of one checkout instead, give the overrides that differ
(``--baseline-overrides`` and / or ``--candidate-overrides``, Hydra ``key=value``, added to each run's
``--extra``) and no baseline: both sides then run the candidate checkout. Usage::

    python -m bench.probes.ab_throughput --baseline main --out DIR [--repeats 2] [--runs nosa_1gpu_nr] \\
        [-- any bench.train_throughput options: --steps 17 --warmup 5 --layers 28 --seq 16384 ...]
    python -m bench.probes.ab_throughput --out DIR --baseline-overrides train.step_reads=each_step \\
        --candidate-overrides train.step_reads=at_log --runs nosa_1gpu_nr -- --extra train.log_interval=5

Writes ``DIR/ab_throughput.json`` (every run's ``train_throughput`` result and the summary; rewritten after
every run, ``complete`` false until the last, so that a stopped comparison keeps what it measured) and prints,
per run name: tokens/s of each repeat on both sides, the change of the means, the spread within
each side, whether the change is larger than that spread, and whether the per-step losses are
identical on both sides (a performance change should not move them).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from runtime.outputs import write_json

ROOT = Path(__file__).resolve().parents[2]

SIDES = ("baseline", "candidate")


def run_order(repeats: int) -> list[tuple[str, int]]:
    """``(side, repeat)`` in A B B A A B ... order: each pair swaps who goes first."""
    order = []
    for i in range(repeats):
        pair = SIDES if i % 2 == 0 else SIDES[::-1]
        order += [(side, i) for side in pair]
    return order


def resolve_commit(repo: Path, rev: str) -> str:
    """The full hash of ``rev`` in the git repository ``repo``; ``ValueError`` where it names no commit."""
    got = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                         capture_output=True, text=True, check=False)
    if got.returncode != 0:
        raise ValueError(f"--baseline {rev!r} is not a commit of {repo}")
    return got.stdout.strip()


def export_revision(repo: Path, commit: str, dest: Path) -> None:
    """``commit``'s tree of the git repository ``repo`` extracted into ``dest`` (written under a temporary
    name, renamed when complete; a failed export removes its partial folder)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        with tempfile.TemporaryFile(dir=dest.parent) as tar:
            subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", commit], stdout=tar, check=True)
            tar.seek(0)
            with tarfile.open(fileobj=tar) as t:
                t.extractall(tmp, filter="data")
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def describe(src: Path) -> dict:
    """The checkout ``src``: its commit and whether it has uncommitted edits (None for a tree that is not
    the top of a git checkout, e.g. an exported one inside another repository)."""
    git = subprocess.run(["git", "-C", str(src), "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                         text=True, check=False)
    lines = git.stdout.split()
    if git.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != src.resolve():
        return {"path": str(src), "commit": None, "dirty": None}
    status = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True, check=False)
    return {"path": str(src), "commit": lines[1], "dirty": status.stdout.strip() != ""}


def summarize(results: dict[str, list[list[dict]]]) -> list[dict]:
    """Per run name, from ``results[side]`` = one ``train_throughput`` results list per repeat: tokens/s
    per repeat, the candidate's mean over the baseline's (``change``: +0.02 = 2% faster), the spread
    within each side (max / min - 1), whether ``|change|`` exceeds the larger spread (None with one repeat:
    no spread to compare with), and whether every repeat of both sides logged the same per-step losses."""
    names = [r["run"] for r in results[SIDES[0]][0]]
    rows = []
    for name in names:
        runs = {side: [next(r for r in rep if r["run"] == name) for rep in results[side]] for side in SIDES}
        missing = [f"{side} {i}" for side in SIDES for i, r in enumerate(runs[side], 1) if "tokens_per_s" not in r]
        if missing:  # skipped by train_throughput (e.g. nosa_tp2 on one GPU)
            rows.append({"run": name, "not_measured": missing})
            continue
        tps = {side: [r["tokens_per_s"] for r in runs[side]] for side in SIDES}
        mean = {side: statistics.fmean(tps[side]) for side in SIDES}
        spread = {side: max(tps[side]) / min(tps[side]) - 1 for side in SIDES}
        change = mean["candidate"] / mean["baseline"] - 1
        losses = [r["losses"] for side in SIDES for r in runs[side]]
        row = {"run": name, "tokens_per_s": tps, "mean": mean, "change": change, "spread": spread,
               "beyond_spread": abs(change) > max(spread.values()) if len(runs["baseline"]) > 1 else None,
               "losses_identical": all(x == losses[0] for x in losses[1:])}
        idle = {side: [r["gpu_idle"]["gpu_idle_ms_per_step"] for r in runs[side] if r.get("gpu_idle")]
                for side in SIDES}
        if all(idle.values()):
            row["gpu_idle_ms_per_step"] = {side: statistics.fmean(v) for side, v in idle.items()}
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    out = ["| run | baseline tokens/s | candidate tokens/s | change of the means | spread (base / cand) | "
           "beyond the spread | losses identical | GPU idle ms/step (base / cand) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "not_measured" in r:
            out.append(f"| {r['run']} | not measured: {', '.join(r['not_measured'])} | | | | | | |")
            continue
        idle = r.get("gpu_idle_ms_per_step")
        out.append(
            f"| {r['run']} | {', '.join(f'{x:,.0f}' for x in r['tokens_per_s']['baseline'])} | "
            f"{', '.join(f'{x:,.0f}' for x in r['tokens_per_s']['candidate'])} | {100 * r['change']:+.2f}% | "
            f"{100 * r['spread']['baseline']:.2f}% / {100 * r['spread']['candidate']:.2f}% | "
            f"{ {True: 'yes', False: 'no', None: 'one repeat: unknown'}[r['beyond_spread']]} | "
            f"{'yes' if r['losses_identical'] else 'NO'} | "
            + (f"{idle['baseline']:.1f} / {idle['candidate']:.1f} |" if idle else "- |"))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    base = p.add_mutually_exclusive_group()
    base.add_argument("--baseline", help="git revision of this repository to compare against")
    base.add_argument("--baseline-src", help="a checkout to compare against (default with overrides: the candidate's)")
    p.add_argument("--candidate-src", default=str(ROOT), help="the checkout under test (default: this one)")
    for side in SIDES:
        p.add_argument(f"--{side}-overrides", nargs="+", default=[], metavar="KEY=VALUE",
                       help=f"Hydra overrides of the {side}'s runs only (added to train_throughput's --extra)")
    p.add_argument("--out", required=True, help="a new or empty folder")
    p.add_argument("--repeats", type=int, default=2, help="runs of each side (alternating order)")
    p.add_argument("--runs", default="nosa_1gpu_nr", help="train_throughput runs, e.g. nosa_1gpu_nr,dense_doc_1gpu_nr")
    a = p.parse_args(argv[:split])
    passthrough = argv[split + 1:]
    if any(x in ("--out", "--runs", "--source") or x.startswith(("--out=", "--runs=", "--source="))
           for x in passthrough):
        p.error("--out, --runs and --source are set by this script; give only other train_throughput options after --")
    if a.repeats < 1:
        p.error("--repeats must be at least 1")
    overrides = {side: getattr(a, f"{side}_overrides") for side in SIDES}
    bad = [o for side in SIDES for o in overrides[side] if "=" not in o or o.startswith("=")]
    if bad:
        p.error(f"overrides are Hydra key=value, got {bad}")
    if not (a.baseline or a.baseline_src):
        if overrides["baseline"] == overrides["candidate"]:
            p.error("give --baseline REV or --baseline-src DIR (code A/B), or overrides that differ between the "
                    "sides (settings A/B)")
        a.baseline_src = a.candidate_src
    out = Path(a.out).resolve()
    if out.exists() and any(out.iterdir()):
        p.error(f"--out {out} is not empty; choose a new folder")
    candidate = Path(a.candidate_src).resolve()
    baseline = out / "baseline_src" if a.baseline else Path(a.baseline_src).resolve()
    commit = None
    if a.baseline:
        try:
            commit = resolve_commit(ROOT, a.baseline)
        except ValueError as e:
            p.error(str(e))
    checkouts = [("candidate", candidate)] + ([] if a.baseline else [("baseline", baseline)])  # an export has one
    for side, src in checkouts:
        if not (src / "train" / "main.py").is_file():
            p.error(f"the {side} {src} has no train/main.py")
    out.mkdir(parents=True, exist_ok=True)
    if a.baseline:
        export_revision(ROOT, commit, baseline)
        sides = {"baseline": {"path": str(baseline), "commit": commit, "dirty": False, "revision": a.baseline}}
    else:
        sides = {"baseline": describe(baseline)}
    sides["candidate"] = describe(candidate)
    for side in SIDES:
        sides[side]["overrides"] = overrides[side]
    srcs = {"baseline": baseline, "candidate": candidate}
    results: dict[str, list[list[dict]]] = {side: [] for side in SIDES}
    envs: dict[str, list[dict]] = {side: [] for side in SIDES}
    order = run_order(a.repeats)
    doc = {"sides": sides, "order": [f"{s} {i + 1}" for s, i in order], "train_throughput_args": passthrough,
           "runs": a.runs, "complete": False, "summary": [], "results": results, "env": envs}
    t0 = time.time()
    for n, (side, i) in enumerate(order, 1):
        run_out = out / f"{side}_{i + 1}"
        print(f"[{n}/{len(order)}] {side} repeat {i + 1}: {a.runs} ({time.time() - t0:.0f} s)", flush=True)
        cmd = [sys.executable, "-m", "bench.train_throughput", "--out", str(run_out), "--runs", a.runs,
               "--source", str(srcs[side]), *passthrough]
        if overrides[side]:
            cmd += ["--extra", *overrides[side]]  # train_throughput adds up repeated --extra lists
        with open(out / f"{side}_{i + 1}.log", "w") as log:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
        got = run_out / "train_throughput.json"
        run = json.loads(got.read_text()) if rc == 0 and got.exists() else {"results": []}
        failed = [r["run"] for r in run["results"] if "tokens_per_s" not in r and "skipped" not in r]
        if rc != 0 or not got.exists() or failed:
            print(f"error: {side} repeat {i + 1} failed (rc {rc}{', runs ' + ', '.join(failed) if failed else ''}); "
                  f"see {out / f'{side}_{i + 1}.log'} and {run_out}", file=sys.stderr)
            return 1
        results[side].append(run["results"])
        envs[side].append(run["env"])
        pairs = min(len(results[x]) for x in SIDES)  # the summary so far: repeats both sides have finished
        doc["complete"] = n == len(order)
        doc["summary"] = summarize({x: results[x][:pairs] for x in SIDES}) if pairs else []
        write_json(out / "ab_throughput.json", doc)  # after every run: a stopped comparison keeps what it measured
    print(f"\nbaseline: {sides['baseline']}\ncandidate: {sides['candidate']}\norder: {' '.join(doc['order'])}\n")
    print(table(doc["summary"]))
    return 0



if __name__ == "__main__":
    sys.exit(main())
