#!/usr/bin/env bash
# The prepared GPU check (issue 45): every GPU figure from two device calls of at most 5 minutes
# each, one JSON per measurement in $OUT written as it goes, one summary.json, going on after a
# failure. docs/performance.md ("The prepared GPU check").
#
#   bash scripts/gpu_check.sh --fetch_wheels   # HERE, once: the 4 wheels the GPU image lacks -> .whl/
#   bash scripts/gpu_check.sh --run=A          # ON THE GPU MACHINE (with .whl/), then --run=B
#   bash scripts/gpu_check.sh --run=B --only=rl_step       # some steps of a run
#   bash scripts/gpu_check.sh --cpu_smoke      # here: both runs' steps at tiny shapes on CPU
#
# The two device calls, each a copy of this checkout with its .whl/ folder on the GPU machine, $OUT
# set to an empty results folder, and a 300-s limit (a machine's start-up comes on top):
#   bash scripts/gpu_check.sh --run=A    # limit 300 s
#   bash scripts/gpu_check.sh --run=B    # limit 300 s
# Each run's steps have limits that add up to at most 270 s of its TOTAL_S=285 s (the wheels'
# install, ~5 s, counts in it; 15 s are left before the call's 300 s for the summary); a step
# gets min(its limit, what is left), and one with under 20 s left is skipped.
#
# Run A (compile-only against the device, the attention and the step's kernels, the decode step):
#   aot_vs_device 40 s  benchmarks/aot_vs_device.py: the 1.5B's train step at 1024-token
#                     completions (then its decode step, if time is left) compiled for this GPU
#                     and deviceless from XLA's spec of the same card (third_party/xla_gpu_specs),
#                     XLA's memory analysis of both side by side: how far `--dry_run_target`'s
#                     figures hold (issue 52)
#   gpu_tests  60 s   pytest -m gpu: cuDNN's two forms against XLA at the 1.5B's attention and our
#                     structure (odd T, padding, packed segments, prompt-then-causal), what 'auto'
#                     picks, the decode step's HLO and values (pass/fail lines in gpu_check.log)
#   peer_1024  135 s  benchmarks/peer_step.py, configs/grpo.py:1.5b at 1024-token completions:
#                     torch without checkpointing (the peer's best; 40 s), then ours (85 s) with
#                     the jax.profiler kernel table (profile.json)
#   decode     35 s   benchmarks/bench_gpu.py --programs=decode: one decode step of the 1.5B,
#                     48 rows, caches for 512 + 1024 tokens
# Run B (the whole RL step, the long completions, the 7B):
#   rl_step    95 s   benchmarks/rl_step.py: scripts/train.py, configs/grpo.py:1.5b,
#                     model.init=random, 1024-token completions, the embedded engine, 2 steps,
#                     every phase per step; no checkpoint (checkpoint.at_end=False)
#   peer_3584  175 s  peer_step.py at the config's own 3584-token completions: torch (40 s), then
#                     ours (125 s; its compile was ~2 min on 2026-11-26)
#   lora_7b    rest   bench_gpu.py --programs=train on configs/grpo_7b.py at its full shape: what
#                     rl_step and peer_3584 leave (its compile took 251 s on 2026-11-26's code,
#                     so it finishes only if those end early; its JSON keeps the compile time
#                     and XLA's memory as soon as they are known). Alone: --run=B --only=lora_7b.
# Files in $OUT (at most 8 a call, so that all of them come back): A: gpu_check.log, summary.json,
# aot_vs_device.json, peer_1024.json, profile.json, decode.json; B: gpu_check.log, summary.json, rl_step.json,
# peer_3584.json, lora_7b.json.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

SMOKE=0
ONLY=""
RUN=""
for arg in "$@"; do
  case "$arg" in
    --fetch_wheels)
      mkdir -p .whl
      # Pure-Python wheels, pinned as constraints/ci.txt pins them; .whl/ is gitignored. The image
      # has pytest, hypothesis, absl, sympy, PyYAML: only these four are missing.
      exec python3 -m pip download --no-deps --only-binary=:all: -d .whl \
        ml_collections==1.1.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0 \
        antlr4-python3-runtime==4.13.2 ;;
    --cpu_smoke) SMOKE=1 ;;
    --run=A | --run=B) RUN="${arg#--run=}" ;;
    --only=*) ONLY="${arg#--only=}" ;;
    *) echo "unknown argument $arg" >&2; exit 2 ;;
  esac
