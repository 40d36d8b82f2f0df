"""The first steps' figures of the CPU default and of each variant's smoke, to compare two trees.

Each case trains a few steps in a fresh workdir (`scripts/train.py`) and keeps, per step, every
metric that is not a clock reading (loss, reward/mean, mmr/lambda_mean, grad_norm, ...), at full
float precision as `metrics.jsonl` stores them. A refactor that must not change the numbers
compares its figures with those of the commit before (`--compare`): bit-identical or it fails.

    python scripts/step_fingerprint.py --out=/tmp/after.json \\
        --compare=docs/step_fingerprint_before.json            # every case
    python scripts/step_fingerprint.py --cases=cpu_default,cpu_default_2proc --out=/tmp/x.json

Cases: the CPU default (configs/cpu_smollm2.py) on one process and on a two-process cluster on
this machine, and the `:smoke` of GRPO, MMR, DRA, Dr.GRPO, DAPO, GSPO, CISPO, RLOO and the
one-step off-policy loop.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]  # --repo runs another tree's train.py
CLOCK_PREFIXES = ("time/", "throughput/")  # seconds and rates: differ from run to run


def _reweight(method: str) -> list[str]:
    """The override choosing `method` ('mmr' | 'dra') in this tree's config keys."""
    base = (REPO / "configs" / "base.py").read_text()
    if "c.reweight.method" in base:
        return [f"--config.reweight.method={method}"]
    return [f"--config.{method}.enabled=True"]


def cases() -> dict[str, tuple[str, list[str], int]]:
    """name -> (config, overrides, processes)."""
    smoke = lambda name: f"configs/{name}.py:smoke"
    return {
        "cpu_default": ("configs/cpu_smollm2.py", [], 1),
        "cpu_default_2proc": ("configs/cpu_smollm2.py", [], 2),
        "grpo": (smoke("grpo"), [], 1),
        "mmr": (smoke("grpo"), _reweight("mmr"), 1),
        "dra": (smoke("grpo"), _reweight("dra"), 1),
        "dr_grpo": (smoke("dr_grpo"), [], 1),
        "dapo": (smoke("dapo"), [], 1),
        "gspo": (smoke("gspo"), [], 1),
        "cispo": (smoke("cispo"), [], 1),
        "rloo": (smoke("grpo"), ["--config.advantage.estimator=rloo"], 1),
        "off_policy": (smoke("grpo"), ["--config.rollout.off_policy_lag=1"], 1),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_case(config: str, overrides: list[str], processes: int, steps: int) -> list[dict]:
    """Per step, the metrics of `steps` steps of `config` (process 0's on a cluster)."""
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="fingerprint_")) / "run"
    cmd = [
        sys.executable,
        "scripts/train.py",
        f"--config={config}",
        f"--workdir={workdir}",
        f"--config.total_steps={steps}",
        "--config.checkpoint.every=1000",
        "--config.checkpoint.at_end=False",
        "--config.logging.every=1",
        "--config.logging.samples=0",
        "--config.eval.every=0",
        *overrides,
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if processes == 1:
        procs = [subprocess.Popen(cmd, cwd=REPO, env=env)]
    else:
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
        port = _free_port()
        procs = [
            subprocess.Popen(
                [
                    *cmd,
                    f"--coordinator_address=localhost:{port}",
                    f"--num_processes={processes}",
                    f"--process_id={i}",
                ],
                cwd=REPO,
                env=env,
                stdout=subprocess.DEVNULL if i else None,
            )
            for i in range(processes)
        ]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"{config} {overrides}: exit codes {codes}; see {workdir}/train.log")
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(CLOCK_PREFIXES)} for r in rows]


def compare(before: dict, after: dict) -> list[str]:
    """Lines naming every figure of a case in both that is not bit-identical."""
    out = []
    for name in sorted(set(before) & set(after)):
        b, a = before[name], after[name]
        if len(b) != len(a):
            out.append(f"{name}: {len(b)} steps before, {len(a)} after")
        for sb, sa in zip(b, a, strict=False):
            for key in sorted(set(sb) | set(sa)):
                if sb.get(key) != sa.get(key):
                    out.append(
                        f"{name} step {sb.get('step')} {key}: {sb.get(key)!r} -> {sa.get(key)!r}"
                    )
    return out


def main(argv=None) -> int:
    global REPO
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file of the figures")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cases", default="", help="comma-separated names (default: all)")
    parser.add_argument("--compare", default="", help="a JSON of this script to compare with")
    parser.add_argument(
        "--repo", default=str(REPO), help="the tree whose scripts/train.py runs (default: this one)"
    )
    args = parser.parse_args(argv)
    REPO = pathlib.Path(args.repo).resolve()
    table = cases()
    names = [n for n in args.cases.split(",") if n] or list(table)
    result = {}
    for name in names:
        config, overrides, processes = table[name]
        t0 = time.perf_counter()
        result[name] = run_case(config, overrides, processes, args.steps)
        last = result[name][-1]
        print(
            f"{name}: {time.perf_counter() - t0:.0f} s; step {last['step']} loss {last['loss']!r} "
            f"reward {last['reward/mean']!r} lambda {last.get('mmr/lambda_mean')!r} "
            f"grad norm {last['grad_norm']!r}",
            flush=True,
        )
        # After every case: a run stopped part-way keeps the cases it finished.
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    if args.compare:
        diffs = compare(json.loads(pathlib.Path(args.compare).read_text()), result)
        print("\n".join(diffs) or f"bit-identical to {args.compare} ({len(result)} cases)")
        return 1 if diffs else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
