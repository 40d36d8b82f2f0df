"""request_models: the completion and chat bodies as pydantic models, and the one-line 400s their
errors become (the messages of each parameter are checked in openai_params_test.py)."""

import annotated_types
import pytest

from mmr_jax.serving import request_models
from mmr_jax.serving.openai_format import HTTPError
from mmr_jax.serving.request_models import ChatCompletionRequest, CompletionRequest

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
BODIES = {CompletionRequest: {"prompt": "hi"}, ChatCompletionRequest: CHAT}


def _refusal(model, body) -> HTTPError:
    with pytest.raises(HTTPError) as e:
        request_models.validate(model, {**BODIES[model], **body})
    assert e.value.status == 400
    return e.value


def _bounded(model):
    """(field, lowest allowed, highest allowed or None) of each field with a numeric range."""
    for name, field in model.model_fields.items():
        low = next((m.ge for m in field.metadata if isinstance(m, annotated_types.Ge)), None)
        high = next((m.le for m in field.metadata if isinstance(m, annotated_types.Le)), None)
        if low is not None:
            yield name, low, high


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_every_range_is_enforced_and_named(model):
    fields = list(_bounded(model))
    assert {"n", "seed", "temperature", "prompt_logprobs"} <= {f for f, _, _ in fields}
    for name, low, high in fields:
        step = 1 if isinstance(low, int) else 0.5
        error = _refusal(model, {name: low - step})
        assert error.message.startswith(f"{name} must be ") and error.param == name
        assert f"got {low - step}" in error.message, error.message
        if high is not None:
            assert f"{high}" in _refusal(model, {name: high + step}).message
        request_models.validate(model, {**BODIES[model], name: low})  # the bound itself is in


@pytest.mark.parametrize(
    "body,message",
    [
        ({"n": "2"}, "n must be an integer, got '2'"),  # strict: no strings for numbers
        ({"n": 2.0}, "n must be an integer, got 2.0"),
        ({"temperature": True}, "temperature must be a finite number, got True"),
        ({"stream": 1}, "stream must be a boolean, got 1"),
        ({"return_token_ids": "yes"}, "return_token_ids must be a boolean"),
        ({"truncation_side": "middle"}, "truncation_side must be 'left' or 'right'"),
        ({"stop": ["a", 1]}, "stop must be a non-empty string or a list of them"),
        ({"stream": True, "stream_options": {"usage": True}}, "stream_options must be an object"),
        (
            {"stream": True, "stream_options": {"include_usage": 1}},
            "include_usage must be a boolean",
        ),
    ],
)
def test_types_are_strict_on_both_routes(body, message):
    for model in (CompletionRequest, ChatCompletionRequest):
        error = _refusal(model, body)
        assert error.message.startswith(message), error.message
        assert error.param == next(iter(body)) or error.param == "stream_options"


def test_a_refused_feature_is_named_before_other_errors():
    body = {"tools": [{"type": "function"}], "n": 0, "nonsense": 1}
    assert _refusal(ChatCompletionRequest, body).message == "tools is not supported by this server"
    error = _refusal(ChatCompletionRequest, {"n": 0, "nonsense": 1})
    assert error.message == "the parameter 'nonsense' is not supported by this server"
    assert error.param == "nonsense"


def test_chat_messages_errors_name_the_message():
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "image_url"}]}]
    error = _refusal(ChatCompletionRequest, {"messages": msgs})
    assert error.message == "messages[1]: only text content parts are supported"
    assert error.param == "messages[1]"
    error = _refusal(
        ChatCompletionRequest, {"messages": [{"role": "assistant", "tool_calls": [{}]}]}
    )
    assert error.message == "messages[0]: tool calls are not supported"


def test_what_clients_send_is_accepted_with_its_values():
    """Bodies as the openai client and lm-eval send them (nulls, vLLM's extensions)."""
    body = {"model": "m", "prompt": [[1, 2], [3]], "max_tokens": 1, "temperature": 0,
            "logprobs": 1, "echo": True, "seed": 1234, "stop": None, "user": "u",
            "stream": False, "top_k": -1, "logit_bias": {"5": -1.5}}  # fmt: skip
    req = request_models.validate(CompletionRequest, body)
    assert req.prompt == [[1, 2], [3]] and req.logprobs == 1 and req.echo is True
    assert req.stops == () and req.logit_bias == {"5": -1.5} and req.temperature == 0.0
    chat = {**CHAT, "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 2,
            "stop": "x", "response_format": {"type": "text"}, "tool_choice": "none"}  # fmt: skip
    req = request_models.validate(ChatCompletionRequest, chat)
    assert req.messages[0].text == "hi" and req.top_logprobs == 2 and req.stops == ("x",)
