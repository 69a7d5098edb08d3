"""Eviction-head ablation from one command: data, dense pretraining, CPT per variant, evaluation,
and one table + plots + JSON.

    python -m eval.ablate --preset tiny --out runs/ablate_tiny                    # CPU, minutes
    python -m eval.ablate --preset proof_h200 --out runs/proof --devices 0,1,2,3  # one process per GPU
    python -m eval.ablate --preset proof_h200 --out runs/proof --variants ed_dma,none,dense --scale 0.5

In stages, for machines that cannot run it whole (each step hands the next only small files):

    python -m eval.ablate --preset proof_h200 --out runs/proof --stage pretrain --export runs/pretrained
    python -m eval.ablate --preset proof_h200 --out runs/proof --init runs/pretrained --variants dense,ed_dma

Steps (each skipped when its output is complete, so a re-run resumes and a finished variant is
never re-run):

1. data: the offline demo corpus (``data.demo_corpus``), the evaluation task set (``<out>/tasks``)
   and, per stage, synthetic retrieval training documents of the same tasks (another seed;
   ``eval.tasks.training_data``) blended with the corpus (``data.packing=best_fit``);
2. dense pretraining (``<out>/pretrain``; data parallel over every ``--devices`` GPU), its learning
   curve (``<out>/curves/pretrain.json``) and, with ``--export DIR``, its weights as a bf16 Hugging
   Face export in files of at most 16 MiB (config, weights, tokenizer: what ``--init`` needs);
   ``--init DIR`` imports such an export instead of pretraining;
3. for each variant (``ed_dma, dma, s_dma, locret, none`` = InfLLM-V2, ``dense``): CPT from the
   pretrained weights (``<out>/cpt/<variant>``), its learning curve, then ``eval.suite``
   (``<out>/eval/<variant>``): locality + offload simulation, RULER-style tasks, perplexity by
   position. With several devices the variants run concurrently, one training process per GPU
   (``CUDA_VISIBLE_DEVICES``); on CPU one after another;
4. ``ablation.md``, ``ablation.json``, ``ablation.png`` and ``learning_curve.{json,png}`` under
   ``--out`` (written even when a variant failed; its row says where its log is). Variants already
   evaluated under ``--out`` (e.g. copied from an earlier machine) join the table. Exit status 1 if
   any variant failed.
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
from eval.ablation_table import ablation_markdown, ablation_plot
from eval.report import save_plot
from runtime.outputs import write_atomic, write_json
from eval.suite import RESULT, SuiteConfig

_PORTS = itertools.count(29400, 11)  # rendezvous ports of the single-process trainers, one per job
REPO_ROOT = Path(__file__).resolve().parent.parent
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


HANDOFF_SHARD_BYTES = 16 << 20  # --export: weight files of at most 16 MiB
BASE = "base"  # the table's row of the imported model before any CPT (presets with ``model_from_init``)
HANDOFF_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass
class DataPaths:
    tokenizer: str
    corpus_prefix: str  # held-out documents come from its validation part
    pretrain_paths: list[str]
    cpt_paths: list[str]
    weights: list[float]  # token shares of (retrieval documents, corpus) in both stages
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
    stage: str = "all"  # all | pretrain (data, pretraining, curve, --export) | cpt (data, CPT) | decode
    init: Optional[Path] = None  # an --export of pretrained weights to start CPT from (no pretraining)
    export: Optional[Path] = None
    base: bool = True  # presets with ``model_from_init``: score the import as the table's ``base`` row
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
    def prepare_data(self, stages: tuple[str, ...]) -> DataPaths:
        """The corpus, the task set and the retrieval documents of ``stages`` (``pretrain``, ``cpt``)."""
        from data.demo_corpus import DEFAULT_OUT, SMALL, DemoSpec, build_demo
        from eval.tasks import TaskSetConfig, build_task_set, load_haystack, tokenizer_hash
        from eval.tasks.training_data import RetrievalMix, build_retrieval_dataset
        from data.tokenizer import Tokenizer

        p = self.preset
        demo_dir = DEFAULT_OUT if p.demo == "full" else str(self.out / "data" / "demo")
        self.say(f"data: demo corpus ({p.demo}) in {demo_dir}")
        man = build_demo(demo_dir, DemoSpec() if p.demo == "full" else SMALL, log=self.say)
        tokenizer, corpus_prefix = man["tokenizer"], man["indexed_prefix"]
        if p.model_from_init:  # an imported model: every token of every stage comes from its own tokenizer
            tokenizer = str(self.pretrained() / "tokenizer")
            if not (Path(tokenizer) / "tokenizer.json").is_file():
                raise EvalError(f"--init {self.init}: the import has no tokenizer.json ({tokenizer}); import a "
                                f"source that carries its tokenizer")
            corpus_prefix = self._corpus_for(man["corpus"], tokenizer)
        elif self.init is not None:  # the pretrained weights came with their tokenizer: the corpus must match it
            if tokenizer_hash(self.init) != tokenizer_hash(tokenizer):
                raise EvalError(f"--init {self.init}: its tokenizer differs from the demo corpus' ({tokenizer}); "
                                f"the corpus was tokenized for another model")
        tok = Tokenizer(tokenizer)
        tasks_dir, data_dir = self.out / "tasks", self.out / "data"
        if not (tasks_dir / "tasks.json").is_file():
            self.say(f"data: evaluation task set at {p.task_lengths} ({p.task_samples} samples per task)")
            build_task_set(man["corpus"], tok, tasks_dir, TaskSetConfig(lengths=p.task_lengths, samples=p.task_samples),
                           log=self.say, hay=load_haystack(man["corpus"], tok))
        mixes = {"pretrain": RetrievalMix(p.pretrain_doc_lengths, p.pretrain_retrieval_tokens),
                 "cpt": RetrievalMix(p.cpt_doc_lengths, p.cpt_retrieval_tokens)}
        paths = {}
        for name, mix in mixes.items():
            prefix = str(data_dir / f"retrieval_{name}_text_document")
            paths[name] = [prefix, corpus_prefix]
            if name in stages:
                t0 = time.time()
                sm = build_retrieval_dataset(man["corpus"], tokenizer, prefix, mix, log=self.say)
                self.say(f"data: {name} = {sm['documents']} retrieval documents at {mix.lengths} "
                         f"({sm['tokens'] / 1e6:.1f}M tokens, {time.time() - t0:.0f} s) + the corpus, "
                         f"{p.retrieval_share:.0%} / {1 - p.retrieval_share:.0%} of the tokens")
        return DataPaths(tokenizer, corpus_prefix, paths["pretrain"], paths["cpt"],
                         [p.retrieval_share, round(1 - p.retrieval_share, 6)], str(tasks_dir))

    def _corpus_for(self, corpus: str, tokenizer: str) -> str:
        """The demo corpus tokenized with ``tokenizer`` (an imported model's), once: its indexed prefix."""
        from data.preprocess import preprocess

        prefix = self.out / "data" / "corpus_text_document"
        if not Path(f"{prefix}.idx").is_file():
            t0 = time.time()
            summ = preprocess(corpus, tokenizer, str(prefix), progress=False)
            self.say(f"data: corpus tokenized with the model's tokenizer: {summ['documents']} documents, "
                     f"{summ['tokens'] / 1e6:.1f}M tokens ({time.time() - t0:.0f} s)")
        return str(prefix)

    # ------------------------------------------------------------------ 2./3. training
    def train_args(self, stage, run_dir: Path, paths: list[str], data: DataPaths, curve_points: int = 0) -> list[str]:
        args = [f"recipe={stage.recipe}", f"run.dir={run_dir}", f"train.max_steps={stage.steps}",
                f"data.paths=[{','.join(paths)}]", f"data.weights=[{','.join(map(str, data.weights))}]",
                f"data.packing={self.preset.packing}", f"data.tokenizer={data.tokenizer}",
                f"data.split='{self.preset.split}'", *stage.overrides]
        if curve_points > 0:  # checkpoints along the stage, all kept, for the learning curve
            args += [f"checkpoint.interval={max(1, stage.steps // curve_points)}", "checkpoint.keep_last=0"]
        return args

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
        gpus = list(dict.fromkeys(d for d in devices if d is not None))  # a repeated id is one GPU
        nproc = _data_parallel(args, len(gpus))
        main = str(REPO_ROOT / "train" / "main.py")
        cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", main]
               if nproc > 1 else [sys.executable, main]) + args
        rc = self.run_logged(key, cmd, run_dir.parent / f"{run_dir.name}.log", ",".join(gpus[:nproc]) or None, nproc)
        if rc != 0 or self.trained_steps(run_dir) < steps:
            raise RuntimeError(f"training exited with {rc}; see {run_dir.parent / f'{run_dir.name}.log'}")

    def pretrain(self, data: DataPaths) -> None:
        stage, run_dir = self.preset.pretrain, self.out / "pretrain"
        self.say(f"pretrain: {stage.recipe}, {stage.steps} steps -> {run_dir}")
        t0 = time.time()
        stop = threading.Event()
        watcher = threading.Thread(target=self._watch_single, args=("pretrain", run_dir, stage.steps, stop, t0),
                                   daemon=True)
        watcher.start()
        try:
            self.train("pretrain", self.train_args(stage, run_dir, data.pretrain_paths, data,
                                                   self.preset.curve_points_pretrain), run_dir,
                       stage.steps, self.devices)
        finally:
            stop.set()
        self.say(f"pretrain: done ({time.time() - t0:.0f} s)")
        if self.preset.curve_points_pretrain:
            self.curve("pretrain", run_dir, data, self.preset.curve_length_pretrain, self.devices[0])

    def pretrained(self) -> Path:
        """What CPT starts from: ``<out>/pretrain``, or the ``--init`` source (an export, a Hugging Face
        directory or a GGUF file) imported once; with ``model_from_init``, its model group extends the
        context to the preset's ``cpt_length``."""
        if self.init is None:
            return self.out / "pretrain"
        from checkpoints_convert.from_hf import import_hf

        dst = self.out / "pretrain_import"
        if not (dst / "latest").is_file():
            self.say(f"init: importing {self.init} -> {dst}")
            gguf = self.init.suffix == ".gguf"
            import_hf(None if gguf else str(self.init), str(dst), log=self.say, gguf=str(self.init) if gguf else None,
                      target_length=self.preset.cpt_length if self.preset.model_from_init else None)
        return dst

    def model_args(self) -> list[str]:
        """The CPT's model: the import's own group (``from_hf``'s ``model/<name>.yaml``) with ``model_from_init``."""
        if not self.preset.model_from_init:
            return []
        src = self.pretrained()
        groups = sorted((src / "model").glob("*.yaml"))
        if len(groups) != 1:
            raise EvalError(f"{src}: expected one model group file in {src / 'model'}, found {len(groups)}")
        return [f"hydra.searchpath=[file://{src}]", f"model={groups[0].stem}"]

    def export_pretrained(self, data: DataPaths) -> None:
        """``--export``: the pretrained weights as a bf16 HF export in files of at most 16 MiB, with
        only what ``--init`` reads (config, weights, tokenizer files; no modeling code)."""
        import shutil

        from checkpoints_convert.to_hf import export

        if (self.export / "config.json").is_file():
            self.say(f"export: {self.export} exists")
            return
        full = self.out / "pretrain_hf"
        if not (full / "config.json").is_file():
            export(str(self.out / "pretrain"), str(full), dtype="bf16", tokenizer=data.tokenizer,
                   max_shard_bytes=HANDOFF_SHARD_BYTES, log=self.say, overwrite=True)
        keep = [f for f in sorted(full.iterdir())
                if f.name in HANDOFF_FILES or f.suffix == ".safetensors" or f.name.endswith(".index.json")]
        tmp = self.export.with_name(self.export.name + f".tmp-{os.getpid()}")
        tmp.mkdir(parents=True)
        for f in keep:
            shutil.copy2(f, tmp / f.name)
        os.replace(tmp, self.export)
        sizes = [f.stat().st_size / 2**20 for f in keep]
        self.say(f"export: {len(keep)} files, {sum(sizes):.1f} MiB (largest {max(sizes):.1f} MiB) -> {self.export}")

    def curve(self, name: str, run_dir: Path, data: DataPaths, length: int, device: Optional[str]) -> None:
        """``eval.curve`` over ``run_dir``'s checkpoints -> ``<out>/curves/<name>.json`` (skipped when done)."""
        out = self.out / "curves" / f"{name}.json"
        if out.is_file():
            done = json.loads(out.read_text())
            if len(done.get("points", [])) >= len(list((run_dir / "checkpoints").glob("iter_*"))):
                return
        cmd = [sys.executable, "-m", "eval.curve", "--run", str(run_dir), "--tasks", data.tasks,
               "--lengths", str(length), "--limit", str(self.preset.curve_samples), "--label", name, "--out", str(out)]
        t0 = time.time()
        rc = self.run_logged(f"{name}-curve", cmd, self.out / "curves" / f"{name}.log", device)
        self.say(f"{name}: learning curve {'done' if rc == 0 else f'FAILED (exit {rc})'} ({time.time() - t0:.0f} s)")

    # ------------------------------------------------------------------ variants
    def run_variant(self, job: Job, device: Optional[str], data: DataPaths) -> None:
        if self.stage == "cpt":
            self.train_variant(job, device, data)
            job.status = "done"
            return
        self.train_variant(job, device, data)
        job.status = "evaluating"
        job.log = self.evaluate(job.variant, self.out / "cpt" / job.variant, device, data)
        job.status = "done"

    def train_variant(self, job: Job, device: Optional[str], data: DataPaths) -> None:
        """The variant's CPT (skipped when trained) and its learning curve."""
        v, stage = job.variant, self.preset.cpt
        cpt_dir = self.out / "cpt" / v
        job.device, job.started, job.status = device, time.time(), "training"
        job.log = str(self.out / "cpt" / f"{v}.log")
        args = self.train_args(stage, cpt_dir, data.cpt_paths, data, self.preset.curve_points_cpt) + [
            f"attention={VARIANTS[v]}", f"init_from={self.pretrained()}", *self.model_args()]
        self.train(v, args, cpt_dir, stage.steps, [device])
        if self.preset.curve_points_cpt:
            job.status = "curve"
            self.curve(v, cpt_dir, data, self.preset.curve_length_cpt, device)

    def evaluate(self, name: str, ckpt: Path, device: Optional[str], data: DataPaths,
                 max_length: Optional[int] = None) -> Optional[str]:
        """``eval.suite`` of ``ckpt`` -> ``<out>/eval/<name>`` (locality and perplexity documents of at most
        ``max_length`` tokens); returns its log (``None``: on the console)."""
        cfg, eval_dir = self.suite_config(max_length), self.out / "eval" / name
        if device is None:  # CPU: in this process (one megatron import for every variant), output on the console
            from eval.suite import evaluate

            evaluate(str(ckpt), data.tasks, data.corpus_prefix, str(eval_dir), cfg, tokenizer=data.tokenizer,
                     log=lambda m: self.say(f"{name}: {m}"))
            return None
        log = eval_dir.parent / f"{name}.log"
        cmd = [sys.executable, "-m", "eval.suite", "--ckpt", str(ckpt), "--tasks", data.tasks,
               "--data", data.corpus_prefix, "--split", self.preset.split, "--length", str(cfg.length),
               "--docs", str(cfg.docs), "--ppl-docs", str(cfg.ppl_docs), "--tokenizer", data.tokenizer,
               "--out", str(eval_dir)]
        rc = self.run_logged(f"{name}-eval", cmd, log, device)
        if rc != 0 or not (eval_dir / RESULT).is_file():
            raise RuntimeError(f"evaluation exited with {rc}; see {log}")
        return str(log)

    def evaluate_base(self, data: DataPaths) -> None:
        """The imported model as it came (no training): the table's ``base`` row."""
        if (self.out / "eval" / BASE / RESULT).is_file():
            self.say(f"{BASE}: already evaluated")
            return
        from runtime.checkpoint_files import find_checkpoint

        src = self.pretrained()
        recorded = json.loads((find_checkpoint(src) / "nosa_config.json").read_text())
        context = recorded["model"]["max_position_embeddings"]
        self.say(f"{BASE}: evaluating the imported model {self.init} (its context: {context} tokens; tasks up to it)")
        t0 = time.time()
        try:
            self.evaluate(BASE, src, self.devices[0], data, max_length=context)
            self.say(f"{BASE}: done ({time.time() - t0:.0f} s)")
        except (RuntimeError, EvalError) as e:
            self.say(f"{BASE}: FAILED: {e}")

    def suite_config(self, max_length: Optional[int] = None) -> SuiteConfig:
        p = self.preset
        return SuiteConfig(length=min(p.eval_length, max_length or p.eval_length), docs=p.locality_docs,
                           ppl_docs=p.ppl_docs, split=p.split)

    def run_variants(self, data: DataPaths) -> None:
        todo: "queue.Queue[Job]" = queue.Queue()
        for v in self.variants:
            job = self.jobs[v] = Job(v)
            if self.stage == "cpt" and self.trained_steps(self.out / "cpt" / v) >= self.preset.cpt.steps:
                job.status = "done"
                self.say(f"{v}: already trained ({self.out / 'cpt' / v})")
            elif self.stage != "cpt" and (self.out / "eval" / v / RESULT).is_file():
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
                self.say(f"{job.variant}: {'CPT' if self.stage == 'cpt' else 'CPT + evaluation'} on {where}")
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

    # ------------------------------------------------------------------ 5. decode on the trained weights
    def export_variant(self, v: str, data: DataPaths) -> Path:
        """``<out>/export/<v>``: the variant's trained weights as a bf16 Hugging Face export (skipped when there)."""
        from checkpoints_convert.to_hf import export

        dst = self.out / "export" / v
        if (dst / "config.json").is_file():
            self.say(f"{v}: export exists ({dst})")
            return dst
        if self.trained_steps(self.out / "cpt" / v) < self.preset.cpt.steps:
            raise EvalError(f"--stage decode: variant {v} is not trained under {self.out / 'cpt' / v}; run "
                            f"--stage cpt (or all) for it first")
        t0 = time.time()
        export(str(self.out / "cpt" / v), str(dst), dtype="bf16", tokenizer=data.tokenizer, log=self.say)
        self.say(f"{v}: exported -> {dst} ({time.time() - t0:.0f} s)")
        return dst

    def decode(self, data: DataPaths, cpu: bool = False) -> int:
        """Decode measurements of the trained variants (``eval.ablate_decode``): the benchmark over their
        exports, ``eval.locality`` of the sparse ones on the benchmark's document, and the comparison.
        The benchmark's long context ends ``LOCALITY_STEPS`` before the CPT length (its decode stays within
        the trained context), and ``eval.locality`` measures those last steps of the document."""
        from eval import ablate_decode as ad

        out, device, length = self.out / "decode", self.devices[0], self.preset.cpt_length
        long = length - ad.LOCALITY_STEPS
        contexts = [long] if cpu else sorted({min(4096, long), long})
        steps = 2 if cpu else None
        sparse = [v for v in self.variants if v != "dense"]
        exports = [self.export_variant(v, data) for v in sparse + [v for v in self.variants if v == "dense"]]
        bench = out / "bench"
        if not (bench / "inference.json").is_file() or not (bench / "done").is_file():
            t0 = time.time()
            cmd = ad.bench_command(sys.executable, exports, data, self.preset.split, long, bench,
                                   self.preset.decode_budget_batch, self.preset.decode_mem_limit_gib, contexts, steps)
            self.say(f"decode: bench.inference over {', '.join(e.name for e in exports)} (log {out / 'bench.log'})")
            rc = self.run_logged("decode-bench", cmd, out / "bench.log", device)
            if rc != 0:
                self.say(f"decode: bench.inference exited with {rc}; see {out / 'bench.log'}")
                return 1
            write_atomic(bench / "done", f"{time.time() - t0:.0f} s\n")
            self.say(f"decode: benchmark done ({time.time() - t0:.0f} s)")
        localities = {}
        for v in sparse:
            loc = out / "locality" / v
            if not (loc / "locality.json").is_file():
                cmd = ad.locality_command(sys.executable, self.out / "export" / v, data, self.preset.split, length, loc)
                rc = self.run_logged(f"{v}-locality", cmd, out / f"locality_{v}.log", device)
                if rc != 0:
                    self.say(f"decode: eval.locality of {v} exited with {rc}; see {out / f'locality_{v}.log'}")
                    return 1
            localities[v] = ad.read_json(loc / "locality.json")
        check = ad.locality_check(ad.read_json(bench / "inference.json"), localities)
        write_json(out / "locality_check.json", check)
        md = ad.check_markdown(check)
        write_atomic(out / "locality_check.md", md)
        print("\n" + (bench / "inference.md").read_text() + "\n" + md, flush=True)
        self.say(f"decode: wrote {bench / 'inference.md'} and {out / 'locality_check.md'}")
        return 0

    # ------------------------------------------------------------------ 4. table
    def listed(self) -> list[str]:
        """The table's variants: those asked for, and any other already evaluated under ``--out``."""
        asked = [] if self.stage == "pretrain" else self.variants
        done = [v for v in VARIANTS if (self.out / "eval" / v / RESULT).is_file()]
        base = [BASE] if (self.out / "eval" / BASE / RESULT).is_file() else []
        return base + asked + [v for v in done if v not in asked]

    def collect(self) -> dict:
        rows = {}
        for v in self.listed():
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
        p = save_plot(self.out / "ablation.png", lambda fig: ablation_plot(fig, table), figsize=(14, 4))
        files += [p] if p else []
        curves = [json.loads(f.read_text()) for f in sorted((self.out / "curves").glob("*.json"))]
        if curves:
            from eval.curve import plot

            pre = [c for c in curves if c["label"] == "pretrain"]
            offset = pre[0]["points"][-1]["tokens"] if pre and pre[0]["points"] else 0
            offsets = {c["label"]: 0 if c["label"] == "pretrain" else offset for c in curves}
            files.append(write_json(self.out / "learning_curve.json", {"curves": curves, "offsets": offsets}))
            p = save_plot(self.out / "learning_curve.png", lambda fig: plot(fig, curves, offsets), figsize=(9, 5))
            files += [p] if p else []
        return files

    # ------------------------------------------------------------------ all
    def run(self) -> int:
        t0 = time.time()
        self.out.mkdir(parents=True, exist_ok=True)
        table = None
        if self.stage == "decode":
            cpu = self.devices[0] is None  # the CPU: one context and a few steps show the path
            return self.decode(self.prepare_data(("cpt",) if self.init else ("pretrain", "cpt")), cpu)
        try:
            stages = ("pretrain",) if self.stage == "pretrain" else (("cpt",) if self.init else ("pretrain", "cpt"))
            data = self.prepare_data(stages)
            if self.init is None:
                self.pretrain(data)
            if self.export is not None:
                self.export_pretrained(data)
            if self.stage in ("all", "cpt"):
                self.run_variants(data)
            if self.stage == "all" and self.preset.model_from_init and self.base:  # after the variants: they come first
                self.evaluate_base(data)
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
        if self.stage == "pretrain":
            return 0 if (self.out / "pretrain" / "checkpoints").is_dir() and self.trained_steps(
                self.out / "pretrain") >= self.preset.pretrain.steps else 1
        return 0 if all(r["status"] == "done" for r in table["variants"].values()) else 1


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


