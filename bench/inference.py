"""Inference benchmark of the exported NOSA model against a stock transformers Llama of the same shape.

One process, one device, random weights (no download): the shape of ``recipes/model/llama3_1b.yaml``
(override with ``--layers`` / ``--kv-heads``) in bf16, the released NOSA geometry (64-token blocks,
64-block budget), the eviction heads' ``A`` set to 1 (zero at init would make every query-agnostic
score equal). Rows:

* prefill: one prompt of 4K / 16K tokens, ``use_cache=True``, last-token logits (median of 3);
  NOSA through the Triton kernels when ``nosa_layers`` is importable on a GPU, else the reference;
* decode: batch 1 / 4 at 4K / 16K context and batch 8 at 32K (``DECODE_CELLS``; one prompt prefilled, its
  cache repeated to the batch), tokens/s over ``--steps`` greedy steps after 2 warm-up steps (``warm_s``:
  their time, the CUDA-graph capture and ``torch.compile`` included). NOSA on CUDA: the CUDA-graphed step
  compiled by Inductor (the default, ``compiled`` True) and the plain graphed step (``nosa_plain``); the NOSA
  caches of one batch size share one capacity (the largest context of that batch), so the step compiles once
  per batch size. The stock Llama: its eager ``DynamicCache`` decode and (``--baseline static``) the static
  cache + ``torch.compile`` decode that transformers documents (``bench.decode_baseline``);
* ``--profile`` with decode rows: one decode step of the NOSA model layer by layer (``bench.decode_profile``:
  per layer kernels, launches, device time, the selection's share; host synchronisations; the kernels of
  the compiled step) at 4K batch 1 and 16K batch 4;
* offload (16K context, ``--long-context N`` for another): the largest batch whose peak device
  memory stays under ``--mem-limit-gib`` with the whole KV cache on the device vs with the
  offloaded cache (blocks in pinned host memory, the selection's blocks in ``topk`` device slots,
  or ``--gpu-blocks N`` slots: fewer than ``topk`` read the blocks without a slot from the host
  every step; host memory bounded by ``--host-mem-limit-gib``),
  found from the measured per-sequence slope (batch 1 and 2), checked at the predicted batch and
  re-predicted from the slope up to the batch that fits (larger while it still fits; bisecting below a
  prediction that did not fit);
  decode tokens/s at each, and the host -> device bytes per generated token (first step = whole
  selections; steady state = the blocks a step adds).

Trained models (``--model EXPORT[,EXPORT...]``: our NOSA exports and dense Llama exports with their
weights; ``bench.exports``): the prompts are held-out text (``--data PREFIX``, the validation part of
``--split``), the offload rows add the cache hit rate, and ``--budget-batch N`` sets every model's device
budget to the peak of the (first) dense export's GPU-resident cache holding ``N`` sequences at the long
context. Dense models also get the decode that transformers documents as its fast path: a static KV
cache and ``torch.compile`` (``bench.decode_baseline``), at batch 1 / 4 and every context.

Every row records its error instead of stopping the table. Writes ``inference.json`` and
``inference.md`` into ``--out`` (temp name, then rename).

Usage: python -m bench.inference --out DIR [--quick] [--mem-limit-gib 12] [--host-mem-limit-gib 48]
       [--model EXPORT,... --data PREFIX [--split 95,5,0] [--budget-batch 16]] [--baseline static|none]
       [--steps 32] [--only prefill,decode,offload] [--long-context N] [--layers N] [--kv-heads N]
       [--gpu-blocks N] [--attention auto|triton|torch] [--decode-streams N] [--part-fetch-grid N]
       [--decode-cells CTXxB,...]
       [--profile] [--memory-profile]
``--quick``: a tiny model and short contexts (runs on a CPU in about a minute; checks the script).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive token counts, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    """The command line (defined before the heavy imports: ``--help`` answers without torch)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for inference.json / inference.md")
    p.add_argument("--quick", action="store_true", help="tiny model and contexts (CPU check of the script)")
    p.add_argument("--mem-limit-gib", type=float, default=12.0, help="device memory limit of the batch search")
    p.add_argument("--host-mem-limit-gib", type=float, default=48.0, help="pinned host memory limit (offload)")
    p.add_argument("--gpu-blocks", type=int, default=None,
                   help="device slots per (sequence, layer, KV head) of the offloaded cache (default: topk)")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per decode row")
    p.add_argument("--offload-steps", type=int, default=12, help="decode steps at the largest batches")
    p.add_argument("--only", default="prefill,decode,offload", help="comma list of prefill, decode, offload")
    p.add_argument("--contexts", type=_int_list, default=None,
                   help="comma list of the prefill / decode contexts in tokens (default 4096,16384; --quick 256,512)")
    p.add_argument("--long-context", type=int, default=None,
                   help="context of the offload rows (default: 16384; 512 with --quick)")
    p.add_argument("--attention", default="auto", choices=("auto", "triton", "torch"),
                   help="NOSA decode attention over the selected blocks: the Triton kernel reading them in "
                        "place, or gathered copies + PyTorch (auto: triton on CUDA)")
    p.add_argument("--decode-streams", type=int, default=None,
                   help="offloaded NOSA decode: the batch in this many parts on their own CUDA streams "
                        "(fetch / compute overlap; default: the cache's, 4; GPU-resident rows keep one stream)")
    p.add_argument("--decode-cells", default=None,
                   help="decode rows: comma list of CONTEXTxBATCH (default 4096x1,4096x4,16384x1,16384x4,32768x8)")
    p.add_argument("--profile", action="store_true",
                   help="decode rows: a per-layer profile of one NOSA step at 4K b1 and 16K b4; offload rows: "
                        "the device time per decode step by kernel (top 20)")
    p.add_argument("--part-fetch-grid", type=int, default=None,
                   help="with --decode-streams: programs per SM of a part's host fetch (cache default 2)")
    p.add_argument("--memory-profile", action="store_true",
                   help="offload rows (CUDA): what the decode steps allocate at the largest batch, by line")
    p.add_argument("--ckpt", "--model", dest="model", default=None,
                   help="trained HF exports (comma-separated): NOSA and dense Llama (--model: the same)")
    p.add_argument("--data", default=None, help="with --ckpt: held-out text for the prompts (indexed prefix or JSONL)")
    p.add_argument("--tokenizer", default=None, help="with --data: tokenizer dir (default: the first export's)")
    p.add_argument("--split", default=None, help="with --data: the training data.split (its validation part is used)")
    p.add_argument("--budget-batch", type=int, default=None,
                   help="with --model: device budget = the dense export's GPU-resident peak at this batch")
    p.add_argument("--baseline", default="static", choices=("static", "none"),
                   help="dense models: also decode with a static KV cache + torch.compile (compile on CUDA only)")
    p.add_argument("--shape", default=None,
                   help="the random models' shape: a model YAML (recipes/model/*.yaml fields, LongRoPE included) or "
                        "an export's config.json (default: recipes/model/llama3_1b.yaml)")
    p.add_argument("--models", default="llama,nosa",
                   help="comma list of the random models to measure: llama (stock transformers), nosa")
    p.add_argument("--layers", type=int, default=None, help="override the number of layers")
    p.add_argument("--kv-heads", type=int, default=None, help="override the number of KV heads")
    return p


