"""The Triton kernels shipped with sparse exports compile for sm80 (A100 / A800) and sm90 (H100 / H200)
in every variant the block cache launches (Triton compiles for a target it does not run on), so a
kernel that only the interpreter ever ran cannot reach a GPU user broken."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_export_kernels_compile_for_ampere_and_hopper():
    pytest.importorskip("triton")
    script = Path(__file__).with_name("compile_export_kernels.py")
    repo = script.parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = f"{repo}{os.pathsep}{env.get('PYTHONPATH', '')}"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    for arch in ("sm80", "sm90"):
        names = {row["kernel"] for row in rows if row["arch"] == arch}
        assert len(names) == 14
        assert {"store_values", "fetch_rows bias=True", "decode_attn fp32=False bias=True host=True",
                "decode_select kc=bf16 wsc=True", "decode_select kc=fp32 wsc=False"} <= names
