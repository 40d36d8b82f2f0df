"""`EmbeddedEngine`: the in-process rollout engine over a JAX `Decoder` (CPU, TPU, or any GPU
without a vLLM server). Generation is `sampler.sample`; weight sync is an `nnx.update`, and the
sampler reads a copy of the weights in the compute dtype (`sampler_weights.sampling_weights`)
made on the first call after each sync: one cast per weight version, none per decode step."""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmr_jax.rollout import base, decode_loop, padding, sampler, sampler_weights


def _param_state(model: nnx.Module) -> nnx.State:
    return nnx.state(model, nnx.Param)


def merged_base_state(model: nnx.Module) -> nnx.State:
    """The non-LoRA parameters of `model` with every adapter merged into its kernel."""
    from mmr_jax.models import layers

    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    return nnx.from_flat_state(
        [(path, flat[path].replace(value)) for path, value in layers.merged_params(model)]
    )


class EmbeddedEngine:
    """Rollout engine holding a `Decoder`; implements `base.RolloutEngine`.

    Args:
      model: the decoder that samples (it may be the trainer's own model object).
      stop_token_ids: ids that always end a completion (the model's EOS ids), like vLLM's EOS.
      pad_id: written after the end of each completion.
      seed: seeds calls whose `SamplingParams.seed` is None (a new seed per call).
      buckets: minimum padded sizes (see `padding.MinSizes`).
      mesh: sample data-parallel over this mesh (see `sampler.sample`); the model's weights are
        replicated on it here, in place. None = on the weights' devices.
      compact: let the decode loop go on with only its live rows once most are done
        (`sampler.sample`'s `compact`; the same completions, fewer steps on finished rows).
    """

    def __init__(
        self,
        model: nnx.Module,
        *,
        stop_token_ids: Sequence[int] = (),
        pad_id: int = 0,
        seed: int = 0,
        buckets: padding.MinSizes = padding.DEFAULT_MIN_SIZES,
        mesh: jax.sharding.Mesh | None = None,
        compact: bool = True,
    ):
        self.model = model
        self.compact = compact
        self.last_loop_stats = decode_loop.LoopStats()
        self.mesh = mesh
        if mesh is not None:  # Once here, not a copy of the weights per call.
            from mmr_jax.models import sharding

            state = nnx.state(model)
            nnx.update(model, jax.device_put(state, sharding.replicated(mesh)))
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        self.pad_id = pad_id
        self.buckets = buckets
        self.version = 0
        # `sampler_weights.sampling_weights` of the model's current arrays, and weak references to
        # those arrays: a copy made on use and kept while the model holds the same arrays.
        self._weights, self._weights_of = None, ()
        self._rng = np.random.default_rng(seed)
        self.max_len = getattr(getattr(model, "config", None), "max_position_embeddings", None)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype=jnp.float32, **kwargs):
        """Loads a HF folder (or hub id); stop ids `stops.stop_token_ids(path)` unless given."""
        from mmr_jax import models
        from mmr_jax.rollout import stops

        model = models.from_pretrained(path, dtype=dtype)
        if "stop_token_ids" not in kwargs:
            kwargs["stop_token_ids"] = stops.stop_token_ids(path)
        return cls(model, **kwargs)

    def next_seed(self) -> int:
        """A fresh seed for a call whose `SamplingParams.seed` is None."""
        return int(self._rng.integers(2**31))

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], params: base.SamplingParams, *, first_row=0
    ) -> base.RolloutBatch:
        seed = self.next_seed()
        self.last_loop_stats = decode_loop.LoopStats()  # what this call's decode loops did
        self._weights = self._sampling_weights()
        return sampler.sample(
            self.model,
            [list(map(int, p)) for p in prompt_ids],
            params,
            stop_token_ids=self.stop_token_ids,
            seed=seed,
            pad_id=self.pad_id,
            buckets=self.buckets,
            max_len=self.max_len,
            mesh=self.mesh,
            compact=self.compact,
            first_row=first_row,
            stats=self.last_loop_stats,
            weights=self._weights,
        )

    def _sampling_weights(self) -> nnx.State:
        """The compute-dtype weights, made again only when the model holds other arrays (after
        `sync_weights`, or an `nnx.update` of `self.model` such as the server's reload): one
        cast per weight version, not per call or decode step."""
        leaves = jax.tree.leaves(nnx.state(self.model))
        same = len(leaves) == len(self._weights_of) and all(
            ref() is leaf for ref, leaf in zip(self._weights_of, leaves, strict=True)
        )
        if self._weights is None or not same:
            self._weights = sampler_weights.sampling_weights(self.model)
            self._weights_of = tuple(weakref.ref(leaf) for leaf in leaves)
        return self._weights

    def sync_weights(self, model: nnx.Module, *, version: int) -> None:
        """Copies `model`'s weights in (LoRA merged when this engine's model has no adapters)."""
        if model is not self.model:
            src, dst = _param_state(model), _param_state(self.model)
            if jax.tree.structure(src) != jax.tree.structure(dst):
                src = merged_base_state(model)
                if jax.tree.structure(src) != jax.tree.structure(dst):
                    raise ValueError("sync_weights: the trainer's model and the engine's differ")
            nnx.update(self.model, src)
        self.version = version
        self._weights, self._weights_of = None, ()  # the copy of the old weights is stale