done
if [ "$SMOKE" = 0 ] && [ -z "$RUN" ]; then
  echo "choose --run=A or --run=B (or --cpu_smoke)" >&2
  exit 2
fi

START=$(date +%s)
if [ "$SMOKE" = 1 ]; then
  OUT="${OUT:-/tmp/gpu_check_smoke}"
  PY="${PYTHON:-$REPO/.venv/bin/python}"
  TOTAL_S="${TOTAL_S:-1800}"
  RUNS="${RUN:-AB}"
  export JAX_PLATFORMS=cpu
else
  : "${OUT:?set OUT to an empty results folder}"
  PY="${PYTHON:-python3}"
  TOTAL_S="${TOTAL_S:-285}"
  RUNS="$RUN"
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || echo "wheel install failed" >&2
  else
    echo "no .whl/ (bash scripts/gpu_check.sh --fetch_wheels first, and copy .whl/ along)" >&2
  fi
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
exec > >(tee -a "$LOG") 2>&1
STATUS=()

wanted() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }

# The summary, rewritten after every step (a run stopped from outside keeps the steps before).
summary() {
  "$PY" - "$OUT/summary.json" "$SMOKE" "$RUNS" "$(( $(date +%s) - START ))" "${STATUS[@]}" <<'EOF'
import json, os, subprocess, sys, importlib.metadata as md
path, smoke, runs, seconds, *status = sys.argv[1:]
steps = {}
for s in status:
    name, state, rc, secs = s.split()
    steps[name] = {"status": state, "exit": int(rc), "seconds": int(secs)}
    f = os.path.join(os.path.dirname(path), name + ".json")
    steps[name]["json"] = os.path.basename(f) if os.path.exists(f) else None
versions = {}
for p in ("jax", "jaxlib", "flax", "torch", "transformers", "ml_collections", "math-verify"):
    try:
        versions[p] = md.version(p)
    except md.PackageNotFoundError:
        versions[p] = None
try:
    gpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip()
except OSError:
    gpu = None
summary = {"cpu_smoke": smoke == "1", "runs": runs, "seconds": int(seconds), "gpu": gpu,
           "versions": versions, "steps": steps}
tmp = path + ".tmp"
open(tmp, "w").write(json.dumps(summary, indent=1))
os.replace(tmp, path)
EOF
}

# step NAME LIMIT_S COMMAND...: runs COMMAND under min(LIMIT_S, what is left of TOTAL_S).
step() {
  local name=$1 limit=$2; shift 2
  wanted "$name" || return 0
  local left=$(( TOTAL_S - ($(date +%s) - START) ))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 20 ]; then
    echo "=== $name: skipped, ${left}s left of ${TOTAL_S}s"
    STATUS+=("$name skipped 0 0")
    summary
    return 0
  fi
  echo "=== $name (limit ${limit}s) $(date -u +%H:%M:%S): $*"
  local t0=$(date +%s)
  LIMIT="$limit" timeout -k 5 "$limit" "$@"
  local rc=$? secs=$(( $(date +%s) - t0 ))
  local what=ok
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && what=timed_out
  [ "$what" = ok ] && [ "$rc" != 0 ] && what=failed
  echo "=== $name: $what (exit $rc) in ${secs}s"
  STATUS+=("$name $what $rc $secs")
  summary
}

if [ "$SMOKE" = 1 ]; then
  # A 2-layer Qwen2 (peer_step's TINY_ARCH) for every step: the same programs and flags, seconds.
  TINY=$(mktemp -d)/tiny
  "$PY" - "$TINY" <<'EOF'
