#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the main job on its embedded default, a tiny CPU run:
#   1. the offline demo corpus + tokenizer (cached under .cache/demo_data)
#   2. tiny_pretrain  (dense, 256 tokens)                      -> runs/demo/pretrain
#   3. tiny_cpt       (NOSA + LongRoPE, 512 tokens, sparse)    -> runs/demo/cpt   (init_from pretrain)
#   4. tiny_sft       (chat SFT, NOSA kept)                    -> runs/demo/sft   (init_from cpt)
#   5. HF export of the SFT model                              -> runs/demo/hf    (when available)
#   6. evaluation of the SFT model: locality + offload cost, RULER-style tasks, perplexity by
#      position on held-out documents                          -> runs/demo/eval  (tasks in runs/demo/tasks)
# Each run dir holds config.yaml, checkpoints/, metrics.jsonl and loss.png. Re-running resumes
# (a finished stage is a no-op). Extra key=value arguments are passed to every stage.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export WANDB_MODE="${WANDB_MODE:-disabled}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
py=.venv/bin/python
run=.venv/bin/torchrun
out=runs/demo
start=$(date +%s)

echo "== [1/6] demo data"
$py -m data.demo_corpus
echo "== [2/6] stage 1: dense pretraining"
$run --nproc_per_node=1 train/main.py recipe=tiny_pretrain run.dir=$out/pretrain "$@"
echo "== [3/6] stage 2: NOSA long-context CPT with LongRoPE"
$run --nproc_per_node=1 train/main.py recipe=tiny_cpt run.dir=$out/cpt init_from=$out/pretrain "$@"
echo "== [4/6] stage 3: SFT"
$run --nproc_per_node=1 train/main.py recipe=tiny_sft run.dir=$out/sft init_from=$out/cpt "$@"
echo "== [5/6] Hugging Face export"
if $py -c "import checkpoints_convert.to_hf" 2>/dev/null; then
  rm -rf $out/hf
  $py -m checkpoints_convert.to_hf --ckpt $out/sft --out $out/hf --tokenizer .cache/demo_data/tokenizer
  $py - "$out/hf" <<'PY'
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path = sys.argv[1]
tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)  # reads the config: nosa_llama
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
prompt = "<|im_start|>user\nWhat is the signature of os.path.join?<|im_end|>\n<|im_start|>assistant\n"
ids = tok(prompt, return_tensors="pt").input_ids
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=24, do_sample=False)
print(f"HF export loads offline ({type(model).__name__}); greedy sample: "
      f"{tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)!r}")
PY
else
  echo "(checkpoints_convert.to_hf not available yet: skipped)"
fi
echo "== [6/6] evaluation: locality + offload cost, RULER-style tasks, perplexity by position"
[ -f $out/tasks/tasks.json ] || $py -m eval.tasks --tokenizer .cache/demo_data/tokenizer \
  --corpus .cache/demo_data/corpus.jsonl --lengths 512 --samples 5 --out $out/tasks
$py -m eval.suite --ckpt $out/sft --tasks $out/tasks --data .cache/demo_data/corpus_text_document \
  --split 95,5,0 --length 512 --docs 4 --ppl-docs 4 --out $out/eval
$py - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("\nsummary:")
for stage in ("pretrain", "cpt", "sft"):
    rows = [json.loads(l) for l in (out / stage / "metrics.jsonl").read_text().splitlines() if l.strip()]
    train = [r for r in rows if r.get("loss") is not None]
    val = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    msg = f"  {stage:>8}: {len(train)} steps, loss {train[0]['loss']:.3f} -> {train[-1]['loss']:.3f}"
    if val:
        msg += f", val_loss {val[-1]:.3f}"
    print(msg + f"  ({out / stage / 'loss.png'})")
r = json.loads((out / "eval" / "result.json").read_text())
loc, ruler, ppl = r["locality"], r["ruler"], r["ppl"]
print(f"  locality (sft, {r['config']['docs']} held-out documents of {r['config']['length']} tokens, sparse steps): "
      f"gamma mean {loc['gamma_mean']:.3f}, min {loc['gamma_min']:.3f}, {loc['fetched_per_step']:.2f} blocks "
      f"fetched/step/head, simulated cache hit rate {loc['sim_hit_rate']:.3f} ({loc['policy']} eviction), "
      f"{loc['throughput_ratio_vs_dense']:.1f}x a dense model's PCIe-bound decode throughput")
print(f"  RULER-style tasks at 512 tokens: average {ruler['average']:.1f} ("
      + ", ".join(f"{t} {v:.0f}" for t, v in ruler["by_task"].items()) + ")")
print("  perplexity by position: " + ", ".join(f"{b['range']} {b['ppl']:.1f}" for b in ppl["buckets"])
      + f"  ({out / 'eval'}/*.md, *.png)")
PY
echo "demo finished in $(( $(date +%s) - start )) s; outputs under $out/"
