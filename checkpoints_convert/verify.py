"""Check an export: tensor round trip and logits against the Megatron model.

    python -m checkpoints_convert.verify --hf <export dir> [--ckpt <megatron ckpt or run dir>]
        [--prompts prompts.txt --tokenizer DIR] [--random 1 --seq-len N | --long] [--tol 1e-4] [--decode-steps 8]

1. Tensors: HF -> Megatron -> HF must be bitwise equal; with ``--ckpt`` also Megatron -> HF must equal
   the export (after the export's dtype cast) and HF -> Megatron must give back the checkpoint's tensors.
2. Logits (with ``--ckpt``): the Megatron forward (TP=PP=1, reference attention, fp32) vs
   ``AutoModelForCausalLM.from_pretrained(hf)`` in fp32 on the prompts
   (one per line of ``--prompts``, tokenised with ``--tokenizer`` or the export's tokenizer) or on
   random token rows; reports the relative L2 error, max |diff|, KL and top-1 agreement. The default
   is one row of ``topk x block_size + 2 x block_size`` tokens for a sparse model (at most
   ``max_position_embeddings``; 4224 at the released geometry, about 270 CPU-s and 5.5 GiB for
   a 135M model; 256 for dense ones), so its last two blocks attend sparsely and the selection drops
   blocks; ``--long`` checks two rows of twice the budget (half of the tokens sparse; 8192 at the released
   geometry). The report gives the sparse share (``sparse``).
3. Decode: the KV-cache path (one token at a time) vs the full forward on the last tokens.
Each step prints a progress line with the elapsed time and, per forward, an ETA (stderr).
The export's modeling code runs only when it is byte-identical to the code this project ships
(or with ``--trust-remote-code``); ``--ckpt`` is verified against its manifest first.
Exit status 1 when a check fails, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from checkpoints_convert.common import (
    cast,
    geometry,
    load_megatron_tensors,
    load_safetensors_dir,
    read_json,
    read_model_config,
    resolve_checkpoint,
)
from checkpoints_convert.mapping import ConversionError, hf_to_megatron, megatron_to_hf


def tensor_roundtrip(hf_dir: Path, ckpt: Optional[Path]) -> list[str]:
    """Returns a list of failures (empty = all bitwise equal)."""
    from checkpoints_convert.from_hf import configs_from_hf

    cfg = read_json(Path(hf_dir) / "config.json")
    model, attn = configs_from_hf(cfg, longrope_choice="switch")  # tensors only: the RoPE choice does not matter
    geo = geometry(model, attn)
    hf = load_safetensors_dir(hf_dir)
    back = megatron_to_hf(hf_to_megatron(hf, geo), geo)
    fails = [f"HF->Megatron->HF: {k} differs" for k in hf
             if k in back and not torch.equal(hf[k], back[k].to(hf[k].dtype))]
    fails += [f"HF->Megatron->HF: {k} lost" for k in hf if k not in back and k != "lm_head.weight"]
    if ckpt is not None:
        m_model, m_attn, _ = read_model_config(ckpt)
        m_geo = geometry(m_model, m_attn)
        mg = load_megatron_tensors(ckpt)
        exported = megatron_to_hf(mg, m_geo)
        dtype = next(iter(hf.values())).dtype
        exported = cast(exported, dtype)
        fails += [f"Megatron->HF: {k} differs from the export" for k in hf
                  if k not in exported or not torch.equal(hf[k], exported[k].to(hf[k].dtype))]
        if dtype == torch.float32 and not m_model.use_mup:
            again = hf_to_megatron(exported, m_geo)
            for k, v in again.items():
                orig = mg.get(k)
                if orig is None:
                    continue
                if k in ("embedding.word_embeddings.weight", "output_layer.weight"):
                    v, orig = v[:m_model.vocab_size], orig[:m_model.vocab_size]
                if not torch.equal(v, orig.to(v.dtype)):
                    fails.append(f"Megatron->HF->Megatron: {k} differs")
    return fails


def trust_remote_code(hf_dir: Path, allowed: bool = False) -> bool:
    """Whether loading ``hf_dir`` may run its modeling code: it has none (stock Llama: False), its
    ``auto_map`` and shipped files are byte-identical to this project's, or ``allowed`` says so.
    Any other modeling code is refused in one line."""
    from checkpoints_convert.hf_modeling import AUTO_MAP, reference_sources

    cfg = read_json(Path(hf_dir) / "config.json")
    if "auto_map" not in cfg:
        return False
    if allowed:
        return True
    differs = [] if cfg["auto_map"] == AUTO_MAP else ["config.json auto_map"]
    for name, src in reference_sources().items():
        f = Path(hf_dir) / name
        if not f.is_file() or f.read_bytes() != src.encode():
            differs.append(name)
    if differs:
        raise ConversionError(f"--hf {hf_dir} ships modeling code that differs from this project's "
                              f"({', '.join(differs[:4])}); review it and pass --trust-remote-code to run it")
    return True


def is_reference_export(hf_dir: Path) -> bool:
    """A released-NOSA-layout folder (its own modeling code needs CUDA kernels; we run ours)."""
    from checkpoints_convert.hf_modeling.configuration_nosa import is_reference_config

    return is_reference_config(read_json(Path(hf_dir) / "config.json"))


def load_hf_model(hf_dir: Path, allow_remote_code: bool = False):
    """The export in fp32, eval mode. A reference-format directory (released NOSA layout, whose own
    modeling code needs CUDA kernels) runs with the modeling code this project ships."""
    from transformers import AutoModelForCausalLM

    if is_reference_export(hf_dir):
        return shipped_model_class().from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(
        str(hf_dir), trust_remote_code=trust_remote_code(hf_dir, allow_remote_code), dtype=torch.float32)
    return model.eval()


def shipped_model_class():
    """``NOSALlamaForCausalLM`` of the modeling code this project ships (written to a temp dir and
    imported the way transformers imports remote code)."""
    import tempfile

    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    from checkpoints_convert.hf_modeling import MODEL_CLASS, write_modeling_files

    with tempfile.TemporaryDirectory(prefix="nosa_modeling_") as tmp:
        write_modeling_files(tmp)
        return get_class_from_dynamic_module(f"modeling_nosa.{MODEL_CLASS}", tmp)


def make_tokens(args, vocab: int) -> torch.Tensor:
    if args.prompts:
        from data.tokenizer import load_hf_tokenizer

        tok = load_hf_tokenizer(args.tokenizer or args.hf)  # tokenizer files only: no model code runs
        lines = [ln for ln in Path(args.prompts).read_text().splitlines() if ln.strip()]
        rows = [torch.tensor(tok(ln)["input_ids"]) for ln in lines]
        n = min(len(r) for r in rows)
        return torch.stack([r[:n] for r in rows])
    gen = torch.Generator().manual_seed(args.seed)
    model, attn = geometry_of(Path(args.hf))
    seq_len = args.seq_len or default_seq_len(model, attn, long=args.long)
    rows = args.random or (2 if args.long else 1)
    return torch.randint(0, vocab, (rows, seq_len), generator=gen)


class Progress:
    """A stderr line after each unit of work (a forward of one row), with the elapsed time and an ETA from
    the units done so far (every unit is taken to cost the same)."""

    def __init__(self, total: int, stream=None) -> None:
        self.total, self.done, self.clock = total, 0, time.perf_counter
        self.start, self.stream = self.clock(), stream or sys.stderr

    def step(self, what: str) -> None:
        self.done += 1
        spent = self.clock() - self.start
        left = spent / self.done * (self.total - self.done)
        eta = f"; ETA {_duration(left)}" if self.done < self.total else ""
        print(f"verify: [{self.done}/{self.total}] {what} ({_duration(spent)} so far{eta})", file=self.stream,
              flush=True)


class LayerProgress:
    """Within a long forward: at most every ``every_s`` seconds a stderr line with the decoder layer reached and
    the forward's ETA (layers take about the same time). Hooks on ``model.model.layers``; a forward starts at
    layer 0. Use as a context manager (the hooks are removed on exit)."""

    def __init__(self, model, every_s: float = 20.0, stream=None) -> None:
        self.layers = list(getattr(getattr(model, "model", None), "layers", []) or [])
        self.every_s, self.stream, self.clock = every_s, stream or sys.stderr, time.perf_counter
        self.handles: list = []
        self.begun = self.last = self.clock()

    def __enter__(self) -> "LayerProgress":
        n = len(self.layers)
        if n:
            self.handles.append(self.layers[0].register_forward_pre_hook(lambda *_: self._begin()))
        for i, layer in enumerate(self.layers[:-1]):
            self.handles.append(layer.register_forward_hook(lambda *_, i=i: self._after(i, n)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()

    def _begin(self) -> None:
        self.begun = self.clock()

    def _after(self, i: int, n: int) -> None:
        now = self.clock()
        if now - self.last < self.every_s:
            return
        self.last = now
        spent = now - self.begun
        print(f"verify:   layer {i + 1} of {n} of this forward ({_duration(spent)}; "
              f"ETA {_duration(spent / (i + 1) * (n - i - 1))})", file=self.stream, flush=True)


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def geometry_of(hf_dir: Path):
    """(ModelConfig, AttentionConfig) of an export's ``config.json``."""
    from checkpoints_convert.from_hf import configs_from_hf

    return configs_from_hf(read_json(Path(hf_dir) / "config.json"), longrope_choice="switch")


