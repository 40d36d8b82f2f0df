"""Rollout engines behind one interface (`base.RolloutEngine`): the embedded JAX sampler (its
prefill, decode loop and sampling) and a vLLM-server client with its launcher; the OpenAI-compatible
server over the embedded sampler is `serving/`.

May import: `models`, `infra`, `config` (the typed rollout settings).
"""

from __future__ import annotations

from mmr_jax.rollout.base import RolloutBatch, RolloutEngine, SamplingParams

__all__ = ["RolloutBatch", "RolloutEngine", "SamplingParams"]
