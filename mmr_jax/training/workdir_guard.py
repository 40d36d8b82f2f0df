"""run.json: the config a run was started with, and the guard that refuses another config's resume.

`prepare_workdir` checks, before anything is loaded, that the workdir may take a run of the config
(keys in `RESUMABLE_KEYS`, and keys the stored run lacks that hold their default, may differ on a
resume) and writes nothing but the folder; `claim` writes run.json once the run's start-up
succeeded (the config, and what the run resolved at start-up), so that a start that fails (an
empty data file, missing weights) claims nothing. A workdir binds its run once it holds a
checkpoint: a run that saved none has nothing to resume, and a start of another config replaces
its run.json with a warning.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from absl import logging
from etils import epath

from mmr_jax.config import checks, command_line
from mmr_jax.infra import run_paths, user_errors
from mmr_jax.training import checkpoint

RUN_FILE = "run.json"
# Keys that may change when a run resumes (they do not change what is trained).
RESUMABLE_KEYS = frozenset({
    "total_steps", "logging", "eval", "checkpoint", "rollout.url", "rollout.timeout_s",
    "rollout.max_retries", "rollout.sync_dir", "rollout.model_name", "rollout.server_venv",
})  # fmt: skip


class RunMismatchError(user_errors.UserError, ValueError):
    """The workdir holds a run of another config."""


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """The keys whose values differ, as 'key: old -> new'. The stored config is read in today's
    keys (`command_line.stored_config`): a key it lacks (added to the config since) counts as its
    default there, as the run ran with it."""
    a, b = _flatten(checks.upgrade(old)), _flatten(new)
    today = _flatten(command_line.stored_config(old))
    a.update({k: v for k, v in today.items() if k not in a and k in b})
    diffs = []
    for key in sorted(set(a) | set(b)):
        if key in RESUMABLE_KEYS or key.split(".")[0] in RESUMABLE_KEYS:
            continue
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            diffs.append(f"{key}: {a.get(key, '<absent>')!r} -> {b.get(key, '<absent>')!r}")
    return diffs


def prepare_workdir(workdir, config: Mapping[str, Any], *, overwrite: bool = False) -> epath.Path:
    """Creates `workdir` (a local path or a bucket URL, `run_paths`), or checks that it may take a
    run of `config` (a plain dict); run.json is left as it is (`claim` writes it).

    A workdir holding a checkpoint of another config's run is refused with the differing keys
    listed, unless `overwrite`, which deletes any existing run's checkpoints, metrics and metadata
    first. Another config's run.json without a checkpoint (a start that failed, or a run stopped
    before its first checkpoint) does not bind the workdir.
    """
    run_paths.check(workdir)
    workdir = run_paths.as_path(workdir)
    run_file = workdir / RUN_FILE
    config = json.loads(json.dumps(config))
    if run_file.exists():
        old = json.loads(run_file.read_text())
        diffs = _differences(old.get("config", {}), config)
        if diffs and not overwrite:
            steps = checkpoint.saved_steps(workdir)
            if steps:
                raise RunMismatchError(
                    f"workdir {workdir} holds a run of another config, checkpointed at steps "
                    f"{steps} ({len(diffs)} differences: " + "; ".join(diffs[:10]) + "). Use "
                    "another --workdir, or pass --overwrite to delete that run."
                )
            logging.warning(
                "workdir %s held a start of another config that saved no checkpoint; this run "
                "takes its place (%d differences: %s)",
                workdir,
                len(diffs),
                "; ".join(diffs[:3]),
            )
        if overwrite:
            logging.warning("--overwrite: deleting the run in %s", workdir)
            for name in (checkpoint.CKPT_DIR, "metrics.jsonl", "tb", RUN_FILE):
                path = workdir / name
                if path.is_dir():
                    path.rmtree()
                elif path.exists():
                    path.unlink()
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if e.errno not in checkpoint.WRITE_ERRNOS:
            raise
        raise checkpoint.write_error(e, workdir, "the workdir") from e
    return workdir


def claim(workdir, config: Mapping[str, Any], **resolved) -> None:
    """Writes run.json once the run's start-up succeeded: `config` (compared on a resume) and
    what the run resolved at start-up (e.g. its attention backend, a NamedTuple; None: not
    resolved; earlier entries kept)."""
    resolved = {k: _plain(v) for k, v in resolved.items() if v is not None}
    workdir = run_paths.as_path(workdir)
    run_file = workdir / RUN_FILE
    old = json.loads(run_file.read_text()) if run_file.exists() else {}
    data = {"config": json.loads(json.dumps(config))}
    if old.get("resolved") or resolved:
        data["resolved"] = {**old.get("resolved", {}), **resolved}
    text = json.dumps(data, indent=2, sort_keys=True)
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        if run_paths.is_remote(workdir):  # an object is written whole: no temporary needed
            run_file.write_text(text)
        else:
            tmp = run_file.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(run_file)  # atomic on POSIX
    except OSError as e:
        if e.errno not in checkpoint.WRITE_ERRNOS:
            raise
        kept = "Nothing in it was changed. "
        raise checkpoint.write_error(e, workdir, "the run metadata", kept=kept) from e


def _plain(value: Any) -> Any:
    return value._asdict() if hasattr(value, "_asdict") else value  # a NamedTuple: its fields


def read_run_config(workdir) -> dict:
    """The config dict stored in `workdir/run.json`."""
    return json.loads((run_paths.as_path(workdir) / RUN_FILE).read_text())["config"]