SPARSE_BLOCKS = 2  # blocks past the selection budget in the default row: the selection drops up to 2 blocks


def default_seq_len(model, attn, long: bool = False) -> int:
    """A sparse model: ``topk x block_size`` plus :data:`SPARSE_BLOCKS` blocks, so its last positions attend
    sparsely (the selection drops blocks) at a cost CPUs afford; ``long``: twice the budget (half of the
    positions sparse). At most ``max_position_embeddings``; 256 for a dense model."""
    if all(v == "dense" for v in attn.layer_variants(model.num_layers)):
        return 256
    budget = attn.nosa.dense_len
    n = 2 * budget if long else budget + SPARSE_BLOCKS * attn.nosa.block_size
    return min(n, model.max_position_embeddings)


def sparse_share(model, attn, seq_len: int) -> dict:
    """Which of ``seq_len`` positions attend sparsely: those at or past the budget ``topk x block_size``
    in the model's NOSA / InfLLM-V2 layers."""
    variants = attn.layer_variants(model.num_layers)
    layers = sum(v != "dense" for v in variants)
    budget = attn.nosa.dense_len
    share = max(0, seq_len - budget) / seq_len if layers and seq_len else 0.0
    return {"share": share, "from_position": budget if layers else None, "sparse_layers": layers,
            "layers": len(variants)}


