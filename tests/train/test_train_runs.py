"""End-to-end training runs on CPU (gloo): resume, crash safety, stage chaining, TP/PP, NaN."""

import json
import math
import re
import sys

import pytest

from data.third_party_noise import missing_optional, note_line
from tests.train.conftest import losses, metrics, run_main, train_here
from train.metrics import wandb_offline_line

PRETRAIN = ["recipe=tiny_pretrain", "train.seq_length=128", "train.global_batch_size=2",
            "train.micro_batch_size=1", "train.eval_interval=2", "train.eval_iters=1", "optim.warmup_steps=1"]
CPT = ["recipe=tiny_cpt", "train.seq_length=256", "train.global_batch_size=2", "train.eval_interval=0",
       "train.eval_iters=1", "optim.warmup_steps=1", "checkpoint.interval=0"]


def _close(a: dict, b: dict, rel: float = 0.0) -> bool:
    return a.keys() == b.keys() and all(math.isclose(a[k], b[k], rel_tol=rel, abs_tol=0.0) for k in a)


# Runs shared by several tests of this module (each test only reads them): a 4-step PRETRAIN run
# without checkpoints (the uninterrupted reference of the resume, crash and fused-optimizer tests;
# optim.fused is on by default, which test_fused_adam_... asserts from its output), and the same
# run stopped after step 2 (train.exit_after_steps) and resumed to step 4. One-process runs whose point is
# not the process itself run in the test's process (train_here).
FOUR_STEPS = [*PRETRAIN, "train.max_steps=4", "checkpoint.interval=0"]
# Runs whose checkpoint no test reads skip writing it (a save costs a tiny run about a third of its time).
NO_SAVE = "checkpoint.save=false"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_args):
    run = tmp_path_factory.mktemp("uninterrupted") / "full"
    return run, train_here([*FOUR_STEPS, *data_args, f"run.dir={run}", NO_SAVE])


@pytest.fixture(scope="module")
def stopped_and_resumed(tmp_path_factory, data_args):
    """``(run dir, output of the stopped run, its latest pointer then, output of the resumed run)``."""
    run = tmp_path_factory.mktemp("stopped") / "split"
    stopped = train_here([*FOUR_STEPS, *data_args, f"run.dir={run}", "train.exit_after_steps=2", "optim.fused=true"])
    latest = (run / "checkpoints" / "latest").read_text().strip()
    resumed = train_here([*FOUR_STEPS, *data_args, f"run.dir={run}", "optim.fused=true"])
    return run, stopped, latest, resumed


def test_stop_and_resume_equals_uninterrupted_run(uninterrupted, stopped_and_resumed):
    full, _ = uninterrupted
    split, stopped, latest, resumed = stopped_and_resumed
    assert "exit_after_steps=2 reached at step 2" in stopped.stdout
    assert latest == "iter_0000002"
    assert "resumed from" in resumed.stdout and "at step 2" in resumed.stdout
    assert losses(full) == losses(split) and len(losses(full)) == 4  # bitwise: same floats
    val = lambda d: {r["step"]: r["val_loss"] for r in metrics(d) if r.get("val_loss") is not None}
    assert val(full) == val(split) and sorted(val(full)) == [2, 4]  # one evaluation after the restart
    assert [r["lr"] for r in metrics(full) if "lr" in r] == [r["lr"] for r in metrics(split) if "lr" in r]
    for row in metrics(full):
        if "loss" in row:
            assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= row.keys()
    assert (full / "loss.png").stat().st_size > 1000 and (full / "config.yaml").is_file()


def test_kill_during_save_keeps_previous_checkpoint(tmp_path, data_args, uninterrupted):
    run = tmp_path / "run"
    args = [*PRETRAIN, *data_args, f"run.dir={run}", "train.max_steps=4", "checkpoint.interval=2"]
    p = run_main(args, env={"NOSA_FAULT_KILL_DURING_SAVE": "4"}, check=False)
    assert p.returncode != 0  # SIGKILL in the middle of the step-4 save
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "iter_0000002"
    assert (ckpts / "iter_0000004.tmp").is_dir() and not (ckpts / "iter_0000004").exists()
    p = train_here(args)
    assert "resumed from" in p.stdout and "iter_0000002 at step 2" in p.stdout
    assert (ckpts / "latest").read_text().strip() == "iter_0000004"
    assert not (ckpts / "iter_0000004.tmp").exists()
    reference, _ = uninterrupted  # the same 4 steps without checkpoints
    assert losses(reference) == losses(run)


