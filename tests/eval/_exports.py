"""Tiny models in every checkpoint form the eval tools take, built the way users build them.

``build(root)`` writes a synthetic corpus, a BPE tokenizer trained on it and a RULER-style task set;
random-weight Hugging Face source dirs (a NOSA model with LongRoPE and a geometry that is sparse
from 96 tokens on, a stock Llama, a NOSA model with the released reference geometry); their
``from_hf`` imports (Megatron checkpoints; megatron-core runs in a subprocess); and the ``to_hf``
exports of those imports with the tokenizer: ``nosa`` (our format, shipped modeling code),
``dense`` (stock ``LlamaForCausalLM``) and ``reference`` (``--format reference``).
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import torch

from tests.subproc import child_env, run_logged

LENGTH = 512  # tokens of the task samples (the model's positions: twice that)
DOC_LENGTH = 256  # tokens of the locality / perplexity documents
VOCAB = 512
WORDS = ("river stone maple lantern harbor silver garden meadow thunder copper violet orchard falcon "
         "window candle forest marble ribbon canyon glacier hollow island jasmine kettle ladder mirror "
         "nectar oyster pepper quartz saddle tunnel velvet wander yellow zephyr anchor basket cobalt "
         "dragon ember feather ginger hazel ivory juniper kernel lemon mosaic nutmeg olive pebble").split()


def corpus(path: Path, docs: int = 24, seed: int = 0) -> Path:
    """JSONL documents of 10 plain paragraphs (no digits: the haystack rules), deterministic in ``seed``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(docs):
        paras = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(12, 40))).capitalize() + "."
                 for _ in range(10)]
        rows.append({"text": "\n\n".join(paras)})
    path.write_text("".join(json.dumps(d) + "\n" for d in rows))
    return path


def _model(longrope: bool):
    from nosa_layers.megatron.config import ModelConfig
    from nosa_layers.rope.longrope import LongRoPEConfig

    lr = LongRoPEConfig(short_factor=[1.0, 1.1, 1.2, 1.3], long_factor=[1.0, 1.1, 1.2, 1.3],
                        original_max_position_embeddings=LENGTH) if longrope else None
    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2, head_dim=8,
                       ffn_hidden_size=64, vocab_size=VOCAB, max_position_embeddings=2 * LENGTH,
                       rope_theta=5000.0, rope_type="longrope" if longrope else "default", longrope=lr)


def _source(out: Path, model, attn, seed: int, tokenizer: Path) -> Path:
    """A random-weight HF dir of ``model``/``attn`` (what ``to_hf`` writes, tensors included)."""
    from safetensors.torch import save_file

    from checkpoints_convert.random_export import load_random_model, stock_llama, write_random_export
    from checkpoints_convert.to_hf import hf_config

    torch.manual_seed(seed)
    if attn.variant == "dense":
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps(hf_config(model, attn, torch.float32), indent=2))
        net = stock_llama(model)
    else:
        net = load_random_model(write_random_export(out, model, attn), eviction_scale=0.8)
    save_file({k: v.contiguous() for k, v in net.state_dict().items() if "rotary" not in k},
              str(out / "model.safetensors"))
    for f in tokenizer.iterdir():  # a model dir as published: weights, config and tokenizer
        shutil.copy(f, out / f.name)
    return out


IMPORT = """
import sys
from checkpoints_convert.from_hf import import_hf
for src, out in zip(sys.argv[1::2], sys.argv[2::2]):
    import_hf(src, out, log=lambda *_: None)
"""


