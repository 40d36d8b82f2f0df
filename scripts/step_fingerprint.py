"""The first steps' figures of the CPU default and of each variant's smoke, to compare two trees.

Each case trains a few steps in a fresh workdir (`scripts/train.py`) and keeps, per step, every
metric that is not a clock reading (loss, reward/mean, mmr/lambda_mean, grad_norm, ...), at full
float precision as `metrics.jsonl` stores them. A refactor that must not change the numbers
compares its figures with those of the commit before (`--compare`): bit-identical or it fails.

    python scripts/step_fingerprint.py --out=/tmp/after.json \\
        --compare=docs/step_fingerprint_before.json            # every case
    python scripts/step_fingerprint.py --cases=cpu_default,cpu_default_2proc --out=/tmp/x.json
    python scripts/step_fingerprint.py --figures=/tmp/x.json \\
        --compare=docs/step_fingerprint_before.json            # compare figures already taken
    git worktree add /tmp/before f014d83^ && ln -s "$PWD/checkpoints" /tmp/before/
    python scripts/step_fingerprint.py --repo=/tmp/before --out=/tmp/before.json  # that tree's
                                                  # scripts/train.py, this script's cases

Cases: the CPU default (configs/cpu_smollm2.py) on one process and on a two-process cluster on
this machine, and the `:smoke` of GRPO, MMR, DRA, Dr.GRPO, DAPO, GSPO, CISPO, RLOO and the
one-step off-policy loop. The smokes run today's `:smoke` task in any tree (`_smoke_task`).

A figure differs either unexplained (exit code 1) or as INTENDED lists it: a reported figure that
another issue changed on purpose, with the reason; never a figure of the step itself (INVARIANT).
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


def _new_keys() -> bool:
    """Whether this tree names the reweighting `reweight.*` (from f014d83) rather than `mmr.*`."""
    return "c.reweight.method" in (REPO / "configs" / "base.py").read_text()


def _reweight(method: str) -> list[str]:
    """The override choosing `method` ('mmr' | 'dra') in this tree's config keys."""
    if _new_keys():
        return [f"--config.reweight.method={method}"]
    return [f"--config.{method}.enabled=True"]


def _smoke_task() -> list[str]:
    """Today's `:smoke` task spelled out, so that a tree from before it ran today's smoke.

    Between f014d83^ and a9132c2 (issue 55) `:smoke` changed from GSM8K with the format and cosine
    rewards and the hashing encoder to the CPU default's task (configs/base.py `cpu_task`): in
    today's tree these overrides are its `:smoke` values (no-ops); in an older one they make its
    `:smoke` today's. Today's task is the better fingerprint: rewards vary within a group, so
    the advantages, lambda and gradients are not all zero as they were on GSM8K at 32 tokens."""
    encoder = "reweight" if _new_keys() else "mmr"
    return [
        "--config.data.source=arithmetic",
        "--config.data.arithmetic_max_operand=10",
        "--config.data.arithmetic_ops=('+',)",
        "--config.data.system_prompt=Answer in one short sentence: 'The answer is N.'",
        "--config.rewards.weights.accuracy=1.0",
        "--config.rewards.weights.format=0.0",
        "--config.rewards.weights.cosine=0.0",
        "--config.rewards.accuracy_number_only=True",
        f"--config.{encoder}.embedding_model=minilm",
        "--config.batch.max_prompt_len=64",
        "--config.dynamic_sampling.max_generation_batches=4",
    ]


