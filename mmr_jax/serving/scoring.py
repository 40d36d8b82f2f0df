"""The server's teacher-forced scoring pass, compiled at start-up: top log-probs of a completion
(`top_logprobs` / `logprobs=k`) and the prompt's log-probs (`prompt_logprobs`, `echo`).

One program per padded length serves both: over a row of T tokens, log softmax(logits /
temperature) at every position, the log-prob and rank of each next token, and the `K_MAX` most
likely tokens (a request's k <= K_MAX is a slice on the host, so k is not part of the program).
Lengths are padded to powers of two from `MIN_LENGTH` to the server's `max_model_len`:
`Scorer.compile` builds them all ahead of time (the start-up grid), so no request waits for a
compile. Prompt log-probs use temperature 1 (vLLM's are of the raw logits).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmr_jax.rollout import padding
from mmr_jax.serving.openai_params import MAX_TOP_LOGPROBS

K_MAX = MAX_TOP_LOGPROBS
MIN_LENGTH = 64  # shorter rows are padded to it: their passes cost about the same


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _score(graphdef, state, tokens_1xT, mask_1xT, temperature):
    """(log-prob [1, T-1] and rank [1, T-1] of each next token, top ids and log-probs
    [1, T, K_MAX]) under log softmax(logits / temperature)."""
    logits = nnx.merge(graphdef, state)(tokens_1xT, attention_mask_NxT=mask_1xT)
    logps = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    chosen = jnp.take_along_axis(logps[:, :-1], tokens_1xT[:, 1:, None], axis=-1)
    ranks = 1 + jnp.sum(logps[:, :-1] > chosen, axis=-1)
    top_logps, top_ids = jax.lax.top_k(logps, K_MAX)
    return chosen[..., 0], ranks, top_ids, top_logps


def lengths(max_model_len: int) -> list[int]:
    """The padded lengths compiled: powers of two from MIN_LENGTH to cover max_model_len."""
    out = [MIN_LENGTH]
    while out[-1] < max_model_len:
        out.append(2 * out[-1])
    return out


class Scorer:
    """`_score` over rows of up to `max_model_len` tokens, per model name; `compile(name)`
    builds a name's programs ahead of time (else they compile when first used)."""

    def __init__(self, max_model_len: int, pad_id: int):
        self.lengths, self.pad_id = lengths(max_model_len), pad_id
        self._compiled: dict[tuple[str, int], Callable] = {}

    def compile(self, name: str, graphdef, state, log: Callable[[str], None] = print) -> None:
        started = time.perf_counter()
        for length in self.lengths:
            tokens = jax.ShapeDtypeStruct((1, length), jnp.int32)
            mask = jax.ShapeDtypeStruct((1, length), jnp.bool_)
            temperature = jax.ShapeDtypeStruct((), jnp.float32)
            lowered = _score.lower(graphdef, state, tokens, mask, temperature)
            self._compiled[name, length] = lowered.compile()
            log(f"compiled scoring pass ({name}, {length} tokens)")
        seconds = time.perf_counter() - started
        log(f"compiled {len(self.lengths)} scoring programs in {seconds:.1f} s")

    def forget(self, name: str) -> None:
        self._compiled = {key: f for key, f in self._compiled.items() if key[0] != name}

    def score(self, name: str, graphdef, state, row: Sequence[int], temperature: float):
        """`_score` of `row` (numpy arrays, the padding cut off: [T-1], [T-1], [T, K_MAX],
        [T, K_MAX])."""
        length = padding.bucket(max(len(row), MIN_LENGTH))
        tokens = np.full((1, length), self.pad_id, np.int32)
        tokens[0, : len(row)] = row
        mask = np.arange(length)[None] < len(row)
        compiled = self._compiled.get((name, length))
        args = (state, tokens, mask, np.float32(temperature))
        out = compiled(*args) if compiled is not None else _score(graphdef, *args)
        n = len(row)
        chosen, ranks, top_ids, top_logps = (np.asarray(a)[0] for a in out)  # no device op
        return chosen[: n - 1], ranks[: n - 1], top_ids[:n], top_logps[:n]