if __name__ == "__main__":
    build_parser().parse_args()  # --help and usage errors exit here, before torch is imported

import torch

from bench import exports
from bench.batch_search import BatchSearch
from bench.decode_checks import DecodeChecks
from bench.inference_util import GIB, cache_kw, log, out_cache
from bench.decode_baseline import static_decode
from bench.decode_profile import step_profile
from checkpoints_convert.random_export import (
    load_random_model,
    stock_llama,
    write_random_export,
)
from nosa_layers.config import NOSAConfig, tiny_geometry
from nosa_layers.megatron.config import AttentionConfig, ModelConfig
from runtime.outputs import write_atomic

REPO = Path(__file__).resolve().parent.parent
# (context, batch) of the decode rows; the profile rows' cells
DECODE_CELLS = ((4096, 1), (4096, 4), (16384, 1), (16384, 4), (32768, 8))
QUICK_DECODE_CELLS = ((256, 1), (256, 4), (512, 1), (512, 4), (768, 2))
PROFILE_CELLS = ((4096, 1), (16384, 4))
QUICK_PROFILE_CELLS = ((256, 1), (512, 4))

def parse_cells(text: str | None) -> tuple:
    """``"4096x1,16384x4"`` -> ``((4096, 1), (16384, 4))`` (empty for None)."""
    if not text:
        return ()
    cells = []
    for item in text.split(","):
        n, _, b = item.strip().lower().partition("x")
        if not (n.isdigit() and b.isdigit() and int(n) > 0 and int(b) > 0):
            raise ValueError(f"--decode-cells: {item!r} is not CONTEXTxBATCH")
        cells.append((int(n), int(b)))
    return tuple(cells)


