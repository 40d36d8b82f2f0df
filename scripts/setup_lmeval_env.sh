#!/usr/bin/env bash
# Creates lm-eval's own venv (default .venv-lmeval, or $LMEVAL_VENV), apart from the trainer's .venv
# and the vLLM server's .venv-vllm: lm_eval 0.4.13 with its `api` extra (the local-completions and
# local-chat-completions models) and transformers for its tokenizer, pinned by constraints/lmeval.txt.
# No torch: lm-eval only talks HTTP to a server. tests/serving/lm_eval_test.py runs its `lm_eval`.
# Apart from .venv because lm_eval's dependencies (pytablewriter: typepy<2) do not resolve against
# constraints/ci.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LMEVAL_VENV:-.venv-lmeval}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q -c constraints/lmeval.txt 'lm_eval[api]==0.4.13' transformers
"$VENV/bin/lm_eval" --help >/dev/null
"$VENV/bin/python" -c "import lm_eval, transformers; print('lm_eval', lm_eval.__version__, 'transformers', transformers.__version__)"
echo "lm-eval environment ready: $VENV"
