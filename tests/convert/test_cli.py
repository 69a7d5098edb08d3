"""The CLIs end to end: from_hf (keep / unfold muP) -> trainer-format checkpoint -> to_hf bitwise,
verify (Megatron forward on the imported checkpoint), and an export that runs with only torch +
transformers (framework imports blocked)."""

from __future__ import annotations

import json
import shutil
import sys

import torch

from checkpoints_convert.common import load_safetensors_dir, read_model_config
from checkpoints_convert.to_hf import export
from tests.convert.conftest import REPO, run, subprocess_env, tail

CASE = "minicpm4-nosa-tp2-long"


CLI = """
import sys
from checkpoints_convert.from_hf import main as from_hf
from checkpoints_convert.to_hf import export
from checkpoints_convert.verify import main as verify
src, keep, unfold, hf_unfold, report = sys.argv[1:]
rc = from_hf(["--hf", src, "--out", keep]) or from_hf(["--hf", src, "--out", unfold, "--mup", "unfold"])
if rc:
    sys.exit(rc)
export(unfold, hf_unfold, log=lambda *_: None)
sys.exit(verify(["--hf", hf_unfold, "--ckpt", unfold, "--seq-len", "200", "--random", "1", "--json", report]))
"""


def test_from_hf_to_hf_and_verify(exports, tmp_path):
    """from_hf (keep and unfold muP), to_hf of the unfolded import and verify on it, one after the other
    in one subprocess (one megatron-core import); the checks below read what it wrote."""
    src = exports[CASE]
    keep, unfold, rep = tmp_path / "keep", tmp_path / "unfold", tmp_path / "verify.json"
    log = tmp_path / "cli.log"
    rc = run([sys.executable, "-c", CLI, src, keep, unfold, tmp_path / "hf_unfold", rep], log, 300)
    assert rc == 0, tail(log)
    for d in (keep, unfold):  # trainer layout: latest pointer + iter dir with nosa_config.json
        assert (d / "latest").read_text().strip() == "iter_0000000"
        assert (d / "iter_0000000" / "metadata.json").is_file()
    m_keep, _, _ = read_model_config(keep / "iter_0000000")
    m_unf, _, _ = read_model_config(unfold / "iter_0000000")
    assert not m_keep.use_mup and m_unf.use_mup and m_unf.scale_emb == 12.0

    a = load_safetensors_dir(src)
    back = load_safetensors_dir(export(str(keep), str(tmp_path / "hf_keep"), log=lambda *_: None))
    assert set(a) == set(back) and all(torch.equal(a[k], back[k]) for k in a)  # bitwise
    back2 = load_safetensors_dir(tmp_path / "hf_unfold")
    for k in a:  # fold(unfold(w)) is exact to about one ulp
        torch.testing.assert_close(back2[k], a[k], rtol=3e-7, atol=0)
    c1 = json.loads((src / "config.json").read_text())
    c2 = json.loads((tmp_path / "hf_unfold" / "config.json").read_text())
    assert c2["nosa_export"]["mup_folded"] == c1["nosa_export"]["mup_folded"]

    # verify: tensor round trip + Megatron (TP=1, loads the from_hf checkpoint) vs HF logits
    report = json.loads(rep.read_text())
    assert report["tensor_roundtrip"] == "ok"
    assert report["logits_vs_megatron"]["rel"] <= 1e-4 and report["decode_vs_forward"]["rel"] <= 1e-4


BLOCKER = r"""
import sys, importlib.abc
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("nosa_layers", "inference", "checkpoints_convert", "train", "data", "megatron"):
            raise ImportError("blocked " + name)
sys.meta_path.insert(0, _Block())
import torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.float32)
ids = torch.randint(0, m.config.vocab_size, (2, 40))
mask = torch.ones_like(ids); mask[0, :7] = 0
out = m.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
assert out.shape == (2, 44)
assert not any(k.split(".")[0] in ("nosa_layers", "inference", "checkpoints_convert") for k in sys.modules)
print("STANDALONE_OK", type(m).__name__)
"""


def test_export_runs_without_the_framework(exports, tmp_path):
    dst = shutil.copytree(exports["llama3-infllm_v2-pp2-long"], tmp_path / "standalone")
    (tmp_path / "check.py").write_text(BLOCKER)
    env = subprocess_env(PYTHONPATH="", HF_MODULES_CACHE=str(tmp_path / "hf_modules"))
    log = tmp_path / "standalone.log"
    rc = run([sys.executable, str(tmp_path / "check.py"), str(dst)], log, 180, cwd=tmp_path, env=env)
    assert rc == 0 and "STANDALONE_OK NOSALlamaForCausalLM" in log.read_text(), tail(log)
    assert REPO.exists()
