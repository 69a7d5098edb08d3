"""Reproducible installs: the fast-moving dependencies have upper bounds, constraints.txt pins every
package of an install at versions pyproject.toml accepts, and scripts/setup.sh installs with it,
again whenever pyproject.toml or constraints.txt changes."""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
BOUNDED = {"torch": "3", "transformers": "6", "lm-eval": "0.5", "megatron-core": "0.20"}


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version.strip(), f"constraints.txt: {line!r} is not NAME==VERSION"
            pins[canonicalize_name(name)] = version.strip()
    return pins


def _requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in project["dependencies"] + extras["dev"] + extras["tensorboard"]]


def test_fast_moving_dependencies_have_upper_bounds():
    reqs = {canonicalize_name(r.name): r for r in _requirements()}
    for name, first_excluded in BOUNDED.items():
        spec = reqs[name].specifier
        assert not spec.contains(first_excluded, prereleases=True), f"{name} {spec} admits {first_excluded}"


def test_constraints_pin_every_requirement_within_its_range():
    pins = _pins()
    for req in _requirements():
        if req.marker is not None and not req.marker.evaluate():
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"constraints.txt does not pin {req.name}"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"constraints.txt pins {req.name}=={pins[name]}, outside pyproject.toml's {req.specifier}"
    assert "nosa-train" not in pins  # the project itself is installed from the checkout


FAKE_PYTHON = """#!/usr/bin/env bash
# stands in for .venv/bin/python: records pip calls, answers the version and import checks
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "pip ${*:3}" >> "$(dirname "$0")/../../pip.log"; exit 0; fi
case "$*" in *print*) echo "torch 0 | megatron-core 0";; esac
exit 0
"""


def _setup(root: Path) -> list[str]:
    """Run scripts/setup.sh in ``root``; the pip commands it ran."""
    log = root / "pip.log"
    log.unlink(missing_ok=True)
    env = dict(os.environ, NOSA_SETUP_MIN_FREE_GIB="0")
    r = subprocess.run(["bash", "scripts/setup.sh"], cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return log.read_text().splitlines() if log.exists() else []


def test_setup_installs_with_the_constraints_and_again_when_they_change(tmp_path):
    (tmp_path / "scripts").mkdir()
    for f in ("scripts/setup.sh", "pyproject.toml", "constraints.txt"):
        shutil.copy(REPO / f, tmp_path / f)
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)

    first = _setup(tmp_path)
    assert any(c.startswith("pip install") and "-c constraints.txt" in c and '-e .[dev]' in c for c in first), first
    assert _setup(tmp_path) == []  # installed: nothing to do
    for changed in ("constraints.txt", "pyproject.toml"):
        for f, t in (("constraints.txt", 1000), ("pyproject.toml", 1000), (".venv/.nosa-installed", 2000)):
            os.utime(tmp_path / f, (t, t))
        assert _setup(tmp_path) == []
        os.utime(tmp_path / changed, (3000, 3000))  # edited after the last install
        assert any("-c constraints.txt" in c for c in _setup(tmp_path)), changed
        assert _setup(tmp_path) == []
