"""The RL batch both sides of the peer benchmark compute (`peer_step.py`): NumPy, no framework.

B prompts of P tokens, G completions of T tokens each (every token valid: the largest batch of
the config, as `dry_run_programs.abstract_batch` shapes it), one advantage per completion, and
the reference policy's log-probs when the KL term is on (beta > 0). Ours computes each prompt
once per group (shared-prompt layout: B * P + B * G * T tokens); the PyTorch peer, TRL's way,
puts the prompt in front of every completion (B * G * (P + T) tokens).
"""

from __future__ import annotations

import dataclasses

import numpy as np

# The loss's normaliser per aggregation (`losses.loss_denominator` on an all-valid mask).
AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm")


@dataclasses.dataclass(frozen=True)
class Shape:
    prompts: int  # B
    generations: int  # G
    prompt_len: int  # P
    completion_len: int  # T

    @property
    def rows(self) -> int:
        return self.prompts * self.generations

    def tokens_shared(self) -> int:
        """Tokens a step computes with each prompt once per group (ours)."""
        return self.prompts * self.prompt_len + self.rows * self.completion_len

    def tokens_per_row(self) -> int:
        """Tokens a step computes with the prompt in every row (TRL's layout)."""
        return self.rows * (self.prompt_len + self.completion_len)


@dataclasses.dataclass(frozen=True)
class PeerBatch:
    prompts_BxP: np.ndarray  # int32
    completions_NxT: np.ndarray  # int32, N = B * G, row n answers prompt n // G
    advantages_N: np.ndarray  # float32
    ref_logps_NxT: np.ndarray | None  # float32, when beta > 0

    @property
    def generations(self) -> int:
        return self.completions_NxT.shape[0] // self.prompts_BxP.shape[0]

    def rows_with_prompts(self) -> np.ndarray:
        """[N, P + T] int32: each completion behind its own copy of its prompt (TRL's rows)."""
        prompts = np.repeat(self.prompts_BxP, self.generations, axis=0)
        return np.concatenate([prompts, self.completions_NxT], axis=1)


def make_batch(shape: Shape, *, vocab_size: int, beta: float, seed: int = 0) -> PeerBatch:
    """A random batch of `shape`: token ids uniform over the vocabulary, advantages N(0, 1),
    reference log-probs near a uniform policy's (-log V, spread 0.1) when beta > 0."""
    if min(dataclasses.astuple(shape)) < 1:
        raise ValueError(f"every dimension of the batch must be >= 1, got {shape}")
    rng = np.random.default_rng(seed)
    b, n, p, t = shape.prompts, shape.rows, shape.prompt_len, shape.completion_len
    ref = None
    if beta > 0:
        ref = (-np.log(vocab_size) + 0.1 * rng.standard_normal((n, t))).astype(np.float32)
    return PeerBatch(
        prompts_BxP=rng.integers(0, vocab_size, (b, p), dtype=np.int32),
        completions_NxT=rng.integers(0, vocab_size, (n, t), dtype=np.int32),
        advantages_N=rng.standard_normal(n).astype(np.float32),
        ref_logps_NxT=ref,
    )


def loss_normaliser(aggregation: str, rows: int, completion_len: int, max_completion_len: int):
    """The whole batch's loss denominator with every token valid (`losses.loss_denominator`)."""
    if aggregation == "seq_mean_token_mean":
        return float(rows)
    if aggregation == "token_mean":
        return float(rows * completion_len)
    if aggregation == "seq_mean_token_sum_norm":
        return float(rows * max_completion_len)
    raise ValueError(f"unknown aggregation {aggregation!r}; known: {AGGREGATIONS}")
