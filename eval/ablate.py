"""Eviction-head ablation from one command: data, dense pretraining, CPT per variant, evaluation,
and one table + plot + JSON.

    python -m eval.ablate --preset tiny --out runs/ablate_tiny                    # CPU, minutes
    python -m eval.ablate --preset proof_h200 --out runs/proof --devices 0,1,2,3  # one process per GPU
    python -m eval.ablate --preset proof_h200 --out runs/proof --variants ed_dma,none,dense --scale 0.5

Steps (each skipped when its output is complete, so a re-run resumes and a finished variant is
never re-run):

1. data: the offline demo corpus (``data.demo_corpus``), the evaluation task set (``<out>/tasks``)
   and synthetic retrieval training documents of the same tasks (another seed), tokenized into
   indexed datasets blended with the corpus;
2. dense pretraining (``<out>/pretrain``; data parallel over every ``--devices`` GPU);
3. for each variant (``ed_dma, dma, s_dma, locret, none`` = InfLLM-V2, ``dense``): CPT from the
   pretrained checkpoint (``<out>/cpt/<variant>``), then ``eval.suite`` (``<out>/eval/<variant>``):
   locality + offload simulation, RULER-style tasks, perplexity by position. With several
   devices the variants run concurrently, one training process per GPU (``CUDA_VISIBLE_DEVICES``);
   on CPU one after another;
4. ``ablation.md``, ``ablation.json``, ``ablation.png`` under ``--out`` (written even when a
   variant failed; its row says where its log is). Exit status 1 if any variant failed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from eval.errors import EvalError
from eval.presets import VARIANTS, AblationPreset, get_preset
from eval.report import fmt, markdown_table, save_plot
from runtime.outputs import write_atomic, write_json
from eval.suite import RESULT, SuiteConfig

_PORTS = itertools.count(29400, 11)  # rendezvous ports of the single-process trainers, one per job
REPO_ROOT = Path(__file__).resolve().parent.parent
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass
class DataPaths:
    tokenizer: str
    corpus_prefix: str  # held-out documents come from its validation part
    pretrain_paths: list[str]
    cpt_paths: list[str]
    tasks: str


@dataclass
class Job:
    """One variant: CPT, then evaluation. ``status``: queued | training | evaluating | done | failed."""

    variant: str
    status: str = "queued"
    device: Optional[str] = None
    started: float = 0.0
    error: Optional[str] = None
    log: Optional[str] = None


@dataclass
class Ablation:
    preset: AblationPreset
    out: Path
    variants: list[str]
    devices: list[Optional[str]]  # GPU ids, or [None] for the CPU
    progress_s: float = 30.0
    jobs: dict = field(default_factory=dict)
    procs: dict = field(default_factory=dict)
    log_lock: threading.Lock = field(default_factory=threading.Lock)

    # ------------------------------------------------------------------ helpers
    def say(self, msg: str) -> None:
        with self.log_lock:
            print(f"[ablate {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def run_logged(self, key: str, cmd: list[str], log: Path, device: Optional[str], nproc: int = 1) -> int:
        """Run ``cmd`` with output in ``log``, pinned to ``device`` (GPU ids) or the CPU."""
        env = dict(os.environ, PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                   WANDB_MODE=os.environ.get("WANDB_MODE", "disabled"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        if device is not None:
            env["CUDA_VISIBLE_DEVICES"] = device
            if nproc > 1:
                env.update({k: os.environ.get(k, v) for k, v in NCCL_ENV.items()})
            else:  # a port per job: concurrent single-process trainers (one GPU or several) must not share one
                env.setdefault("MASTER_PORT", str(next(_PORTS)))
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as fh:
            fh.write(f"\n$ {' '.join(cmd)}\n")
            fh.flush()
            p = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            self.procs[key] = p
            try:
                return p.wait()
            finally:
                self.procs.pop(key, None)

    def stop_all(self) -> None:
        for p in list(self.procs.values()):
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    # ------------------------------------------------------------------ 1. data
    def prepare_data(self) -> DataPaths:
        from data.demo_corpus import DEFAULT_OUT, SMALL, DemoSpec, build_demo
        from data.preprocess import preprocess
        from data.sources import write_jsonl
        from data.tokenizer import Tokenizer
        from eval.tasks import TaskSetConfig, build_task_set, load_haystack, training_documents

        p = self.preset
        demo_dir = DEFAULT_OUT if p.demo == "full" else str(self.out / "data" / "demo")
        self.say(f"data: demo corpus ({p.demo}) in {demo_dir}")
        man = build_demo(demo_dir, DemoSpec() if p.demo == "full" else SMALL, log=self.say)
        tok = Tokenizer(man["tokenizer"])
        tasks_dir, data_dir = self.out / "tasks", self.out / "data"
        merged = {name: str(data_dir / f"train_{name}_text_document") for name in ("pretrain", "cpt")}
        todo = [n for n, pre in merged.items() if not Path(pre + ".idx").is_file()]
        if not (tasks_dir / "tasks.json").is_file() or todo:
            hay = load_haystack(man["corpus"], tok)
            if not (tasks_dir / "tasks.json").is_file():
                self.say(f"data: evaluation task set at {p.task_lengths} ({p.task_samples} samples per task)")
                build_task_set(man["corpus"], tok, tasks_dir,
                               TaskSetConfig(lengths=p.task_lengths, samples=p.task_samples), log=self.say, hay=hay)
            for name in todo:
                lengths = p.pretrain_doc_lengths if name == "pretrain" else p.cpt_doc_lengths
                docs = training_documents(hay, tok, lengths, _task_names(), p.train_docs, 0)
                data_dir.mkdir(parents=True, exist_ok=True)
                jsonl, retrieval = (data_dir / f"retrieval_{name}.jsonl",
                                    str(data_dir / f"retrieval_{name}_text_document"))
                write_jsonl(str(jsonl), docs)
                preprocess(str(jsonl), man["tokenizer"], retrieval, progress=False)
                n_docs, n_tok = merge_indexed(merged[name], [retrieval, man["indexed_prefix"]], tok.vocab_size)
                self.say(f"data: {name} = {len(docs)} retrieval documents at {lengths} + the corpus "
                         f"({n_docs} documents, {n_tok} tokens)")
        # Both stages hold the same number of documents, so the validation part of the split (the
        # last documents: corpus documents) is the same held-out set in both.
        return DataPaths(man["tokenizer"], merged["cpt"], [merged["pretrain"]], [merged["cpt"]], str(tasks_dir))

    # ------------------------------------------------------------------ 2./3. training
    def train_args(self, stage, run_dir: Path, paths: list[str], tokenizer: str) -> list[str]:
        return [f"recipe={stage.recipe}", f"run.dir={run_dir}", f"train.max_steps={stage.steps}",
                f"data.paths=[{','.join(paths)}]", f"data.tokenizer={tokenizer}", f"data.split='{self.preset.split}'",
                *stage.overrides]

    @staticmethod
    def trained_steps(run_dir: Path) -> int:
        from runtime.checkpoint_files import find_checkpoint

        try:
            ckpt = find_checkpoint(run_dir)
        except FileNotFoundError:
            return 0
        if ckpt is None or not (ckpt / "nosa_config.json").is_file():
            return 0
        return int(json.loads((ckpt / "nosa_config.json").read_text()).get("step", 0))

    def train(self, key: str, args: list[str], run_dir: Path, steps: int, devices: list[Optional[str]]) -> None:
        """``train/main.py`` (torchrun over several GPUs); skipped when ``run_dir`` holds step ``steps``."""
        if self.trained_steps(run_dir) >= steps:
            self.say(f"{key}: already trained ({run_dir})")
            return
        gpus = [d for d in devices if d is not None]
        nproc = _data_parallel(args, len(gpus))
        main = str(REPO_ROOT / "train" / "main.py")
        cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", main]
               if nproc > 1 else [sys.executable, main]) + args
        rc = self.run_logged(key, cmd, run_dir.parent / f"{run_dir.name}.log", ",".join(gpus[:nproc]) or None, nproc)
        if rc != 0 or self.trained_steps(run_dir) < steps:
            raise RuntimeError(f"training exited with {rc}; see {run_dir.parent / f'{run_dir.name}.log'}")

    def pretrain(self, data: DataPaths) -> None:
        stage = self.preset.pretrain
        run_dir = self.out / "pretrain"
        self.say(f"pretrain: {stage.recipe}, {stage.steps} steps -> {run_dir}")
        t0 = time.time()
        stop = threading.Event()
        watcher = threading.Thread(target=self._watch_single, args=("pretrain", run_dir, stage.steps, stop, t0),
                                   daemon=True)
        watcher.start()
        try:
            self.train("pretrain", self.train_args(stage, run_dir, data.pretrain_paths, data.tokenizer), run_dir,
                       stage.steps, self.devices)
        finally:
            stop.set()
        self.say(f"pretrain: done ({time.time() - t0:.0f} s)")

    # ------------------------------------------------------------------ variants
    def run_variant(self, job: Job, device: Optional[str], data: DataPaths) -> None:
        v, stage = job.variant, self.preset.cpt
        cpt_dir, eval_dir = self.out / "cpt" / v, self.out / "eval" / v
        job.device, job.started, job.status = device, time.time(), "training"
        job.log = str(self.out / "cpt" / f"{v}.log")
        args = self.train_args(stage, cpt_dir, data.cpt_paths, data.tokenizer) + [
            f"attention={VARIANTS[v]}", f"init_from={self.out / 'pretrain'}"]
        self.train(v, args, cpt_dir, stage.steps, [device])
        job.status = "evaluating"
        cfg = self.suite_config()
        if device is None:  # CPU: in this process (one megatron import for every variant), output on the console
            from eval.suite import evaluate

            job.log = None
            evaluate(str(cpt_dir), data.tasks, data.corpus_prefix, str(eval_dir), cfg,
                     log=lambda m: self.say(f"{v}: {m}"))
        else:
            log = eval_dir.parent / f"{v}.log"
            job.log = str(log)
            cmd = [sys.executable, "-m", "eval.suite", "--ckpt", str(cpt_dir), "--tasks", data.tasks,
                   "--data", data.corpus_prefix, "--split", self.preset.split, "--length", str(cfg.length),
                   "--docs", str(cfg.docs), "--ppl-docs", str(cfg.ppl_docs), "--out", str(eval_dir)]
            rc = self.run_logged(f"{v}-eval", cmd, log, device)
            if rc != 0 or not (eval_dir / RESULT).is_file():
                raise RuntimeError(f"evaluation exited with {rc}; see {log}")
        job.status = "done"

    def suite_config(self) -> SuiteConfig:
        p = self.preset
        return SuiteConfig(length=p.eval_length, docs=p.locality_docs, ppl_docs=p.ppl_docs, split=p.split)

    def run_variants(self, data: DataPaths) -> None:
        todo: "queue.Queue[Job]" = queue.Queue()
        for v in self.variants:
            job = self.jobs[v] = Job(v)
            if (self.out / "eval" / v / RESULT).is_file():
                job.status = "done"
                self.say(f"{v}: already evaluated ({self.out / 'eval' / v})")
            else:
                todo.put(job)

        def worker(device: Optional[str]) -> None:
            while True:
                try:
                    job = todo.get_nowait()
                except queue.Empty:
                    return
                where = "cpu" if device is None else f"gpu {device}"
                self.say(f"{job.variant}: CPT + evaluation on {where}")
                try:
                    self.run_variant(job, device, data)
                    self.say(f"{job.variant}: done ({time.time() - job.started:.0f} s)")
                except Exception as e:  # noqa: BLE001 - one failed variant must not stop the others
                    job.status, job.error = "failed", f"{type(e).__name__}: {e}"
                    self.say(f"{job.variant}: FAILED: {job.error}")

        threads = [threading.Thread(target=worker, args=(d,), daemon=True) for d in self.devices]
        for t in threads:
            t.start()
        last = time.time()
        while any(t.is_alive() for t in threads):
            time.sleep(0.5)
            if time.time() - last >= self.progress_s:
                last = time.time()
                self.say("progress: " + "; ".join(self._job_line(j) for j in self.jobs.values()))

    def _job_line(self, job: Job) -> str:
        if job.status == "training":
            return f"{job.variant} {self._train_progress(self.out / 'cpt' / job.variant, self.preset.cpt.steps)}"
        if job.status in ("evaluating",):
            return f"{job.variant} evaluating ({time.time() - job.started:.0f} s)"
        return f"{job.variant} {job.status}"

    @staticmethod
    def _train_progress(run_dir: Path, steps: int) -> str:
        rows = _metrics(run_dir)
        losses = [r for r in rows if r.get("loss") is not None]
        if not losses:
            return "starting"
        r = losses[-1]
        return f"step {r['step']}/{steps} loss {r['loss']:.3f} ({r.get('tokens_per_s', 0):,.0f} tok/s)"

    def _watch_single(self, name: str, run_dir: Path, steps: int, stop: threading.Event, t0: float) -> None:
        while not stop.wait(self.progress_s):
            self.say(f"{name}: {self._train_progress(run_dir, steps)} ({time.time() - t0:.0f} s)")

    # ------------------------------------------------------------------ 4. table
    def collect(self) -> dict:
        rows = {}
        for v in self.variants:
            job = self.jobs.get(v) or Job(v)
            res_path = self.out / "eval" / v / RESULT
            result = json.loads(res_path.read_text()) if res_path.is_file() else None
            metrics = _metrics(self.out / "cpt" / v)
            train = [r["loss"] for r in metrics if r.get("loss") is not None]
            val = [r["val_loss"] for r in metrics if r.get("val_loss") is not None]
            rows[v] = {"status": "done" if result else job.status, "error": job.error, "log": job.log,
                       "train_loss": sum(train[-10:]) / len(train[-10:]) if train else None,
                       "val_loss": val[-1] if val else None, "steps": len(train), "result": result}
        return {"preset": asdict(self.preset), "variants": rows}

    def write_outputs(self, table: dict) -> list[Path]:
        files = [write_json(self.out / "ablation.json", table),
                 write_atomic(self.out / "ablation.md", ablation_markdown(table))]
        p = save_plot(self.out / "ablation.png", lambda fig: ablation_plot(fig, table), figsize=(12, 4))
        return files + ([p] if p else [])

    # ------------------------------------------------------------------ all
    def run(self) -> int:
        t0 = time.time()
        self.out.mkdir(parents=True, exist_ok=True)
        try:
            data = self.prepare_data()
            self.pretrain(data)
            self.run_variants(data)
        except KeyboardInterrupt:
            self.stop_all()
            raise
        except RuntimeError as e:  # the pretraining failed: no variant can run
            self.say(f"FAILED: {e}")
        finally:
            table = self.collect()
            files = self.write_outputs(table)
            print("\n" + ablation_markdown(table), flush=True)
            self.say(f"wrote {', '.join(str(f) for f in files)} ({time.time() - t0:.0f} s)")
        return 0 if all(r["status"] == "done" for r in table["variants"].values()) else 1


def merge_indexed(out_prefix: str, prefixes: list[str], vocab_size: int) -> tuple[int, int]:
    """One indexed dataset with the documents of ``prefixes`` in order (EODs kept), through a temp
    prefix renamed at the end; returns ``(documents, tokens)``."""
    from data.indexed import IndexedWriter, read_indexed

    tmp = f"{out_prefix}.tmp-{os.getpid()}"
    w = IndexedWriter(tmp, vocab_size)
    for prefix in prefixes:
        ds = read_indexed(prefix)
        for i in range(len(ds.sequence_lengths)):
            w.add(ds[i])
        del ds
    w.close()
    summary = (json.loads(Path(prefixes[-1] + ".summary.json").read_text())
               if Path(prefixes[-1] + ".summary.json").is_file() else {})
    write_json(Path(out_prefix + ".summary.json"), {"tokenizer": summary.get("tokenizer"), "sources": prefixes,
                                                     "documents": w.documents, "tokens": w.tokens})
    os.replace(tmp + ".bin", out_prefix + ".bin")
    os.replace(tmp + ".idx", out_prefix + ".idx")
    return w.documents, w.tokens


def _data_parallel(args: list[str], gpus: int) -> int:
    """The most GPUs (<= ``gpus``) that split the stage's global batch evenly; 1 unless the stage
    names ``train.global_batch_size`` and ``train.micro_batch_size`` in its overrides."""
    value = lambda key: next((int(a.split("=", 1)[1]) for a in args if a.startswith(key + "=")), None)  # noqa: E731
    gbs, mbs = value("train.global_batch_size"), value("train.micro_batch_size")
    if gbs is None or mbs is None:
        return 1
    n = max(1, gpus)
    while n > 1 and gbs % (mbs * n):
        n -= 1
    return n


def _task_names() -> list[str]:
    from eval.tasks import TASKS

    return list(TASKS)


def _metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


def _row_numbers(row: dict) -> dict:
    """The numbers of one variant's table row (None where not measured)."""
    r = row["result"] or {}
    loc, ppl, ruler = r.get("locality") or {}, (r.get("ppl") or {}).get("buckets") or [], r.get("ruler") or {}
    return {"train_loss": row["train_loss"], "val_loss": row["val_loss"],
            **{f"ppl {b['range']}": b["ppl"] for b in ppl}, "ruler": ruler.get("average"),
            "gamma_mean": loc.get("gamma_mean"), "gamma_min": loc.get("gamma_min"),
            "fetched": loc.get("fetched_per_step"),
            "mb_per_token": None if loc.get("bytes_per_token") is None else loc["bytes_per_token"] / 1e6,
            "tok_s": loc.get("decode_tokens_per_s"), "vs_dense": loc.get("throughput_ratio_vs_dense")}


