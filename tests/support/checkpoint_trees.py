"""A toy train-state pytree for the checkpointer tests, and what a crash can leave of a step.

ck.save(1, checkpoint_trees.state(1.0), {"step": 1})
out, meta = ck.restore(checkpoint_trees.abstract(checkpoint_trees.state()))
checkpoint_trees.CORRUPTIONS["data_truncated"](step_folder)
"""

import shutil

import jax
import jax.numpy as jnp
import optax


def state(scale=1.0):
    """params {'w': scale * ones(3, 4), 'b': {'x': [0, 1]}}, an AdamW state, an rng, a step."""
    params = {"w": scale * jnp.ones((3, 4)), "b": {"x": jnp.arange(2.0)}}
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    rng = jax.random.key_data(jax.random.key(7))
    return {"params": params, "opt_state": opt.init(params), "rng": rng, "step": jnp.int32(0)}


def abstract(tree):
    """`tree` as ShapeDtypeStructs (what Checkpointer.restore takes)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _truncate(path, size=None):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 if size is None else size])


CORRUPTIONS = {  # what a crash or a bad disk can leave in a step folder orbax already renamed
    "data_truncated": lambda d: [_truncate(f) for f in (d / "state").rglob("d/*") if f.is_file()],
    "state_metadata_truncated": lambda d: _truncate(d / "state" / "_METADATA", 10),
    "meta_missing": lambda d: (d / "meta" / "metadata").unlink(),
    "state_missing": lambda d: shutil.rmtree(d / "state"),
}
