"""A study: a grid of training variants x seeds, each a normal `trainer.train` run, resumable.

Layout of a study folder:

    <folder>/study_config.json      the resolved study (every run's training config); a rerun with
                                    another config is refused, the differing keys named
    <folder>/<variant>_s<seed>/     one trainer workdir per run (run.json, checkpoints, metrics)
    <folder>/<variant>_s<seed>/study_run.json   written when the run ends: finished | diverged
    <folder>/study.json, report.md, curves.png  the aggregate (`reporting`)

The folder may be in a bucket (gs://, `run_paths`): every path here is an `epath.Path`. On
several hosts every run trains on all of them (`on_hosts`: `run_study(hosts=Hosts())`).

Re-running the same study skips runs with a `study_run.json`, and the trainer resumes an
interrupted run from its latest checkpoint. A run whose loss became non-finite is marked diverged
(rerunning it would diverge again: sampling is seeded) and reported as such.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import ml_collections

from mmr_jax.config import checks, schema
from mmr_jax.infra import console, metrics, run_paths, user_errors
from mmr_jax.training import checkpoint, workdir_guard

STUDY_FILE = "study_config.json"
RUN_FILE = "study_run.json"
EVAL_METRIC = "eval/average/pass@1"


class StudyMismatchError(user_errors.UserError, ValueError):
    """The study folder holds a study of another config."""


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One cell of the grid: its folder name, variant, seed and validated training config."""

    name: str
    variant: str
    seed: int
    cfg: schema.TrainConfig


def plain(tree) -> Any:
    """ConfigDict / tuples -> JSON-normal dicts and lists (the form stored and compared)."""
    if hasattr(tree, "to_dict"):
        tree = tree.to_dict()
    return json.loads(json.dumps(tree, default=str))


def _merge(node: ml_collections.ConfigDict, delta: Mapping, where: str) -> None:
    for key, value in delta.items():
        if key not in node:
            raise KeyError(
                f"variant delta {where}{key!r}: no such training key; have {sorted(node)}"
            )
        if isinstance(value, Mapping):
            _merge(node[key], value, f"{where}{key}.")
        else:
            node[key] = value


def train_config(study: ml_collections.ConfigDict, variant: str, seed: int):
    """The training ConfigDict of one run: `study.train` + the variant's delta + seed and name."""
    c = copy.deepcopy(study.train)
    c.unlock()
    _merge(c, plain(study.variants[variant]), "")
    c.seed = seed
    c.name = f"{study.name}/{variant}_s{seed}"
    return c


def plan(study: ml_collections.ConfigDict) -> list[RunSpec]:
    """The grid (variants in `study.run` order, then seeds), each config validated; checks the
    study-level keys a report needs."""
    missing = [v for v in (*study.run, *study.baselines) if v not in study.variants]
    if missing:
        raise ValueError(
            f"study names variants {sorted(set(missing))} not in variants {sorted(study.variants)}"
        )
    not_run = [v for pair in study.compare for v in pair if v not in study.run]
    if not_run:
        raise ValueError(f"study.compare names {sorted(set(not_run))}, not in study.run")
    if not study.seeds or len(set(study.seeds)) != len(study.seeds):
        raise ValueError(f"study.seeds={tuple(study.seeds)} must be non-empty and distinct")
    if not 0 < study.threshold <= 1:
        raise ValueError(f"study.threshold={study.threshold} must lie in (0, 1]")
    specs = []
    # Seed-major (grpo_s1, mmr_grpo_s1, ..., grpo_s2, ...): a study cut short holds whole seeds of
    # every variant, so its paired comparisons are usable at any point.
    for seed in study.seeds:
        for variant in study.run:
            cfg = checks.from_config_dict(train_config(study, variant, seed))
            if cfg.eval.every <= 0:
                raise ValueError("a study needs held-out evaluation: set train.eval.every > 0")
            if cfg.logging.every != 1:
                raise ValueError("a study sums time/step over steps: set train.logging.every = 1")
            specs.append(RunSpec(f"{variant}_s{seed}", variant, int(seed), cfg))
    return specs


def resolved(study: ml_collections.ConfigDict, specs: list[RunSpec]) -> dict:
    """What `study_config.json` stores: the study keys and every run's full training config."""
    keys = {k: v for k, v in plain(study).items() if k not in ("folder", "train", "variants")}
    return {"study": keys, "runs": {s.name: s.cfg.to_dict() for s in specs}}


def differences(old, new, where: str = "") -> list[str]:
    """'key: old -> new' for every leaf that differs between two JSON trees (paths dotted)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            path = f"{where}.{key}" if where else str(key)
            if key not in old:
                out.append(f"{path}: (absent) -> {new[key]!r}")
            elif key not in new:
                out.append(f"{path}: {old[key]!r} -> (absent)")
            else:
                out += differences(old[key], new[key], path)
        return out
    return [] if old == new else [f"{where}: {old!r} -> {new!r}"]


def check_folder(folder, stored: dict) -> None:
    """Writes `stored` as the folder's study config, or refuses a folder holding another one."""
    path = run_paths.as_path(folder) / STUDY_FILE
    stored = plain(stored)
    if path.exists():
        diff = differences(json.loads(path.read_text()), stored)
        if diff:
            shown = "; ".join(diff[:12]) + (f"; ... ({len(diff)} in all)" if len(diff) > 12 else "")
            raise StudyMismatchError(
                f"{folder} holds a study of another config (stored -> now): {shown}. "
                "Use another study.folder, or restore the config to resume this one."
            )
        return
    _write_json(path, stored)


