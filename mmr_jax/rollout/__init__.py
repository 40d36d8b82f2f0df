"""Rollout engines behind one interface (`base.RolloutEngine`): the embedded JAX sampler (its
prefill, decode loop and sampling) and a vLLM-server client with its launcher; the OpenAI-compatible
server over the embedded sampler is `serving/`.

May import: `models`, `infra`, `config` (the typed rollout settings).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from mmr_jax.rollout.base import RolloutBatch, RolloutEngine, SamplingParams

__all__ = ["RolloutBatch", "RolloutEngine", "SamplingParams", "make_engine"]


def make_engine(
    kind: str = "embedded",
    *,
    model=None,
    model_path: str | os.PathLike | None = None,
    url: str = "http://localhost:8000",
    served_model_name: str | None = None,
    sync_dir: str | os.PathLike | None = None,
    lora: bool = False,
    timeout_s: float = 600.0,
    max_retries: int = 3,
    wait_ready_s: float = 0.0,
    pad_id: int = 0,
    seed: int = 0,
    stop_token_ids: Sequence[int] | None = None,
) -> RolloutEngine:
    """An engine by name.

    'embedded': samples with `model` (a `Decoder`, e.g. the trainer's own), or loads `model_path`.
    'vllm': a client of the server at `url` serving `served_model_name` (default: `model_path`,
      what scripts/launch_vllm.py serves); weights sync through `sync_dir`, as LoRA when `lora`;
      waits up to `wait_ready_s` for the server to come up (0 = not at all).
    Both engines end completions on `stop_token_ids`, by default `model_path`'s (a folder or a hub
    id): the tokenizer's EOS and every EOS of its generation config (`stops.stop_token_ids`).
    """
    from mmr_jax.rollout import embedded, stops

    if stop_token_ids is None:
        stop_token_ids = stops.stop_token_ids(model_path) if model_path else ()
    eos = tuple(int(t) for t in stop_token_ids)
    if kind == "embedded":
        if model is None:
            if model_path is None:
                raise ValueError("the embedded engine needs `model` or `model_path`")
            return embedded.EmbeddedEngine.from_pretrained(
                model_path, stop_token_ids=eos, pad_id=pad_id, seed=seed
            )
        return embedded.EmbeddedEngine(model, stop_token_ids=eos, pad_id=pad_id, seed=seed)
    if kind == "vllm":
        from mmr_jax.rollout import vllm_client, vllm_engine

        name = served_model_name or (str(model_path) if model_path else None)
        if name is None:
            raise ValueError("the vllm engine needs `served_model_name` or `model_path`")
        client = vllm_client.VllmClient(url, timeout_s=timeout_s, max_retries=max_retries)
        return vllm_engine.VllmEngine(
            client,
            model=name,
            sync_dir=sync_dir,
            lora=lora,
            pad_id=pad_id,
            eos_token_ids=eos,
            base_model_name_or_path=str(model_path) if model_path else None,
            wait_ready_s=wait_ready_s,
        )
    raise ValueError(f"unknown rollout engine {kind!r}; expected 'embedded' or 'vllm'")
