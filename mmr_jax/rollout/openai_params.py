"""Request bodies of /v1/completions and /v1/chat/completions -> prompt ids and sampling values.

A request is answered as asked or refused (`openai_format.HTTPError` 400), never answered as if a
parameter were absent: controls this sampler does not apply are accepted only at their neutral
values, and features it lacks (tools, beam search, echo, ...) are refused by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mmr_jax.rollout import base
from mmr_jax.rollout.openai_format import HTTPError

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat (and vLLM's default max_logprobs)
MAX_STOPS = 4  # OpenAI's limit on stop strings

_UNSUPPORTED = {
    "echo": "echo",
    "use_beam_search": "beam search",
    "suffix": "suffix",
    "prompt_embeds": "prompt_embeds",
}
_CHAT_UNSUPPORTED = {
    "tools": "tools",
    "functions": "functions",
    "function_call": "function_call",
    "audio": "audio output",
    "prediction": "predicted outputs",
    "echo": "echo",
    "use_beam_search": "beam search",
    "continue_final_message": "continue_final_message",
}

# Sampling controls the embedded sampler does not apply: accepted only at their neutral value.
_NEUTRAL = {
    "best_of": (None, 1),
    "repetition_penalty": (None, 1, 1.0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "min_p": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "min_tokens": (None, 0),
}
_CHAT_NEUTRAL = {
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "add_generation_prompt": (None, True),
}


@dataclasses.dataclass(frozen=True)
class Request:
    """What a completion request asks, beside the prompts and sampling values.

    logprobs: None (no log-probs) or k, the number of most likely alternatives per token
      (0: the sampled token's log-prob only).
    """

    prompts: list[list[int]]
    params: base.SamplingParams
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False


def _check_supported(body: dict, unsupported: dict, neutral: dict) -> None:
    for key, what in unsupported.items():
        if body.get(key):
            raise HTTPError(400, f"{what} is not supported by this server", param=key)
    for key, values in neutral.items():
        if body.get(key) not in values:
            raise HTTPError(400, f"{key}={body[key]!r} is not supported by this server", param=key)


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


def _stream(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream")
    if stream not in (None, True, False):
        raise HTTPError(400, f"stream must be a boolean, got {stream!r}", param="stream")
    options = body.get("stream_options")
    if options is None:
        return bool(stream), False
    if not stream:
        raise HTTPError(
            400, "stream_options is only allowed when stream is true", param="stream_options"
        )
    if not isinstance(options, dict):
        raise HTTPError(400, "stream_options must be an object", param="stream_options")
    return True, bool(options.get("include_usage"))


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


def _request(body, prompts, max_tokens, max_model_len, param, logprobs) -> Request:
    temperature, top_p = body.get("temperature"), body.get("top_p")
    top_k = _int(body, "top_k", low=-1)
    stream, include_usage = _stream(body)
    try:
        params = base.SamplingParams(
            max_new_tokens=max_tokens,
            temperature=1.0 if temperature is None else float(temperature),
            top_p=1.0 if top_p is None else float(top_p),
            top_k=0 if top_k is None or top_k < 0 else top_k,
            n=_int(body, "n", low=1) or 1,
            stop_token_ids=tuple(body.get("stop_token_ids") or ()),
            seed=_int(body, "seed", low=-(2**63)),
        )
    except (TypeError, ValueError) as e:
        raise HTTPError(400, f"invalid sampling parameters: {e}") from e
    _check_context(prompts, params.max_new_tokens, max_model_len, param)
    return Request(
        prompts=prompts,
        params=params,
        stop=_stops(body),
        logprobs=logprobs,
        stream=stream,
        include_usage=include_usage,
        ignore_eos=bool(body.get("ignore_eos")),
    )


def _prompts(body: dict, backend: Any) -> list[list[int]]:
    prompt = body.get("prompt")
    add_special = bool(body.get("add_special_tokens", True))
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise HTTPError(
            400, "prompt must be a string, a list of strings or token ids", param="prompt"
        )
    if all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append(backend.encode(p, add_special_tokens=add_special))
        elif isinstance(p, list) and all(isinstance(t, int) and t >= 0 for t in p):
            out.append(list(p))
        else:
            raise HTTPError(400, "mixed or invalid prompt list", param="prompt")
        if not out[-1]:
            raise HTTPError(400, "empty prompt", param="prompt")
    return out


def parse_completion_request(body: dict, backend: Any) -> Request:
    """The `Request` of a /v1/completions body (`backend`: a `server.Backend`)."""
    _check_supported(body, _UNSUPPORTED, _NEUTRAL)
    prompts = _prompts(body, backend)
    logprobs = _int(body, "logprobs", low=0, high=MAX_TOP_LOGPROBS)
    max_tokens = _int(body, "max_tokens", low=1)
    return _request(body, prompts, max_tokens or 16, backend.max_model_len, "prompt", logprobs)


def _messages(body: dict) -> list[dict]:
    """The messages, each {"role", "content": str}; text content parts are joined."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise HTTPError(400, f"{where} must be an object with a role", param=where)
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise HTTPError(400, f"{where}: only text content parts are supported", param=where)
            content = "".join(str(p.get("text", "")) for p in content)
        if content is None and m.get("tool_calls"):
            raise HTTPError(400, f"{where}: tool calls are not supported", param=where)
        if not isinstance(content, str):
            raise HTTPError(400, f"{where}.content must be a string or text parts", param=where)
        out.append({"role": m["role"], "content": content})
    return out


def parse_chat_request(
    body: dict, backend: Any, *, default_max_tokens: int | None = None
) -> Request:
    """The `Request` of a /v1/chat/completions body: one prompt, the messages rendered by the
    tokenizer's chat template with the assistant's generation prompt (`backend.chat_prompt`).
    Without max_tokens, as many as the context allows (OpenAI's rule), at most
    `default_max_tokens` when given."""
    _check_supported(body, _CHAT_UNSUPPORTED, {**_NEUTRAL, **_CHAT_NEUTRAL})
    messages = _messages(body)
    want = body.get("logprobs")
    if want not in (None, True, False):
        raise HTTPError(400, f"logprobs must be a boolean, got {want!r}", param="logprobs")
    top = _int(body, "top_logprobs", low=0, high=MAX_TOP_LOGPROBS)
    if top and not want:
        raise HTTPError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    try:
        prompt = backend.chat_prompt(messages)
    except Exception as e:  # A template's own error (roles out of order, ...) is the request's.
        raise HTTPError(400, f"chat template failed: {e}", param="messages") from e
    room = backend.max_model_len - len(prompt)
    if default_max_tokens is not None:
        room = max(1, min(room, default_max_tokens))
    _check_context([prompt], 1, backend.max_model_len, "messages")
    max_tokens = _int(body, "max_completion_tokens", low=1) or _int(body, "max_tokens", low=1)
    logprobs = (top or 0) if want else None
    return _request(body, [prompt], max_tokens or room, backend.max_model_len, "messages", logprobs)
