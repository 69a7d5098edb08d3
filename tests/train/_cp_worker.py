"""Context-parallel parity worker: one launch of 4 gloo rank processes trains the same runs in several
layouts (``train.main.train`` per job, the process group kept between jobs) and writes what the test compares.

Jobs (``JOBS``): a tiny model whose layers are dense, InfLLM-V2 and NOSA (``[dense, infllm_v2, nosa, nosa]``,
the tiny geometry, LongRoPE) at CP=1 (DP=4), TP=2 (sequence parallel, DP=2), CP=2 (DP=2), CP=4 with selective
recompute, CP=2 x TP=2 (sequence parallel), CP=2 x PP=2 with full recompute, each 4 steps from the same
initial weights on packed rows of short documents; then the checkpoint round trip: a NOSA model (every layer
NOSA: checkpoints stack the layers' tensors, so every layer needs the same parameters) at CP=2 stops at
step 4 with a checkpoint, copies of that run resume at CP=1, 2 and 4 and train step 5; last, the initial
weights: one step of the NOSA model at a learning rate far below an fp32 ulp of the weights (so the saved
checkpoint holds the initial weights) at TP=1 (DP=4) and at TP=2 x PP=2. Each job's run dir keeps
its ``metrics.jsonl`` (loss and grad norm per step); ``OUT/params_<job>_<when>.pt`` holds rank 0's full
weights right after a restore or a save; ``OUT/batches.pt`` the ``cu_seqlens`` the CP=4 job trained on;
``OUT/summary.json`` the exit code of each job.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import traceback

import torch

from runtime.megatron_cpu import lean_megatron_import  # noqa: E402

lean_megatron_import()  # before anything imports megatron-core
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from train import trainer as trainer_module  # noqa: E402
from train.compose import load_config  # noqa: E402
from train.config import validate  # noqa: E402
from train.main import train  # noqa: E402

MIXED = ["attention.layer_pattern=[dense,infllm_v2,nosa,nosa]", "attention.backend=reference"]
NOSA = ["attention.backend=reference"]
TP2 = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]
LAYOUTS = {
    "cp1": [],
    "tp2": TP2,
    "cp2": ["parallel.context_parallel_size=2"],
    "cp4": ["parallel.context_parallel_size=4"],
    "cp2_tp2": ["parallel.context_parallel_size=2", *TP2],
    "cp4_selective": ["parallel.context_parallel_size=4", "train.recompute=selective"],
    "cp2_pp2_full": ["parallel.context_parallel_size=2", "parallel.pipeline_model_parallel_size=2",
                     "train.recompute=full"],
}
JOBS = [(f"mixed_{lay}", MIXED + LAYOUTS[lay]) for lay in ("cp1", "tp2", "cp2", "cp2_tp2", "cp4_selective",
                                                           "cp2_pp2_full")]
RESUME_LAYOUTS = ("cp1", "cp2", "cp4")
# one step that changes no weight (1e-30 is far below an fp32 ulp of them): its checkpoint holds the initial weights
INIT_STEP = ["train.max_steps=1", "optim.lr=1.0e-30", "optim.min_lr=0.0", "optim.warmup_steps=0",
             "optim.weight_decay=0.0"]
INIT_LAYOUTS = {"init_tp1": [], "init_tp2_pp2": ["parallel.tensor_model_parallel_size=2",
                                                 "parallel.pipeline_model_parallel_size=2"]}


def common(data: str, tokenizer: str) -> list[str]:
    return ["recipe=tiny_cpt", f"data.paths=[{data}]", f"data.tokenizer={tokenizer}", "run.device=cpu",
            "run.cpu_init=true", "train.seq_length=384", "train.max_steps=4", "train.eval_interval=0",
            "train.eval_iters=0", "train.locality_interval=0", "logging.plot=false", "checkpoint.interval=0",
            "optim.adam_eps=1e-5"]


def full_params(tr) -> dict:
    """Rank 0's weights by name (every layout here keeps whole replicas on rank 0: no TP / PP)."""
    return {f"{i}.{n}": p.detach().clone() for i, m in enumerate(tr.model) for n, p in m.module.named_parameters()}


