"""Checkpoints written before the decoder's layers were stacked: read and stacked on restore.

Before the scan over layers, the model's state held one subtree per layer
(`params/layers/0/self_attn/q_proj/kernel/value`, ...; Adam's mu and nu the same); now one
stacked subtree holds them all (`params/layers/self_attn/q_proj/kernel/value`, [L, ...]). Such a
checkpoint is restored as saved (host arrays), each `layers/<i>/...` family is stacked along a
new leading axis in layer order, and the result is placed as the current abstract state asks
(its shapes, dtypes and shardings), so a run resumes from it unchanged.
"""

from __future__ import annotations

import ast
import json
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

LAYERS = "layers"


class LayoutMismatchError(ValueError):
    """A per-layer checkpoint does not fit the current model once stacked."""


def _saved_paths(step_dir: epath.Path) -> list[tuple[str, ...]]:
    meta = step_dir / "state" / "_METADATA"
    if not meta.is_file():
        return []
    tree = json.loads(meta.read_text()).get("tree_metadata", {})
    return [tuple(ast.literal_eval(key)) for key in tree]


def _layer_position(path: tuple[str, ...]) -> int | None:
    """Index of the layer number in a per-layer path (`..., 'layers', '3', ...`), else None."""
    for i in range(len(path) - 1):
        if path[i] == LAYERS and path[i + 1].isdigit():
            return i + 1
    return None


def has_unstacked_layers(step_dir: epath.PathLike) -> bool:
    """Whether the checkpoint step folder (local or a bucket's) holds per-layer subtrees (the
    layout before stacking)."""
    return any(_layer_position(p) is not None for p in _saved_paths(epath.Path(step_dir)))


def stack_layers(flat: dict[tuple[str, ...], Any]) -> dict[tuple[str, ...], np.ndarray]:
    """{path: array} with per-layer paths merged: ('layers', '<i>', *rest) -> ('layers', *rest),
    arrays stacked in layer order; every layer must hold the same leaves."""
    out, families = {}, {}
    for path, value in flat.items():
        pos = _layer_position(path)
        if pos is None:
            out[path] = value
            continue
        stacked_path = path[:pos] + path[pos + 1 :]
        families.setdefault(stacked_path, {})[int(path[pos])] = value
    for path, by_layer in families.items():
        if sorted(by_layer) != list(range(len(by_layer))):
            raise LayoutMismatchError(f"{'/'.join(path)}: layers {sorted(by_layer)} saved")
        out[path] = np.stack([np.asarray(by_layer[i]) for i in range(len(by_layer))])
    return out


def restore(manager: ocp.CheckpointManager, step: int, abstract: Any) -> dict[str, Any]:
    """{'state': the state stacked and placed as `abstract`, 'meta': the JSON} of a per-layer
    checkpoint at `step`."""
    args = ocp.args.Composite(state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore())
    raw = manager.restore(int(step), args=args)
    saved = stack_layers(ocp.tree.to_flat_dict(raw["state"]))
    wanted = ocp.tree.to_flat_dict(abstract)
    missing = sorted("/".join(p) for p in wanted if p not in saved)
    if missing:
        raise LayoutMismatchError(
            f"checkpoint step {step} (per-layer layout) lacks {missing[:5]} "
            f"({len(missing)} in all) once its layers are stacked"
        )
    placed = {}
    for path, want in wanted.items():
        value = saved[path]
        if tuple(value.shape) != tuple(want.shape):
            raise LayoutMismatchError(
                f"{'/'.join(path)}: saved {tuple(value.shape)} once stacked, the model wants "
                f"{tuple(want.shape)} (another layer count or size?)"
            )
        sharding = getattr(want, "sharding", None)
        value = np.asarray(value, dtype=want.dtype)
        placed[path] = jax.device_put(value, sharding) if sharding is not None else value
    return {"state": ocp.tree.from_flat_dict(placed, target=abstract), "meta": raw["meta"]}
