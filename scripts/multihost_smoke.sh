#!/usr/bin/env bash
# Two-process smoke test of fail-fast (docs/multihost.md): process 1 raises an ordinary Python
# exception in step 2's update (MMR_JAX_RAISE_AT=train:2); both processes must stop within
# LIMIT_S seconds, process 1 with its own error (exit 1), process 0 with PeerLostError naming it
# (exit 3), instead of waiting in JAX's exit barrier.
#
#   scripts/multihost_smoke.sh local                 # both processes on this machine (CPU)
#   # two nodes, node0 at 10.0.0.1 (a shared WORKDIR), run on each with its rank:
#   COORDINATOR=10.0.0.1:1234 scripts/multihost_smoke.sh node 0
#   COORDINATOR=10.0.0.1:1234 scripts/multihost_smoke.sh node 1
#
# CONFIG (default configs/cpu_smollm2.py:smoke), WORKDIR (default a fresh temporary folder;
# on two nodes give one both can read), LIMIT_S (default 120), HEARTBEAT_S (default 30),
# PYTHON (default python).
set -u
cd "$(dirname "$0")/.."
CONFIG=${CONFIG:-configs/cpu_smollm2.py:smoke}
WORKDIR=${WORKDIR:-$(mktemp -d)/run}
LIMIT_S=${LIMIT_S:-120}
HEARTBEAT_S=${HEARTBEAT_S:-30}  # raise it on a loaded machine (a starved process looks dead)
PYTHON=${PYTHON:-python}
mode=${1:-local}

run() {  # run <process id> <coordinator>: one process of the run, its output to WORKDIR.p<id>.out
  local env_fault=()
  [ "$1" = 1 ] && env_fault=(MMR_JAX_RAISE_AT=train:2)
  env "${env_fault[@]}" MMR_JAX_COMPILE_CACHE=off "$PYTHON" scripts/train.py \
    --config="$CONFIG" --workdir="$WORKDIR" --config.total_steps=4 \
    --coordinator_address="$2" --num_processes=2 --process_id="$1" \
    --distributed_heartbeat_s="$HEARTBEAT_S" \
    > "$WORKDIR.p$1.out" 2>&1
}

check() {  # check <process id> <exit code>
  local want want_text
  if [ "$1" = 1 ]; then want=1; want_text="ERROR: InjectedFault"; else want=3; want_text="process 1 failed: InjectedFault"; fi
  if [ "$2" = "$want" ] && grep -q "$want_text" "$WORKDIR.p$1.out"; then
    echo "process $1: PASS (exit $2, '$want_text')"
  else
    echo "process $1: FAIL (exit $2, want $want and '$want_text'; see $WORKDIR.p$1.out)"; return 1
  fi
}

mkdir -p "$(dirname "$WORKDIR")"
fault_then_exit() {  # waits for the fault in process 1's log, then times the exits
  local pids=("$@") t0
  until grep -qs "injecting a fault" "$WORKDIR/train.process1.log" "$WORKDIR/train.log"; do
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null || break 2; done
    sleep 1
  done
  t0=$(date +%s)
  for p in "${pids[@]}"; do
    while kill -0 "$p" 2>/dev/null; do
      if [ $(( $(date +%s) - t0 )) -gt "$LIMIT_S" ]; then
        echo "FAIL: process still running $LIMIT_S s after the fault"; kill "${pids[@]}" 2>/dev/null; return 1
      fi
      sleep 1
    done
  done
  echo "every local process exited $(( $(date +%s) - t0 )) s after the fault"
}

if [ "$mode" = local ]; then
  port=$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("localhost", 0)); print(s.getsockname()[1])')
  export JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=1
  run 0 "localhost:$port" & p0=$!
  run 1 "localhost:$port" & p1=$!
  fault_then_exit "$p0" "$p1"; ok=$?
  wait "$p0"; c0=$?; wait "$p1"; c1=$?
  check 0 "$c0" && check 1 "$c1" && [ "$ok" = 0 ]
elif [ "$mode" = node ]; then
  rank=${2:?give the process id, 0 or 1}
  run "$rank" "${COORDINATOR:?set COORDINATOR=HOST:PORT of node 0}" & p=$!
  fault_then_exit "$p"; ok=$?
  wait "$p"; c=$?
  check "$rank" "$c" && [ "$ok" = 0 ]
else
  echo "usage: $0 local | node <0|1>"; exit 2
fi
