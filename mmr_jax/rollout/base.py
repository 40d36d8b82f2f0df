"""The rollout interface every engine implements (embedded JAX sampler, vLLM server client).

Legend: B prompts, G completions per prompt (`SamplingParams.n`), T generated tokens (padded to
the longest completion).

Log-prob convention: `RolloutBatch.logprobs[b, i, t] = log softmax(logits / temperature)[token]`,
i.e. after temperature but *before* top-p / top-k truncation and renormalisation. That is what the
trainer recomputes (`models.logprobs.token_logprobs(..., temperature=T)`), so the importance ratio
is exactly 1 on-policy when top-p = 1 and top-k = 0. With temperature 0 (greedy) the log-probs are
those of the untempered distribution, log softmax(logits).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample; `temperature=0` means greedy. `top_k=0` turns top-k off."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclasses.dataclass
class RolloutBatch:
    """Host numpy arrays, prompt-major: `tokens[b, i]` is completion i of prompt b.

    tokens: int32 [B, G, T] completion ids (pad after the end; the stop token is kept).
    mask: bool [B, G, T] True = a generated token (including the stop token).
    logprobs: float32 [B, G, T] sampler log-probs after temperature, 0 where masked.
    finish_reasons: [B][G] 'stop' | 'length'.
    """

    tokens: np.ndarray
    mask: np.ndarray
    logprobs: np.ndarray
    finish_reasons: list[list[str]]

    def __post_init__(self):
        if self.tokens.ndim != 3:
            raise ValueError(f"tokens must be [B, G, T], got shape {self.tokens.shape}")
        shape = self.tokens.shape
        if self.mask.shape != shape or self.logprobs.shape != shape:
            raise ValueError(
                f"tokens {shape}, mask {self.mask.shape} and logprobs {self.logprobs.shape} differ"
            )
        if len(self.finish_reasons) != shape[0] or any(
            len(r) != shape[1] for r in self.finish_reasons
        ):
            raise ValueError(f"finish_reasons must be [B={shape[0]}][G={shape[1]}]")

    @property
    def lengths(self) -> np.ndarray:
        """int32 [B, G] number of generated tokens (stop token included)."""
        return self.mask.sum(-1).astype(np.int32)

    def completion_ids(self, b: int, i: int) -> list[int]:
        """The generated ids of completion i of prompt b, without padding."""
        return self.tokens[b, i, : int(self.mask[b, i].sum())].tolist()


def batch_from_lists(
    token_lists: Sequence[Sequence[Sequence[int]]],
    logprob_lists: Sequence[Sequence[Sequence[float]]],
    finish_reasons: Sequence[Sequence[str]],
    *,
    pad_id: int = 0,
    min_len: int = 1,
) -> RolloutBatch:
    """Packs ragged [B][G][t] completions into a padded `RolloutBatch`."""
    num_prompts = len(token_lists)
    n = len(token_lists[0]) if num_prompts else 0
    max_len = max([min_len] + [len(c) for comps in token_lists for c in comps])
    tokens = np.full((num_prompts, n, max_len), pad_id, np.int32)
    mask = np.zeros((num_prompts, n, max_len), bool)
    logprobs = np.zeros((num_prompts, n, max_len), np.float32)
    for b, (comps, lps) in enumerate(zip(token_lists, logprob_lists, strict=True)):
        if len(comps) != n:
            raise ValueError(f"prompt {b} has {len(comps)} completions, expected {n}")
        for i, (c, lp) in enumerate(zip(comps, lps, strict=True)):
            if len(c) != len(lp):
                raise ValueError(f"completion ({b}, {i}): {len(c)} tokens but {len(lp)} logprobs")
            tokens[b, i, : len(c)] = c
            mask[b, i, : len(c)] = True
            logprobs[b, i, : len(c)] = lp
    return RolloutBatch(tokens, mask, logprobs, [list(r) for r in finish_reasons])


class RolloutEngine(Protocol):
    """Generates completions for token-id prompts and takes weight updates from the trainer."""

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams
    ) -> RolloutBatch: ...

    def sync_weights(self, model: Any, *, version: int) -> None: ...