def sparse_line(sp: dict, tokens, long_len: Optional[int] = None) -> str:
    """What the check covers; ``long_len``: the row length of ``--long``, named when it covers more."""
    rows, n = int(tokens.shape[0]), int(tokens.shape[1])
    if not sp["sparse_layers"]:
        return f"verify: {rows} x {n} tokens checked; dense model: no sparse attention"
    more = ""
    if long_len and long_len > n and sp["share"] < 0.5:
        share = max(0, long_len - sp["from_position"]) / long_len
        more = f"; --long checks 2 x {long_len} tokens, {100 * share:.0f}% sparse"
    return (f"verify: {rows} x {n} tokens checked; {100 * sp['share']:.1f}% of them attend sparsely "
            f"(positions >= {sp['from_position']} in {sp['sparse_layers']} of {sp['layers']} layers{more})")


def compare_logits(a: torch.Tensor, b: torch.Tensor, chunk: int = 64) -> dict:
    """``a`` against the reference ``b`` (``[..., vocab]``): relative L2 error, max |diff|, mean KL(b || a) and
    top-1 agreement, in fp64 over ``chunk`` positions at a time (memory stays a few copies of one chunk)."""
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    diff_sq = ref_sq = kl = most = 0.0
    agree = 0
    for i in range(0, a.shape[0], chunk):
        x, y = a[i:i + chunk], b[i:i + chunk]
        xd, yd = x.double(), y.double()
        diff = xd - yd
        diff_sq += float(diff.square().sum())
        ref_sq += float(yd.square().sum())
        most = max(most, float(diff.abs().max()))
        la, lb = torch.log_softmax(xd, -1), torch.log_softmax(yd, -1)
        kl += float((lb.exp() * (lb - la)).sum())
        agree += int((x.argmax(-1) == y.argmax(-1)).sum())
    n = max(a.shape[0], 1)
    return {"rel": math.sqrt(diff_sq) / max(math.sqrt(ref_sq), 1e-30), "max_abs": most, "kl": kl / n,
            "top1": agree / n}