def cases() -> dict[str, tuple[str, list[str], int]]:
    """name -> (config, overrides, processes)."""
    smoke = lambda name: f"configs/{name}.py:smoke"
    task = _smoke_task()
    # Since a9132c2 (issue 55) the CPU default holds 32 sums out of training for its evaluation
    # (eval.source='arithmetic'): the benchmarks' source, as before it, trains on every sum.
    cpu = ["--config.eval.source=benchmarks"]
    return {
        "cpu_default": ("configs/cpu_smollm2.py", cpu, 1),
        "cpu_default_2proc": ("configs/cpu_smollm2.py", cpu, 2),
        "grpo": (smoke("grpo"), task, 1),
        "mmr": (smoke("grpo"), [*task, *_reweight("mmr")], 1),
        "dra": (smoke("grpo"), [*task, *_reweight("dra")], 1),
        "dr_grpo": (smoke("dr_grpo"), task, 1),
        "dapo": (smoke("dapo"), task, 1),
        "gspo": (smoke("gspo"), task, 1),
        "cispo": (smoke("cispo"), task, 1),
        "rloo": (smoke("grpo"), [*task, "--config.advantage.estimator=rloo"], 1),
        "off_policy": (smoke("grpo"), [*task, "--config.rollout.off_policy_lag=1"], 1),
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
        "--config.eval.at_start=False",  # the CPU default's held-out evaluation: not a step
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


# Figures of the before tree that another issue changed on purpose: (case or "*", key) -> why.
# Only what a run reports may be listed; a difference in a figure of the step itself (INVARIANT)
# fails whatever this table says. Each entry names the commit whose change it is.
_FILLER = "edb05c1 (issue 55): DAPO's filler groups leave the loss through their own mask"
INTENDED: dict[tuple[str, str], str] = {
    # Before, a filler group left the loss by having its completions marked invalid: it counted
    # as an invalid gold answer and as a group without reward variance. Now its gold stays valid.
    ("dapo", "groups/invalid_gold_frac"): f"{_FILLER}; counts only gold answers that do not parse",
    ("dapo", "groups/filter_zero_variance_frac"): f"{_FILLER}; over their real rewards",
    ("dapo", "dynamic_sampling/filler_frac"): f"{_FILLER}; new: the share of filler groups",
}
INVARIANT = frozenset({"loss", "grad_norm", "mmr/lambda_mean", "kl", "entropy", "lr"})
assert not {key for _, key in INTENDED} & INVARIANT, "a step figure cannot be an intended change"


def compare(before: dict, after: dict) -> tuple[list[str], list[str]]:
    """(unexplained, intended): a line for each figure of a case in both that is not bit-identical.

    Intended lines are those INTENDED names for the case (or every case), with the reason."""
    unexplained, intended = [], []
    for name in sorted(set(before) & set(after)):
        b, a = before[name], after[name]
        if len(b) != len(a):
            unexplained.append(f"{name}: {len(b)} steps before, {len(a)} after")
        for sb, sa in zip(b, a, strict=False):
            for key in sorted(set(sb) | set(sa)):
                if sb.get(key, "absent") == sa.get(key, "absent"):
                    continue
                line = f"{name} step {sb.get('step')} {key}: {sb.get(key, 'absent')!r} -> "
                line += repr(sa.get(key, "absent"))
                why = INTENDED.get((name, key)) or INTENDED.get(("*", key))
                if why and key not in INVARIANT:
                    intended.append(f"{line}  [intended: {why}]")
                else:
                    unexplained.append(line)
    return unexplained, intended


def main(argv=None) -> int:
    global REPO
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="", help="JSON file of the figures")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cases", default="", help="comma-separated names (default: all)")
    parser.add_argument("--compare", default="", help="a JSON of this script to compare with")
    parser.add_argument(
        "--figures", default="", help="compare this JSON of the script instead of running cases"
    )
    parser.add_argument(
        "--repo", default=str(REPO), help="the tree whose scripts/train.py runs (default: this one)"
    )
    args = parser.parse_args(argv)
    if not args.out and not args.figures:
        parser.error("--out (the figures to write) or --figures (the figures to compare)")
    REPO = pathlib.Path(args.repo).resolve()
    table = cases()
    names = [n for n in args.cases.split(",") if n] or list(table)
    result = json.loads(pathlib.Path(args.figures).read_text()) if args.figures else {}
    for name in [] if args.figures else names:
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
        before = json.loads(pathlib.Path(args.compare).read_text())
        unexplained, intended = compare(before, result)
        print("\n".join(intended + unexplained))
        both = sorted(set(before) & set(result))
        print(
            f"{len(both)} cases compared with {args.compare} ({', '.join(both)}): "
            f"{len(unexplained)} figures differ unexplained, {len(intended)} as intended"
        )
        return 1 if unexplained else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
