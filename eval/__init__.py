"""Evaluation of trained NOSA models: offload/locality report, RULER-style long-context tasks,
perplexity by position, and the eviction-head ablation sweep.

Commands (each ``--help``s itself; see eval/README.md)::

    python -m eval.locality --ckpt <run dir | checkpoint | HF model dir> --data <prefix | jsonl> --length N --out DIR
    python -m eval.tasks    --tokenizer DIR --corpus <prefix | jsonl> --lengths 4096,8192 --out DIR
    python -m eval.ruler    --ckpt ... --tasks DIR [--harness direct | lm-eval] --out DIR
    python -m eval.ppl      --ckpt ... --data ... --length N --out DIR
    python -m eval.ablate   --preset tiny | proof_h200 --out DIR [--devices 0,1,2,3]
    python -m eval.compare  [NAME=]DIR[,DIR...] ... [--out DIR]   # runs and eval outputs side by side

Layering: docs/ARCHITECTURE.md (``train`` runs as a subprocess, never imported).
"""

# the help of every eval command's --ckpt (the model it reads)
CKPT_HELP = ("the model: a run dir, its checkpoints/ dir, one iter_* dir, or a Hugging Face model dir (an export, "
             "a stock Llama, a released NOSA checkpoint)")
