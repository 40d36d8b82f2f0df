"""Checkpoints of a training run: Orbax for arrays, JSON for host state, a run-metadata guard.

Layout of a workdir:

    <workdir>/run.json            the config of the run (refuses another config's resume)
    <workdir>/checkpoints/<step>/state   params (or LoRA adapters), optimiser state, RNG key data
    <workdir>/checkpoints/<step>/meta    JSON: step, data-iterator position, anything host-side

Orbax writes each step into a temporary folder and renames it when complete, so a process killed
mid-save leaves the previous checkpoints intact; only the last `keep` are kept.
"""

from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging

RUN_FILE = "run.json"
CKPT_DIR = "checkpoints"
# Keys that may change when a run resumes (they do not change what is trained).
RESUMABLE_KEYS = frozenset({
    "total_steps", "logging", "eval", "checkpoint", "rollout.url", "rollout.timeout_s",
    "rollout.max_retries", "rollout.sync_dir", "rollout.model_name", "rollout.server_venv",
})  # fmt: skip


class RunMismatchError(ValueError):
    """The workdir holds a run of another config."""


class Checkpointer:
    """Save / restore of (array pytree, JSON dict) pairs by step, the last `keep` kept.

    Args:
      directory: folder of step subfolders (created).
      keep: number of most recent checkpoints kept (None = all).
      keep_period: also keep steps divisible by this (0 = off).
      async_save: write in a background thread; `wait()` or the next save joins it.
    """

    def __init__(self, directory, *, keep: int | None = 3, keep_period: int = 0, async_save=True):
        self.directory = pathlib.Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep or None,
            keep_period=keep_period or None,
            create=True,
            enable_async_checkpointing=async_save,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state: Any, meta: Mapping[str, Any]) -> bool:
        """Saves `state` (a pytree of arrays) and `meta` (JSON-able) at `step`."""
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta))
        )
        saved = self._manager.save(int(step), args=args, force=True)
        if saved:
            logging.info("checkpoint: saving step %d to %s", step, self.directory)
        return saved

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict] | None:
        """(state, meta) at `step` (default: latest), or None when there is no checkpoint.

        `abstract_state` is a pytree of `jax.ShapeDtypeStruct` (with shardings) or arrays
        that fixes the structure, dtypes and placement of the result.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        abstract = jax.tree.map(_abstract, abstract_state)
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
        )
        out = self._manager.restore(int(step), args=args)
        return out["state"], dict(out["meta"])

    def restore_meta(self, step: int | None = None) -> dict | None:
        """Only the JSON part of a checkpoint."""
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        out = self._manager.restore(int(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


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
    a, b = _flatten(old), _flatten(new)
    diffs = []
    for key in sorted(set(a) | set(b)):
        if key in RESUMABLE_KEYS or key.split(".")[0] in RESUMABLE_KEYS:
            continue
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            diffs.append(f"{key}: {a.get(key, '<absent>')!r} -> {b.get(key, '<absent>')!r}")
    return diffs


def prepare_workdir(workdir, config: Mapping[str, Any], *, overwrite: bool = False) -> pathlib.Path:
    """Creates `workdir` or checks that it holds a run of the same `config` (a plain dict).

    A workdir holding another config's run is refused with the differing keys listed, unless
    `overwrite`, which deletes any existing run's checkpoints, metrics and metadata first.
    """
    workdir = pathlib.Path(workdir)
    run_file = workdir / RUN_FILE
    config = json.loads(json.dumps(config))
    if run_file.exists():
        old = json.loads(run_file.read_text())
        diffs = _differences(old.get("config", {}), config)
        if diffs and not overwrite:
            raise RunMismatchError(
                f"workdir {workdir} holds a run of another config ({len(diffs)} differences: "
                + "; ".join(diffs[:10])
                + "). Use another --workdir, or pass --overwrite to delete that run."
            )
        if overwrite:
            logging.warning("--overwrite: deleting the run in %s", workdir)
            for name in (CKPT_DIR, "metrics.jsonl", "tb", RUN_FILE):
                path = workdir / name
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
    workdir.mkdir(parents=True, exist_ok=True)
    tmp = run_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({"config": config}, indent=2, sort_keys=True))
    tmp.replace(run_file)  # atomic on POSIX
    return workdir


def read_run_config(workdir) -> dict:
    """The config dict stored in `workdir/run.json`."""
    return json.loads((pathlib.Path(workdir) / RUN_FILE).read_text())["config"]


def export_model(model, out_dir, *, base_path: str, dtype, lora: bool) -> pathlib.Path:
    """Writes `model` as a HF folder (LoRA merged) that transformers and vLLM load.

    Under LoRA the adapters alone are also written as a PEFT folder, `<out_dir>/adapter`.
    `base_path` is the HF folder the run started from (tokenizer files, PEFT base name).
    """
    from mmr_jax.models import export, hub

    out_dir = pathlib.Path(out_dir)
    export.save_hf(model, out_dir, tokenizer_dir=hub.resolve_checkpoint(base_path), dtype=dtype)
    if lora:
        export.save_peft_adapter(model, out_dir / "adapter", base_model_name_or_path=base_path)
    logging.info("exported %s", out_dir)
    return out_dir
