"""Entry point: ``torchrun [--nproc_per_node=N] train/main.py recipe=<name> [dotted.overrides ...]``.

Examples::

    torchrun --nproc_per_node=8 train/main.py recipe=nosa_8b_cpt init_from=runs/nosa_8b_pretrain \\
        data.paths=[/data/cpt_text_document] data.tokenizer=/data/tokenizer
    python train/main.py recipe=tiny_cpt train.max_steps=5          # one CPU process
    python train/main.py recipe=nosa_8b_cpt print_config=true       # resolved config, then exit
    python train/main.py recipe=nosa_8b_cpt dry_run=true            # validate layout, memory estimate

Only Hydra-style ``key=value`` overrides are accepted (no flags). The run directory
(``run.dir``, default ``runs/<recipe>``) receives ``config.yaml``, ``checkpoints/``,
``metrics.jsonl`` and ``loss.png``.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # `python train/main.py` / `torchrun train/main.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    from train.compose import load_config, to_yaml
    from train.config import validate
    from train.distributed import world_size_from_env

    overrides = list(sys.argv[1:] if argv is None else argv)
    bad = [a for a in overrides if a.startswith("-") or "=" not in a]
    if bad:
        print(f"train/main.py takes only key=value overrides (e.g. recipe=tiny_cpt train.max_steps=5); got {bad}",
              file=sys.stderr)
        return 2
    try:
        cfg = load_config(overrides)
        if cfg.print_config:
            if int(os.environ.get("RANK", "0")) == 0:
                print(to_yaml(cfg))
            return 0
        if cfg.dry_run:
            from train.dry_run import dry_run

            return dry_run(cfg)
        validate(cfg, world_size=world_size_from_env())
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return train(cfg)


def train(cfg) -> int:
    from pathlib import Path

    import torch.distributed as dist

    from train.compose import to_yaml
    from train.distributed import init_distributed, shutdown
    from train.trainer import NonFiniteLossError, Trainer

    env = init_distributed(cfg)
    try:
        if env.is_main:
            Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
            (Path(cfg.run_dir) / "config.yaml").write_text(to_yaml(cfg))
        dist.barrier()
        Trainer(cfg, env).run()
    except NonFiniteLossError as e:
        print(f"[rank {env.rank}] {e}", file=sys.stderr, flush=True)
        return 3
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
