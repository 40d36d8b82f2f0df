"""Prompt log-probs: vLLM's `prompt_logprobs` and the prompt part of `echo` with `logprobs`.

`scores` is one teacher-forced forward pass over a prompt: per prompt token after the first, its
log-prob under the raw logits (log softmax, no temperature, as vLLM's prompt log-probs), its rank
in the vocabulary (1: the most likely) and the k most likely tokens there. The first token has no
log-prob (nothing predicts it): None in both outputs, as vLLM's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@dataclasses.dataclass(frozen=True)
class PromptScores:
    """Per prompt position t >= 1 (arrays of length T - 1): the token's log-prob and rank, and
    the k most likely tokens there (ids and log-probs [T - 1, k], most likely first)."""

    ids: list[int]
    logprobs: np.ndarray
    ranks: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


@functools.partial(jax.jit, static_argnames=("graphdef", "k"))
def _scores(graphdef, state, tokens_BxT, mask_BxT, *, k: int):
    logits = nnx.merge(graphdef, state)(tokens_BxT, attention_mask_BxT=mask_BxT)
    logps = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logps, tokens_BxT[:, 1:, None], axis=-1)
    ranks = 1 + jnp.sum(logps > chosen, axis=-1)
    top_logps, top_ids = jax.lax.top_k(logps, k)
    return chosen[..., 0], ranks, top_ids, top_logps


def scores(model, prompt: Sequence[int], k: int, *, length: int, pad_id: int) -> PromptScores:
    """The `PromptScores` of `prompt` under `model` (an NNX decoder), padded to `length`."""
    tokens = np.full((1, length), pad_id, np.int32)
    tokens[0, : len(prompt)] = prompt
    mask = np.arange(length)[None] < len(prompt)
    graphdef, state = nnx.split(model)
    chosen, ranks, top_ids, top_logps = _scores(graphdef, state, tokens, mask, k=max(k, 1))
    at = slice(0, len(prompt) - 1)
    return PromptScores(
        ids=list(prompt),
        logprobs=np.asarray(chosen[0, at]),
        ranks=np.asarray(ranks[0, at]),
        top_ids=np.asarray(top_ids[0, at, :k]),
        top_logprobs=np.asarray(top_logps[0, at, :k]),
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