@pytest.fixture(scope="module")
def cpt_runs(tmp_path_factory, data_args, wrapper_run):
    """NOSA CPT from the launcher's 2-step pretraining (init_from, resharded) at TP=1 (one process), TP=2, and
    PP=2 with 2 virtual stages (interleaved 1F1B), full activation recompute, W&B offline and a profile of step 2;
    then SFT at PP=2 from the TP=2 checkpoint. ``({name: run dir}, {name: output})``."""
    root = tmp_path_factory.mktemp("chain")
    dirs = {n: root / n for n in ("cpt1", "cpt_tp", "cpt_pp", "sft")}
    pre, p = wrapper_run  # the 2-step pretraining (1 process), launched through launch/run_train.sh
    assert p.returncode == 0, p.stderr[-3000:]
    cpt = [*CPT, *data_args, f"init_from={pre}", "train.max_steps=2"]
    out = {"cpt1": train_here([*cpt, f"run.dir={dirs['cpt1']}", NO_SAVE]).stdout,
           "cpt_tp": run_main([*cpt, f"run.dir={dirs['cpt_tp']}", "parallel.tensor_model_parallel_size=2"],
                              nproc=2).stdout,
           "cpt_pp": run_main([*cpt, f"run.dir={dirs['cpt_pp']}", "parallel.pipeline_model_parallel_size=2",
                               "parallel.virtual_pipeline_model_parallel_size=2", "train.recompute=full",
                               "logging.wandb=offline", "profile.start_step=2", "profile.num_steps=1", NO_SAVE],
                              nproc=2, env={"WANDB_MODE": "offline"}).stdout}
    out["sft"] = run_main(["recipe=tiny_sft", *data_args, f"run.dir={dirs['sft']}", f"init_from={dirs['cpt_tp']}",
                           "train.seq_length=256", "train.global_batch_size=2", "train.max_steps=2",
                           "optim.warmup_steps=1", "checkpoint.interval=0", "parallel.pipeline_model_parallel_size=2",
                           NO_SAVE], nproc=2).stdout
    return dirs, out


def test_stage_chain_with_tensor_and_pipeline_parallel(cpt_runs, wrapper_run):
    """pretrain (1 proc) -> NOSA CPT at TP=1 and TP=2 and PP=2 (init_from, resharded; the PP=2 run interleaved
    with full recompute) -> SFT at PP=2: the CPT losses agree across the layouts."""
    runs, out = cpt_runs
    cpt1, cpt_tp, cpt_pp, sft = (runs[n] for n in ("cpt1", "cpt_tp", "cpt_pp", "sft"))
    pre, _ = wrapper_run
    assert "new parameters keep their initial values" in out["cpt_tp"]  # dense -> NOSA: eviction heads are new
    assert _close(losses(cpt1), losses(cpt_tp), rel=1e-5), (losses(cpt1), losses(cpt_tp))
    assert _close(losses(cpt1), losses(cpt_pp), rel=1e-5), (losses(cpt1), losses(cpt_pp))
    work = lambda d: [r["attention_work"] for r in metrics(d) if "loss" in r]  # the step's documents
    assert work(pre) == [1.0, 1.0]  # EOD packing: every row one causal pass
    assert len(work(cpt1)) == 2 and all(0 < w <= 1 for w in work(cpt1))
    assert work(cpt1) == work(cpt_tp) == work(cpt_pp)  # same data whatever the layout
    cfg = json.loads((cpt_tp / "checkpoints" / "iter_0000002" / "nosa_config.json").read_text())
    assert cfg["attention"]["variant"] == "nosa" and cfg["model"]["rope_type"] == "longrope"
    assert len(losses(sft)) == 2 and all(math.isfinite(v) for v in losses(sft).values())
    assert len(work(sft)) == 2 and all(0 < w < 0.5 for w in work(sft))  # rows packed with short conversations
    for name in ("cpt_tp", "cpt_pp", "sft"):  # 2 processes: third-party warnings folded (TP: the CUDA advice too)
        assert not re.search(r"Warning|warnings\.warn\(", out[name]), out[name][-3000:]
        assert out[name].count(note_line()) == (1 if missing_optional() else 0)


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_non_finite_steps_are_never_applied_nor_saved(tmp_path, data_args, policy):
    """stop: lr=1e6 gives a finite loss with NaN gradients at step 3: not applied, exit 3, the step-2
    checkpoint (finite, intact) is named. skip: lr=1e30 makes the loss itself NaN; after
    train.nan_skip_limit consecutive skips the run stops (exit 3) instead of saving garbage."""
    import torch

    from checkpoints_convert.common import load_megatron_tensors
    from runtime.checkpoint_manifest import verify

    run = tmp_path / policy
    lr = "1.0e+06" if policy == "stop" else "1.0e+30"
    p = train_here([*PRETRAIN, *data_args, f"run.dir={run}", "train.max_steps=8", "checkpoint.interval=2",
                  f"optim.lr={lr}", "optim.min_lr=0.0", "optim.warmup_steps=0", "train.eval_interval=0",
                  f"train.nan_policy={policy}", "train.nan_skip_limit=3", "logging.plot=false"], check=False)
    rows = [r for r in metrics(run) if "loss" in r]
    errors = [ln for ln in p.stdout.splitlines() if ln.startswith("error:")]
    assert p.returncode == 3 and len(errors) == 1 and "Traceback" not in p.stdout, p.stdout[-3000:]
    if policy == "stop":
        assert "step 3: loss is 9." in errors[0] and "gradients hold NaN/inf; the update was not applied" in errors[0]
        assert "newest verified checkpoint: " + str(run / "checkpoints" / "iter_0000002") in errors[0]
        assert [r["step"] for r in rows] == [1, 2]
    else:
        assert "3 consecutive steps skipped (train.nan_skip_limit=3)" in errors[0]
        assert [r["skipped"] for r in rows][-2:] == [True, True]  # the third skip stops before it is logged
    for ckpt in (run / "checkpoints").glob("iter_*"):  # whatever was saved is intact and finite
        assert verify(ckpt) is None
        assert all(torch.isfinite(t).all() for t in load_megatron_tensors(ckpt).values()), ckpt