def _write_json(path, obj) -> None:
    path = run_paths.as_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if run_paths.is_remote(path):  # an object is written whole: never torn
        path.write_text(json.dumps(obj, indent=1))
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)  # atomic: a killed study never leaves a torn marker


def run_status(folder, spec: RunSpec) -> dict | None:
    """The run's end marker ({'status': 'finished' | 'diverged', ...}) or None."""
    path = run_paths.as_path(folder) / spec.name / RUN_FILE
    return json.loads(path.read_text()) if path.exists() else None


def folder_view(folder, specs: list[RunSpec]) -> dict:
    """What a process sees of the study folder: the stored config's text (None without one) and
    each run's end status (None while it has not ended)."""
    path = run_paths.as_path(folder) / STUDY_FILE
    return {
        "config": path.read_text() if path.exists() else None,
        "ended": {s.name: (run_status(folder, s) or {}).get("status") for s in specs},
    }


def progress_line(done: int, total: int, current: str, finished_wall: list[float]) -> str:
    """'study: 2/9 runs done | now mmr_grpo_s1 | ETA 1h02m05s' (mean finished run x remaining)."""
    eta = "?"
    if finished_wall:
        eta = metrics.format_duration(sum(finished_wall) / len(finished_wall) * (total - done))
    return f"study: {done}/{total} runs done | now {current} | ETA {eta}"


def run_study(
    study: ml_collections.ConfigDict,
    *,
    train_fn: Callable | None = None,
    log: Callable[[str], None] = lambda s: console.info("%s", s),
    drop_checkpoints: bool = False,
    hosts=None,
) -> list[RunSpec]:
    """Runs (or resumes) every run of the grid in turn; returns the specs.

    `drop_checkpoints`: delete a run's checkpoints once its end marker is written. The report
    reads only each run's metrics, and the last checkpoint of every ended run would otherwise
    stay on disk (1.4 GB a SmolLM2 run, 42 GB for a 30-run study).
    `hosts`: this is one of the study's processes on several hosts, and `hosts` their agreements
    (`on_hosts.Hosts`; `train_fn` trains each run in a child that joins the run's cluster):
    the processes agree on the folder and on each run's outcome, and process 0 alone writes.
    """
    from mmr_jax.training import trainer

    train_fn = train_fn or trainer.train
    specs = plan(study)
    folder = run_paths.as_path(study.folder)
    stored = resolved(study, specs)
    if hosts is None:
        check_folder(folder, stored)
    else:
        hosts.check_folder(
            folder, stored, lambda: check_folder(folder, stored), lambda: folder_view(folder, specs)
        )
    writes = hosts is None or hosts.is_primary()  # one process: never asks JAX (no backend)
    statuses = [run_status(folder, s) for s in specs]
    walls = [s["wall_s"] for s in statuses if s is not None]
    done = sum(s is not None for s in statuses)
    for spec, status in zip(specs, statuses, strict=True):
        if status is not None:
            continue
        log(progress_line(done, len(specs), spec.name, walls))
        t0 = time.monotonic()
        marker, error = {"status": "finished"}, None
        try:
            train_fn(spec.cfg, folder / spec.name)
        except trainer.NonFiniteLossError as e:
            marker = {"status": "diverged", "error": str(e)}
            log(f"study: {spec.name} diverged: {e}")
        except Exception as e:
            if hosts is None:
                raise
            error = e  # raised below, once every process knows the run failed
        if hosts is not None:
            hosts.agree_outcome(spec.name, "failed" if error else marker["status"], error)
        # wall_s: this process's time on the run (an interrupted run's earlier time is lost here;
        # the report's train_s sums time/step from the metrics instead).
        marker["wall_s"] = time.monotonic() - t0
        if writes:
            _write_json(folder / spec.name / RUN_FILE, marker)
            if drop_checkpoints:
                _drop_checkpoints(folder / spec.name, log)
        if hosts is not None:  # the next run's children wait for process 0's, started after this
            hosts.barrier()
        walls.append(marker["wall_s"])
        done += 1
        _release_run_memory()
    log(f"study: {done}/{len(specs)} runs done")
    return specs


def _drop_checkpoints(workdir, log: Callable[[str], None]) -> None:
    """Deletes an ended run's checkpoints folder (its metrics and markers stay)."""
    path = run_paths.as_path(workdir) / checkpoint.CKPT_DIR
    if path.is_dir():
        size = run_paths.tree_size(path)
        path.rmtree()
        log(f"study: dropped {path} ({size / 2**30:.2f} GiB; --keep_checkpoints keeps them)")


