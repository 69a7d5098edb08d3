#!/usr/bin/env bash
# Creates ./.venv with Python 3.12 and installs the project (editable) with its dev extras, at the exact
# versions of constraints.txt. Idempotent: a second run only re-checks the install (it reinstalls when
# pyproject.toml or constraints.txt is newer than the last install). Finds Python 3.12 as `python3.12` on PATH,
# or through pyenv (PYENV_VERSION=3.12.x), or via $NOSA_PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  if [ -n "${NOSA_PYTHON:-}" ]; then echo "$NOSA_PYTHON"; return 0; fi
  if command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    echo "python3.12"; return 0
  fi
  if command -v pyenv >/dev/null 2>&1; then
    local v
    v=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V | tail -n 1 || true)
    if [ -n "$v" ]; then echo "env PYENV_VERSION=$v python3.12"; return 0; fi
  fi
  return 1
}

if [ ! -x .venv/bin/python ]; then
  py=$(find_python) || { echo "setup: Python 3.12 not found (put python3.12 on PATH, install it with pyenv, or set NOSA_PYTHON)" >&2; exit 1; }
  echo "setup: creating .venv with $py"
  $py -m venv .venv
fi
.venv/bin/python -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' \
  || { echo "setup: .venv is not Python 3.12; remove .venv and run again" >&2; exit 1; }

# Free space (GiB, rounded down) on the file system that holds path $1.
free_gib() { df -Pk "$1" 2>/dev/null | awk 'NR == 2 { print int($4 / 1048576) }'; }

stamp=.venv/.nosa-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  # A first install (torch's CUDA build) needs about 7 GiB in .venv plus its download in the temp dir:
  # say so in one line instead of pip's "No space left on device" halfway through.
  if ! .venv/bin/python -c 'import torch' >/dev/null 2>&1; then
    need=${NOSA_SETUP_MIN_FREE_GIB:-8}
    for where in .venv "${TMPDIR:-/tmp}"; do
      have=$(free_gib "$where")
      if [ -n "$have" ] && [ "$have" -lt "$need" ]; then
        echo "setup: only ${have} GiB free for $where; installing torch needs about ${need} GiB" \
             "(free some space, point TMPDIR elsewhere, or set NOSA_SETUP_MIN_FREE_GIB)" >&2
        exit 1
      fi
    done
  fi
  echo "setup: installing dependencies (first run downloads torch, several GB)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -c constraints.txt -e ".[dev]"
  touch "$stamp"
fi
echo "setup: ok ($(.venv/bin/python -c 'import torch, megatron.core as m; print("torch", torch.__version__, "| megatron-core", m.__version__)'))"