def ablation_markdown(table: dict) -> str:
    p = table["preset"]
    variants = table["variants"]
    buckets = sorted({k for row in variants.values() for k in _row_numbers(row) if k.startswith("ppl ")},
                     key=lambda k: int(k.split()[1].split("-")[0].rstrip("K") or 0))
    head = ["variant", "status", "train loss", "val loss", *buckets, "RULER avg", "gamma mean", "gamma min",
            "fetched blocks/step", "MB/token H2D", "decode tok/s (PCIe)", "x dense"]
    rows = []
    for v, row in variants.items():
        n = _row_numbers(row)
        status = row["status"] if row["status"] != "failed" else f"failed ({row['log'] or row['error']})"
        rows.append([_variant_label(v), status, n["train_loss"], n["val_loss"], *[n.get(b) for b in buckets],
                     n["ruler"], n["gamma_mean"], n["gamma_min"], n["fetched"], n["mb_per_token"], n["tok_s"],
                     n["vs_dense"]])
    lines = [f"# Eviction-head ablation: preset {p['name']}", "", p["description"], "",
             f"Pretraining {p['pretrain']['recipe']} ({p['pretrain']['steps']} steps), CPT {p['cpt']['recipe']} "
             f"({p['cpt']['steps']} steps per variant); evaluation on held-out documents of {p['eval_length']} "
             f"tokens (validation part of split {p['split']}), RULER-style tasks at {p['task_lengths']} "
             f"({p['task_samples']} samples per task and length). Locality and offload numbers over the sparse "
             f"decode steps; bytes and throughput for bf16 KV blocks over PCIe at 55 GB/s.", "",
             markdown_table(head, rows)]
    tasks = sorted({t for row in variants.values()
                    for t in ((row["result"] or {}).get("ruler") or {}).get("by_task", {})})
    if tasks:
        lines += ["", "RULER-style task scores (mean over lengths):", "", markdown_table(
            ["variant", *tasks],
            [[_variant_label(v), *[((row["result"] or {}).get("ruler") or {}).get("by_task", {}).get(t)
                                   for t in tasks]] for v, row in variants.items()])]
    return "\n".join(lines) + "\n"


