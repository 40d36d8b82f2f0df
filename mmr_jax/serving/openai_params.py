"""Request bodies of /v1/completions and /v1/chat/completions -> prompt ids and sampling values.

A request is answered as asked or refused (`openai_format.HTTPError` 400), never answered as if a
parameter were absent: controls this sampler does not apply are accepted only at their neutral
values, features it lacks (tools, beam search, echo, guided decoding, prompt log-probs, ...) are
refused by name, and so is every key outside the ones listed here (`_COMMON`, `_COMPLETION`,
`_CHAT` and the neutral tables). Values are type-checked (numbers finite, ids inside the
vocabulary) before anything is generated or compiled.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from mmr_jax.rollout import base
from mmr_jax.serving import token_controls
from mmr_jax.serving.openai_format import HTTPError

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat (and vLLM's default max_logprobs)
MAX_STOPS = 4  # OpenAI's limit on stop strings

_UNSUPPORTED = {
    "use_beam_search": "beam search",
    "suffix": "suffix",
    "prompt_embeds": "prompt_embeds",
}

# Sampling controls the embedded sampler does not apply: accepted only at their neutral value.
_NEUTRAL = {
    "best_of": (None, 1),
    "repetition_penalty": (None, 1, 1.0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "min_p": (None, 0, 0.0),
}
# Keys both routes take (handled below); keys with no effect on the output are in _NO_EFFECT.
_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop",
    "stop_token_ids", "ignore_eos", "stream", "stream_options", "logprobs",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
    *token_controls.KEYS,
}  # fmt: skip
_NO_EFFECT = {"user", "metadata", "store", "request_id", "service_tier", "priority"}
BOTH = {
    "truncation_side",
    "return_token_ids",
    "return_tokens_as_token_ids",
    "prompt_logprobs",
    "truncate_prompt_tokens",
}
_COMPLETION = {"prompt", "add_special_tokens", "echo"} | BOTH


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


def _check_supported(body: dict, unsupported: dict, neutral: dict, known: set) -> None:
    for key, what in unsupported.items():
        if body.get(key):
            raise HTTPError(400, f"{what} is not supported by this server", param=key)
    for key, values in neutral.items():
        value = body.get(key)
        if not any(type(value) is type(v) and value == v for v in values):
            raise HTTPError(400, f"{key}={body[key]!r} is not supported by this server", param=key)
    for key in body:
        if key not in known and key not in unsupported and key not in neutral:
            raise HTTPError(
                400, f"the parameter {key!r} is not supported by this server", param=key
            )
    if body.get("spaces_between_special_tokens") not in (None, True):
        raise HTTPError(
            400,
            "spaces_between_special_tokens=false is not supported by this server",
            param="spaces_between_special_tokens",
        )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise HTTPError(400, f"model must be a string, got {model!r}", param="model")


def _bool(body: dict, key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise HTTPError(400, f"{key} must be a boolean, got {value!r}", param=key)
    return value


def _float(body: dict, key: str, default: float, *, low: float, high: float | None = None):
    """A finite number in [low, high] (`low` excluded for top_p), or `default` when absent."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise HTTPError(400, f"{key} must be a finite number, got {value!r}", param=key)
    open_low = key == "top_p"
    if value < low or (open_low and value == low) or (high is not None and value > high):
        if high is None:
            bound = f">= {low:g}"
        else:
            bound = f"in {'(' if open_low else '['}{low:g}, {high:g}]"
        raise HTTPError(400, f"{key} must be {bound}, got {value}", param=key)
    return float(value)


def _token_ids(ids, vocab_size: int, param: str) -> list[int]:
    """`ids` as a list of ints in [0, vocab_size), or a 400 naming `param`."""
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise HTTPError(400, f"{param} must be a list of integer token ids", param=param)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise HTTPError(
            400, f"{param}: token id {bad[0]} is out of vocabulary (size {vocab_size})", param=param
        )
    return list(ids)


def _int(body: dict, key: str, *, low: int, high: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise HTTPError(400, f"{key} must be an integer, got {value!r}", param=key)
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise HTTPError(400, f"{key} must be {bound}, got {value}", param=key)
    return value


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise HTTPError(400, "stop must be a non-empty string or a list of them", param="stop")
    if len(stops) > MAX_STOPS:
        raise HTTPError(400, f"stop takes at most {MAX_STOPS} strings", param="stop")
    return tuple(stops)


def _stream(body: dict) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats: usage on every chunk, as vLLM)."""
    stream = body.get("stream")
    if stream not in (None, True, False):
        raise HTTPError(400, f"stream must be a boolean, got {stream!r}", param="stream")
    options = body.get("stream_options")
    if options is None:
        return bool(stream), False, False
    if not stream:
        raise HTTPError(
            400, "stream_options is only allowed when stream is true", param="stream_options"
        )
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise HTTPError(
            400,
            "stream_options must be an object with include_usage, continuous_usage_stats",
            param="stream_options",
        )
    include = _bool(options, "include_usage", False)
    return True, include, include and _bool(options, "continuous_usage_stats", False)


def _check_context(prompts: list[list[int]], max_new: int, max_model_len: int, param: str):
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


def _prompt_logprobs(body: dict, logprobs: int | None, stream: bool) -> int | None:
    """vLLM's prompt_logprobs (0-20); echo with logprobs asks for them too (as vLLM)."""
    k = _int(body, "prompt_logprobs", low=0, high=MAX_TOP_LOGPROBS)
    if k is not None and k > 0 and stream:
        raise HTTPError(
            400, "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs"
        )
    if k is None and body.get("echo") and logprobs is not None:
        k = logprobs
    return k


