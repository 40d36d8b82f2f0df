"""Request bodies of /v1/chat/completions -> a `openai_params.Request` (one prompt: the messages
through the tokenizer's chat template). Checked as `openai_params` checks completions: every key
known, refused by name, or accepted at its neutral value only.
"""

from __future__ import annotations

from typing import Any

from mmr_jax.serving.openai_format import HTTPError
from mmr_jax.serving.openai_params import (
    _COMMON,
    _NEUTRAL,
    _NO_EFFECT,
    BOTH,
    MAX_TOP_LOGPROBS,
    Request,
    _bool,
    _check_context,
    _check_supported,
    _int,
    _request,
    _truncate,
)

_CHAT_UNSUPPORTED = {
    "tools": "tools",
    "functions": "functions",
    "function_call": "function_call",
    "audio": "audio output",
    "prediction": "predicted outputs",
    "echo": "echo",
    "use_beam_search": "beam search",
}
_CHAT_NEUTRAL = {
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "parallel_tool_calls": (None, True, False),  # only means something with tools
}
_CHAT = {
    "messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs",
    "add_generation_prompt", "continue_final_message",
} | BOTH  # fmt: skip
# chat_template_kwargs that would change how the template is called, not what it renders.
_TEMPLATE_RESERVED = {
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize",
    "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
    "padding", "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask",
}  # fmt: skip


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
    _check_supported(
        body, _CHAT_UNSUPPORTED, {**_NEUTRAL, **_CHAT_NEUTRAL}, _COMMON | _NO_EFFECT | _CHAT
    )
    messages = _messages(body)
    template_kwargs = _template_kwargs(body)
    want = body.get("logprobs")
    if want not in (None, True, False):
        raise HTTPError(400, f"logprobs must be a boolean, got {want!r}", param="logprobs")
    top = _int(body, "top_logprobs", low=0, high=MAX_TOP_LOGPROBS)
    if top and not want:
        raise HTTPError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    generation_prompt = _bool(body, "add_generation_prompt", True)
    continue_final = _bool(body, "continue_final_message", False)
    if generation_prompt and continue_final:
        raise HTTPError(
            400,
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    if continue_final:
        template_kwargs = {**template_kwargs, "continue_final_message": True}
    if not generation_prompt:
        template_kwargs = {**template_kwargs, "add_generation_prompt": False}
    try:
        if template_kwargs:
            prompt = backend.chat_prompt(messages, template_kwargs=template_kwargs)
        else:
            prompt = backend.chat_prompt(messages)
    except Exception as e:  # A template's own error (roles out of order, ...) is the request's.
        raise HTTPError(400, f"chat template failed: {e}", param="messages") from e
    (prompt,) = _truncate(body, [prompt], backend.max_model_len)
    room = backend.max_model_len - len(prompt)
    if default_max_tokens is not None:
        room = max(1, min(room, default_max_tokens))
    _check_context([prompt], 1, backend.max_model_len, "messages")
    max_tokens = _int(body, "max_completion_tokens", low=1) or _int(body, "max_tokens", low=1)
    logprobs = (top or 0) if want else None
    return _request(body, backend, [prompt], max_tokens or room, "messages", logprobs)


def _template_kwargs(body: dict) -> dict:
    """chat_template_kwargs: extra variables the chat template renders with (as vLLM)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise HTTPError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
    reserved = sorted(set(kwargs) & _TEMPLATE_RESERVED)
    if reserved:
        raise HTTPError(
            400,
            f"chat_template_kwargs may not set {reserved[0]!r}",
            param="chat_template_kwargs",
        )
    return kwargs