def load_shape(path: str) -> ModelConfig:
    """``ModelConfig`` from a model YAML (its fields; ``longrope`` a mapping) or an export's ``config.json``."""
    from checkpoints_convert.from_hf import configs_from_hf
    from nosa_layers.megatron.config import validate
    from runtime.dataclass_io import from_dict

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--shape {path}: no such file")
    if p.suffix == ".json":
        return configs_from_hf(json.loads(p.read_text()))[0]
    import yaml

    m = from_dict(ModelConfig, yaml.safe_load(p.read_text()), "--shape")
    validate(m, AttentionConfig(variant="dense"))
    return m


def model_shape(args) -> ModelConfig:
    if args.shape:
        m = load_shape(args.shape)
    elif args.quick:
        m = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                        ffn_hidden_size=128, vocab_size=512, max_position_embeddings=4096)
    else:
        import yaml

        fields = yaml.safe_load((REPO / "recipes/model/llama3_1b.yaml").read_text())
        m = ModelConfig(**fields)
    over = {k: v for k, v in (("num_layers", args.layers), ("num_kv_heads", args.kv_heads)) if v}
    return dataclasses.replace(m, **over)


class Bench(BatchSearch, DecodeChecks):
    def __init__(self, args) -> None:
        self.args = args
        self.dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = torch.bfloat16 if self.dev.type == "cuda" else torch.float32
        self.models = [m for m in (args.model or "").split(",") if m]
        self.shape = exports.export_shape(self.models[0]) if self.models else model_shape(args)
        self.geo = tiny_geometry() if args.quick else NOSAConfig()
        self.text = None  # held-out tokens of --data (trained models), else random prompts
        self.ctx = args.contexts or ([256, 512] if args.quick else [4096, 16384])
        default_cells = QUICK_DECODE_CELLS if args.quick else DECODE_CELLS
        if args.contexts:  # batch 1 and 4 at each given context
            default_cells = tuple((n, b) for n in args.contexts for b in (1, 4))
        self.decode_cells = parse_cells(args.decode_cells) or default_cells
        self.profile_cells = QUICK_PROFILE_CELLS if args.quick else PROFILE_CELLS
        self.long = args.long_context or self.ctx[-1]
        self.rows: list = []
        self.tmp = Path(tempfile.mkdtemp(prefix="nosa_bench_"))

    # ------------------------------------------------------------------ helpers
    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def free(self) -> None:
        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()

    def prompt(self, n: int, batch: int = 1) -> torch.Tensor:
        if self.text is not None and n <= self.text.numel():
            return self.text[:n].repeat(batch, 1).to(self.dev)
        g = torch.Generator().manual_seed(n)
        return torch.randint(10, self.shape.vocab_size, (batch, n), generator=g).to(self.dev)

    def row(self, name: str, fn) -> dict:
        log(f"row {name} ...")
        t0 = time.time()
        r = {"row": name}
        try:
            r.update(fn())
        except Exception as e:  # noqa: BLE001 (one failing row never stops the table)
            r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            traceback.print_exc()
        self.free()
        r["wall_s"] = round(time.time() - t0, 2)
        log(f"row {name}: {json.dumps(r)}")
        self.rows.append(r)
        self.write(quiet=True)  # partial tables survive a time limit
        return r

    def build_nosa(self):
        attn = AttentionConfig(variant="nosa", nosa=self.geo, backend="auto")
        path = write_random_export(self.tmp / "nosa_export", self.shape, attn)
        return load_random_model(path, self.dtype, self.dev, eviction_scale=1.0)

    def build_llama(self):
        return stock_llama(self.shape, self.dtype, self.dev)

    def attention_backend(self, model) -> str:
        if not hasattr(model, "selections"):
            return "sdpa"
        from importlib import import_module

        mod = import_module(type(model).__module__.rsplit(".", 1)[0] + ".nosa_dispatch")
        return mod.resolve_backend("auto", self.dev)

    # ------------------------------------------------------------------ measurements
    @torch.no_grad()
    def prefill_time(self, model, n: int) -> dict:
        ids = self.prompt(n)
        times = []
        for i in range(4):  # 1 warm-up (Triton compiles here) + 3 timed
            self.sync()
            t0 = time.perf_counter()
            model(ids, use_cache=True, logits_to_keep=1)
            self.sync()
            if i:
                times.append(time.perf_counter() - t0)
        return {"prefill_s": round(statistics.median(times), 4), "tokens": n}

    def decode_reserve(self, n: int, batch: int) -> int:
        """Tokens per sequence of a decode row's NOSA cache: the largest context of the rows of this batch
        size (one capacity per batch size: the compiled step traces once per batch size), plus the steps."""
        ctx = max([c for c, b in self.decode_cells if b == batch] + [n])
        return ctx + self.args.steps + 8

    @torch.no_grad()
    def prefilled_cache(self, model, n: int, batch: int, reserve: int | None = None, **cache_opts):
        """Cache of one prompt of ``n`` tokens repeated to ``batch`` sequences (``reserve`` tokens per
        sequence allocated, default ``n`` + the steps), and the next tokens."""
        kw = {}
        if cache_opts.get("offload") and self.args.gpu_blocks:
            cache_opts = {**cache_opts, "gpu_blocks": self.args.gpu_blocks}
        if hasattr(model, "new_cache"):
            # parts on streams overlap host fetches with compute: offloaded caches only (the GPU-resident
            # rows, the baseline of the offload ratios, stay at their faster single stream)
            streams = self.args.decode_streams if cache_opts.get("offload") else 1
            kw[cache_kw(model)] = model.new_cache(reserve=reserve or n + self.args.steps + 8,
                                                  attention=self.args.attention,
                                                  decode_streams=streams, **cache_opts)
            if self.args.part_fetch_grid:
                kw[cache_kw(model)].part_fetch_programs_per_sm = self.args.part_fetch_grid
        out = model(self.prompt(n), use_cache=True, logits_to_keep=1, **kw)
        cache = out_cache(out)
        if batch > 1:
            cache.batch_repeat_interleave(batch)
        tok = out.logits[:, -1:].argmax(-1).repeat(batch, 1)
        return cache, tok

    @torch.no_grad()
    def decode_rate(self, model, cache, tok, steps: int, warm: int = 2) -> dict:
        name = cache_kw(model)
        per_step, warm_s = [], 0.0
        for i in range(warm + steps):
            self.sync()
            t0 = time.perf_counter()
            out = model(tok, use_cache=True, **{name: cache})
            cache = out_cache(out)
            tok = out.logits[:, -1:].argmax(-1)
            self.sync()
            if i >= warm:
                per_step.append(time.perf_counter() - t0)
            else:
                warm_s += time.perf_counter() - t0
        B = tok.shape[0]
        total = sum(per_step)
        self.last_steps = per_step
        out = {"batch": B, "steps": steps, "step_ms": round(1e3 * total / steps, 3),
               "tok_per_s": round(B * steps / total, 1), "warm_s": round(warm_s, 2)}
        graph = getattr(cache, "graph", None)
        if hasattr(cache, "offload") and self.dev.type == "cuda":  # NOSA: how the steps ran
            out["cuda_graph"] = graph is not None and graph.graph is not None
            out["compiled"] = out["cuda_graph"] and graph.compiled
        return out

    # ------------------------------------------------------------------ rows
    def run(self) -> None:
        if self.models:
            self.run_exports()
            return
        only = set(self.args.only.split(","))
        log(f"device {self.dev} ({torch.cuda.get_device_name() if self.dev.type == 'cuda' else 'cpu'}), "
            f"{self.dtype}, shape {self.shape.num_layers}L h{self.shape.hidden_size} "
            f"{self.shape.num_attention_heads}/{self.shape.num_kv_heads} heads d{self.shape.kv_channels}, "
            f"geometry {dataclasses.asdict(self.geo)}")
        chosen = set(self.args.models.split(","))
        for kind, build in (("llama_sdpa", self.build_llama), ("nosa", self.build_nosa)):
            if kind.split("_")[0] not in chosen:
                continue
            if not only & {"prefill", "decode"} and kind == "llama_sdpa":
                continue
            log(f"building {kind} (random weights)")
            model = build()
            self.model_rows(kind, model, only)
            del model
            self.free()

    def run_exports(self) -> None:
        """Rows of trained exports: decode (and the static-cache baseline for dense ones), then the largest
        batch under one device budget, its decode rate, bytes per token and hit rate."""
        only = set(self.args.only.split(","))
        a = self.args
        if a.data:
            tokenizer = a.tokenizer or self.models[0]
            self.text = exports.text_tokens(a.data, tokenizer, max(self.ctx[-1], self.long) + 8, a.split,
                                            self.shape.vocab_size)
        order = sorted(self.models, key=lambda m: exports.export_kind(m) != "llama")  # dense first: the budget
        for path in order:
            kind = exports.export_kind(path)
            name = f"{kind}:{Path(path).name}"
            log(f"loading {name} ({path})")
            model = exports.load_export(path, self.dtype, self.dev)
            if a.budget_batch and kind == "llama" and not getattr(self, "budget_from", None):
                self.row(f"budget {name} gpu_kv b{a.budget_batch} ctx{self.long}",
                         lambda model=model, name=name: self.set_budget(model, name))
            self.model_rows(name, model, only)
            del model
            self.free()

    def set_budget(self, model, name: str) -> dict:
        """``--mem-limit-gib`` := the peak of ``model``'s GPU-resident cache at ``--budget-batch`` sequences."""
        p = self.probe(model, self.args.budget_batch, offload=False)
        self.args.mem_limit_gib = p["peak_bytes"] / GIB
        self.budget_from = name
        return {"model": name, "batch": self.args.budget_batch, "context": self.long,
                "peak_gib": round(p["peak_bytes"] / GIB, 3), "note": "the device budget of every model below"}

    def baseline_rows(self, kind: str, model) -> None:
        """Static KV cache + torch.compile (transformers' documented fast decode) at the decode cells."""
        compiled = self.args.baseline == "static" and self.dev.type == "cuda"
        for n, B in self.decode_cells:
            self.row(f"decode {kind} static{'+compile' if compiled else ''} ctx{n} b{B}",
                     lambda n=n, B=B: {"model": kind, "context": n,
                                       **static_decode(model, self.prompt(n, B), self.args.steps, compiled)})

    def model_rows(self, kind: str, model, only: set) -> None:
        backend = self.attention_backend(model)
        if "prefill" in only:
            for n in self.ctx:
                self.row(f"prefill {kind} {n}",
                         lambda n=n: {"model": kind, "attention": backend, **self.prefill_time(model, n)})
        if "decode" in only:
            nosa = hasattr(model, "new_cache")
            variants = [(kind, None)]
            if nosa and self.dev.type == "cuda":  # the compiled graphed step (default) and the plain one
                variants.append((f"{kind}_plain", False))
            for name, compile_opt in variants:
                if compile_opt is not None:
                    model.set_cache_options(compile=compile_opt)
                for n, B in self.decode_cells:
                    def dec(n=n, B=B, name=name):
                        cache, tok = self.prefilled_cache(model, n, B,
                                                          reserve=self.decode_reserve(n, B) if nosa else None)
                        path = {"attention": cache.attention} if hasattr(cache, "attention") else {}
                        return {"model": name, "context": n, **path,
                                **self.decode_rate(model, cache, tok, self.args.steps)}
                    self.row(f"decode {name} ctx{n} b{B}", dec)
                if compile_opt is not None:
                    model.set_cache_options()
            if not nosa and self.args.baseline != "none":
                self.baseline_rows(kind, model)
            if nosa and self.args.profile:
                for n, B in self.profile_cells:
                    self.row(f"profile {kind} ctx{n} b{B}", lambda n=n, B=B: {
                        "model": kind, "context": n,
                        **step_profile(model, *self.prefilled_cache(model, n, B, reserve=self.decode_reserve(n, B)),
                                       self.dev)})
            if kind == "nosa" and self.dev.type == "cuda":
                self.row("check nosa decode: graph / offload vs eager", lambda: self.graph_check(model))
                model.set_cache_options(cuda_graphs=False)
                for n in self.ctx:
                    def eager(n=n):
                        cache, tok = self.prefilled_cache(model, n, 4)
                        return {"model": kind, "context": n, **self.decode_rate(model, cache, tok, self.args.steps)}
                    self.row(f"decode nosa_eager ctx{n} b4", eager)
                model.set_cache_options()
        if "offload" in only:
            if hasattr(model, "new_cache"):
                self.offload_rows(model, kind)
            elif self.models:  # a dense export: its largest batch under the same budget
                self.dense_rows(model, kind)

    def dense_rows(self, model, kind: str) -> None:
        found = {}

        def search():
            r = self.largest_batch(model, offload=False)
            found["batch"] = r["batch"]
            return {"model": kind, "mode": "gpu_kv", "context": self.long, **r}

        self.row(f"max batch {kind} gpu_kv ctx{self.long}", search)
        if "batch" in found:
            self.row(f"decode {kind} gpu_kv ctx{self.long} max batch", lambda: {
                "model": kind, "mode": "gpu_kv", "context": self.long,
                **self.decode_rate(model, *self.prefilled_cache(model, self.long, found["batch"]),
                                   self.args.offload_steps)})

    def offload_rows(self, model, kind: str = "nosa") -> None:
        found = {}
        for offload in (False, True):
            slots = self.args.gpu_blocks
            mode = "gpu_kv" if not offload else f"offload_{slots}slots" if slots else "offload"

            def search(offload=offload, mode=mode):
                r = self.largest_batch(model, offload)
                found[mode] = r["batch"]
                return {"model": kind, "mode": mode, "context": self.long, **r}

            self.row(f"max batch {kind} {mode} ctx{self.long}", search)
            if mode not in found:
                continue

            def rate(offload=offload, mode=mode):
                B = found[mode]
                cache, tok = self.prefilled_cache(model, self.long, B, offload=offload)
                first = self.decode_rate(model, cache, tok, 1, warm=0)  # offload: fetches whole selections
                blocks0 = cache.fetched_blocks()
                r = self.decode_rate(model, cache, tok, self.args.offload_steps, warm=1)
                out = {"model": kind, "mode": mode, "context": self.long, **r,
                       "first_step_ms": first["step_ms"], "attention": cache.attention}
                if offload:
                    block_bytes = cache.fetched_block_bytes()  # K, V and the block's bias row
                    steady = (cache.fetched_blocks() - blocks0) / (self.args.offload_steps + 1)
                    out.update({
                        "fetch": cache.fetch,
                        "first_step_h2d_mib": round(blocks0 * block_bytes / 2**20, 2),
                        "h2d_bytes_per_token": int(steady * block_bytes / B),
                        "d2h_bytes_per_token": cache.token_d2h_bytes(),
                        "fetched_blocks_per_step_per_head": round(
                            steady / (B * self.shape.num_kv_heads * self.shape.num_layers), 2),
                        "hit_rate": round(exports.hit_rate(steady, B, self.shape.num_layers, self.shape.num_kv_heads,
                                                           model.config.nosa_config["topk"]
                                                           if hasattr(model.config, "nosa_config") else self.geo.topk),
                                          4),
                    })
                if self.args.profile:
                    out.update(self.kernel_profile(model, cache, tok))
                    for r in out["profile_top"]:
                        log(f"  {r['ms_per_step']:9.3f} ms x{r['calls_per_step']:<5d} {r['name']}")
                return out

            self.row(f"decode {kind} {mode} ctx{self.long} max batch", rate)
            if self.args.memory_profile:
                self.row(f"memory nosa {mode} ctx{self.long} max batch",
                         lambda offload=offload, mode=mode: self.step_memory(model, found[mode], offload, mode))

    # ------------------------------------------------------------------ output
    def write(self, quiet: bool = False) -> None:
        out = Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"device": torch.cuda.get_device_name() if self.dev.type == "cuda" else "cpu",
                "dtype": str(self.dtype), "torch": torch.__version__, "quick": self.args.quick,
                "shape": dataclasses.asdict(self.shape), "geometry": dataclasses.asdict(self.geo),
                "args": vars(self.args)}
        write_atomic(out / "inference.json", json.dumps({"meta": meta, "rows": self.rows}, indent=2) + "\n")
        write_atomic(out / "inference.md", markdown(self.rows, meta) + "\n")
        if not quiet:
            log(f"wrote {out / 'inference.json'} and {out / 'inference.md'}")


