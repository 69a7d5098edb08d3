"""Decode-time locality and offload cost of a trained model on real long documents.

    python -m eval.locality --ckpt <run dir | checkpoint | HF model dir> --data <prefix | jsonl> \\
        --length 16384 [--docs 4] [--split 95,5,0] [--capacity C] [--bandwidth-gbs 55] --out DIR

For each document: one forward pass (the prefill) records every NOSA layer's post-RoPE q/k and
eviction scores; row t of the parallel selection is the decode-time selection of step t (proven
and tested in ``nosa_layers``), so the whole decode walk costs one selection per layer. Reported
per layer and KV head over the measured steps (``t >= --from-step``, default the first sparse
step ``topk * block_size``): gamma(t) mean / p5 / min, blocks fetched per step and the cache-hit
rate of the "previous selection stays resident" cache (``nosa_layers.measure_locality``), plus
the offloading-decoder simulation of ``eval.offload_sim`` (cache of C blocks per head, eviction
by the model's own query-agnostic score and by LRU): hit rate, host->device bytes per token and
the decode throughput a PCIe bandwidth allows, against a dense model of the same shape.
A length within the selection budget (nothing sparse) or whose blocks all fit the simulated cache
(nothing evicted) is named as a warning in the summary, with the length that would measure it.

Writes ``locality.json``, ``locality.md``, ``gamma_over_position.png`` and ``per_layer.png``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from eval import offload_sim as sim
from eval.report import fmt, markdown_table, save_plot
from runtime.outputs import write_atomic, write_json

DEFAULT_BANDWIDTH_GB_S = 55.0  # pinned host->device copies of an H200 host (PCIe 5 x16), measured


@dataclass
class LocalityConfig:
    """What to measure: ``docs`` documents of ``length`` tokens; steps ``t >= from_step``
    (None: the first sparse step); simulated cache of ``capacity`` blocks per (layer, KV head)
    (None: the selection budget + the sliding window, ``topk + local_blocks``)."""

    length: int
    docs: int = 4
    from_step: Optional[int] = None
    capacity: Optional[int] = None
    bandwidth_gb_s: float = DEFAULT_BANDWIDTH_GB_S


class _HeadAccumulator:
    """Sums over documents for one sparse layer: gamma values, hits, needed and fetched per head."""

    def __init__(self, heads: int, length: int) -> None:
        self.gammas: list[np.ndarray] = []
        self.counts = {k: np.zeros(heads) for k in ("hits", "selected", "fetched")}
        self.sim: dict[str, dict[str, np.ndarray]] = {}
        self.curve = np.zeros(length)
        self.docs = 0

    def add_locality(self, stats, from_step: int) -> None:
        g = stats.gamma[0].double().cpu().numpy()  # [Hkv, T]
        self.gammas.append(g[:, from_step:])
        for k in self.counts:
            self.counts[k] += getattr(stats, k)[0, :, from_step:].double().sum(-1).cpu().numpy()
        self.curve[1:] += g[:, 1:].mean(axis=0)  # gamma(0) is undefined
        self.docs += 1

    def add_sim(self, policy: str, trace: sim.CacheTrace, rows: slice, from_step: int) -> None:
        acc = self.sim.setdefault(policy, {k: 0.0 for k in ("hits", "needed", "fetched")})
        for k in acc:
            acc[k] = acc[k] + getattr(trace, k)[rows, from_step:].sum(-1)

    def per_head(self) -> list[dict]:
        g = np.concatenate(self.gammas, axis=1)
        steps = g.shape[1]  # measured steps over all documents
        rows = []
        for h in range(g.shape[0]):
            row = {"head": h, **_gamma_stats(g[h]),
                   "hit_rate": float(self.counts["hits"][h] / self.counts["selected"][h]),
                   "fetched_per_step": float(self.counts["fetched"][h] / steps),
                   "selected_per_step": float(self.counts["selected"][h] / steps)}
            for policy, acc in self.sim.items():
                row[f"sim_{policy}_hit_rate"] = float(acc["hits"][h] / acc["needed"][h])
                row[f"sim_{policy}_fetched_per_step"] = float(acc["fetched"][h] / steps)
            rows.append(row)
        return rows


def _gamma_stats(values: np.ndarray) -> dict:
    v = values[np.isfinite(values)]
    if not v.size:
        return {"gamma_mean": None, "gamma_p5": None, "gamma_min": None}
    return {"gamma_mean": float(v.mean()), "gamma_p5": float(np.percentile(v, 5)), "gamma_min": float(v.min())}


def analyze(model, docs: list, cfg: LocalityConfig, log=print) -> dict:
    """The locality + offload report (a JSON-able dict) of ``model`` (``eval.load.EvalModel``) on ``docs``."""
    import torch

    from eval.capture import capture_selection_inputs
    from nosa_layers import measure_locality, select_blocks

    src = model.src
    nosa = src.attn.nosa
    variants = src.variants
    sparse = [i for i, v in enumerate(variants) if v != "dense"]
    heads, T, bs = src.model.num_kv_heads, cfg.length, nosa.block_size
    capacity = cfg.capacity or nosa.topk + nosa.local_blocks
    from_step = cfg.from_step if cfg.from_step is not None else min(nosa.dense_len, T - 1)
    from_step = max(1, min(from_step, T - 1))
    geo = sim.KVGeometry(num_kv_heads=heads, head_dim=src.model.kv_channels, block_size=bs)
    acc = {i: _HeadAccumulator(heads, T) for i in sparse}
    has_scores = all(variants[i] == "nosa" for i in sparse) and bool(sparse)
    policies = ["score", "lru"] if has_scores else ["lru"]
    dense_ph = sim.dense_fetched_per_head(T, bs, capacity)[from_step:]
    model_fetched = {p: [] for p in policies}
    t0 = time.perf_counter()
    for d, doc in enumerate(docs):
        with capture_selection_inputs(model.module) as got:
            model.logits(doc)
        sels, scores = [], []
        for i in sparse:
            c = got[i]
            acc[i].add_locality(measure_locality(c.q, c.k, c.score, c.cfg, walk="parallel"), from_step)
            sels.append(select_blocks(c.q, c.k, c.score, c.cfg)[0].cpu().numpy())
            if has_scores:
                scores.append(sim.pooled_block_scores(c.score[0].cpu().numpy(), bs, nosa.kernel_size,
                                                      nosa.kernel_stride))
        dense_rows = (len(variants) - len(sparse)) * heads * dense_ph
        for policy in policies:
            if sparse:
                trace = sim.simulate_cache(np.concatenate(sels), bs, capacity, policy,
                                           np.concatenate(scores) if policy == "score" else None)
                for j, i in enumerate(sparse):
                    acc[i].add_sim(policy, trace, slice(j * heads, (j + 1) * heads), from_step)
                model_fetched[policy].append(trace.fetched[:, from_step:].sum(0) + dense_rows)
            else:
                model_fetched[policy].append(dense_rows)
        log(f"  document {d + 1}/{len(docs)}: {T} tokens, {len(sparse)} sparse layer(s) "
            f"({time.perf_counter() - t0:.1f} s)")
        del got
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    dense_total = np.concatenate([len(variants) * heads * dense_ph for _ in docs])
    headline = policies[0]
    offload = {p: sim.offload_summary(np.concatenate(model_fetched[p]), dense_total, geo, cfg.bandwidth_gb_s)
               for p in policies}
    layers = []
    for i, v in enumerate(variants):
        if v == "dense":
            layers.append({"layer": i, "variant": "dense", "note": "dense: no selection"})
            continue
        a = acc[i]
        curve = a.curve / max(1, a.docs)
        layers.append({"layer": i, "variant": v, "heads": a.per_head(),
                       "gamma_curve": _bucket_curve(curve, bs)})
    summary = _summary(acc, headline, offload[headline]) if sparse else {
        "note": "dense: no selection", "policy": headline, **offload[headline]}
    summary["warnings"] = measured_nothing(nosa, T, capacity, bool(sparse))
    return {
        "model": {"path": str(src.path), "kind": src.kind, "label": src.label, "step": src.step,
                  "layer_variants": variants, "num_layers": src.model.num_layers, "num_kv_heads": heads,
                  "head_dim": src.model.kv_channels, "geometry": asdict(nosa)},
        "config": {**asdict(cfg), "from_step": from_step, "capacity": capacity, "docs": len(docs)},
        "dense": not sparse, "summary": summary, "offload": offload, "layers": layers,
    }


def measured_nothing(nosa, length: int, capacity: int, sparse: bool) -> list[str]:
    """Why a result measures nothing sparse or nothing evicted (each with the length that would), or []."""
    budget, blocks = nosa.dense_len, nosa.num_blocks(length)
    if sparse and length <= budget:
        return [f"nothing sparse: {length} tokens are within the selection budget (topk {nosa.topk} x block_size "
                f"{nosa.block_size} = {budget} tokens), so every step attends densely and gamma is 1 by construction; "
                f"sparse from --length {budget + 1} (e.g. --length {2 * budget})"]
    if blocks <= capacity:
        return [f"nothing evicted: the whole document ({blocks} blocks) fits the simulated cache ({capacity} blocks "
                f"per layer and KV head), so no block is fetched after the prefill; evictions from --length "
                f"{capacity * nosa.block_size + 1} (or --capacity below {blocks})"]
    return []


def _bucket_curve(curve: np.ndarray, width: int) -> dict:
    """Mean gamma(t) per bucket of ``width`` positions (position 0 has no gamma)."""
    x, y = [], []
    for s in range(0, len(curve), width):
        seg = curve[max(1, s):s + width]
        if seg.size:
            x.append(s)
            y.append(float(seg.mean()))
    return {"position": x, "gamma": y}


def _summary(acc: dict, policy: str, offload: dict) -> dict:
    g = np.concatenate([np.concatenate(a.gammas, axis=1).ravel() for a in acc.values()])
    heads = [h for a in acc.values() for h in a.per_head()]
    mean = lambda key: float(np.mean([h[key] for h in heads]))  # noqa: E731
    return {**_gamma_stats(g), "hit_rate": mean("hit_rate"), "fetched_per_step": mean("fetched_per_step"),
            "selected_per_step": mean("selected_per_step"),
            "sim_hit_rate": mean(f"sim_{policy}_hit_rate"),
            "sim_fetched_per_step": mean(f"sim_{policy}_fetched_per_step"),
            **{k: mean(k) for k in heads[0] if k.startswith("sim_") and k.endswith("hit_rate")},
            "policy": policy, **offload}


def summary_line(r: dict) -> str:
    s = r["summary"]
    tput = s["decode_tokens_per_s"]
    ratio = s["throughput_ratio_vs_dense"]
    cost = (f"{s['bytes_per_token'] / 1e6:.3f} MB/token host->device vs dense {s['dense_bytes_per_token'] / 1e6:.3f} "
            f"-> {'not bus-bound' if tput is None else f'{tput:,.0f} tok/s'} at {s['bandwidth_gb_s']:g} GB/s"
            f"{'' if ratio is None else f' ({ratio:.2f}x dense)'}")
    warn = "".join(f"; warning: {w}" for w in s.get("warnings", []))
    if r["dense"]:
        return f"dense: no selection; {cost}{warn}"
    return (f"{r['model']['label']}: gamma mean {s['gamma_mean']:.3f} p5 {s['gamma_p5']:.3f} min {s['gamma_min']:.3f}, "
            f"{s['fetched_per_step']:.2f} blocks fetched/step/head, sim hit rate {s['sim_hit_rate']:.3f} "
            f"({s['policy']}); {cost}{warn}")


def markdown(r: dict) -> str:
    c = r["config"]
    lines = [f"# Locality and offload cost: {r['model']['label']} ({r['model']['path']})", "",
             f"{c['docs']} document(s) of {c['length']} tokens; steps t >= {c['from_step']}; simulated GPU cache "
             f"{c['capacity']} blocks per (layer, KV head); {c['bandwidth_gb_s']:g} GB/s host->device.", "",
             summary_line(r), ""]
    rows = []
    for layer in r["layers"]:
        if "heads" not in layer:
            rows.append([layer["layer"], "-", "dense: no selection"] + [None] * 7)
            continue
        for h in layer["heads"]:
            rows.append([layer["layer"], h["head"], layer["variant"], h["gamma_mean"], h["gamma_p5"], h["gamma_min"],
                         h["fetched_per_step"], h["hit_rate"], h.get("sim_score_hit_rate"), h["sim_lru_hit_rate"]])
    lines.append(markdown_table(["layer", "KV head", "variant", "gamma mean", "gamma p5", "gamma min",
                                 "fetched/step", "hit rate (prev. step)", "sim hit rate (score)",
                                 "sim hit rate (LRU)"], rows))
    lines += ["", "| policy | hit rate | bytes/token | dense bytes/token | tokens/s | dense tokens/s | ratio |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for policy, o in r["offload"].items():
        hit = r["summary"].get(f"sim_{policy}_hit_rate")
        lines.append("| " + " | ".join([policy] + [fmt(x) for x in (
            hit, o["bytes_per_token"], o["dense_bytes_per_token"], o["decode_tokens_per_s"],
            o["dense_decode_tokens_per_s"], o["throughput_ratio_vs_dense"])]) + " |")
    return "\n".join(lines) + "\n"


def write_report(r: dict, out: Path) -> list[Path]:
    """``locality.json``, ``locality.md`` and the PNGs under ``out``."""
    out = Path(out)
    files = [write_json(out / "locality.json", r), write_atomic(out / "locality.md", markdown(r))]
    sparse = [layer for layer in r["layers"] if "heads" in layer]
    if not sparse:
        return files

    def curves(fig):
        ax = fig.add_subplot()
        for layer in sparse:
            ax.plot(layer["gamma_curve"]["position"], layer["gamma_curve"]["gamma"], label=f"layer {layer['layer']}")
        ax.axvline(r["config"]["from_step"], color="gray", ls=":", lw=1)
        ax.set_xlabel("decode position t")
        ax.set_ylabel("gamma(t), mean over heads and documents")
        ax.set_title(f"locality: {r['model']['label']}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)

    def bars(fig):
        ax = fig.add_subplot()
        names = [str(layer["layer"]) for layer in sparse]
        x = np.arange(len(names))
        series = [("gamma mean", "gamma_mean"), ("sim hit rate (LRU)", "sim_lru_hit_rate")]
        if "sim_score_hit_rate" in sparse[0]["heads"][0]:
            series.insert(1, ("sim hit rate (score)", "sim_score_hit_rate"))
        w = 0.8 / len(series)
        for j, (label, key) in enumerate(series):
            ax.bar(x + j * w, [np.mean([h[key] for h in layer["heads"]]) for layer in sparse], w, label=label)
        ax.set_xticks(x + 0.4 - w / 2, names)
        ax.set_xlabel("layer")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")

    for name, draw in (("gamma_over_position.png", curves), ("per_layer.png", bars)):
        p = save_plot(out / name, draw)
        if p:
            files.append(p)
    return files


def run(ckpt: str, data: str, out: str, length: int, docs: int = 4, split: Optional[str] = None,
        tokenizer: Optional[str] = None, from_step: Optional[int] = None, capacity: Optional[int] = None,
        bandwidth_gb_s: float = DEFAULT_BANDWIDTH_GB_S, dtype: str = "auto", log=print) -> dict:
    from eval.documents import load_documents
    from eval.load import check_length, load_model, load_tokenizer, resolve_source

    src = resolve_source(ckpt, tokenizer)
    check_length(src, length)
    tok = load_tokenizer(src)
    texts = load_documents(data, tok, length, docs, src.model.vocab_size, split)
    log(f"locality: {src.label} from {src.path} on {len(texts)} document(s) of {length} tokens")
    model = load_model(src, dtype=dtype)
    r = analyze(model, texts, LocalityConfig(length, len(texts), from_step, capacity, bandwidth_gb_s), log)
    files = write_report(r, Path(out))
    log(summary_line(r))
    log("wrote " + ", ".join(str(f) for f in files))
    return r


def main(argv=None) -> int:
    from eval import CKPT_HELP
    from runtime.cli import run_cli

    ap = argparse.ArgumentParser(prog="python -m eval.locality", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True, help=CKPT_HELP)
    ap.add_argument("--data", required=True, help="indexed dataset prefix or JSONL (text field)")
    ap.add_argument("--length", type=int, required=True, help="tokens per document")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--split", default=None, help="the trainer's data.split: use only its held-out documents")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--from-step", type=int, default=None, help="first measured step (default topk*block_size)")
    ap.add_argument("--capacity", type=int, default=None, help="simulated GPU cache, blocks per (layer, KV head)")
    ap.add_argument("--bandwidth-gbs", type=float, default=DEFAULT_BANDWIDTH_GB_S, help="host->device GB/s")
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    return run_cli("eval.locality", run, a.ckpt, a.data, a.out, a.length, a.docs, a.split, a.tokenizer,
                   a.from_step, a.capacity, a.bandwidth_gbs, a.dtype)


if __name__ == "__main__":
    sys.exit(main())