def decode_check(model, tokens: torch.Tensor, steps: int, full: Optional[torch.Tensor] = None,
                 on_row=None) -> dict:
    """Teacher-forced decode of the last ``steps`` tokens with the KV cache vs the full forward (``full``:
    its logits when already computed), one row at a time; ``on_row()`` after each row."""
    p = tokens.shape[1] - steps
    incs, refs = [], []
    with torch.no_grad():
        for i, row in enumerate(tokens):
            row = row[None]
            ref = full[i:i + 1] if full is not None else model(row).logits
            out = model(row[:, :p], use_cache=True)
            cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            logits = [out.logits[:, -1:]]
            for t in range(p, tokens.shape[1] - 1):
                kw = {"cache": cache} if hasattr(out, "cache") else {"past_key_values": cache}
                out = model(row[:, t:t + 1], use_cache=True, **kw)
                logits.append(out.logits)
            incs.append(torch.cat(logits, dim=1))
            refs.append(ref[:, p - 1:-1])
            if on_row is not None:
                on_row()
    return compare_logits(torch.cat(incs), torch.cat(refs).to(incs[0].dtype))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m checkpoints_convert.verify", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", "--export", dest="hf", required=True, help="the export to check (--export: the same)")
    ap.add_argument("--ckpt", default=None, help="the model it came from: a run dir, checkpoints/ dir or iter_* dir")
    ap.add_argument("--prompts", default=None, help="text file, one prompt per line")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--random", type=int, default=None,
                    help="random rows when no prompts are given (default 1; 2 with --long)")
    ap.add_argument("--seq-len", type=int, default=None,
                    help="random row length (default: topk x block_size + 2 blocks for a sparse model, so its last "
                         "positions attend sparsely: 4224 at the released geometry; 256 for a dense one)")
    ap.add_argument("--long", action="store_true",
                    help="the long check: 2 rows of 2 x topk x block_size tokens (half of them sparse; 8192 at the "
                         "released geometry: several times the default's time and memory)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=1e-4, help="max relative L2 error of the logits")
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="run the export's modeling code even if it differs from the code this project ships")
    args = ap.parse_args(argv)
    from runtime.heap_reuse import reused_heap
    from runtime.process_exit import freeze_at_exit
    from data.third_party_noise import quiet_third_party

    freeze_at_exit()
    quiet_third_party(note_stream=sys.stderr)  # stdout is the JSON report
    try:
        with reused_heap():  # the forwards' GB-sized temporaries: reused, not page-faulted afresh per layer
            report = run_checks(args)
    except (ConversionError, FileNotFoundError) as e:
        print(f"verify: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2)
    print(text, flush=True)
    if args.json:
        Path(args.json).write_text(text)
    print(verdict(report, args.tol), file=sys.stderr, flush=True)  # last: the long report stays on stdout
    return 0 if report["ok"] else 1


def verdict(report: dict, tol: float) -> str:
    """One line: ``verify: ok (...)`` with what was checked, or ``verify: FAILED: <first failing check>``."""
    fails = report.get("tensor_roundtrip")
    if fails not in (None, "ok"):
        more = f" (+{len(fails) - 1} more)" if len(fails) > 1 else ""
        return f"verify: FAILED: tensor_roundtrip: {fails[0]}{more}"
    done = ["tensor_roundtrip bitwise"]
    for key in ("logits_vs_megatron", "decode_vs_forward"):
        if key in report:
            rel = report[key]["rel"]
            if not rel <= tol:
                return f"verify: FAILED: {key}: relative error {rel:.3g} > --tol {tol:g}"
            done.append(f"{key} {rel:.3g} <= {tol:g}")
    return f"verify: {'ok' if report.get('ok') else 'FAILED'} ({', '.join(done)})"


def run_checks(args) -> dict:
    """The report of every check; bad input raises ``ConversionError`` / ``FileNotFoundError``."""
    hf_dir = Path(args.hf)
    report: dict = {"hf": str(hf_dir)}
    ckpt = resolve_checkpoint(args.ckpt) if args.ckpt else None
    if not is_reference_export(hf_dir):
        trust_remote_code(hf_dir, args.trust_remote_code)  # modeling code this project did not ship: refused first
    start = time.perf_counter()
    fails = tensor_roundtrip(hf_dir, ckpt)
    print(f"verify: tensor round trip {'ok' if not fails else f'FAILED ({len(fails)})'} "
          f"({_duration(time.perf_counter() - start)}); loading the export", file=sys.stderr, flush=True)
    model = load_hf_model(hf_dir, args.trust_remote_code)
    report["tensor_roundtrip"] = "ok" if not fails else fails
    ok = not fails
    tokens = make_tokens(args, model.config.vocab_size)
    report["tokens"] = list(tokens.shape)
    geo = geometry_of(hf_dir)
    report["sparse"] = sparse_share(*geo, int(tokens.shape[1]))
    long_len = None if args.prompts or args.long else default_seq_len(*geo, long=True)
    print(sparse_line(report["sparse"], tokens, long_len), file=sys.stderr, flush=True)
    rows = int(tokens.shape[0])
    with LayerProgress(model):
        return _logit_checks(args, report, ok, model, ckpt, tokens, rows)


def _logit_checks(args, report: dict, ok: bool, model, ckpt, tokens: torch.Tensor, rows: int) -> dict:
    decode = args.decode_steps > 0 and tokens.shape[1] > args.decode_steps + 1
    progress = Progress(rows * ((ckpt is not None) * 2 + decode))
    got = None
    if ckpt is not None:
        from checkpoints_convert.megatron_io import megatron_logits

        m_model, m_attn, _ = read_model_config(ckpt)
        count = iter(range(1, rows + 1))
        ref = megatron_logits(ckpt, m_model, m_attn, tokens,
                              on_row=lambda: progress.step(f"Megatron forward, row {next(count)} of {rows}"))
        outs = []
        with torch.no_grad():
            for i, row in enumerate(tokens):
                outs.append(model(row[None]).logits.float())
                progress.step(f"Hugging Face forward, row {i + 1} of {rows}")
        got = torch.cat(outs)
        report["logits_vs_megatron"] = compare_logits(got, ref)
        ok &= report["logits_vs_megatron"]["rel"] <= args.tol
    if decode:
        count = iter(range(1, rows + 1))
        report["decode_vs_forward"] = decode_check(
            model, tokens, args.decode_steps, full=got,
            on_row=lambda: progress.step(f"KV-cache decode, row {next(count)} of {rows}"))
        ok &= report["decode_vs_forward"]["rel"] <= args.tol
    report["ok"] = bool(ok)
    return report


if __name__ == "__main__":
    sys.exit(main())
