"""What one request may ask of `server.OpenAIServer`, checked before anything is generated.

vLLM's flags where vLLM has one: `max_num_seqs` (sequences decoded together: here also the most
one request may ask, prompts x n), `max_model_len` (prompt + completion, `openai_params`). Beside
them a cap on the KV cache a request asks for (rows x (prompt + max_tokens) tokens) and on the
body's bytes. Every excess is a 400 in OpenAI's error shape, answered in milliseconds: no
program is compiled for it. `n` is compiled in power-of-two buckets (`n_slots`), so a handful
of decode programs serve every request.
"""

from __future__ import annotations

import dataclasses

from mmr_jax.serving import openai_params
from mmr_jax.serving.openai_format import HTTPError


@dataclasses.dataclass(frozen=True)
class Limits:
    """max_num_seqs: rows (prompts x n) of one request and of one decode batch.
    max_request_tokens: sum over a request's rows of prompt + max_tokens.
    max_body_bytes: a request body's size (Content-Length)."""

    max_num_seqs: int = 256
    max_request_tokens: int = 2**18
    max_body_bytes: int = 4 * 2**20

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if getattr(self, field.name) < 1:
                raise ValueError(f"{field.name} must be >= 1")


def n_slots(n: int) -> int:
    """Rows per prompt the decode program is compiled for: n rounded up to a power of two."""
    return 1 << (n - 1).bit_length()


def check(request: openai_params.Request, limits: Limits) -> None:
    """A 400 when `request` asks more than `limits` allow."""
    n = request.params.n
    rows = len(request.prompts) * n
    if rows > limits.max_num_seqs:
        raise HTTPError(
            400,
            f"this request asks for {rows} sequences ({len(request.prompts)} prompts x n={n}); "
            f"this server decodes at most {limits.max_num_seqs} (--max_num_seqs)",
            param="n",
            code="too_many_sequences",
        )
    tokens = sum(len(p) + request.params.max_new_tokens for p in request.prompts) * n
    if tokens > limits.max_request_tokens:
        raise HTTPError(
            400,
            f"this request asks for {tokens} tokens of context (prompts x n x (prompt + "
            f"max_tokens)); this server allows {limits.max_request_tokens} per request "
            "(--max_request_tokens): lower n or max_tokens",
            param="max_tokens",
            code="request_too_large",
        )