COLUMNS = ("row", "prefill_s", "tok_per_s", "step_ms", "warm_s", "cuda_graph", "compiled", "first_step_ms",
           "fetch", "batch", "peak_gib", "host_gib",
           "per_seq_device_mib", "per_seq_cache_mib", "first_step_h2d_mib", "h2d_bytes_per_token",
           "d2h_bytes_per_token", "fetched_blocks_per_step_per_head", "hit_rate",
           "attention", "max_abs_logit_diff", "offload_max_abs_logit_diff", "error")


def markdown(rows: list, meta: dict) -> str:
    used = [c for c in COLUMNS if any(c in r for r in rows)]
    lines = [f"device: {meta['device']}, {meta['dtype']}, torch {meta['torch']}", "",
             "| " + " | ".join(used) + " |", "|" + "---|" * len(used)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in used) + " |")
    pre = {r["row"]: r.get("prefill_s") for r in rows if r["row"].startswith("prefill")}
    ratios = []
    for r in rows:
        if r["row"].startswith("prefill nosa") and r.get("prefill_s"):
            base = pre.get(r["row"].replace("nosa", "llama_sdpa"))
            if base:
                ratios.append(f"{r['row']}: {r['prefill_s'] / base:.2f}x stock Llama SDPA")
    # decode: NOSA tokens/s over the best dense decode of the same cell (static + compile when measured)
    dense = {}
    for r in rows:
        if r["row"].startswith("decode llama_sdpa") and r.get("tok_per_s") and "context" in r:
            key = (r["context"], r["batch"])
            dense[key] = max(dense.get(key, (0, "")), (r["tok_per_s"], r["row"].split()[1:-2]))
    for r in rows:
        if r["row"].split()[:2] in (["decode", "nosa"], ["decode", "nosa_plain"]) and r.get("tok_per_s") \
                and (r.get("context"), r.get("batch")) in dense:
            best, what = dense[(r["context"], r["batch"])]
            ratios.append(f"{r['row']}: {r['tok_per_s'] / best:.2f}x the best dense decode "
                          f"({' '.join(what)}, {best} tok/s)")
    return "\n".join(lines + [""] + ratios)


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    bad = set(args.only.split(",")) - {"prefill", "decode", "offload"}
    if bad:
        print(f"error: --only: unknown row kind(s) {sorted(bad)}; use prefill, decode, offload", file=sys.stderr)
        return 2
    if Path(args.out).exists() and not Path(args.out).is_dir():
        print(f"error: --out {args.out} exists and is not a directory", file=sys.stderr)
        return 2
    bad = set(args.models.split(",")) - {"llama", "nosa"}
    if bad:
        print(f"error: --models: unknown model(s) {sorted(bad)}; use llama, nosa", file=sys.stderr)
        return 2
    if args.shape and (args.model or args.quick):
        print("error: --shape sets the random models' shape; not with --model (exports) or --quick", file=sys.stderr)
        return 2
    try:
        parse_cells(args.decode_cells)
        if args.shape:
            load_shape(args.shape)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.decode_streams is not None and args.decode_streams < 1:
        print(f"error: --decode-streams must be >= 1, got {args.decode_streams}", file=sys.stderr)
        return 2
    if args.part_fetch_grid is not None and args.part_fetch_grid < 1:
        print(f"error: --part-fetch-grid must be >= 1, got {args.part_fetch_grid}", file=sys.stderr)
        return 2
    if args.memory_profile and not torch.cuda.is_available():
        print("error: --memory-profile needs a CUDA device (the allocator history of the caching allocator)",
              file=sys.stderr)
        return 2
    missing = [m for m in (args.model or "").split(",") if m and not (Path(m) / "config.json").is_file()]
    if missing:
        print(f"error: --model {missing[0]}: no export there (config.json missing)", file=sys.stderr)
        return 2
    if (args.data or args.budget_batch) and not args.model:
        print("error: --data and --budget-batch go with --model (trained exports)", file=sys.stderr)
        return 2
    if args.budget_batch is not None and args.budget_batch < 1:
        print(f"error: --budget-batch must be >= 1, got {args.budget_batch}", file=sys.stderr)
        return 2
    if args.gpu_blocks is not None and args.gpu_blocks < 1:
        print(f"error: --gpu-blocks must be >= 1, got {args.gpu_blocks}", file=sys.stderr)
        return 2
    if min(args.mem_limit_gib, args.host_mem_limit_gib) <= 0 or min(args.steps, args.offload_steps) < 1:
        print("error: memory limits must be > 0 and step counts >= 1", file=sys.stderr)
        return 2
    if args.quick:
        args.mem_limit_gib = min(args.mem_limit_gib, 0.05)
        args.host_mem_limit_gib = min(args.host_mem_limit_gib, 0.05)
        args.steps = min(args.steps, 4)
        args.offload_steps = min(args.offload_steps, 4)
    b = Bench(args)
    try:
        b.run()
    finally:
        b.write()
        shutil.rmtree(b.tmp, ignore_errors=True)  # the weightless export this run wrote
    return 0


if __name__ == "__main__":
    sys.exit(main())
