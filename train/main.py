"""Entry point: ``torchrun [--nproc_per_node=N] train/main.py recipe=<name> [dotted.overrides ...]``.

Examples::

    torchrun --nproc_per_node=8 train/main.py recipe=nosa_8b_cpt init_from=runs/nosa_8b_pretrain \\
        data.paths=[/data/cpt_text_document] data.tokenizer=/data/tokenizer
    python train/main.py recipe=tiny_cpt train.max_steps=5          # one CPU process
    python train/main.py recipe=nosa_8b_cpt --cfg job               # resolved config, then exit
    python train/main.py recipe=nosa_8b_cpt dry_run=true            # validate layout, memory estimate
    python train/main.py -m recipe=tiny_cpt attention=nosa_tiny,dense   # sweep: one run per value
    python train/main.py --help

Hydra's command line (``key=value`` overrides, ``--help``, ``--cfg job``, ``-m``; see
:mod:`train.cli`). The run directory (``run.dir``, default ``runs/<recipe>``; a multirun job's is
``<run.dir or runs/<recipe>>/<swept key=value,...>``) receives ``config.yaml``, ``checkpoints/``,
``metrics.jsonl`` and ``loss.png``.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # `python train/main.py` / `torchrun train/main.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    from runtime.megatron_cpu import lean_megatron_import
    from runtime.process_exit import freeze_at_exit
    from data.third_party_noise import quiet_third_party
    from train.cli import CliError, help_text, parse_cli
    from train.compose import group_options

    freeze_at_exit()  # the exit skips the collector's passes over what torch / megatron-core built
    quiet_third_party()  # megatron-core's optional-package and deprecation warnings: one line
    lean_megatron_import()  # CPU only: megatron-core's import without its GPU-only compile machinery

    rank0 = int(os.environ.get("RANK", "0")) == 0
    try:
        cli = parse_cli(list(sys.argv[1:] if argv is None else argv))
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cli.help:
        if rank0:
            print(help_text(group_options()))
        return 0
    try:
        jobs = plan_jobs(cli)
        if cli.cfg == "job" or any(cfg.print_config for _, cfg in jobs):
            if rank0:
                from train.compose import COMMANDS, to_yaml

                for job, cfg in jobs:  # the config without the switches that asked for it
                    text = to_yaml(cfg, omit=COMMANDS)
                    print(f"# {' '.join(job)}\n{text}" if cli.multirun else text)
            return 0
        if any(cfg.dry_run for _, cfg in jobs):
            from train.dry_run import dry_run
            from train.multirun import header

            rcs = []
            for i, (job, cfg) in enumerate(jobs):
                if cli.multirun and rank0:
                    print(header(i, len(jobs), job, cfg.run_dir), flush=True)
                rcs.append(dry_run(cfg))
            return max(rcs)
        from train.config import validate
        from train.distributed import world_size_from_env

        for _, cfg in jobs:
            validate(cfg, world_size=world_size_from_env())
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if not cli.multirun:
        return train(jobs[0][1])
    return run_multirun(cli, jobs, rank0)


def run_multirun(cli, jobs: list, rank0: bool) -> int:
    """Every job in turn (a header each); jobs that already finished are skipped; the sweep stops at
    the first failure; a summary table at the end."""
    from train.cli import override_dirname
    from train.compose import expand_sweep
    from train.multirun import FAILED, FINISHED, NOT_RUN, TRAINED, finished_step, header, summary

    done = [finished_step(cfg) for _, cfg in jobs]  # read once, before any job runs: every rank agrees
    to_run = [i for i, step in enumerate(done) if step is None]
    status = [NOT_RUN] * len(jobs)
    rc = 0
    for i, (job, cfg) in enumerate(jobs):
        if rank0:
            print(header(i, len(jobs), job, cfg.run_dir), flush=True)
        if done[i] is not None:
            status[i] = FINISHED
            if rank0:
                print(f"[multirun] job {i + 1}/{len(jobs)} already finished: its checkpoint is at step {done[i]} = "
                      f"train.max_steps (raise train.max_steps to continue it)", flush=True)
            continue
        rc = train(cfg, last=i == to_run[-1])
        status[i] = TRAINED if rc == 0 else f"{FAILED} (exit {rc})"
        if rc:
            if rank0 and i + 1 < len(jobs):
                print(f"error: multirun job {i + 1}/{len(jobs)} failed (exit {rc}); the {len(jobs) - i - 1} "
                      f"job(s) after it were not run", file=sys.stderr, flush=True)
            break
    if rank0:
        swept = expand_sweep(cli.compose_overrides)[1]
        print(summary([(override_dirname(job, swept), cfg.run_dir, st) for (job, cfg), st in zip(jobs, status)]),
              flush=True)
    return rc


def plan_jobs(cli) -> list[tuple[list[str], object]]:
    """``(overrides, RunConfig)`` of each job: one, or one per combination of a ``-m`` sweep (each
    with its own run dir); every job is composed (and so checked) before the first one starts."""
    from train.cli import CliError, job_run_dir
    from train.compose import expand_sweep, load_config

    if not cli.multirun:
        return [(cli.overrides, load_config(cli.compose_overrides))]
    combos, swept = expand_sweep(cli.compose_overrides)
    jobs = []
    for job in combos:
        cfg = load_config(job)
        cfg.run.dir = job_run_dir(cfg.run.dir, cfg.recipe, job, swept)
        jobs.append((job, cfg))
    dirs = [cfg.run_dir for _, cfg in jobs]
    if len(set(dirs)) != len(dirs):
        raise CliError(f"multirun jobs share a run dir ({min(d for d in set(dirs) if dirs.count(d) > 1)})")
    return jobs


def train(cfg, last: bool = True) -> int:
    """Train under a lock on ``run.dir``; bad input, a damaged checkpoint, a non-finite step, Ctrl-C or a lost
    rank end in one line.

    ``last=False`` (a multirun job followed by others) keeps the process group for the next job and
    only tears down megatron's model-parallel state."""
    from pathlib import Path

    import torch.distributed as dist

    from data.sources import BadInputError
    from runtime.checkpoint_files import CheckpointError
    from runtime.outputs import write_atomic
    from train.compose import to_yaml
    from train.config import config_changes
    from train.distributed import init_distributed, shutdown
    from train.lost_rank import Peers, is_collective_failure, lost_rank_line
    from train.metrics import RunFileError, check_metrics_file
    from train.preemption import StopSignal, StoppedWhileStarting, interruption
    from train.run_lock import RunDirLock, RunDirLocked
    from train.trainer import NonFiniteError, Trainer

    env = init_distributed(cfg)
    lock = RunDirLock(cfg.run_dir)
    peers = Peers() if env.world_size > 1 else None
    trainer, broken = None, False  # broken: collectives unusable, leave without a barrier
    # save signals (from the lock on): the trainer acts on them at a step boundary; while the run winds down
    # (torchrun stopping the survivors of a lost rank) they do not kill the report
    held = StopSignal(cfg.cluster.save_signals, env.device, armed=False)
    try:
        held_by = [None]
        if env.is_main:
            try:
                lock.acquire()
                check_metrics_file(cfg.run_dir)  # before anything is built
            except (RunDirLocked, RunFileError) as e:
                held_by[0] = str(e)
        dist.broadcast_object_list(held_by, src=0)
        if held_by[0]:
            raise RunDirLocked(held_by[0])
        if env.is_main:
            changed = sum(config_changes(cfg), [])
            if changed and (Path(cfg.run_dir) / "checkpoints").is_dir():
                print(f"resuming with changed settings: {'; '.join(changed)}", flush=True)
            write_atomic(Path(cfg.run_dir) / "config.yaml", to_yaml(cfg))
        dist.barrier()
        trainer = Trainer(cfg, env)
        trainer.run(held)
    except (NonFiniteError, CheckpointError, RunDirLocked, RunFileError, BadInputError) as e:
        if env.is_main or env.world_size == 1:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 3 if isinstance(e, NonFiniteError) else 2
    except KeyboardInterrupt as e:  # Ctrl-C, or a save signal before the steps: nothing is saved
        broken = env.world_size > 1  # alone, the usual teardown waits for no one
        if env.is_main:
            print(trainer.interrupted(e) if trainer else f"{interruption(e)} while starting: nothing was trained, "
                  f"no checkpoint was changed", file=sys.stderr, flush=True)
        return 128 + e.signum if isinstance(e, StoppedWhileStarting) else 130
    except BaseException as e:  # noqa: BLE001 - torch's CheckpointException is a BaseException
        if peers is None or isinstance(e, SystemExit) or not is_collective_failure(e):
            raise
        broken = True
        lost = peers.lost()
        if peers.reporter(lost):
            newest = trainer.newest_verified(scan=True) if trainer else "no checkpoint was changed"
            print(f"error: {lost_rank_line(lost, trainer.step if trainer else 0, e, newest)}",
                  file=sys.stderr, flush=True)
        return 1
    finally:
        lock.release()
        if broken:
            pass  # no barrier with a peer gone or interrupted; the process exits next
        elif last:
            shutdown()
        else:
            from megatron.core import parallel_state as ps

            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
            dist.barrier()
        held.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