@pytest.fixture(scope="module")
def wrapper_run(tmp_path_factory, data_args):
    """A 2-step PRETRAIN run through launch/run_train.sh (RUN_ROOT + RUN_ID, no run.dir): the run
    the launcher test checks, and the pretrained checkpoint the stage chain starts from.
    ``(the run dir the launcher should have named, the finished process)``."""
    import os
    import subprocess

    from tests.train.conftest import ROOT

    root = tmp_path_factory.mktemp("launcher")
    env = {**os.environ, "RUN_ROOT": str(root), "RUN_ID": "job42", "NPROC_PER_NODE": "1",
           "OMP_NUM_THREADS": "1", "PYTHON": sys.executable, "MASTER_PORT": "0"}
    p = subprocess.run(["bash", str(ROOT / "launch" / "run_train.sh"), *PRETRAIN, *data_args, "train.max_steps=2",
                        "checkpoint.interval=0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return root / "tiny_pretrain-job42", p


def test_launch_wrapper_names_the_run_dir_from_run_id(wrapper_run):
    run, p = wrapper_run
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(losses(run)) == 2 and (run / "checkpoints" / "latest").is_file()


def test_interleaved_pipeline_full_recompute_and_wandb_offline(cpt_runs):
    """PP=2 with 2 virtual stages (interleaved 1F1B), full activation recompute, W&B offline files, a profile
    (the stage chain's PP=2 CPT run; its losses equal TP=1's there)."""
    runs, out = cpt_runs
    run = runs["cpt_pp"]
    assert len(losses(run)) == 2 and all(math.isfinite(v) for v in losses(run).values()), out["cpt_pp"][-2000:]
    offline = list((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, "no offline W&B run written"
    said = [ln for ln in out["cpt_pp"].splitlines() if ln.startswith("wandb:")]
    assert said == [wandb_offline_line(str(offline[0]))], said  # W&B's own ~27 lines folded into one
    summary = json.loads((run / "profile" / "summary.json").read_text())
    assert summary["steps"] == [2, 2] and (run / "profile" / "trace.json").stat().st_size > 0
    assert {"attention_forward", "attention_backward", "nosa_selection", "nosa_index", "everything_else"} <= \
        summary["gpu_ms_per_step"].keys()


def test_overlap_param_gather_syncs_before_eval_and_save(tmp_path, data_args):
    """DP=2 with the distributed optimizer: gathering the updated parameters lazily in the next
    step's forward (``overlap_param_gather``) trains and saves exactly as the eager gather does:
    the checkpoints hold the weights of their step (what exports and the next stage read), because
    checkpointing (and evaluation) force the gather first. Both runs are the two jobs of one 2-rank multirun
    launch (eager first: a lazy gather left pending by the first job could not make the second one stale)."""
    import torch

    from checkpoints_convert.common import load_megatron_tensors

    # no validation: its forward would run the gather hooks before each save and hide a stale save
    common = [*PRETRAIN, *data_args, "train.max_steps=4", "checkpoint.interval=2", "train.global_batch_size=4",
              "parallel.overlap_grad_reduce=true", "train.eval_iters=0"]
    run_main(["-m", *common, f"run.dir={tmp_path}", "parallel.overlap_param_gather=false,true"], nproc=2)
    eager, lazy = (tmp_path / f"parallel.overlap_param_gather={v}" for v in ("False", "True"))
    assert losses(eager) == losses(lazy) and len(losses(eager)) == 4
    for it in ("iter_0000002", "iter_0000004"):
        a, b = (load_megatron_tensors(d / "checkpoints" / it) for d in (eager, lazy))
        assert a.keys() == b.keys() and a
        stale = [k for k in a if not torch.equal(a[k], b[k])]
        assert not stale, f"{it}: weights differ from the eager-gather run: {stale[:3]}"


def test_fused_adam_resumes_bit_for_bit_and_takes_over_a_multi_tensor_checkpoint(tmp_path, data_args, uninterrupted,
                                                                                  stopped_and_resumed):
    """``optim.fused`` (torch's fused AdamW; here its CPU kernel): a fused run resumes bit for bit, and
    a checkpoint written by the multi-tensor path resumes fused with its step counters, its losses
    within rounding of the fused run's (a lost count would change the bias correction of the first
    steps by far more than the tolerance)."""
    base = [*FOUR_STEPS, *data_args]
    full_dir, full = uninterrupted  # optim.fused at its default
    assert "optimizer: torch's fused AdamW kernel" in full.stdout
    split, stopped, _, resumed = stopped_and_resumed  # optim.fused=true, stopped at step 2
    assert all("optimizer: torch's fused AdamW kernel" in p.stdout for p in (stopped, resumed))
    assert losses(split) == losses(full_dir) and len(losses(split)) == 4  # bitwise
    mixed = tmp_path / "mixed"
    p = train_here([*base, f"run.dir={mixed}", "train.exit_after_steps=2", "optim.fused=false"])
    assert "fused AdamW" not in p.stdout
    p = train_here([*base, f"run.dir={mixed}", "optim.fused=true"])
    assert "resumed from" in p.stdout and "at step 2" in p.stdout
    assert "optimizer: torch's fused AdamW kernel" in p.stdout  # the groups after loading the unfused ones
    assert _close(losses(mixed), losses(full_dir), rel=1e-4), (losses(mixed), losses(full_dir))


def test_checkpoints_carry_the_tokenizer_and_token_ids_into_the_export(stopped_and_resumed, tmp_path):
    """A run's checkpoint records its tokenizer, and a stage started from it carries that and the token ids
    of the Hugging Face model it descends from; to_hf exports both without --tokenizer."""
    from transformers import AutoTokenizer

    from checkpoints_convert.to_hf import export
    from data.tokenizer import Tokenizer
    from runtime.checkpoint_files import carried_record

    run = stopped_and_resumed[0]
    record = json.loads((run / "checkpoints" / "iter_0000004" / "nosa_config.json").read_text())
    tok = Tokenizer(record["tokenizer"])  # absolute: the run's data.tokenizer
    # a from_hf import records its source's token ids; the next stage (no tokenizer of its own) carries them on
    imported = tmp_path / "import" / "iter_0000000"
    imported.mkdir(parents=True)
    ids = {"bos_token_id": 7, "eos_token_id": 8, "pad_token_id": 9}
    (imported / "nosa_config.json").write_text(json.dumps({**record, "tokenizer": None, "source": record["tokenizer"],
                                                           "token_ids": ids}))
    assert carried_record("", str(imported)) == {"tokenizer": record["tokenizer"], "token_ids": ids}
    assert carried_record("", str(run)) == {"tokenizer": record["tokenizer"]}

    lines = []
    out = export(str(run), str(tmp_path / "hf"), log=lines.append)
    assert lines[0] == f"tokenizer: {record['tokenizer']} (recorded with the checkpoint)"
    assert (out / "tokenizer.json").is_file()
    cfg, gen = (json.loads((out / f).read_text()) for f in ("config.json", "generation_config.json"))
    eos = [tok.hf.eos_token_id, tok.hf.convert_tokens_to_ids("<|im_end|>")]  # <|im_end|> joins eos (chat)
    assert cfg["eos_token_id"] == gen["eos_token_id"] == eos and cfg["pad_token_id"] == tok.hf.pad_token_id
    loaded = AutoTokenizer.from_pretrained(str(out))  # a dense export: stock Llama, nothing to ask
    assert loaded.encode("def add(a, b):") == tok.hf.encode("def add(a, b):")