def _variant_label(v: str) -> str:
    return {"ed_dma": "ed_dma (NOSA)", "none": "none (InfLLM-V2)"}.get(v, v)


def ablation_plot(fig, table: dict) -> None:
    names = list(table["variants"])
    nums = [_row_numbers(table["variants"][v]) for v in names]
    panels = [("RULER average", "ruler"), ("gamma mean (sparse steps)", "gamma_mean"),
              ("decode throughput vs dense (PCIe bound)", "vs_dense")]
    for i, (title, key) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        vals = [n[key] if n[key] is not None else 0.0 for n in nums]
        ax.bar(range(len(names)), vals, color=["C0" if n[key] is not None else "lightgray" for n in nums])
        ax.set_xticks(range(len(names)), names, rotation=30)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
        for x, n in enumerate(nums):
            if n[key] is not None:
                ax.text(x, vals[x], fmt(n[key], 2), ha="center", va="bottom", fontsize=7)


def parse_devices(spec: Optional[str]) -> list[Optional[str]]:
    """``0,1,2,3`` -> GPU ids; ``cpu`` or no GPU -> ``[None]`` (the CPU); default: every visible GPU."""
    if spec == "cpu":
        return [None]
    if spec:
        ids = [d.strip() for d in spec.split(",") if d.strip()]
        if not all(d.isdigit() for d in ids):
            raise EvalError(f"--devices {spec!r}: give GPU ids like 0,1,2,3 or 'cpu'")
        return ids
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] or [None]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.ablate", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--preset", default="tiny", help="tiny | proof_h200")
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default=None, help=f"comma-separated subset of {','.join(VARIANTS)}")
    ap.add_argument("--devices", default=None, help="GPU ids (one training process each) or 'cpu'; default all GPUs")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the training steps of both stages")
    ap.add_argument("--progress", type=float, default=None, help="seconds between progress lines")
    a = ap.parse_args(argv)
    try:
        preset = get_preset(a.preset).scaled(a.scale)
        variants = a.variants.split(",") if a.variants else list(preset.variants)
        preset.validate(variants)
        devices = parse_devices(a.devices)
    except EvalError as e:
        print(f"eval.ablate: error: {e}", file=sys.stderr)
        return 2
    progress = a.progress if a.progress is not None else (10.0 if devices == [None] else 30.0)
    try:
        return Ablation(preset, Path(a.out), variants, devices, progress).run()
    except EvalError as e:
        print(f"eval.ablate: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
