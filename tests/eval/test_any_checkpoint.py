"""Every eval tool on every checkpoint form: a NOSA export (LongRoPE, sparse at the lengths scored), a
dense export (a stock ``LlamaForCausalLM`` dir), a Megatron checkpoint and a reference-format dir, all
built once for the module from random weights (``tests/eval/_exports.py``). The direct path (the
Megatron model) and lm-evaluation-harness (the Hugging Face model) must score the same items the
same way, which only holds when both loaded the same model and tokenizer. The exports' tokenizers
load with ``AutoTokenizer`` as users load them, with or without ``trust_remote_code``."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.eval._exports import build, run_tools, tool_calls
from tests.subproc import child_env

pytestmark = pytest.mark.slow  # the module fixture imports and exports three models (about a minute on 2 cores)


@pytest.fixture(scope="module")
def forms(tmp_path_factory) -> dict:
    return build(tmp_path_factory.mktemp("forms"))


def _items(out: Path) -> dict:
    rows = [json.loads(line) for line in (out / "items.jsonl").read_text().splitlines()]
    return {(r["task"], r["length"], r["sample"], r["item"]): r for r in rows}


def _same_items(direct: Path, lm_eval: Path) -> None:
    a, b = _items(direct), _items(lm_eval)
    assert a.keys() == b.keys() and len(a) == 2 * (1 + 5)  # 2 samples of niah_single (1 item) and vt (5)
    for key, row in a.items():
        assert b[key]["loglik"] == pytest.approx(row["loglik"], rel=1e-4), key
        assert b[key]["greedy"] == row["greedy"], key


FORM_TOOLS = {"nosa": None, "dense": None,  # None: every tool
              "megatron_nosa": ("ruler", "ruler_lm_eval"), "reference": ("ruler", "ruler_lm_eval", "ppl")}


@pytest.fixture(scope="module")
def outputs(forms, tmp_path_factory) -> dict:
    """Every eval tool on the NOSA and the dense export, both harnesses on the Megatron checkpoint and
    the reference-format dir: form -> (return codes, its tools' log, output dir). All in one
    subprocess (one megatron-core import); each form's log is the import preamble + its own calls."""
    root = tmp_path_factory.mktemp("tools")
    calls = {name: tool_calls(forms, forms[name], root / name, *([tools] if tools else []))
             for name, tools in FORM_TOOLS.items()}
    rcs, text = run_tools([c for cs in calls.values() for c in cs], root / "tools.log", timeout_s=900)
    preamble, *parts = re.split(r"(?m)^=== ", text)
    assert len(parts) == len(rcs), text[-6000:]
    out, i = {}, 0
    for name, cs in calls.items():
        n = len(cs)
        out[name] = (rcs[i:i + n], "=== ".join([preamble, *parts[i:i + n]]), root / name)
        i += n
    return out


@pytest.mark.parametrize("name", ["nosa", "dense"])
def test_every_eval_tool_on_an_export(outputs, name):
    rcs, text, out = outputs[name]
    assert rcs == [0] * 5, text[-6000:]
    assert "Traceback" not in text and "[y/N]" not in text
    assert "IS DEPRECATED" not in text and "Falling back" not in text  # third-party notices: one line at most
    _same_items(out / "ruler", out / "ruler_lm_eval")
    ruler = json.loads((out / "ruler" / "ruler.json").read_text())
    assert ruler["model"]["kind"] == "hf" and ruler["model"]["label"] == ("ed_dma" if name == "nosa" else "dense")
    ppl = json.loads((out / "ppl" / "ppl.json").read_text())
    assert ppl["docs"] == 2 and all(math.isfinite(b["ppl"]) and b["tokens"] > 0 for b in ppl["buckets"])
    loc = json.loads((out / "locality" / "locality.json").read_text())
    if name == "dense":
        assert loc["dense"] and loc["summary"]["note"] == "dense: no selection"
    else:  # 256 tokens, sparse from 96 on: real selections
        assert not loc["dense"] and 0 < loc["summary"]["gamma_min"] <= loc["summary"]["gamma_mean"] <= 1
    result = json.loads((out / "suite" / "result.json").read_text())
    assert result["ruler"]["items"] == 12 and result["ppl"]["overall"]["ppl"] == pytest.approx(
        ppl["overall"]["ppl"], rel=1e-4)


def test_compare_a_nosa_model_with_a_dense_baseline(outputs, tmp_path):
    """eval.compare on the two models' suite outputs (and each tool's own outputs): every number of the
    table is the one its file holds; markdown, JSON and PNG are written."""
    from eval.compare import compare

    nosa, dense = outputs["nosa"][2], outputs["dense"][2]
    got = compare([f"NOSA={nosa / 'suite'}", f"dense={dense / 'ruler_lm_eval'},{dense / 'ppl'},{dense / 'locality'}"],
                  str(tmp_path), log=lambda *_: None)
    table = {(r["section"], r["metric"]): r["values"] for r in got["rows"]}
    suite = json.loads((nosa / "suite" / "result.json").read_text())
    ruler = json.loads((dense / "ruler_lm_eval" / "ruler.json").read_text())
    ppl = json.loads((dense / "ppl" / "ppl.json").read_text())
    assert table[("RULER", "average")] == [suite["ruler"]["average"], ruler["average"]]
    assert table[("perplexity", "overall")] == [suite["ppl"]["overall"]["ppl"], ppl["overall"]["ppl"]]
    assert table[("locality", "gamma mean")][0] == suite["locality"]["gamma_mean"]
    assert table[("locality", "gamma mean")][1] is None  # the dense model selects nothing
    loc = json.loads((dense / "locality" / "locality.json").read_text())["summary"]
    assert table[("locality", "host->device bytes/token")] == [suite["locality"]["bytes_per_token"],
                                                               loc["bytes_per_token"]]
    assert "## RULER" in (tmp_path / "compare.md").read_text()
    assert json.loads((tmp_path / "compare.json").read_text())["columns"][0]["name"] == "NOSA"
    assert (tmp_path / "compare.png").stat().st_size > 1000


def test_megatron_checkpoint_and_reference_dir(outputs):
    """A Megatron checkpoint and a reference-format dir (bf16, no modeling code) through both harnesses:
    lm-eval gets a temporary export of each; the import of the NOSA export scores as the export does."""
    for name, tools in (("megatron_nosa", 2), ("reference", 3)):
        rcs, text, out = outputs[name]
        assert rcs == [0] * tools, text[-6000:]
        assert text.count("exporting") == 1, text[-6000:]  # one temporary export for lm-eval per form
        _same_items(out / "ruler", out / "ruler_lm_eval")
    _same_items(outputs["nosa"][2] / "ruler", outputs["megatron_nosa"][2] / "ruler")  # import == its export
    ref_out = outputs["reference"][2]
    ref = json.loads((ref_out / "ruler" / "ruler.json").read_text())
    assert ref["model"]["kind"] == "hf" and ref["model"]["label"] == "ed_dma"
    assert json.loads((ref_out / "ppl" / "ppl.json").read_text())["overall"]["tokens"] > 0


USER_SCRIPT = """
import sys
from transformers import AutoTokenizer
for path in sys.argv[2:]:
    print(path, AutoTokenizer.from_pretrained(path).encode(sys.argv[1]))
"""


def test_export_tokenizers_load_as_users_load_them(forms):
    """AutoTokenizer.from_pretrained(export) with trust_remote_code True, False or left out (a script
    without a terminal: transformers' question gets no answer) gives the training tokenizer."""
    from transformers import AutoTokenizer

    from data.tokenizer import Tokenizer

    text = "Maple lantern harbor <|im_start|>user\nsilver garden<|im_end|>"
    want = Tokenizer(str(forms["tokenizer"])).hf.encode(text)
    names = ("nosa", "dense", "reference")
    for name in names:
        assert Tokenizer(str(forms[name])).hf.encode(text) == want, name
        for trust in (False, True):
            assert AutoTokenizer.from_pretrained(str(forms[name]), trust_remote_code=trust).encode(text) == want
    # one script loads every export (one interpreter start), as a user's script would
    r = subprocess.run([sys.executable, "-c", USER_SCRIPT, text, *(str(forms[n]) for n in names)],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120, env=child_env())
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()  # transformers' unanswered question may precede a line on stdout
    for n in names:
        assert any(line.endswith(f"{forms[n]} {want}") for line in lines), (n, r.stdout[-3000:], r.stderr[-3000:])