class Recorder:
    """Wraps the trainer to keep weights after a restore / a save, and the batches of one job."""

    def __init__(self, out: str) -> None:
        self.out, self.job, self.batches = out, None, None
        trainer = trainer_module.Trainer
        restore, save, run, to_mb = trainer.restore, trainer._save, trainer.run, trainer_module.to_microbatch
        rec = self

        def run_and_report(tr, *args, **kwargs):  # a failing rank says so and ends the launch at once
            try:
                return run(tr, *args, **kwargs)
            except BaseException:
                print(f"rank {dist.get_rank()} failed in {rec.job}:\n{traceback.format_exc()}", file=sys.stderr,
                      flush=True)
                os._exit(1)  # train() would return and this rank wait in a collective the others never join

        def restore_and_keep(tr):
            restore(tr)
            rec.keep(tr, "restored")

        def save_and_keep(tr):
            save(tr)
            rec.keep(tr, "saved")

        def to_microbatch(batch, *args, **kwargs):
            if rec.batches is not None and "cu_seqlens" in batch:
                rec.batches.append(batch["cu_seqlens"].clone())
            return to_mb(batch, *args, **kwargs)

        trainer_module.Trainer.run = run_and_report
        trainer_module.Trainer.restore = restore_and_keep
        trainer_module.Trainer._save = save_and_keep
        trainer_module.to_microbatch = to_microbatch

    def keep(self, tr, when: str) -> None:
        if not self.job.startswith(("ckpt", "resume")):
            return
        if dist.get_rank() == 0 and tr.cfg.parallel.model_parallel_size == tr.cfg.parallel.context_parallel_size:
            torch.save(full_params(tr), os.path.join(self.out, f"params_{self.job}_{when}.pt"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--jobs", default=None, help="debugging: run only these jobs, NAME:override;override,...")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    base = common(args.data, args.tokenizer)
    rec = Recorder(args.out)
    summary = {}

    def job(name: str, overrides: list[str]) -> None:
        rec.job = name
        cfg = validate(load_config(base + overrides + [f"run.dir={os.path.join(args.out, name)}"]),
                       world_size=dist.get_world_size())
        summary[name] = train(cfg, last=False)
        if summary[name] != 0:  # end the launch now: the other ranks would wait in a collective until the timeout
            print(f"rank {dist.get_rank()}: {name} exited with {summary[name]}", file=sys.stderr, flush=True)
            os._exit(1)
        dist.barrier()

    if args.jobs:
        for spec in args.jobs.split(","):
            name, _, over = spec.partition(":")
            job(name, [o for o in over.split(";") if o])
        dist.barrier()
        dist.destroy_process_group()
        return
    for name, overrides in JOBS:
        rec.batches = [] if name == "mixed_cp4_selective" else None
        job(name, overrides + ["checkpoint.save=false"])
        if rec.batches is not None and dist.get_rank() == 0:
            torch.save(rec.batches, os.path.join(args.out, "batches.pt"))
    rec.batches = None
    job("ckpt_cp2", NOSA + LAYOUTS["cp2"] + ["train.max_steps=5", "train.exit_after_steps=4"])
    for lay in RESUME_LAYOUTS:
        name = f"resume_{lay}"
        if dist.get_rank() == 0:
            shutil.copytree(os.path.join(args.out, "ckpt_cp2"), os.path.join(args.out, name))
        dist.barrier()
        job(name, NOSA + LAYOUTS[lay] + ["train.max_steps=5", "checkpoint.resume=auto"])
    for name, overrides in INIT_LAYOUTS.items():
        job(name, NOSA + overrides + INIT_STEP)
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "summary.json"), "w") as fh:
            json.dump(summary, fh, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
