#!/usr/bin/env bash
# Rewrites constraints.txt with what a fresh install of the project resolves today: a throwaway Python 3.12
# venv (deleted at the end; torch's CUDA build, several GB), `pip install -e ".[dev]"` without constraints,
# `pip freeze`. Run the tests on the new pins (bash scripts/test.sh) before committing them.
# Python: $NOSA_PYTHON, else python3.12 on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${NOSA_PYTHON:-python3.12}
$py -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' \
  || { echo "update_constraints: $py is not Python 3.12 (set NOSA_PYTHON)" >&2; exit 1; }
venv=$(mktemp -d "${TMPDIR:-/tmp}/nosa-constraints.XXXXXX")
trap 'rm -rf "$venv"' EXIT
$py -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
echo "update_constraints: resolving a fresh install in $venv"
"$venv/bin/python" -m pip install -q -e ".[dev]"
{
  sed -n '/^#/p' constraints.txt
  "$venv/bin/python" -m pip freeze --exclude-editable | grep -v "^#"
} > constraints.txt.tmp
mv constraints.txt.tmp constraints.txt
echo "update_constraints: wrote constraints.txt ($(grep -vc '^#' constraints.txt) pins); run bash scripts/test.sh"
