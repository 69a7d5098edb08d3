"""Recipes compose and validate; the CLI's config errors are one line; dry run of the 8B."""

import re
import subprocess
import sys

import pytest

from nosa_layers.config import NOSAConfig, tiny_geometry
from nosa_layers.eviction import EVICTION_HEADS
from train.compose import from_dict, load_config
from train.config import RunConfig, validate
from train.longrope_init import attention_factor, yarn_ramp_factors
from tests.train.conftest import ROOT

RECIPES = sorted(p.stem for p in (ROOT / "recipes" / "recipe").glob("*.yaml"))


def _imported_model_group(root) -> list[str]:
    """The overrides that give a recipe of an imported model (``import_*``) its model: the group file that
    ``from_hf --target-length 16384`` writes, here for a small GQA 9 / 3 Llama with an 8K context."""
    from checkpoints_convert.model_group import extend_context, write_model_group
    from nosa_layers.megatron.config import ModelConfig

    src = ModelConfig(size="imported_llama", num_layers=2, hidden_size=576, num_attention_heads=9, num_kv_heads=3,
                      head_dim=64, ffn_hidden_size=1536, vocab_size=49152, max_position_embeddings=8192,
                      rope_theta=100000.0, tie_embeddings=True)
    path = write_model_group(root, extend_context(src, 16384), "a test")
    return [f"hydra.searchpath=[file://{root}]", f"model={path.stem}"]


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_composes_and_validates(name, tmp_path):
    model = _imported_model_group(tmp_path) if name.startswith("import_") else []
    cfg = load_config([f"recipe={name}", *model])
    assert isinstance(cfg, RunConfig) and cfg.recipe == name
    validate(cfg, world_size=cfg.parallel.model_parallel_size, check_files=False)
    stage = re.search(r"_(pretrain|cpt|sft)", name).group(1)
    assert cfg.stage.kind == stage
    if stage == "pretrain":
        assert cfg.attention.variant == "dense" and cfg.model.rope_type == "default"
    else:  # CPT and SFT run NOSA (or an ablation) with LongRoPE
        assert cfg.attention.variant in ("nosa", "infllm_v2") and cfg.model.rope_type == "longrope"
        assert len(cfg.model.longrope.short_factor) == cfg.model.kv_channels // 2
    if name.startswith("nosa_") and stage == "cpt":  # 16K, or the 64K / 128K stages with context parallelism
        length = {"": 16384, "_64k": 65536, "_128k": 131072}[name.split("_cpt", 1)[1].split("_evict")[0]]
        assert cfg.train.seq_length == length and cfg.data.packing == "document"
        assert cfg.model.max_position_embeddings == length
        assert cfg.parallel.context_parallel_size == max(1, length // 32768)
        if length > 16384:  # factors as train.longrope_init computes them for the stage's length
            lr = cfg.model.longrope
            want = yarn_ramp_factors(cfg.model.kv_channels, cfg.model.rope_theta, lr.original_max_position_embeddings,
                                     length)
            assert lr.short_factor == lr.long_factor == [round(f, 6) for f in want]
            assert lr.attention_factor == round(attention_factor(lr.original_max_position_embeddings, length), 6)


def test_every_eviction_head_has_its_ablation_recipe():
    """Each registered head is one class plus an attention preset and a 1B CPT ablation recipe."""
    heads = {n: load_config([f"recipe={n}"]).attention for n in RECIPES if "_evict_" in n}
    assert heads["nosa_1b_cpt_evict_none"].variant == "infllm_v2"
    for h in sorted(set(EVICTION_HEADS) - {"none", NOSAConfig().eviction_head}):
        assert (ROOT / "recipes" / "attention" / f"nosa_evict_{h}.yaml").is_file(), h
        assert heads[f"nosa_1b_cpt_evict_{h}"].nosa.eviction_head == h
        assert heads[f"nosa_1b_cpt_evict_{h}"].variant == "nosa"


def test_tiny_recipes_use_the_tiny_geometry():
    """``recipes/attention/nosa_tiny.yaml`` is ``nosa_layers.config.tiny_geometry()``, the tests' geometry."""
    for name in ("tiny_cpt", "tiny_sft"):
        assert load_config([f"recipe={name}"]).attention.nosa == tiny_geometry()


def test_dotted_overrides_win_over_the_recipe():
    cfg = load_config(["recipe=tiny_cpt", "train.max_steps=7", "parallel.tensor_model_parallel_size=2",
                       "checkpoint.interval=3", "checkpoint.resume=none", "train.exit_after_steps=2",
                       "run.dir=/tmp/x", "init_from=/tmp/y"])
    assert (cfg.train.max_steps, cfg.parallel.tensor_model_parallel_size, cfg.checkpoint.interval,
            cfg.checkpoint.resume, cfg.train.exit_after_steps, cfg.run_dir, cfg.init_from) == \
        (7, 2, 3, "none", 2, "/tmp/x", "/tmp/y")
    assert load_config(["recipe=tiny_cpt"]).run_dir == "runs/tiny_cpt"


def test_strict_conversion_names_the_bad_key():
    with pytest.raises(ValueError, match=r"unknown config key 'train.max_step'; did you mean 'max_steps'"):
        from_dict(RunConfig, {"train": {"max_step": 3}})
    with pytest.raises(ValueError, match="train.max_steps must be an integer"):
        from_dict(RunConfig, {"train": {"max_steps": "many"}})


@pytest.mark.parametrize("override,msg", [
    ("train.micro_batch_size=3", "not divisible by micro_batch_size"),
    ("optim.min_lr=1.0", "min_lr"),
    ("train.seq_length=500", "multiple of the NOSA block_size"),
    ("stage.kind=rl", "stage.kind"),
    ("parallel.context_parallel_size=3", "divisible by 2\\*context_parallel=6"),
    ("train.loss_impl=whole", "train.loss_impl='whole' is not one of"),
    ("train.loss_chunk_tokens=0", "train.loss_chunk_tokens=0 must be >= 1"),
    ("train.precision=fp16", "train.loss_impl=chunked computes the logit gradients in the forward"),
])
def test_validation_errors_are_one_line(override, msg):
    cfg = load_config(["recipe=tiny_cpt", override])
    with pytest.raises((ValueError, NotImplementedError), match=msg) as e:
        validate(cfg, world_size=cfg.parallel.model_parallel_size, check_files=False)
    assert "\n" not in str(e.value)


def _cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "train" / "main.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_cli_print_config_and_errors():
    """train/main.py's main() in this process (test_dry_run_8b_... runs the script itself)."""
    from tests.train.conftest import train_here

    p = train_here(["recipe=tiny_cpt", "print_config=true"])
    assert p.returncode == 0 and "eviction_head: ed_dma" in p.stdout and "seq_length: 512" in p.stdout
    p = train_here(["recipe=tiny_cpt", "train.max_stepz=3"], check=False)
    assert p.returncode != 0 and "max_stepz" in p.stderr
    p = train_here(["--recipe", "tiny_cpt"], check=False)
    assert p.returncode == 2 and "only key=value overrides" in p.stderr
    p = train_here(["recipe=tiny_cpt", "train.micro_batch_size=3"], check=False)
    assert p.returncode == 2 and p.stderr.strip().startswith("config error:")


def test_dry_run_8b_counts_parameters_on_the_meta_device():
    p = _cli("recipe=nosa_8b_cpt", "dry_run=true")
    assert p.returncode == 0, p.stderr[-3000:]
    cfg = load_config(["recipe=nosa_8b_cpt"])
    m = cfg.model
    h, d = m.hidden_size, m.kv_channels
    layer = (h * (m.num_attention_heads + 2 * m.num_kv_heads) * d + m.num_attention_heads * d * h
             + 3 * h * m.ffn_hidden_size + 2 * h + m.num_kv_heads + m.num_kv_heads * m.num_kv_heads * d)
    total = m.num_layers * layer + 2 * m.padded_vocab_size * h + h
    got = float(re.search(r"parameters: ([0-9.]+) B total", p.stdout).group(1))
    assert got == pytest.approx(total / 1e9, abs=1e-3)
    assert "layout valid for 8 GPUs (TP=4 PP=2 CP=1 DP=1)" in p.stdout and "fits in 80 GiB" in p.stdout
    gib = float(re.search(r"= ~([0-9.]+) GiB", p.stdout).group(1))
    assert 10 < gib < 80  # fits an 80 GB GPU at TP=4 x PP=2 with selective recompute


def test_init_from_compares_every_field_the_checkpoint_records(tmp_path):
    """A recipe that differs from init_from's checkpoint in any recorded field (not only the shapes) is one
    line naming the field and the override that accepts it; the CPT stage declares its own changes; the dry
    run checks the same."""
    import json

    from runtime.checkpoint_files import configs_to_dict
    from tests.train.conftest import train_here
    from train.config import init_changes_line
    from train.dry_run import dense_length_note

    pre = load_config(["recipe=tiny_pretrain"])
    ckpt = tmp_path / "iter_0000001"
    ckpt.mkdir()
    (ckpt / "nosa_config.json").write_text(json.dumps(configs_to_dict(pre.model, pre.attention)))

    def check(*overrides):
        cfg = load_config([*overrides, f"init_from={ckpt}"])
        return validate(cfg, world_size=1, check_files=False, check_init=True)

    with pytest.raises(ValueError) as e:
        check("recipe=tiny_pretrain", "model.rope_theta=500000", "model.norm_eps=1e-6")
    msg = str(e.value)
    assert "\n" not in msg and "model.rope_theta (checkpoint 10000.0, recipe 500000.0)" in msg
    assert "model.norm_eps (checkpoint 1e-05, recipe 1e-06)" in msg
    assert msg.endswith("init_changes=[model.rope_theta,model.norm_eps]")
    cfg = check("recipe=tiny_pretrain", "model.rope_theta=500000", "init_changes=[model.rope_theta]")
    assert "model.rope_theta (checkpoint 10000.0, recipe 500000.0)" in init_changes_line(cfg)
    cfg = check("recipe=tiny_cpt")  # dense -> NOSA with LongRoPE: the stage's own, declared changes
    line = init_changes_line(cfg)
    assert "model.rope_type (checkpoint 'default', recipe 'longrope')" in line and "attention." not in line
    assert line.endswith("change the model below 256 tokens too (python -m train.longrope_init --short original "
                         "keeps it there)")
    with pytest.raises(ValueError, match=r"model\.max_position_embeddings .*init_changes=\[model.max_position"):
        check("recipe=tiny_cpt", "init_changes=[]")
    with pytest.raises(ValueError, match=r"init_changes has \['model.rope_thta'\]"):
        check("recipe=tiny_pretrain", "init_changes=[model.rope_thta]")
    p = train_here(["recipe=tiny_pretrain", "dry_run=true", f"init_from={ckpt}", "model.rope_theta=500000"],
                   check=False)
    assert p.returncode == 2 and "model.rope_theta" in p.stderr and "fits" not in p.stdout
    # within the selection budget (tiny geometry: 6 blocks of 16 tokens) NOSA trains densely, and says so
    assert "train densely" in dense_length_note(load_config(["recipe=tiny_cpt", "train.seq_length=96"]))
    assert dense_length_note(load_config(["recipe=tiny_cpt"])) is None


def test_longrope_init_writes_the_whole_block_and_says_what_changes_at_short_context(capsys):
    """train.longrope_init: max_position_embeddings in the block, a note that the factors change the model at
    short context (or, with --short original, the source model's RoPE up to --orig); a wrong factor count
    names the tool."""
    import torch
    import yaml

    from nosa_layers.rope.longrope import LongRoPEConfig, longrope_cos_sin
    from train.longrope_init import main

    main(["--head-dim", "16", "--theta", "10000", "--orig", "256", "--target", "512"])
    text = capsys.readouterr().out
    assert text.startswith("# these factors change the model at short context too: 7 of 8")
    model = yaml.safe_load(text)["model"]
    tiny = load_config(["recipe=tiny_cpt"]).model  # its block is this command's output
    assert model["max_position_embeddings"] == tiny.max_position_embeddings == 512
    assert LongRoPEConfig(**model["longrope"]) == tiny.longrope
    main(["--head-dim", "16", "--theta", "10000", "--orig", "256", "--target", "512", "--short", "original"])
    lr = LongRoPEConfig(**yaml.safe_load(capsys.readouterr().out)["model"]["longrope"])
    pos = torch.arange(256)
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    cos, _ = longrope_cos_sin(lr, pos, 16, 10000.0, 512)
    assert torch.allclose(cos, torch.cat([pos[:, None] * inv] * 2, -1).cos())  # the source model's RoPE
    bad = load_config(["recipe=tiny_cpt", "model.longrope.short_factor=[1.0,2.0]"])
    with pytest.raises(ValueError, match=r"model\.longrope\.short_factor has 2 entries; it needs head_dim/2 = 8 .*"
                                         r"python -m train\.longrope_init --head-dim 16 --theta 10000 --orig 256 "
                                         r"--target 512"):
        validate(bad, world_size=1, check_files=False)