def parse_devices(spec: Optional[str]) -> list[Optional[str]]:
    """``0,1,2,3`` -> GPU ids; ``cpu`` or no GPU -> ``[None]`` (the CPU); default: every visible GPU. An id
    may repeat (``0,0,0``): that many variants train at once on that GPU (small models leave most of a
    GPU idle); data-parallel pretraining uses each GPU once."""
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
    ap.add_argument("--preset", default="tiny", help="tiny | proof_h200 | smollm2_135m")
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default=None, help=f"comma-separated subset of {','.join(VARIANTS)}")
    ap.add_argument("--devices", default=None,
                    help="GPU ids (one variant at a time on each; repeat an id to share it) or 'cpu'; default all GPUs")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the training steps of both stages")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="change a preset field (retrieval_share=0.9, pretrain.steps=4000, "
                         "pretrain_doc_lengths=256,512)")
    ap.add_argument("--train-override", action="append", default=[], metavar="STAGE:KEY=VALUE",
                    help="add a train/main.py override to a stage (pretrain:train.global_batch_size=8)")
    ap.add_argument("--stage", default="all", choices=["all", "pretrain", "cpt", "decode"],
                    help="pretrain: stop after the pretraining (and --export); cpt: train the variants, no "
                         "evaluation; decode: decode measurements of the trained variants (exports, "
                         "bench.inference, decode-time locality against eval.locality)")
    ap.add_argument("--export", default=None, help="write the pretrained weights here (bf16, files <= 16 MiB)")
    ap.add_argument("--init", default=None,
                    help="start CPT from an --export of another run, a Hugging Face model directory or a GGUF file "
                         "(no pretraining)")
    ap.add_argument("--progress", type=float, default=None, help="seconds between progress lines")
    ap.add_argument("--no-base", action="store_true",
                    help="do not score the imported model as the table's base row (presets that start from --init)")
    a = ap.parse_args(argv)
    try:
        preset = get_preset(a.preset).with_settings(a.set, a.train_override).scaled(a.scale)
        variants = a.variants.split(",") if a.variants else list(preset.variants)
        preset.validate(variants)
        devices = parse_devices(a.devices)
        if a.init and a.stage == "pretrain":
            raise EvalError("--init skips the pretraining; --stage pretrain has nothing to do with it")
        if preset.needs_init and not a.init:
            raise EvalError(f"preset {preset.name} starts from an imported model: give --init <HF dir or .gguf file> "
                            f"(SmolLM2: bash scripts/fetch_smollm2.sh DIR)")
        if a.init and Path(a.init).suffix == ".gguf":
            if not Path(a.init).is_file():
                raise EvalError(f"--init {a.init}: no such file")
        elif a.init and not (Path(a.init) / "config.json").is_file():
            raise EvalError(f"--init {a.init}: no export there (config.json missing); give an --export directory, a "
                            f"Hugging Face model directory or a .gguf file")
        if a.export and Path(a.export).exists() and not (Path(a.export) / "config.json").is_file():
            raise EvalError(f"--export {a.export} exists and is not an export; give a new directory")
    except EvalError as e:
        print(f"eval.ablate: error: {e}", file=sys.stderr)
        return 2
    progress = a.progress if a.progress is not None else (10.0 if devices == [None] else 30.0)
    try:
        return Ablation(preset, Path(a.out), variants, devices, progress, a.stage,
                        Path(a.init) if a.init else None, Path(a.export) if a.export else None,
                        base=not a.no_base).run()
    except EvalError as e:
        print(f"eval.ablate: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
