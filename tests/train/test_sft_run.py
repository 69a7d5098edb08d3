"""SFT training from two inputs with weights and a validation split: val_loss is logged, the
conversations are tokenized once (a resume reads the cache) and the resume is exact."""

import math

from tests.train.conftest import metrics, train_here


def test_sft_two_inputs_validation_split_and_cached_resume(tmp_path, demo_data):
    from pathlib import Path

    lines = Path(demo_data["sft"]).read_text().splitlines(keepends=True)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(lines[::2]))
    b.write_text("".join(lines[1::2]))
    run = tmp_path / "sft"
    args = ["recipe=tiny_sft", "attention=dense", "sft.path=", f"sft.paths=[{a},{b}]", "sft.weights=[1,0.5]",
            "sft.val_fraction=0.1",
            f"sft.cache_dir={tmp_path / 'cache'}", f"sft.tokenizer={demo_data['tokenizer']}", f"run.dir={run}",
            "train.seq_length=256", "train.global_batch_size=2", "train.eval_iters=1", "optim.warmup_steps=1",
            "checkpoint.interval=0", "logging.plot=false"]
    p = train_here([*args, "train.max_steps=2"])
    assert "tokenized, cached in" in p.stdout
    p = train_here([*args, "train.max_steps=3"])
    assert "resumed from" in p.stdout and "from cache" in p.stdout and "tokenized" not in p.stdout
    val = {r["step"]: r["val_loss"] for r in metrics(run) if r.get("val_loss") is not None}
    assert sorted(val) == [2, 3] and all(math.isfinite(v) for v in val.values())
    assert [r["step"] for r in metrics(run) if "loss" in r] == [1, 2, 3]
