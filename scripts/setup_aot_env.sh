#!/usr/bin/env bash
# Builds the compile-only accelerator environments, apart from .venv:
#   .venv-aot-tpu  jax[tpu]    (libtpu: the TPU compiler, about 0.7 GB)
#   .venv-aot-gpu  jax[cuda12] (the CUDA plugin, cuDNN and the compiler wheels, about 4.8 GB)
# Each is a thin venv over the main one ($VENV, default .venv, built first by
# scripts/setup_env.sh): a .pth file adds the main venv's site-packages after the venv's own, so
# the package (editable), jax, CPU torch and the test tools are the main venv's, and only the
# plugin is installed here (constraints/aot.txt pins it; jax stays constraints/ci.txt's). pip
# itself comes from the main venv too, and installs into this one. Rebuild these after rebuilding
# the main venv. With them, on any machine, no accelerator needed:
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
BASE=${VENV:-.venv}
if ! "$BASE/bin/python" -c "import mmr_jax, jax" 2>/dev/null; then
    echo "FATAL: the main venv $BASE is missing or incomplete; run scripts/setup_env.sh first" >&2
    exit 1
fi
BASE_SITE=$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
build() {  # build <venv> <jax extra>
    local venv=$1 extra=$2
    [ -x "$venv/bin/python" ] || "$PY" -m venv --without-pip "$venv"
    local site
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # addsitedir (not a bare path line) so the main venv's own .pth files run too: the
    # editable install's finder is one of them.
    echo "import site; site.addsitedir('$(realpath "$BASE_SITE")')" > "$site/zz_main_venv.pth"
    "$venv/bin/python" -m pip install -q -c constraints/ci.txt -c constraints/aot.txt "jax[$extra]==$JAX"
    echo "environment ready: $venv (over $BASE)"
}
if [ "$WHICH" != gpu ]; then build "$DIR/.venv-aot-tpu" tpu; fi
if [ "$WHICH" != tpu ]; then build "$DIR/.venv-aot-gpu" cuda12; fi
