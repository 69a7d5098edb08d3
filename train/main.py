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
    """Train under a lock on ``run.dir``; bad input, a damaged checkpoint or a non-finite step end in one line."""
    from pathlib import Path

    import torch.distributed as dist

    from data.sources import BadInputError
    from runtime.checkpoint_files import CheckpointError
    from train.compose import to_yaml
    from train.config import config_changes
    from train.distributed import init_distributed, shutdown
    from train.run_lock import RunDirLock, RunDirLocked
    from train.trainer import NonFiniteError, Trainer

    env = init_distributed(cfg)
    lock = RunDirLock(cfg.run_dir)
    try:
        held = [None]
        if env.is_main:
            try:
                lock.acquire()
            except RunDirLocked as e:
                held[0] = str(e)
        dist.broadcast_object_list(held, src=0)
        if held[0]:
            raise RunDirLocked(held[0])
        if env.is_main:
            changed = sum(config_changes(cfg), [])
            if changed and (Path(cfg.run_dir) / "checkpoints").is_dir():
                print(f"resuming with changed settings: {'; '.join(changed)}", flush=True)
            _write_atomic(Path(cfg.run_dir) / "config.yaml", to_yaml(cfg))
        dist.barrier()
        Trainer(cfg, env).run()
    except (NonFiniteError, CheckpointError, RunDirLocked, BadInputError) as e:
        if env.is_main or env.world_size == 1:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 3 if isinstance(e, NonFiniteError) else 2
    finally:
        lock.release()
        shutdown()
    return 0


def _write_atomic(path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