def _release_run_memory() -> None:
    """Frees what a finished run left behind before the next one starts in this process.

    Each run jits its own train step and sampler (new closures over its model), which JAX's
    caches keep, with whatever they reference, after the run ends. Clearing them helps little in
    practice (a study process still grew from 11.7 to 12.8 GB between runs); a process a run
    (`own_process.train_in_child`, which the study script uses) is the robust fix. Kept for
    in-process `train_fn`s.
    """
    import gc

    gc.collect()
    jax.clear_caches()
    gc.collect()


# What `archive` keeps: the study's own files, and of each ended run what the report reads.
ARCHIVE_STUDY_FILES = (STUDY_FILE, "study.json", "report.md", "curves.png")
ARCHIVE_RUN_FILES = (metrics.METRICS_FILE, workdir_guard.RUN_FILE, RUN_FILE)


def archive(folder, dest) -> list[str]:
    """Copies a study without its checkpoints into `dest`; returns the names of the runs kept.

    Kept: the study files and, of every ended run (finished or diverged), its metrics, run.json
    and end marker, a few hundred KB a run where its checkpoints are GBs. Copying the archive into
    an empty study folder (`cp -r DEST/. FOLDER/`) carries a study to another machine or session:
    the same command then skips the ended runs and trains the others (an unfinished run starts
    over, as its checkpoints stay behind).
    """
    folder, dest = run_paths.as_path(folder), run_paths.as_path(dest)
    if not (folder / STUDY_FILE).exists():
        raise FileNotFoundError(f"{folder} holds no study ({STUDY_FILE} missing)")
    dest.mkdir(parents=True, exist_ok=True)
    for name in ARCHIVE_STUDY_FILES:
        if (folder / name).exists():
            (folder / name).copy(dest / name, overwrite=True)
    kept = []
    for run in sorted(p for p in folder.iterdir() if (p / RUN_FILE).exists()):
        (dest / run.name).mkdir(exist_ok=True)
        for name in ARCHIVE_RUN_FILES:
            if (run / name).exists():
                (run / name).copy(dest / run.name / name, overwrite=True)
        kept.append(run.name)
    return kept


def read_curve(workdir, metric: str = EVAL_METRIC) -> dict:
    """A run's held-out curve from its metrics: steps, values, cumulative training seconds.

    train_s[i] sums time/step minus time/eval over steps 1..steps[i] (evaluation excluded; the
    first step of each process includes compilation). Steps are deduplicated, last row wins.
    """
    path = run_paths.as_path(workdir) / metrics.METRICS_FILE
    by_step: dict[int, dict] = {}
    if path.exists():
        for row in metrics.read_jsonl(path):
            by_step.setdefault(int(row["step"]), {}).update(row)
    steps, values, train_s, elapsed, last = [], [], [], 0.0, 0
    for step in sorted(by_step):
        row = by_step[step]
        t = row.get("time/step")
        if isinstance(t, int | float):
            elapsed += t - float(row.get("time/eval", 0.0))
        last = max(last, step)
        if isinstance(row.get(metric), int | float):
            steps.append(step)
            values.append(float(row[metric]))
            train_s.append(elapsed)
    return {"steps": steps, "values": values, "train_s": train_s, "last_step": last}


def collect(study: ml_collections.ConfigDict, specs: list[RunSpec]) -> dict:
    """Everything `study.json` holds: the study keys, every run's status and curves, the summary."""
    from mmr_jax.studies import reporting

    folder = run_paths.as_path(study.folder)
    runs = []
    for spec in specs:
        workdir = folder / spec.name
        marker = run_status(folder, spec)
        if marker is not None:
            status = marker["status"]
        else:
            status = "incomplete" if (workdir / metrics.METRICS_FILE).exists() else "pending"
        row = {"name": spec.name, "variant": spec.variant, "seed": spec.seed, "status": status}
        if marker is not None:
            row.update({k: v for k, v in marker.items() if k != "status"})
        row["curve"] = read_curve(workdir)
        row["train_reward"] = read_curve(workdir, "reward/mean")
        runs.append(row)
    cfg = specs[0].cfg
    meta = {
        **resolved(study, specs)["study"],
        "total_steps": cfg.total_steps,
        "eval_every": cfg.eval.every,
        "metric": EVAL_METRIC,
    }
    return {"study": meta, "runs": runs, "summary": reporting.summarise(runs, meta)}


def base_accuracy(cfg: schema.TrainConfig):
    """Held-out evaluation of the untrained checkpoint, as the run would evaluate it at step 0."""
    from mmr_jax.models import hub
    from mmr_jax.problems import evaluation
    from mmr_jax.rollout import embedded
    from mmr_jax.training import problem_sets

    path = hub.resolve_checkpoint(cfg.model.path)
    e = cfg.eval
    return evaluation.evaluate(
        embedded.EmbeddedEngine.from_pretrained(path, seed=cfg.seed),
        hub.load_tokenizer(path),
        problem_sets.eval_problems(cfg),
        n=e.n,
        temperature=e.temperature,
        top_p=e.top_p,
        max_new_tokens=e.max_new_tokens,
        system_prompt=e.system_prompt,
        seed=cfg.seed,
        number_only=e.number_only,
    )
