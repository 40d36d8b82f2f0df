"""Request bodies of /v1/completions and /v1/chat/completions -> prompt ids and sampling values.

A body is first validated as its pydantic model (`request_models`: every key known, typed and
ranged; features this server lacks refused by name; controls it does not apply accepted at
their neutral values only), then checked against the model served (token ids inside the
vocabulary, the context length, truncation) and turned into a `Request`. A request is answered
as asked or refused (`openai_format.HTTPError` 400), never answered as if a parameter were
absent, and nothing is generated or compiled before it passes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mmr_jax.rollout import base
from mmr_jax.serving import request_models, token_controls
from mmr_jax.serving.openai_format import HTTPError
from mmr_jax.serving.request_models import MAX_TOP_LOGPROBS

__all__ = ["MAX_TOP_LOGPROBS", "Request", "parse_completion_request"]


@dataclasses.dataclass(frozen=True)
class Request:
    """What a completion request asks, beside the prompts and sampling values.

    logprobs: None (no log-probs) or k, the number of most likely alternatives per token
      (0: the sampled token's log-prob only).
    prompt_logprobs: None, or k alternatives per prompt token (vLLM's prompt_logprobs; echo with
      logprobs asks for them too).
    echo: the completion's text and log-probs start with the prompt's (completions only).
    continuous_usage: a stream's every chunk carries the usage so far.
    controls: logit_bias, allowed_token_ids, min_tokens (`token_controls`).
    """

    prompts: list[list[int]]
    params: base.SamplingParams
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    prompt_logprobs: int | None = None
    echo: bool = False
    generate: bool = True  # False: echo with max_tokens 0, the prompt alone
    ignore_eos: bool = False
    include_stop_str: bool = False
    skip_special_tokens: bool = True
    controls: token_controls.TokenControls = token_controls.NONE


def token_ids(ids: list[int], vocab_size: int, param: str) -> list[int]:
    """`ids` (integers, as the request models type them) if all lie in [0, vocab_size), else a
    400 naming `param`."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise HTTPError(
            400, f"{param}: token id {bad[0]} is out of vocabulary (size {vocab_size})", param=param
        )
    return list(ids)


def check_context(prompts: list[list[int]], max_new: int, max_model_len: int, param: str):
    longest = max(len(p) for p in prompts)
    if longest + max_new > max_model_len:
        raise HTTPError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {longest + max_new} tokens ({longest} in the {param}, {max_new} for the "
            "completion). Please reduce the length of the prompt or max_tokens.",
            param=param,
            code="context_length_exceeded",
        )


def truncate(
    body: request_models.CompletionRequest | request_models.ChatCompletionRequest,
    prompts: list[list[int]],
    max_model_len: int,
) -> list[list[int]]:
    """vLLM's truncate_prompt_tokens: keep each prompt's last k tokens (-1: max_model_len; the
    first k with truncation_side 'right')."""
    k = body.truncate_prompt_tokens
    if k is None:
        return prompts
    if k > max_model_len:
        raise HTTPError(
            400,
            f"truncate_prompt_tokens value ({k}) is greater than max_model_len "
            f"({max_model_len}). Please request a smaller truncation size.",
            param="truncate_prompt_tokens",
        )
    k = max_model_len if k == -1 else k
    if k == 0:
        raise HTTPError(
            400, "truncate_prompt_tokens=0 leaves no prompt", param="truncate_prompt_tokens"
        )
    side = body.truncation_side or "left"
    return [p[-k:] if side == "left" else p[:k] for p in prompts]


def build_request(body, backend, prompts, max_tokens, param, logprobs, echo=False) -> Request:
    """The `Request` of a validated body (`request_models`) and its prompts' ids."""
    stop_ids = token_ids(body.stop_token_ids or [], backend.vocab_size, "stop_token_ids")
    options = body.stream_options or request_models.StreamOptions()
    include_usage = bool(options.include_usage)
    try:
        params = base.SamplingParams(
            max_new_tokens=max(max_tokens, 1),
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(body.top_k or 0, 0),
            n=body.n or 1,
            stop_token_ids=tuple(stop_ids),
            seed=body.seed,
        )
    except (TypeError, ValueError) as e:
        raise HTTPError(400, f"invalid sampling parameters: {e}") from e
    check_context(prompts, params.max_new_tokens, backend.max_model_len, param)
    controls = token_controls.parse(
        {key: getattr(body, key) for key in token_controls.KEYS},
        vocab_size=backend.vocab_size,
        max_tokens=params.max_new_tokens,
    )
    prompt_logprobs = body.prompt_logprobs
    if prompt_logprobs is None and echo and logprobs is not None:
        prompt_logprobs = logprobs  # echo with logprobs: the prompt's too (as vLLM)
    return Request(
        prompts=prompts,
        params=params,
        stop=body.stops,
        logprobs=logprobs,
        stream=bool(body.stream),
        include_usage=include_usage,
        continuous_usage=include_usage and bool(options.continuous_usage_stats),
        prompt_logprobs=prompt_logprobs,
        echo=echo,
        generate=max_tokens > 0,
        ignore_eos=bool(body.ignore_eos),
        include_stop_str=bool(body.include_stop_str_in_output),
        skip_special_tokens=body.skip_special_tokens is not False,
        controls=controls,
    )


def _prompts(body: request_models.CompletionRequest, backend: Any) -> list[list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise HTTPError(
            400, "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt"
        )
    if all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    out = []
    for p in prompt:
        if isinstance(p, str):
            try:
                p.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate ("\\ud83d"): not text
                raise HTTPError(400, f"prompt is not valid Unicode: {e}", param="prompt") from e
            out.append(backend.encode(p, add_special_tokens=body.add_special_tokens is not False))
        else:
            out.append(token_ids(p, backend.vocab_size, "prompt"))
        if not out[-1]:
            raise HTTPError(400, "empty prompt", param="prompt")
    return out


def parse_completion_request(body: dict, backend: Any) -> Request:
    """The `Request` of a /v1/completions body (`backend`: a `server.Backend`)."""
    req = request_models.validate(request_models.CompletionRequest, body)
    prompts = truncate(req, _prompts(req, backend), backend.max_model_len)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    return build_request(req, backend, prompts, max_tokens, "prompt", req.logprobs, bool(req.echo))
