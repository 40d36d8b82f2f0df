"""Prompt log-probs: vLLM's `prompt_logprobs` and the prompt part of `echo` with `logprobs`.

`scores` is one teacher-forced forward pass over a prompt (`scoring`, compiled at start-up): per
prompt token after the first, its log-prob under the raw logits (log softmax, no temperature, as
vLLM's prompt log-probs), its rank in the vocabulary (1: the most likely) and the k most likely
tokens there. The first token has no log-prob (nothing predicts it): None in both outputs, as
vLLM's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class PromptScores:
    """Per prompt position t >= 1 (arrays of length T - 1): the token's log-prob and rank, and
    the k most likely tokens there (ids and log-probs [T - 1, k], most likely first)."""

    ids: list[int]
    logprobs: np.ndarray
    ranks: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


def scores(score: Callable, prompt: Sequence[int], k: int) -> PromptScores:
    """The `PromptScores` of `prompt`, from `score(row, temperature)` (`scoring.Scorer.score`
    over the served model: next-token log-probs, ranks and top tokens of the row)."""
    chosen, ranks, top_ids, top_logps = score(list(prompt), 1.0)
    at = slice(0, len(prompt) - 1)
    return PromptScores(
        ids=list(prompt),
        logprobs=chosen[at],
        ranks=ranks[at],
        top_ids=top_ids[at, :k],
        top_logprobs=top_logps[at, :k],
    )


def vllm_prompt_logprobs(s: PromptScores, token_string: Callable[[int], str]) -> list:
    """vLLM's `prompt_logprobs`: [None, {token id: {logprob, rank, decoded_token}}, ...], the
    prompt token first, then its k alternatives (JSON turns the ids into strings)."""
    out: list = [None]
    for t in range(len(s.ids) - 1):
        entry = {}
        entry[s.ids[t + 1]] = _entry(s.logprobs[t], s.ranks[t], token_string(s.ids[t + 1]))
        for j, (tid, lp) in enumerate(zip(s.top_ids[t], s.top_logprobs[t], strict=True)):
            entry.setdefault(int(tid), _entry(lp, j + 1, token_string(int(tid))))
        out.append(entry)
    return out


def _entry(logprob, rank, text: str) -> dict:
    return {"logprob": max(float(logprob), -9999.0), "rank": int(rank), "decoded_token": text}


def echo_entries(s: PromptScores, names: Callable[[Sequence[int]], list[str]], tokens):
    """The prompt's part of a legacy logprobs object: per token (log-prob or None, top
    alternatives as {text: log-prob} or None, the token itself under its text in `tokens`);
    the first token has neither, as vLLM's."""
    logprobs: list[float | None] = [None]
    tops: list[dict | None] = [None]
    for t in range(len(s.ids) - 1):
        logprobs.append(max(float(s.logprobs[t]), -9999.0))
        top = dict(zip(names(s.top_ids[t].tolist()), s.top_logprobs[t].tolist(), strict=True))
        top[tokens[t + 1]] = logprobs[-1]
        tops.append(top)
    return logprobs, tops
