"""The ablation's decode measurements on its trained weights (``eval.ablate --stage decode``).

For the trained variants under ``<out>/cpt/``: a bf16 Hugging Face export of each (``<out>/export/<variant>``,
with the run's tokenizer), then, each as its own process,

* ``bench.inference`` over all exports, the prompts held-out text of the ablation's corpus: decode at batch
  1 / 4 (4K and the CPT length less ``LOCALITY_STEPS``), the dense exports also with transformers' static
  cache + ``torch.compile``, and at that length the largest batch under one device budget (the dense
  export's GPU-resident cache holding ``budget_batch`` sequences) with the GPU-resident and the offloaded
  cache: tokens/s, host -> device bytes per token, cache hit rate (``<out>/decode/bench/inference.{json,md}``);
* ``eval.locality`` of each sparse export on the same held-out document, measured over its last ``LOCALITY_STEPS``
  steps up to the CPT length (``<out>/decode/locality/<variant>/``),

and ``<out>/decode/locality_check.{json,md}``: the decoder's cache hit rate and blocks fetched per step (its
offloaded cache keeps the previous step's selection, ``topk`` slots per layer and KV head) against
``eval.locality``'s measure of the same cache from the parallel selection, with the relative difference
and whether it is within ``TOLERANCE``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from eval.report import markdown_table

TOLERANCE = 0.15  # decode-time locality within 15% of eval.locality's
LOCALITY_STEPS = 64  # measured steps after the CPT length (eval.locality)


def bench_command(python: str, exports: list[Path], data, split: str, length: int, out: Path,
                  budget_batch: int, mem_limit_gib: float, contexts: Optional[list[int]] = None,
                  steps: Optional[int] = None) -> list[str]:
    """``bench.inference`` over ``exports`` at the CPT ``length``; the device budget is a dense export's
    cache of ``budget_batch`` sequences, or ``mem_limit_gib`` without one; ``contexts``/``steps`` override
    its decode contexts and step count."""
    cmd = [python, "-m", "bench.inference", "--ckpt", ",".join(str(e) for e in exports),
           "--data", data.corpus_prefix, "--tokenizer", data.tokenizer, "--split", split,
           "--only", "decode,offload", "--long-context", str(length), "--budget-batch", str(budget_batch),
           "--mem-limit-gib", str(mem_limit_gib), "--out", str(out)]
    if contexts:
        cmd += ["--contexts", ",".join(map(str, contexts))]
    if steps:
        cmd += ["--steps", str(steps), "--offload-steps", str(steps)]
    return cmd


def locality_command(python: str, export: Path, data, split: str, length: int, out: Path) -> list[str]:
    """``eval.locality`` of ``export`` over the last ``LOCALITY_STEPS`` steps of ``length`` tokens of the first
    held-out document that long (the benchmark prefills the tokens before them)."""
    return [python, "-m", "eval.locality", "--ckpt", str(export), "--data", data.corpus_prefix,
            "--tokenizer", data.tokenizer, "--split", split, "--length", str(length),
            "--from-step", str(length - LOCALITY_STEPS), "--docs", "1", "--out", str(out)]


def _offload_row(rows: list, name: str) -> Optional[dict]:
    """The benchmark's offloaded decode row of the export ``name`` (its max-batch decode)."""
    for r in rows:
        if r["row"].startswith(f"decode nosa:{name} offload") and "max batch" in r["row"]:
            return r
    return None


def _rel(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None or b == 0:
        return None
    return abs(a - b) / abs(b)


def locality_check(bench: dict, localities: dict) -> dict:
    """Decoder vs ``eval.locality`` per sparse variant: ``bench`` = ``inference.json``, ``localities`` =
    ``{variant: locality.json}``. Hit rate = 1 - fetched / selected blocks per step (previous selection
    resident); fetched = blocks per step per (layer, KV head)."""
    out = {}
    for v, loc in localities.items():
        row = _offload_row(bench["rows"], v)
        s = loc["summary"]
        dec_hit = None if row is None else row.get("hit_rate")
        dec_fetch = None if row is None else row.get("fetched_blocks_per_step_per_head")
        rel_hit, rel_fetch = _rel(dec_hit, s.get("hit_rate")), _rel(dec_fetch, s.get("fetched_per_step"))
        measured = rel_hit is not None and rel_fetch is not None
        out[v] = {"decoder_hit_rate": dec_hit, "locality_hit_rate": s.get("hit_rate"), "rel_diff_hit_rate": rel_hit,
                  "decoder_fetched_per_step": dec_fetch, "locality_fetched_per_step": s.get("fetched_per_step"),
                  "rel_diff_fetched": rel_fetch, "decoder_batch": None if row is None else row.get("batch"),
                  "decoder_steps": None if row is None else row.get("steps"),
                  "locality_steps": loc["config"]["length"] - loc["config"]["from_step"],
                  "within_tolerance": measured and max(rel_hit, rel_fetch) <= TOLERANCE,
                  "error": None if measured else (row or {}).get("error", "no offloaded decode row")}
    return {"tolerance": TOLERANCE, "variants": out}


def check_markdown(check: dict) -> str:
    """The comparison as a table, with the verdict per variant."""
    rows = []
    for v, c in check["variants"].items():
        verdict = ("within" if c["within_tolerance"] else "NOT within") + f" {check['tolerance']:.0%}"
        rows.append([v, c["decoder_hit_rate"], c["locality_hit_rate"], c["rel_diff_hit_rate"],
                     c["decoder_fetched_per_step"], c["locality_fetched_per_step"], c["rel_diff_fetched"],
                     c["decoder_batch"], verdict if c["error"] is None else f"not measured: {c['error']}"])
    return "\n".join([
        "# Decode-time locality against eval.locality", "",
        "The offloaded decoder (topk slots per layer and KV head: the previous step's selection stays) on the "
        "benchmark's prompt, against eval.locality's measure of that cache from the parallel selection over the "
        "steps after the same context.", "",
        markdown_table(["variant", "decoder hit rate", "eval.locality hit rate", "rel. diff", "decoder fetched/step",
                        "eval.locality fetched/step", "rel. diff", "decoder batch", "verdict"], rows), ""])


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