def build(root: Path) -> dict[str, Path]:
    """Every form under ``root``: keys ``tokenizer``, ``corpus``, ``tasks``, ``megatron_<name>`` (import),
    ``nosa``, ``dense``, ``reference`` (exports)."""
    from data.tokenizer import Tokenizer, train_bpe
    from eval.tasks import TaskSetConfig, build_task_set
    from nosa_layers.config import NOSAConfig, tiny_geometry
    from nosa_layers.megatron.config import AttentionConfig
    from checkpoints_convert.to_hf import export

    out = {"corpus": corpus(root / "corpus.jsonl")}
    texts = [json.loads(line)["text"] for line in out["corpus"].read_text().splitlines()]
    out["tokenizer"] = Path(train_bpe(texts, VOCAB, str(root / "tokenizer"), min_frequency=1))
    tok = Tokenizer(str(out["tokenizer"]))
    out["tasks"] = build_task_set(str(out["corpus"]), tok, root / "tasks", TaskSetConfig(
        lengths=[LENGTH], tasks=["niah_single", "vt"], samples=2, seed=0), log=lambda *_: None)

    tok_dir = out["tokenizer"]
    sources = {
        "nosa": _source(root / "src_nosa", _model(longrope=True),
                        AttentionConfig(variant="nosa", nosa=tiny_geometry(), backend="reference"), 1, tok_dir),
        "dense": _source(root / "src_dense", _model(longrope=False), AttentionConfig(variant="dense"), 2, tok_dir),
        "reference": _source(root / "src_reference", _model(longrope=True),
                             AttentionConfig(variant="nosa", nosa=NOSAConfig(), backend="reference"), 3, tok_dir),
    }
    log = root / "import.log"
    args = [str(a) for name, src in sources.items() for a in (src, root / f"megatron_{name}")]
    rc = run_logged([sys.executable, "-c", IMPORT, *args], log, 900, env=child_env(OMP_NUM_THREADS="2"))
    if rc != 0:
        raise RuntimeError(f"from_hf import exited with {rc}:\n{log.read_text()[-4000:]}")
    quiet = dict(log=lambda *_: None, tokenizer=str(out["tokenizer"]))
    for name in sources:
        out[f"megatron_{name}"] = root / f"megatron_{name}"
        out[name] = export(str(root / f"megatron_{name}"), str(root / name),
                           fmt="reference" if name == "reference" else "nosa", **quiet)
    return out


TOOLS = """
import json, sys
from eval import locality, ppl, ruler, suite
mains = {"ruler": ruler.main, "ppl": ppl.main, "locality": locality.main, "suite": suite.main}
calls = json.loads(sys.argv[1])
rcs = []
for name, argv in calls:
    print(f"=== {name} {' '.join(argv)}", flush=True)
    rcs.append(mains[name](argv))
json.dump(rcs, open(sys.argv[2], "w"))
"""


def tool_calls(forms: dict, ckpt: Path, out: Path, tools=("ruler", "ruler_lm_eval", "ppl", "locality", "suite")):
    """``[tool, argv]`` of each eval tool on ``ckpt``, writing under ``out/<tool>``."""
    data = ["--data", str(forms["corpus"]), "--length", str(DOC_LENGTH), "--docs", "2"]
    argv = {"ruler": ["ruler", ["--tasks", str(forms["tasks"])]],
            "ruler_lm_eval": ["ruler", ["--tasks", str(forms["tasks"]), "--harness", "lm-eval"]],
            "ppl": ["ppl", data], "locality": ["locality", data],
            "suite": ["suite", ["--tasks", str(forms["tasks"]), *data, "--ppl-docs", "2"]]}
    return [[argv[t][0], ["--ckpt", str(ckpt), *argv[t][1], "--out", str(out / t)]] for t in tools]


def run_tools(calls: list, log: Path, timeout_s: int = 600) -> tuple[list[int], str]:
    """Run the eval tools' ``main`` one after the other in one subprocess (one megatron-core import)."""
    rcs = log.with_suffix(".json")
    rc = run_logged([sys.executable, "-c", TOOLS, json.dumps(calls), str(rcs)], log, timeout_s,
                    env=child_env(OMP_NUM_THREADS="2"))
    text = log.read_text(errors="replace")
    if rc != 0 or not rcs.is_file():
        raise AssertionError(f"eval tools exited with {rc}:\n{text[-6000:]}")
    return json.loads(rcs.read_text()), text
