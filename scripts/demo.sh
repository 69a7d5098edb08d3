#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the main job on its embedded default: a tiny CPU run
# writing under runs/demo/. Today: NOSA layers forward/backward and a decode-time locality report
# (runs/demo/locality/locality.json); grows into the three training stages and the HF export.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export WANDB_MODE="${WANDB_MODE:-disabled}" HF_HUB_OFFLINE=1
.venv/bin/python -m nosa_layers.demo --out runs/demo/locality "$@"