import json, os, sys
sys.path.insert(0, "benchmarks")
from peer_step import TINY_ARCH
base = json.load(open("third_party/hf_configs/deepseek_r1_distill_qwen_1_5b.json"))
os.makedirs(sys.argv[1])
json.dump({**base, **TINY_ARCH, "max_position_embeddings": 2048}, open(os.path.join(sys.argv[1], "config.json"), "w"))
EOF
  PEER=(--cpu_smoke --steps=1 --warmup=0)
  TINY_SET=(--set=model.path="$TINY" --set=model.dtype=float32 --set=model.remat=none
    --set=batch.prompts=2 --set=batch.generations=2 --set=batch.max_prompt_len=16
    --set=loss.minibatches=2)
  CFG15=(--configs=configs/grpo.py:1.5b "${TINY_SET[@]}")
  CFG7=(--configs=configs/grpo_7b.py "${TINY_SET[@]}" --set=batch.max_completion_len=16)
  T1024=16 T3584=(--set=batch.max_completion_len=24)
  DECODE_STEPS=2
  # the tiny vocabulary's byte-level tokenizer makes the system prompt ~540 tokens: prompts of 768
  RL=(--config=configs/grpo.py:1.5b,smoke --steps=1 --set=model.path="$TINY"
    --set=batch.max_completion_len=16 --set=batch.max_prompt_len=768)
  L_TESTS=120 L_PEER=300 L_DECODE=200 L_RL=300 L_PEER2=300 L_AOT=300
  AOT=(--cpu_smoke --configs=configs/grpo.py:1.5b "${TINY_SET[@]}"
    --set=batch.max_completion_len="$T1024")
  TIMEOUTS_A="" TIMEOUTS_B=""
  TESTS_MODE=(--collect-only)  # here: only that they are collected under -m gpu
else
  PEER=(--config=configs/grpo.py:1.5b --steps=2 --warmup=0)
  CFG15=(--configs=configs/grpo.py:1.5b)
  CFG7=(--configs=configs/grpo_7b.py)
  T1024=1024 T3584=()
  DECODE_STEPS=10
  RL=(--config=configs/grpo.py:1.5b --steps=2 --set=batch.max_completion_len=1024)
  L_TESTS=60 L_PEER=135 L_DECODE=35 L_RL=95 L_PEER2=175 L_AOT=40
  AOT=(--configs=configs/grpo.py:1.5b --set=batch.max_completion_len="$T1024")
  TIMEOUTS_A="torch=40,ours=85" TIMEOUTS_B="torch=40,ours=125"
  TESTS_MODE=()
fi

if [[ "$RUNS" == *A* ]]; then
  # First: the same programs compiled for this GPU and deviceless (how far a dry run holds).
  step aot_vs_device "$L_AOT" "$PY" benchmarks/aot_vs_device.py "${AOT[@]}" \
    --json="$OUT/aot_vs_device.json"

  # The GPU-only parity tests (skipped on CPU, so they run only here).
  step gpu_tests "$L_TESTS" "$PY" -m pytest -m gpu -q -p no:cacheprovider -o addopts="" \
    "${TESTS_MODE[@]}" tests/models/attention_impl_test.py tests/models/attention_probe_test.py \
    tests/rollout/decode_inplace_test.py

  step peer_1024 "$L_PEER" "$PY" benchmarks/peer_step.py "${PEER[@]}" \
    --set=batch.max_completion_len="$T1024" --sides=torch,ours --side_timeouts="$TIMEOUTS_A" \
    --profile=/tmp/gpu_check_trace --profile_json="$OUT/profile.json" --json="$OUT/peer_1024.json"

  step decode "$L_DECODE" "$PY" benchmarks/bench_gpu.py "${CFG15[@]}" --programs=decode \
    --steps="$DECODE_STEPS" --set=batch.max_completion_len="$T1024" --json="$OUT/decode.json"
fi

if [[ "$RUNS" == *B* ]]; then
  # rl_step stops its trainer 5 s before its limit and writes what it measured.
  step rl_step "$L_RL" bash -c 'exec "$@" --timeout_s=$((LIMIT - 5))' _ \
    "$PY" benchmarks/rl_step.py "${RL[@]}" --json="$OUT/rl_step.json"

  step peer_3584 "$L_PEER2" "$PY" benchmarks/peer_step.py "${PEER[@]}" "${T3584[@]}" \
    --sides=torch,ours --side_timeouts="$TIMEOUTS_B" --json="$OUT/peer_3584.json"

  step lora_7b 270 "$PY" benchmarks/bench_gpu.py "${CFG7[@]}" --programs=train --steps=1 \
    --json="$OUT/lora_7b.json"
fi

summary
cat "$OUT/summary.json"
echo
echo "=== done in $(( $(date +%s) - START ))s"