def _truncate(body: dict, prompts: list[list[int]], max_model_len: int) -> list[list[int]]:
    """vLLM's truncate_prompt_tokens: keep each prompt's last k tokens (-1: max_model_len; the
    first k with truncation_side 'right')."""
    k = _int(body, "truncate_prompt_tokens", low=-1, high=2**63 - 1)
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
    side = body.get("truncation_side", "left")
    if side not in ("left", "right"):
        raise HTTPError(400, "truncation_side must be 'left' or 'right'", param="truncation_side")
    return [p[-k:] if side == "left" else p[:k] for p in prompts]


def _request(body, backend, prompts, max_tokens, param, logprobs, echo=False) -> Request:
    top_k = _int(body, "top_k", low=-1)
    stream, include_usage, continuous_usage = _stream(body)
    stop_ids = body.get("stop_token_ids")
    stop_ids = (
        () if stop_ids is None else _token_ids(stop_ids, backend.vocab_size, "stop_token_ids")
    )
    try:
        params = base.SamplingParams(
            max_new_tokens=max(max_tokens, 1),
            temperature=_float(body, "temperature", 1.0, low=0.0),
            top_p=_float(body, "top_p", 1.0, low=0.0, high=1.0),
            top_k=0 if top_k is None or top_k < 0 else top_k,
            n=_int(body, "n", low=1) or 1,
            stop_token_ids=tuple(stop_ids or ()),
            seed=_int(body, "seed", low=-(2**63), high=2**63 - 1),
        )
    except (TypeError, ValueError) as e:
        raise HTTPError(400, f"invalid sampling parameters: {e}") from e
    _check_context(prompts, params.max_new_tokens, backend.max_model_len, param)
    controls = token_controls.parse(
        body, vocab_size=backend.vocab_size, max_tokens=params.max_new_tokens
    )
    stop = _stops(body)
    if controls.min_tokens and stop:
        raise HTTPError(
            400, "min_tokens with stop strings is not supported by this server", param="stop"
        )
    return Request(
        prompts=prompts,
        params=params,
        stop=stop,
        logprobs=logprobs,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        prompt_logprobs=_prompt_logprobs(body, logprobs, stream),
        echo=echo,
        generate=max_tokens > 0,
        ignore_eos=_bool(body, "ignore_eos", False),
        include_stop_str=_bool(body, "include_stop_str_in_output", False),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        controls=controls,
    )


def _prompts(body: dict, backend: Any) -> list[list[int]]:
    prompt = body.get("prompt")
    add_special = _bool(body, "add_special_tokens", True)
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt is None or prompt == []:
        raise HTTPError(
            400, "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt"
        )
    if not isinstance(prompt, list):
        raise HTTPError(
            400, "prompt must be a string, a list of strings or token ids", param="prompt"
        )
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = [prompt]
    out = []
    for p in prompt:
        if isinstance(p, str):
            try:
                p.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate ("\\ud83d"): not text
                raise HTTPError(400, f"prompt is not valid Unicode: {e}", param="prompt") from e
            out.append(backend.encode(p, add_special_tokens=add_special))
        elif isinstance(p, list) and all(isinstance(t, int) for t in p):
            out.append(_token_ids(p, backend.vocab_size, "prompt"))
        else:
            raise HTTPError(400, "mixed or invalid prompt list", param="prompt")
        if not out[-1]:
            raise HTTPError(400, "empty prompt", param="prompt")
    return out


def parse_completion_request(body: dict, backend: Any) -> Request:
    """The `Request` of a /v1/completions body (`backend`: a `server.Backend`)."""
    _check_supported(body, _UNSUPPORTED, _NEUTRAL, _COMMON | _NO_EFFECT | _COMPLETION)
    for key in ("return_token_ids", "return_tokens_as_token_ids"):
        _bool(body, key, False)
    echo = _bool(body, "echo", False)
    prompts = _truncate(body, _prompts(body, backend), backend.max_model_len)
    logprobs = _int(body, "logprobs", low=0, high=MAX_TOP_LOGPROBS)
    max_tokens = _int(body, "max_tokens", low=0 if echo else 1)
    if max_tokens is None:
        max_tokens = 16
    return _request(body, backend, prompts, max_tokens, "prompt", logprobs, echo)
