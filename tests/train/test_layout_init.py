"""Initial weights are a function of (seed, parameter) only: TP=2 x PP=2 starts from exactly the weights
of TP=1 (CPU init, through train/main.py with gloo processes). The one layout splits tensors and stages
at once, so a TP-only or a PP-only init bug shows in it too (TP=2 and PP=2 alone are not run: ~80 CPU s)."""

import math

import torch

from checkpoints_convert.common import load_megatron_tensors
from runtime.checkpoint_files import find_checkpoint
from tests.train.conftest import losses, run_main

# one step at a learning rate so small that no weight changes (1e-30 is far below an fp32 ulp of
# the weights): the saved checkpoint holds the initial weights; the step-1 loss is of those too
ONE_STEP = ["recipe=tiny_cpt", "train.seq_length=256", "train.global_batch_size=2", "train.micro_batch_size=1",
            "train.max_steps=1", "train.eval_iters=0", "train.eval_interval=0", "optim.lr=1.0e-30",
            "optim.min_lr=0.0", "optim.warmup_steps=0", "optim.weight_decay=0.0", "checkpoint.interval=0",
            "logging.plot=false"]
LAYOUTS = {"tp2pp2": (2, 2)}


def test_every_layout_starts_from_the_same_weights(tmp_path, data_args):
    runs = {}
    for name, (tp, pp) in {"tp1": (1, 1), **LAYOUTS}.items():
        runs[name] = tmp_path / name
        run_main([*ONE_STEP, *data_args, f"run.dir={runs[name]}", f"parallel.tensor_model_parallel_size={tp}",
                  f"parallel.pipeline_model_parallel_size={pp}"], nproc=tp * pp)
    weights = {n: load_megatron_tensors(find_checkpoint(d)) for n, d in runs.items()}
    ref = weights["tp1"]
    for name in LAYOUTS:
        assert weights[name].keys() == ref.keys()
        for k, v in ref.items():
            assert torch.equal(weights[name][k], v), (name, k)  # bitwise
        # the first loss of identical weights on identical data: equal up to reduction order over TP
        assert math.isclose(losses(runs[name])[1], losses(runs["tp1"])[1], rel_tol=1e-6), name
