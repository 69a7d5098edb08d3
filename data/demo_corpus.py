"""``python -m data.demo_corpus [--out DIR] [--small] [--force]``: the offline demo data, cached.

Builds, from text that exists on every Debian machine with Python (nothing downloaded):
  corpus.jsonl            one document per file: the running interpreter's standard-library sources,
                          ``/usr/share/doc`` text files (incl. gzipped changelogs), ``/usr/share/common-licenses``
  tokenizer/              byte-level BPE (``tokenizers``) saved as an HF dir with a ChatML template
  corpus_text_document    ``.bin/.idx`` (megatron-core indexed dataset) of the corpus
  sft.jsonl               chat Q/A derived with ``ast`` from stdlib docstrings and signatures
  longctx.jsonl           synthetic passkey / multi-key-needle retrieval prompts at several lengths
Prints ``name=path`` lines. A second call with the same spec only checks the manifest (fast).
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import os
import random
import re
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field

from data.third_party_noise import quiet_third_party

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, ".cache", "demo_data")
BUILD_VERSION = 3  # bump when the build logic changes, to invalidate caches


@dataclass
class DemoSpec:
    """Size caps of the demo build (bytes are UTF-8 text bytes)."""

    stdlib_bytes: int = 14_000_000
    doc_bytes: int = 8_000_000
    max_file_bytes: int = 200_000
    vocab_size: int = 8192
    tokenizer_train_bytes: int = 12_000_000
    sft_max_examples: int = 4000
    longctx_lengths: list = field(default_factory=lambda: [4096, 16384])
    longctx_depths: list = field(default_factory=lambda: [0.1, 0.5, 0.9])
    longctx_per_cell: int = 2
    seed: int = 0


SMALL = DemoSpec(stdlib_bytes=900_000, doc_bytes=400_000, max_file_bytes=60_000, vocab_size=1024,
                 tokenizer_train_bytes=1_300_000, sft_max_examples=300, longctx_lengths=[512, 2048],
                 longctx_depths=[0.0, 0.5, 1.0], longctx_per_cell=1)

_TEXT_EXTS = {"", ".txt", ".md", ".rst", ".gz", ".Debian"}


def _read_text(path: str, cap: int):
    """Return UTF-8 text of ``path`` (gunzipped if .gz) cut at a line boundary below ``cap``, or None if binary."""
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            raw = f.read(cap + 1)
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError):
        return None
    if "\x00" in text:
        return None
    if len(raw) > cap:
        text = text[: text.rfind("\n", 0, cap) + 1 or cap]
    return text


def _walk_sorted(root: str, skip_dirs=()):
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in skip_dirs and not x.startswith("."))
        for fn in sorted(files):
            yield os.path.join(d, fn)


def iter_corpus(spec: DemoSpec):
    """Yield corpus rows ``{"text", "source", "path"}`` in a deterministic order within the caps."""
    stdlib = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__", "lib-dynload", "config-3.12-x86_64-linux-gnu"}
    budget = spec.stdlib_bytes
    for p in _walk_sorted(stdlib, skip):
        if budget <= 0:
            break
        if p.endswith(".py"):
            t = _read_text(p, spec.max_file_bytes)
            if t and t.strip():
                budget -= len(t.encode())
                yield {"text": t, "source": "python-stdlib", "path": os.path.relpath(p, stdlib)}
    for p in _walk_sorted("/usr/share/common-licenses"):
        t = _read_text(p, spec.max_file_bytes)
        if t and t.strip():
            yield {"text": t, "source": "common-licenses", "path": os.path.basename(p)}
    budget = spec.doc_bytes
    for p in _walk_sorted("/usr/share/doc"):
        if budget <= 0:
            break
        base = os.path.basename(p)
        ext = os.path.splitext(base)[1]
        if os.path.islink(p) or (ext not in _TEXT_EXTS and base != "copyright"):
            continue
        t = _read_text(p, spec.max_file_bytes)
        if t and t.strip():
            budget -= len(t.encode())
            yield {"text": t, "source": "debian-doc", "path": os.path.relpath(p, "/usr/share/doc")}


# ----------------------------------------------------------------------------- SFT from the stdlib
def _first_paragraph(doc: str) -> str:
    para = doc.strip().split("\n\n")[0]
    return re.sub(r"\s+", " ", para).strip()


def sft_examples_from_source(module: str, source: str):
    """Yield (question, answer, system) triples for public documented functions/methods of ``source``."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    nodes = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            nodes.append(("", node))
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            nodes += [(node.name + ".", n) for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for prefix, fn in nodes:
        if fn.name.startswith("_"):
            continue
        doc = ast.get_docstring(fn)
        if not doc:
            continue
        desc = _first_paragraph(doc)
        if not 20 <= len(desc) <= 400:
            continue
        kw = "async def" if isinstance(fn, ast.AsyncFunctionDef) else "def"
        sig = f"{kw} {fn.name}({ast.unparse(fn.args)})"
        qual = f"{module}.{prefix}{fn.name}"
        yield (f"Which function in Python's `{module}` module does the following? Give its signature.\n\n{desc}",
               f"`{qual}`:\n\n```python\n{sig}\n```", None)
        yield (f"What does `{qual}` do?\n\n```python\n{sig}\n```", desc,
               "You are a concise assistant that explains the Python standard library.")


def build_sft(corpus_rows, spec: DemoSpec) -> list[dict]:
    rows = []
    for r in corpus_rows:
        if r["source"] != "python-stdlib":
            continue
        mod = r["path"][:-3].replace(os.sep, ".")
        mod = mod[: -len(".__init__")] if mod.endswith(".__init__") else mod
        for q, a, system in sft_examples_from_source(mod, r["text"]):
            msgs = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": q}, {"role": "assistant", "content": a}]
            rows.append({"messages": msgs, "source": f"python-stdlib:{r['path']}"})
    random.Random(spec.seed).shuffle(rows)
    return rows[: spec.sft_max_examples]


# ----------------------------------------------------------------------------- long-context retrieval
_WORDS = ("amber", "basil", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper",
          "kestrel", "lotus", "maple", "nectar", "onyx", "pepper", "quartz", "raven", "saffron", "tundra")


def build_longctx(filler_paragraphs: list[str], count_tokens, spec: DemoSpec) -> list[dict]:
    """Passkey and multi-key-needle prompts; the user prompt fits in ``context_tokens`` tokens
    (``0.9 * context_tokens <= prompt_tokens <= context_tokens``, measured with the demo tokenizer)."""
    rng = random.Random(spec.seed + 1)
    paras, lens = [], []
    for p in filler_paragraphs:
        if p.strip() and not re.search(r"\d{4,}", p):
            n = count_tokens(p)
            paras.append(p)
            lens.append(n + 1)
    out = []
    cursor = 0
    for target in spec.longctx_lengths:
        cap = max(32, target // 16)  # small paragraphs so trimming to the budget loses little
        fit = [i for i, n in enumerate(lens) if n <= cap]
        for depth in spec.longctx_depths:
            for rep in range(spec.longctx_per_cell):
                for task in ("passkey", "multikey"):
                    if task == "passkey":
                        key = str(rng.randint(10000, 99999))
                        needles = [f"The pass key is {key}. Remember it. {key} is the pass key."]
                        question, answer = "What is the pass key? Answer with the number only.", key
                    else:
                        names = rng.sample(_WORDS, 4)
                        vals = [str(rng.randint(100000, 999999)) for _ in names]
                        needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(names, vals)]
                        pick = rng.randrange(len(names))
                        question = f"What is the special magic number for {names[pick]}? Answer with the number only."
                        answer = vals[pick]
                    hay, n = [], sum(count_tokens(x) + 1 for x in needles + [question])
                    while n < 0.97 * target:
                        i = fit[cursor % len(fit)]
                        hay.append(paras[i])
                        n += lens[i]
                        cursor += 1
                    while True:
                        body = list(hay)
                        pos = round(depth * len(body))
                        for j, nd in enumerate(needles):  # multikey: spread around the depth
                            body.insert(min(len(body), pos + j * max(1, len(body) // 16)), nd)
                        prompt = "\n".join(body) + f"\n\n{question}"
                        n_tok = count_tokens(prompt)
                        if n_tok <= target:
                            break
                        hay.pop()
                    out.append({"task": task, "context_tokens": target, "depth": depth, "answer": answer,
                                "prompt_tokens": n_tok,
                                "messages": [{"role": "user", "content": prompt},
                                             {"role": "assistant", "content": answer}]})
    return out


# ----------------------------------------------------------------------------- build + cache
def _spec_hash(spec: DemoSpec) -> str:
    key = json.dumps({"v": BUILD_VERSION, "spec": asdict(spec), "py": sys.version.split()[0]}, sort_keys=True)
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def paths_for(out_dir: str) -> dict:
    return {
        "corpus": os.path.join(out_dir, "corpus.jsonl"),
        "tokenizer": os.path.join(out_dir, "tokenizer"),
        "indexed_prefix": os.path.join(out_dir, "corpus_text_document"),
        "sft": os.path.join(out_dir, "sft.jsonl"),
        "longctx": os.path.join(out_dir, "longctx.jsonl"),
        "manifest": os.path.join(out_dir, "manifest.json"),
    }


def _cached(out_dir: str, spec: DemoSpec):
    p = paths_for(out_dir)
    try:
        with open(p["manifest"]) as f:
            man = json.load(f)
    except (OSError, ValueError):
        return None
    files = [p["corpus"], p["sft"], p["longctx"], p["indexed_prefix"] + ".bin", p["indexed_prefix"] + ".idx",
             os.path.join(p["tokenizer"], "tokenizer.json")]
    if man.get("hash") == _spec_hash(spec) and all(os.path.isfile(f) for f in files):
        return {**man, **{k: v for k, v in p.items() if k != "manifest"}}  # paths valid even if the dir moved
    return None


def build_demo(out_dir: str = DEFAULT_OUT, spec: DemoSpec | None = None, force: bool = False, log=print) -> dict:
    """Build (or reuse) the demo data in ``out_dir``; returns the manifest (paths + stats)."""
    spec = spec or DemoSpec()
    if not force:
        man = _cached(out_dir, spec)
        if man is not None:
            return man
    from data.preprocess import preprocess
    from data.sources import write_jsonl
    from data.tokenizer import Tokenizer, train_bpe

    os.makedirs(out_dir, exist_ok=True)
    p = paths_for(out_dir)
    t0 = time.perf_counter()
    rows = list(iter_corpus(spec))
    n_corpus = write_jsonl(p["corpus"], rows)
    corpus_bytes = sum(len(r["text"].encode()) for r in rows)
    by_source: dict = {}
    for r in rows:
        by_source[r["source"]] = by_source.get(r["source"], 0) + 1
    log(f"[demo] corpus: {n_corpus} documents, {corpus_bytes / 1e6:.1f} MB {by_source} "
        f"({time.perf_counter() - t0:.1f}s)")

    def train_texts():
        left = spec.tokenizer_train_bytes
        for r in rows[:: max(1, len(rows) // 4000)] + rows:  # spread first, then fill up
            if left <= 0:
                return
            left -= len(r["text"])
            yield r["text"]

    train_bpe(train_texts(), spec.vocab_size, p["tokenizer"])
    tok = Tokenizer(p["tokenizer"])
    log(f"[demo] tokenizer: vocab {tok.vocab_size} ({time.perf_counter() - t0:.1f}s)")
    summ = preprocess(p["corpus"], p["tokenizer"], p["indexed_prefix"], progress=False)
    log(f"[demo] indexed: {summ['documents']} docs, {summ['tokens']} tokens, {summ['tokens_per_s'] / 1e3:.0f}K tok/s "
        f"({time.perf_counter() - t0:.1f}s)")
    sft = build_sft(rows, spec)
    write_jsonl(p["sft"], sft)
    paras = [q for r in rows if r["source"] != "python-stdlib" for q in r["text"].split("\n\n")[:50]]
    longctx = build_longctx(paras, lambda s: len(tok.encode_plain([s])[0]), spec)
    write_jsonl(p["longctx"], longctx)
    log(f"[demo] sft: {len(sft)} conversations; longctx: {len(longctx)} prompts ({time.perf_counter() - t0:.1f}s)")
    man = {"hash": _spec_hash(spec), "spec": asdict(spec), **{k: v for k, v in p.items() if k != "manifest"},
           "stats": {"corpus_documents": n_corpus, "corpus_bytes": corpus_bytes, "by_source": by_source,
                     "tokens": summ["tokens"], "vocab_size": tok.vocab_size, "sft_examples": len(sft),
                     "longctx_prompts": len(longctx), "build_seconds": round(time.perf_counter() - t0, 1),
                     "preprocess_tokens_per_s": summ["tokens_per_s"]}}
    tmp = p["manifest"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(man, f, indent=2)
    os.replace(tmp, p["manifest"])
    return man


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data.demo_corpus", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"cache dir (default {DEFAULT_OUT})")
    ap.add_argument("--small", action="store_true", help="tiny build (tests, smoke runs)")
    ap.add_argument("--force", action="store_true", help="rebuild even if the cache matches")
    ap.add_argument("--json", action="store_true", help="print the manifest as JSON")
    args = ap.parse_args(argv)
    quiet_third_party(note_stream=sys.stderr)  # stdout is the name=path lines
    man = build_demo(args.out, SMALL if args.small else DemoSpec(), force=args.force,
                     log=lambda m: print(m, file=sys.stderr))
    if args.json:
        print(json.dumps(man, indent=2))
    else:
        for k in ("corpus", "tokenizer", "indexed_prefix", "sft", "longctx"):
            print(f"{k}={man[k]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
