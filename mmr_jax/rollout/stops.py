"""The token ids that end a completion, the same for every rollout engine.

A checkpoint names its EOS in two places: the tokenizer's `eos_token`, and generation_config.json's
`eos_token_id` (an id or a list: chat models list both their end-of-turn and end-of-text tokens).
transformers' `generate` and vLLM stop on the union; so do we, for the embedded sampler and in the
`stop_token_ids` every vLLM request sends (the launcher turns vLLM's own reading of the generation
config off, since that file also carries sampling defaults the trainer does not model).
"""

from __future__ import annotations

import json
import os
import pathlib

from mmr_jax.models import hub


def _ids(value) -> list[int]:
    """An `eos_token_id` entry (None, an id or a list of ids) as a list."""
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def generation_eos_ids(folder: str | os.PathLike) -> list[int]:
    """generation_config.json's eos ids; without that file, config.json's (as transformers derives
    a generation config from the model config)."""
    folder = pathlib.Path(folder)
    for name in ("generation_config.json", "config.json"):
        f = folder / name
        if f.is_file():
            return _ids(json.loads(f.read_text()).get("eos_token_id"))
    return []


def stop_token_ids(path_or_repo_id: str | os.PathLike, tokenizer=None) -> tuple[int, ...]:
    """Sorted union of the tokenizer's EOS id and the generation config's EOS ids.

    Args:
      path_or_repo_id: a checkpoint folder or a hub id (resolved through the HF cache, as the
        model and tokenizer are: `hub.resolve_checkpoint`).
      tokenizer: the checkpoint's tokenizer when the caller has it loaded already; else it is
        loaded from the checkpoint.
    """
    return checkpoint_stop_ids(hub.resolve_checkpoint(path_or_repo_id), tokenizer)


def checkpoint_stop_ids(folder: str | os.PathLike, tokenizer=None) -> tuple[int, ...]:
    """`stop_token_ids` of a checkpoint folder (one `hub.resolve_checkpoint` gave)."""
    if tokenizer is None:
        tokenizer = hub.load_tokenizer(folder)
    ids = set(generation_eos_ids(folder)) | set(_ids(tokenizer.eos_token_id))
    return tuple(sorted(ids))
