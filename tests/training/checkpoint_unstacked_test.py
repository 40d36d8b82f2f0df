"""A checkpoint written before the layers were stacked restores into the stacked model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from mmr_jax.models import config as model_config
from mmr_jax.models import decoder
from mmr_jax.models import lora as lora_lib
from mmr_jax.step import train_step
from mmr_jax.training import checkpoint, checkpoint_unstacked


def _state(num_layers: int, seed: int = 0) -> dict:
    cfg = model_config.ModelConfig(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_layers=num_layers,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
    )
    model = decoder.Decoder(cfg, rngs=nnx.Rngs(seed))
    params = lora_lib.split_policy(model).params
    opt = optax.adam(1e-2)
    opt_state = opt.init(params)
    # One update, so Adam's mu and nu are not zeros.
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.1, params)
    _, opt_state = opt.update(grads, opt_state, params)
    state = train_step.TrainState(
        step=jnp.int32(7), params=params, opt_state=opt_state, rng=jnp.arange(2, dtype=jnp.uint32)
    )
    return {
        "step": state.step,
        "params": state.params,
        "opt_state": state.opt_state,
        "rng": state.rng,
    }


def _per_layer(tree) -> dict:
    """The tree as the unstacked model saved it: ('layers', L...) -> ('layers', '<i>', ...)."""
    flat = {}
    for path, value in ocp.tree.to_flat_dict(tree).items():
        if "layers" in path:
            at = path.index("layers") + 1
            for i in range(value.shape[0]):
                flat[path[:at] + (str(i),) + path[at:]] = np.asarray(value[i])
        else:
            flat[path] = np.asarray(value)
    return ocp.tree.from_flat_dict(flat)


def test_per_layer_checkpoint_restores_stacked(tmp_path):
    state = _state(3)
    ckpt = checkpoint.Checkpointer(tmp_path, async_save=False)
    ckpt.save(5, _per_layer(state), {"step": 5})
    ckpt.wait()
    assert checkpoint_unstacked.has_unstacked_layers(tmp_path / "5")
    restored, meta = ckpt.restore(jax.tree.map(jnp.zeros_like, state))
    assert meta["step"] == 5
    want = ocp.tree.to_flat_dict(state)
    got = ocp.tree.to_flat_dict(restored)
    assert set(got) == set(want)
    stacked = [p for p in want if "layers" in p]
    assert len(stacked) > 10  # params and Adam's mu and nu of every layer module
    for path in want:
        np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(want[path]))


def test_a_stacked_checkpoint_is_not_taken_for_a_per_layer_one(tmp_path):
    state = _state(2)
    ckpt = checkpoint.Checkpointer(tmp_path, async_save=False)
    ckpt.save(1, state, {"step": 1})
    ckpt.wait()
    assert not checkpoint_unstacked.has_unstacked_layers(tmp_path / "1")


def test_per_layer_checkpoint_of_another_depth_is_refused_with_the_reason(tmp_path):
    ckpt = checkpoint.Checkpointer(tmp_path, async_save=False)
    ckpt.save(1, _per_layer(_state(2)), {"step": 1})
    ckpt.wait()
    deeper = jax.tree.map(jnp.zeros_like, _state(3))
    with pytest.raises(checkpoint.CheckpointRestoreError, match="saved .2, .* wants .3,"):
        ckpt.restore(deeper)
