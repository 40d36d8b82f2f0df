"""Request bodies of /v1/chat/completions -> a `openai_params.Request` (one prompt: the messages
through the tokenizer's chat template). Validated as its pydantic model
(`request_models.ChatCompletionRequest`: every key known, refused by name, or accepted at its
neutral value only), then checked against the model served, as completions are.
"""

from __future__ import annotations

from typing import Any

from mmr_jax.serving import request_models
from mmr_jax.serving.openai_format import HTTPError
from mmr_jax.serving.openai_params import (
    Request,
    build_request,
    check_context,
    token_ids,
    truncate,
)


def parse_chat_request(
    body: dict, backend: Any, *, default_max_tokens: int | None = None
) -> Request:
    """The `Request` of a /v1/chat/completions body: one prompt, the messages rendered by the
    tokenizer's chat template with the assistant's generation prompt (`backend.chat_prompt`).
    With vLLM's `kv_transfer_params.prompt_token_ids`, those ids are the prompt, the messages
    not rendered. Without max_tokens, as many as the context allows (OpenAI's rule), at most
    `default_max_tokens` when given."""
    req = request_models.validate(request_models.ChatCompletionRequest, body)
    messages = [{"role": m.role, "content": m.text} for m in req.messages]
    template_kwargs = dict(req.chat_template_kwargs or {})
    if req.continue_final_message:
        template_kwargs["continue_final_message"] = True
    if req.add_generation_prompt is False:
        template_kwargs["add_generation_prompt"] = False
    reused = req.kv_transfer_params.prompt_token_ids if req.kv_transfer_params else None
    if reused is not None:  # vLLM's decode-side reuse: a prefill stage's ids, verbatim
        param = "kv_transfer_params.prompt_token_ids"
        prompt = token_ids(reused, backend.vocab_size, param)
        if not prompt:
            raise HTTPError(400, f"{param} must not be empty", param=param)
        return _request(req, backend, prompt, default_max_tokens)
    try:
        if template_kwargs:
            prompt = backend.chat_prompt(messages, template_kwargs=template_kwargs)
        else:
            prompt = backend.chat_prompt(messages)
    except Exception as e:  # A template's own error (roles out of order, ...) is the request's.
        raise HTTPError(400, f"chat template failed: {e}", param="messages") from e
    return _request(req, backend, prompt, default_max_tokens)


def _request(req, backend, prompt: list[int], default_max_tokens: int | None) -> Request:
    """The `Request` of a validated chat body over its prompt ids."""
    (prompt,) = truncate(req, [prompt], backend.max_model_len)
    room = backend.max_model_len - len(prompt)
    if default_max_tokens is not None:
        room = max(1, min(room, default_max_tokens))
    check_context([prompt], 1, backend.max_model_len, "messages")
    max_tokens = req.max_completion_tokens or req.max_tokens or room
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return build_request(req, backend, [prompt], max_tokens, "messages", logprobs)
