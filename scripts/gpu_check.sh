#!/usr/bin/env bash
# The prepared GPU check (issues 34 and 35): one command for a session with a lent GPU, under 8
# minutes, one JSON per measurement in $OUT, going on after a failure. docs/performance.md.
#
#   bash scripts/gpu_check.sh --fetch_wheels   # HERE, once: the wheels the lent image lacks -> .whl/
#   bash scripts/gpu_check.sh                  # ON THE DEVICE (carry .whl): every step, in order
#   bash scripts/gpu_check.sh --only=peer_1024,decode    # some steps
#   bash scripts/gpu_check.sh --cpu_smoke      # here: every step at tiny shapes on CPU (OUT=/tmp/..)
#
# The device call: run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540).
# Steps, in priority order, each with its own time limit, cut to what is left of TOTAL_S:
#   gpu_tests  pytest -m gpu on the attention and decode parity tests (output in gpu_check.log)
#   peer_1024  benchmarks/peer_step.py, configs/grpo.py:1.5b at 1024-token completions: ours,
#              torch with and without checkpointing; plus the jax.profiler kernel table
#              (profile.json)
#   decode     benchmarks/bench_gpu.py --programs=decode: one decode step of the 1.5B, 48 rows,
#              caches for 512 + 1024 tokens
#   rl_step    benchmarks/rl_step.py: scripts/train.py, configs/grpo.py:1.5b, model.init=random,
#              1024-token completions, the embedded engine, 2 steps: every phase per step
#   peer_3584  peer_step.py at the config's own 3584-token completions: torch without
#              checkpointing (the peer's best), then ours
#   lora_7b    bench_gpu.py --programs=train on configs/grpo_7b.py at its full shape (at
#              2026-11-26's speed, 251 s compile + 2 x 49 s: run it alone with --only=lora_7b)
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

SMOKE=0
ONLY=""
for arg in "$@"; do
  case "$arg" in
    --fetch_wheels)
      mkdir -p .whl
      # Pure-Python wheels, pinned as constraints/ci.txt pins them; .whl/ is gitignored.
      exec python3 -m pip download --no-deps --only-binary=:all: -d .whl \
        ml_collections==1.1.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0 \
        antlr4-python3-runtime==4.13.2 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 \
        hypothesis==6.170.15 sortedcontainers==2.4.0 ;;
    --cpu_smoke) SMOKE=1 ;;
    --only=*) ONLY="${arg#--only=}" ;;
    *) echo "unknown argument $arg" >&2; exit 2 ;;
  esac
done

if [ "$SMOKE" = 1 ]; then
  OUT="${OUT:-/tmp/gpu_check_smoke}"
  PY="${PYTHON:-$REPO/.venv/bin/python}"
  TOTAL_S="${TOTAL_S:-3600}"
  export JAX_PLATFORMS=cpu
else
  : "${OUT:?set OUT (the device tool sets it)}"
  PY="${PYTHON:-python3}"
  TOTAL_S="${TOTAL_S:-465}"  # the steps' share of the 8 minutes (the wheels' install apart)
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || echo "wheel install failed" >&2
  else
    echo "no .whl/ (bash scripts/gpu_check.sh --fetch_wheels here, then carry .whl)" >&2
  fi
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
exec > >(tee -a "$LOG") 2>&1
START=$(date +%s)
STATUS=()

wanted() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }

# step NAME LIMIT_S COMMAND...: runs COMMAND under min(LIMIT_S, what is left of TOTAL_S).
step() {
  local name=$1 limit=$2; shift 2
  wanted "$name" || return 0
  local left=$(( TOTAL_S - ($(date +%s) - START) ))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 20 ]; then
    echo "=== $name: skipped, ${left}s left of ${TOTAL_S}s"
    STATUS+=("$name skipped 0 0")
    return 0
  fi
  echo "=== $name (limit ${limit}s) $(date -u +%H:%M:%S): $*"
  local t0=$(date +%s)
  timeout -k 10 "$limit" "$@"
  local rc=$? secs=$(( $(date +%s) - t0 ))
  local what=ok
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && what=timed_out
  [ "$what" = ok ] && [ "$rc" != 0 ] && what=failed
  echo "=== $name: $what (exit $rc) in ${secs}s"
  STATUS+=("$name $what $rc $secs")
}

