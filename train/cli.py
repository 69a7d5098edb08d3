"""The command line of ``train/main.py``: Hydra's flags and overrides, parsed without Hydra's runtime.

Accepted, as in any Hydra app: ``key=value`` overrides (``recipe=<name>`` needs no ``+``),
``--help`` / ``-h``, ``--cfg job`` (print the resolved config and exit; ``-c job``), ``--resolve``
(accepted: the printed config is always resolved), and ``--multirun`` / ``-m`` (a sweep such as
``attention=nosa,infllm_v2,dense``: one run per combination, one after the other, each in its own
run dir, see :func:`job_run_dir`), and ``--config-dir DIR`` / ``-cd DIR`` (recipes outside the checkout:
``DIR`` holds group folders as ``recipes/`` does, e.g. ``DIR/recipe/my_run.yaml``, searched besides
``recipes/``; Hydra's ``hydra.searchpath``). Hydra's runtime (output dirs, logging setup, cwd change) is not
used, so every torchrun rank parses the same command line into the same jobs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

USAGE = ("usage: [torchrun ...] train/main.py [--help] [--cfg job] [-m] [--config-dir DIR] recipe=<name> "
         "[key=value ...]")
FLAGS = "--help, --cfg job, --resolve, -m/--multirun, --config-dir DIR"


class CliError(ValueError):
    """A command line this program does not accept (one line)."""


@dataclass
class Cli:
    overrides: list[str] = field(default_factory=list)
    help: bool = False
    cfg: str | None = None  # "job": print the config and exit
    multirun: bool = False
    config_dirs: list[str] = field(default_factory=list)  # --config-dir: more recipe folders (absolute)

    @property
    def compose_overrides(self) -> list[str]:
        """The overrides with the recipe folders of ``--config-dir`` on Hydra's search path."""
        if not self.config_dirs:
            return list(self.overrides)
        return [*self.overrides, f"hydra.searchpath=[{','.join('file://' + d for d in self.config_dirs)}]"]


def parse_cli(argv: list[str]) -> Cli:
    """Split ``argv`` into Hydra flags and ``key=value`` overrides; a bad flag is a :class:`CliError`."""
    out = Cli()
    it = iter(argv)
    for a in it:
        if a in ("-h", "--help"):
            out.help = True
        elif a in ("-m", "--multirun"):
            out.multirun = True
        elif a == "--resolve":
            pass
        elif a in ("-cd", "--config-dir") or a.startswith("--config-dir="):
            d = a.split("=", 1)[1] if "=" in a else next(it, None)
            if not d or not os.path.isdir(d):
                raise CliError(f"--config-dir {d or ''}: not a directory; give a folder of recipe groups laid out "
                               f"as recipes/ (e.g. DIR/recipe/<name>.yaml)".replace("--config-dir :", "--config-dir:"))
            out.config_dirs.append(os.path.abspath(d))
        elif a in ("-c", "--cfg") or a.startswith("--cfg="):
            what = a.split("=", 1)[1] if "=" in a else next(it, None)
            if what != "job":
                raise CliError(f"--cfg {what or ''} is not supported: use --cfg job (this program has no Hydra "
                               f"runtime config to print)".replace("--cfg  ", "--cfg "))
            out.cfg = what
        elif a.startswith("-") or "=" not in a:
            raise CliError(f"unknown argument {a!r}: train/main.py takes only key=value overrides (e.g. "
                           f"recipe=tiny_cpt train.max_steps=5) and the Hydra flags {FLAGS}")
        else:
            out.overrides.append(a)
    return out


def help_text(groups: dict[str, list[str]]) -> str:
    """``--help``: usage, flags, the config groups with their options, and where the keys are listed."""
    lines = [USAGE, "",
             "Trains a model with megatron-core from a recipe of recipes/ (Hydra config groups) and",
             "key=value overrides of any field of train/config.py:RunConfig.", "",
             "Flags (Hydra's):",
             "  -h, --help        this help",
             "  --cfg job         print the resolved config of the given overrides and exit (-c job)",
             "  --resolve         accepted; the printed config is always resolved",
             "  -m, --multirun    sweep: key=a,b[,...] (also range(), choice(), glob() over a group) runs every",
             "                    combination in turn, each in <run.dir or runs/<recipe>>/<swept key=value,...>",
             "  --config-dir DIR  recipes outside the checkout: DIR holds group folders as recipes/ does",
             "                    (DIR/recipe/<name>.yaml, DIR/model/<name>.yaml, ...), searched besides recipes/",
             "", "Config groups (select with <group>=<option>):"]
    for g, opts in groups.items():
        lines.append(f"  {g}: {', '.join(opts)}")
    lines += ["", "Examples:",
              "  python train/main.py recipe=tiny_cpt train.max_steps=5",
              "  python train/main.py recipe=nosa_8b_cpt --cfg job",
              "  torchrun --nproc_per_node=8 train/main.py -m recipe=nosa_1b_cpt attention=nosa,infllm_v2,dense",
              "  python train/main.py recipe=nosa_8b_cpt dry_run=true",
              "", "Every key with its default: train/main.py --cfg job (or recipe=<name> --cfg job)."]
    return "\n".join(lines)


def override_dirname(job: list[str], swept: list[str]) -> str:
    """Hydra's ``override_dirname`` of the swept keys of one job: ``key=value`` sorted, joined by ``,``
    (``/`` in values becomes ``_``, so each job is one directory)."""
    keys = set(swept)
    parts = sorted(o for o in job if o.split("=", 1)[0].lstrip("+~") in keys)
    return ",".join(p.replace(os.sep, "_") for p in parts)


def job_run_dir(run_dir: str | None, recipe: str, job: list[str], swept: list[str]) -> str:
    """The run dir of one multirun job: ``<run.dir>/<override_dirname>``, or without ``run.dir``
    ``runs/<recipe>/<override_dirname>`` (a swept ``recipe`` is then named by the path already)."""
    if "run.dir" in swept:
        raise CliError("run.dir cannot be swept: each job of a multirun gets <run.dir>/<swept key=value,...>")
    if run_dir is None:
        base, swept = f"runs/{recipe}", [k for k in swept if k != "recipe"]
    else:
        base = run_dir
    name = override_dirname(job, swept)
    return os.path.join(base, name) if name else base
