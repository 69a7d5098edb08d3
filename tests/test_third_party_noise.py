"""Known third-party startup warnings (optional accelerators missing, megatron-core / torch deprecation
notices) become one line on rank 0; every other warning is shown as before."""

from __future__ import annotations

import subprocess
import sys

from runtime.third_party_noise import missing_optional, note_line
from tests.subproc import REPO, child_env

SCRIPT = """
import logging, warnings
from runtime.third_party_noise import quiet_third_party
quiet_third_party()
quiet_third_party()  # idempotent
warnings.warn("Transformer Engine and Apex are not installed. Falling back to local implementations of x")
warnings.warn("Apex is not installed. Falling back to Torch Norm")
warnings.warn("full scope is deprecated. Use empty cuda_graph_modules to capture the whole layer.")
logging.getLogger("megatron.core.models.gpt.gpt_model").warning("GPTModel IS DEPRECATED. GPTModel is only ...")
logging.getLogger("megatron.core.dist_checkpointing.strategies.torch").warning("MCore's async save is deprecated.")
warnings.warn("a warning of our own that must stay", UserWarning)
logging.getLogger("megatron.core.models.gpt.gpt_model").warning("another megatron warning")
"""


def _output(script: str, **env) -> tuple[list[str], list[str]]:
    """(stdout lines, stderr lines) of ``python -c script``."""
    p = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=child_env(**env), capture_output=True,
                       text=True, timeout=120, check=True)
    return [ln for ln in p.stdout.splitlines() if ln.strip()], [ln for ln in p.stderr.splitlines() if ln.strip()]


def test_known_warnings_become_one_line_and_others_stay():
    out, err = _output(SCRIPT)
    assert out == [note_line()] and "Transformer Engine" in out[0] and "Apex" in out[0]  # a progress line
    rest = "\n".join(err)
    assert "a warning of our own that must stay" in rest and "another megatron warning" in rest
    assert not any(k in rest for k in ("not installed", "deprecated", "DEPRECATED"))
    assert _output(SCRIPT, RANK="1")[0] == []  # other ranks: no note
    out, err = _output(SCRIPT, NOSA_THIRD_PARTY_WARNINGS="1")
    every = "\n".join(err)
    assert out == [] and "GPTModel IS DEPRECATED" in every and "Falling back to Torch Norm" in every


def test_a_dry_run_prints_one_line_before_its_result():
    p = subprocess.run([sys.executable, str(REPO / "train" / "main.py"), "recipe=tiny_cpt", "dry_run=true"],
                       cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not p.stderr.strip()
    assert p.stdout.splitlines()[0] == (note_line() if missing_optional() else p.stdout.splitlines()[0])
    assert p.stdout.count("dry run of tiny_cpt") == 1 and p.stdout.count("note:") == int(bool(missing_optional()))