if [ "$SMOKE" = 1 ]; then
  PEER=(--cpu_smoke --steps=1 --warmup=0)
  CFG15="configs/cpu_smollm2.py"  # SmolLM2-135M's shapes (bench_gpu's --configs is a comma list)
  CFG7="configs/cpu_smollm2.py --set=lora.enabled=True"  # LoRA, as the 7B
  T1024=(--set=batch.max_completion_len=32)
  T3584=(--set=batch.max_completion_len=48)
  CFG_RL="configs/grpo.py:1.5b,smoke"  # the 1.5B config shrunk to SmolLM2's architecture
  # 512 prompt tokens: the built byte-level tokenizer makes the system prompt ~370 tokens long
  RL_SET=(--steps=1 --set=batch.max_completion_len=32 --set=batch.max_prompt_len=512)
  L=(1200 600 1200 1200 900)
else
  PEER=(--config=configs/grpo.py:1.5b --steps=2 --warmup=0)
  CFG15="configs/grpo.py:1.5b"
  CFG7="configs/grpo_7b.py"
  T1024=(--set=batch.max_completion_len=1024)
  T3584=()
  CFG_RL="configs/grpo.py:1.5b"
  RL_SET=(--steps=2 --set=batch.max_completion_len=1024)
  L=(150 50 150 300 560)  # peer_3584 and lora_7b get what is left of TOTAL_S
fi

# The GPU-only parity tests (cuDNN attention against XLA's, the bf16 decode step's HLO and values):
# skipped on CPU, so they run only here. Their pass/fail lines go to gpu_check.log.
if [ "$SMOKE" = 0 ]; then
  step gpu_tests 90 "$PY" -m pytest -m gpu -q -p no:cacheprovider -o addopts="" \
    tests/decode_inplace_test.py tests/attention_impl_test.py
fi

step peer_1024 "${L[0]}" "$PY" benchmarks/peer_step.py "${PEER[@]}" "${T1024[@]}" \
  --profile=/tmp/gpu_check_trace --profile_json="$OUT/profile.json" --json="$OUT/peer_1024.json"

step decode "${L[1]}" "$PY" benchmarks/bench_gpu.py --configs="$CFG15" --programs=decode \
  --steps=10 --set=batch.max_completion_len="${T1024[0]##*=}" --json="$OUT/decode.json"

step rl_step "${L[2]}" "$PY" benchmarks/rl_step.py --config="$CFG_RL" "${RL_SET[@]}" \
  --json="$OUT/rl_step.json"

step peer_3584 "${L[3]}" "$PY" benchmarks/peer_step.py "${PEER[@]}" "${T3584[@]}" \
  --sides=torch,ours --json="$OUT/peer_3584.json"  # the peer first: ours compiles ~2 min

# shellcheck disable=SC2086  # CFG7 holds a config and, in the smoke, its override
step lora_7b "${L[4]}" "$PY" benchmarks/bench_gpu.py --configs=$CFG7 --programs=train \
  --steps=1 --json="$OUT/lora_7b.json"

"$PY" - "$OUT/summary.json" "$SMOKE" "${STATUS[@]}" <<'EOF'
import json, subprocess, sys, importlib.metadata as md
steps = {}
for s in sys.argv[3:]:
    name, status, rc, secs = s.split()
    steps[name] = {"status": status, "exit": int(rc), "seconds": int(secs)}
versions = {}
for p in ("jax", "jaxlib", "flax", "torch", "transformers", "ml_collections"):
    try:
        versions[p] = md.version(p)
    except md.PackageNotFoundError:
        versions[p] = None
try:
    gpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip()
except OSError:
    gpu = None
summary = {"cpu_smoke": sys.argv[2] == "1", "gpu": gpu, "versions": versions, "steps": steps}
open(sys.argv[1], "w").write(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
EOF
echo "=== done in $(( $(date +%s) - START ))s"
