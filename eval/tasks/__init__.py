"""RULER-style task sets: generate once (``python -m eval.tasks``), score many models.

A task set directory holds ``tasks.json`` (manifest: tokenizer hash, seed, lengths, tasks),
``<task>_<length>.jsonl`` (samples with token spans of every answer item),
``<task>_<length>.items.jsonl`` + lm-eval YAMLs (``eval.tasks.lm_eval_tasks``) and optionally
``train.jsonl`` (documents of the same tasks with another seed and the answers filled in, for
training on retrieval).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from data.sources import write_jsonl
from eval.errors import EvalError
from eval.tasks.ruler import TASKS, TaskSample, generate, item_token_spans  # noqa: F401 (TaskSample: public name)

MANIFEST = "tasks.json"
DEFAULT_LENGTHS = [4096, 8192, 16384]
TRAIN_SEED_OFFSET = 1_000_003  # training documents never share a sample with the evaluation seed


@dataclass
class TaskSetConfig:
    """Which samples to generate: ``samples`` per (task, length), deterministic in ``seed``."""

    lengths: list[int] = field(default_factory=lambda: list(DEFAULT_LENGTHS))
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    samples: int = 20
    seed: int = 0
    train_docs: int = 0  # per (task, length) for train.jsonl (0: none)
    train_lengths: Optional[list[int]] = None  # lengths of the training documents (None: ``lengths``)

    def validate(self) -> "TaskSetConfig":
        bad = [t for t in self.tasks if t not in TASKS]
        if bad:
            raise EvalError(f"unknown task(s) {bad}; choose from {sorted(TASKS)}")
        if not self.lengths or min(self.lengths) < 128:
            raise EvalError(f"lengths {self.lengths}: give lengths of at least 128 tokens")
        if self.samples < 1 or self.train_docs < 0:
            raise EvalError("samples must be >= 1 and train_docs >= 0")
        return self


def tokenizer_hash(tokenizer_dir: str | Path) -> str:
    return hashlib.sha1((Path(tokenizer_dir) / "tokenizer.json").read_bytes()).hexdigest()


def encoder(tok):
    """Text -> ids exactly as lm-eval's HF model encodes (the tokenizer's ``encode``)."""
    return lambda text: tok.hf.encode(text)


def load_haystack(corpus: str, tok):
    """Paragraphs and words of ``corpus`` (JSONL or indexed prefix) for the generators."""
    from eval.tasks.haystack import build_haystack, corpus_texts

    return build_haystack(corpus_texts(corpus, tok), tok)


def training_documents(hay, tok, lengths: list[int], tasks: list[str], count: int, seed: int) -> list[dict]:
    """``{"text", "task", "length"}`` documents (prompt + answers) to train retrieval on; drawn with
    ``seed + TRAIN_SEED_OFFSET``, so they never repeat an evaluation sample of ``seed``."""
    enc = encoder(tok)
    return [{"text": s.full_text(), "task": s.task, "length": s.length}
            for length in lengths for task in tasks
            for s in generate(task, hay, enc, length, count, seed + TRAIN_SEED_OFFSET)]


SAMPLES_PER_JOB = 10  # task-set samples per worker job


def _task_rows(job: tuple[str, int, int, int, int]) -> list[dict]:
    """Rows (sample fields + ``item_spans``) of samples ``start .. start + count - 1`` (a pool job)."""
    from eval.tasks.workers import state

    task, length, start, count, seed = job
    w = state()
    rows = []
    for s in generate(task, w["hay"], w["enc"], length, count, seed, start=start):
        _, spans = item_token_spans(s, w["enc"])
        rows.append({**asdict(s), "item_spans": spans})
    return rows


def build_task_set(corpus: str, tok, out: str | Path, cfg: TaskSetConfig, log=print, hay=None,
                   workers: Optional[int] = None) -> Path:
    """Generate the task set into ``out`` (written to a temp dir, then renamed); samples are made
    by ``workers`` processes (default: every core; one for small sets), the same for any number."""
    from eval.tasks import lm_eval_tasks
    from eval.tasks.workers import default_workers, job_results, init_worker, state
    from runtime.outputs import atomic_dir

    cfg.validate()
    out = Path(out)
    if out.exists():
        what = "is a task set already" if (out / MANIFEST).is_file() else "exists and is not a task set"
        raise EvalError(f"--out {out} {what}; give a new directory")
    t0 = time.perf_counter()
    pairs = [(task, length) for length in cfg.lengths for task in cfg.tasks]
    jobs = [(task, length, s, min(SAMPLES_PER_JOB, cfg.samples - s), cfg.seed)
            for task, length in pairs for s in range(0, cfg.samples, SAMPLES_PER_JOB)]
    if workers is None:
        small = sum(cfg.lengths) * cfg.samples * len(cfg.tasks) < 2_000_000
        workers = 1 if small else default_workers()
    if workers == 1 and hay is not None:  # reuse the caller's haystack in this process
        state().update(key=(corpus, tok.path), tok=tok, enc=encoder(tok), hay=hay)
    with atomic_dir(out) as tmp:
        rows_of: dict[tuple[str, int], list[dict]] = {p: [] for p in pairs}
        with job_results(_task_rows, jobs, corpus, tok.path, workers) as results:
            for job, rows in zip(jobs, results):
                rows_of[(job[0], job[1])] += rows
                if len(rows_of[(job[0], job[1])]) == cfg.samples:
                    log(f"  {job[0]} @ {job[1]}: {cfg.samples} samples ({time.perf_counter() - t0:.1f} s)")
        for (task, length), rows in rows_of.items():
            items = [{"context": c, "continuation": k, "sample": r["index"], "item": j}
                     for r in rows for j, (c, k) in enumerate(zip(_contexts(r), _continuations(r)))]
            write_jsonl(str(tmp / f"{task}_{length}.jsonl"), rows)
            write_jsonl(str(tmp / f"{task}_{length}.items.jsonl"), items)
        names = lm_eval_tasks.write_configs(tmp, pairs, out.resolve())
        if cfg.train_docs:
            if hay is None:
                init_worker(corpus, tok.path)
            docs = training_documents(hay or state()["hay"], tok, cfg.train_lengths or cfg.lengths, cfg.tasks,
                                      cfg.train_docs, cfg.seed)
            write_jsonl(str(tmp / "train.jsonl"), docs)
            log(f"  train.jsonl: {len(docs)} documents")
        manifest = {"config": asdict(cfg), "tokenizer": str(Path(tok.path).resolve()),
                    "tokenizer_sha1": tokenizer_hash(tok.path), "corpus": str(corpus),
                    "lm_eval_tasks": names, "group": lm_eval_tasks.GROUP}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    log(f"  task set: {len(pairs)} (task, length) pairs, {len(jobs)} jobs on {workers} worker(s) "
        f"({time.perf_counter() - t0:.1f} s)")
    return out


def _continuations(row: dict) -> list[str]:
    return [(" " if j == 0 else ", ") + a for j, a in enumerate(row["answers"])]


def _contexts(row: dict) -> list[str]:
    conts = _continuations(row)
    return [row["prompt"] + "".join(conts[:j]) for j in range(len(conts))]


@dataclass
class TaskSet:
    root: Path
    manifest: dict

    @property
    def lengths(self) -> list[int]:
        return list(self.manifest["config"]["lengths"])

    @property
    def tasks(self) -> list[str]:
        return list(self.manifest["config"]["tasks"])

    def samples(self, task: str, length: int) -> list[dict]:
        path = self.root / f"{task}_{length}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def check_tokenizer(self, tokenizer_dir) -> None:
        if tokenizer_hash(tokenizer_dir) != self.manifest["tokenizer_sha1"]:
            raise EvalError(f"tokenizer mismatch: the task set {self.root} was generated with "
                            f"{self.manifest['tokenizer']}, the model uses {tokenizer_dir}; regenerate it "
                            f"with the model's tokenizer (python -m eval.tasks --tokenizer ...)")

    def pick_lengths(self, lengths: Optional[list[int]], max_positions: int) -> list[int]:
        """The requested lengths (default: all of the set) after checking them against the model."""
        chosen = lengths or self.lengths
        missing = [n for n in chosen if n not in self.lengths]
        if missing:
            raise EvalError(f"task set {self.root} has no length(s) {missing}; it has {self.lengths}")
        too_long = [n for n in chosen if n > max_positions]
        if too_long:
            raise EvalError(f"task length(s) {too_long} exceed the model's max_position_embeddings={max_positions}; "
                            f"pick --lengths <= {max_positions}")
        return chosen


def load_task_set(path: str | Path) -> TaskSet:
    root = Path(path)
    if not (root / MANIFEST).is_file():
        raise EvalError(f"--tasks {path}: no task set there (generate one with python -m eval.tasks)")
    return TaskSet(root, json.loads((root / MANIFEST).read_text()))
