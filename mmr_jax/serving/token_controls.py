"""vLLM's per-request logits controls: `logit_bias`, `allowed_token_ids` and `min_tokens`.

As vLLM applies them, to the raw logits before temperature, top-k and top-p:
- `logit_bias` {token id (a string or an int): bias}: the bias is added to that token's logit,
  clamped to [-100, 100] (vLLM's `to_sampling_params`); keys that are not ids (all named) or
  ids outside the vocabulary are a 400.
- `allowed_token_ids` [ids]: every other token's logit is -inf; an empty list or an id outside
  the vocabulary is a 400.
- `min_tokens` k: while fewer than k tokens are generated, the row's stop tokens (EOS unless
  `ignore_eos`, and `stop_token_ids`) have logit -inf; k above `max_tokens` is a 400, and so is
  k > 0 with stop strings (vLLM holds them back until k tokens: not built here).
Only the continuous batch applies them (`slot_scheduler`: a bias row [V] per slot, added to the
logits in the decode step). Reported log-probs include the bias and the masks, except under
`raw_logprobs` (before any processing), as vLLM's logprobs modes; `top_logprobs` alternatives
come from the scoring pass, without them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import numpy as np

from mmr_jax.serving.openai_format import HTTPError

KEYS = ("logit_bias", "allowed_token_ids", "min_tokens")
MAX_BIAS = 100.0


@dataclasses.dataclass(frozen=True)
class TokenControls:
    """bias: {token id: bias}; allowed: the only ids that may be drawn (None: all);
    min_tokens: stop tokens banned until this many tokens are generated."""

    bias: tuple[tuple[int, float], ...] = ()
    allowed: tuple[int, ...] | None = None
    min_tokens: int = 0


NONE = TokenControls()


def _as_id(key) -> int | None:
    if isinstance(key, bool | float):
        return None
    try:
        return int(key)
    except ValueError:
        return None


def _ids(keys: list, vocab_size: int, param: str) -> list[int]:
    """`keys` as token ids, or a 400 naming every key that is not one (vLLM's messages)."""
    ids = [_as_id(k) for k in keys]
    bad = [k for k, tid in zip(keys, ids, strict=True) if tid is None]
    if bad:
        raise HTTPError(
            400,
            f"{param} keys must be integers or strings of integers (token ids); found "
            f"{', '.join(repr(k) for k in bad)}",
            param=param,
        )
    outside = [t for t in ids if not 0 <= t < vocab_size]
    if outside:
        raise HTTPError(
            400,
            f"token_id(s) {outside} in {param} contain out-of-vocab token ids. Vocabulary "
            f"size: {vocab_size}",
            param=param,
        )
    return ids


def parse(body: dict, *, vocab_size: int, max_tokens: int) -> TokenControls:
    """The controls of a request body, or a 400 naming the parameter."""
    bias = body.get("logit_bias")
    if bias is None:
        bias = {}
    if not isinstance(bias, dict):
        raise HTTPError(400, "logit_bias must be an object of token id: bias", param="logit_bias")
    pairs = {}
    for tid, value in zip(_ids(list(bias), vocab_size, "logit_bias"), bias.values(), strict=True):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value):
            raise HTTPError(400, f"logit_bias[{tid}] must be a finite number, got {value!r}",
                            param="logit_bias")  # fmt: skip
        pairs[tid] = min(MAX_BIAS, max(-MAX_BIAS, float(value)))
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        if not isinstance(allowed, list) or not allowed:
            raise HTTPError(400, "allowed_token_ids must be a non-empty list of token ids",
                            param="allowed_token_ids")  # fmt: skip
        allowed = tuple(sorted(set(_ids(allowed, vocab_size, "allowed_token_ids"))))
    min_tokens = body.get("min_tokens")
    if min_tokens is None:
        min_tokens = 0
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise HTTPError(400, f"min_tokens must be an integer >= 0, got {min_tokens!r}",
                        param="min_tokens")  # fmt: skip
    if min_tokens > max_tokens:
        raise HTTPError(
            400,
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}",
            param="min_tokens",
        )
    return TokenControls(tuple(sorted(pairs.items())), allowed, min_tokens)


def base_bias(controls: TokenControls, vocab_size: int) -> np.ndarray:
    """float32 [V] added to a row's logits: the bias, and -inf outside `allowed`."""
    out = np.zeros(vocab_size, np.float32)
    if controls.allowed is not None:
        out[:] = -np.inf
        out[list(controls.allowed)] = 0.0
    for tid, value in controls.bias:
        out[tid] += value
    return out


def ban(row_bias: np.ndarray, stop_ids: Iterable[int]) -> np.ndarray:
    """`row_bias` with the stop tokens at -inf (`min_tokens` not yet reached)."""
    out = row_bias.copy()
    out[list(stop_ids)] = -np.inf
    return out
