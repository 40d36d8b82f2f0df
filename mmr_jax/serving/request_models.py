"""The bodies of /v1/completions and /v1/chat/completions as pydantic models (as vLLM's
`protocol.py`): every key the server takes, its type, range and default, and the keys it refuses.

A body is answered as asked or refused, never answered as if a parameter were absent: unknown
keys are refused (`extra="forbid"`), types are strict (no "0.5" for a number, no `true` for an
integer, numbers finite), features this server lacks are refused by name when set (`_refused`),
and sampling controls it does not apply are accepted only at their neutral values (`_neutral`).
What needs the model (token ids inside the vocabulary, the context length, the chat template) is
checked after, by `openai_params` / `openai_chat_params`.

`validate` turns pydantic's first error into a one-line 400 in OpenAI's shape naming the
parameter (`HTTPError`, `param` the key): "temperature must be >= 0, got -1", "the parameter
'x' is not supported by this server".
"""

from typing import Annotated, Any, Literal, TypeVar

import annotated_types
import pydantic
from pydantic import AfterValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from mmr_jax.serving.openai_format import HTTPError

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat (and vLLM's default max_logprobs)
MAX_STOPS = 4  # OpenAI's limit on stop strings
INT64 = (-(2**63), 2**63 - 1)
# chat_template_kwargs that would change how the template is called, not what it renders.
TEMPLATE_RESERVED = {
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize",
    "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
    "padding", "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask",
}  # fmt: skip
_REFUSED_KINDS = ("refused", "neutral")  # reported before any other error of a body


def _request_error(message: str, param: str | None = None) -> PydanticCustomError:
    """An error of the whole body (a model validator's), carrying the parameter it names."""
    return PydanticCustomError("request", message, {"param": param})


def _refused(what: str):
    """A feature this server lacks: refused when set to anything but null/false/empty."""

    def check(value):
        if value:
            raise PydanticCustomError("refused", f"{what} is not supported by this server")
        return value

    return Annotated[Any, AfterValidator(check)]


def _neutral(*values):
    """A sampling control the sampler does not apply: accepted only at these values (same
    type: `true` is not 1)."""

    def check(value, info: pydantic.ValidationInfo):
        if not any(type(value) is type(v) and value == v for v in values):
            message = f"{info.field_name}={value!r} is not supported by this server"
            raise PydanticCustomError("neutral", message[:300])
        return value

    return Annotated[Any, AfterValidator(check)]


Stop = Annotated[str, Field(min_length=1)]
TokenIds = list[int]


class _Body(pydantic.BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # usage on every chunk (vLLM's)


class _Common(_Body):
    """The keys both routes take."""

    # Refused, or accepted at their neutral value only (checked first).
    use_beam_search: _refused("beam search") = None
    best_of: _neutral(None, 1) = None
    repetition_penalty: _neutral(None, 1, 1.0) = None
    presence_penalty: _neutral(None, 0, 0.0) = None
    frequency_penalty: _neutral(None, 0, 0.0) = None
    min_p: _neutral(None, 0, 0.0) = None
    spaces_between_special_tokens: _neutral(None, True) = None
    # Sampling.
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)  # vLLM's: -1 or 0 is off
    n: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1])
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOPS)] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool | None = None
    # Logits controls (vLLM's; their contents are checked by `token_controls`).
    logit_bias: dict[str, Any] | None = None
    allowed_token_ids: list[Any] | None = None
    min_tokens: int | None = Field(None, ge=0)
    # Output.
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Prompt.
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64[1])
    truncation_side: Literal["left", "right"] | None = None
    # Accepted without effect on the output.
    user: Any = None
    metadata: Any = None
    store: Any = None
    request_id: Any = None
    service_tier: Any = None
    priority: Any = None

    @pydantic.model_validator(mode="after")
    def _consistent(self):
        if self.stream_options is not None and not self.stream:
            raise _request_error(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        if self.prompt_logprobs and self.stream:
            raise _request_error(
                "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
            )
        if self.min_tokens and self.stop:
            raise _request_error(
                "min_tokens with stop strings is not supported by this server", "stop"
            )
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_Common):
    """POST /v1/completions."""

    suffix: _refused("suffix") = None
    prompt_embeds: _refused("prompt_embeds") = None
    # text, texts, token ids, or lists of token ids (ids checked against the vocabulary after)
    prompt: str | list[str | TokenIds] | TokenIds | None = None
    echo: bool | None = None  # the prompt's text and log-probs first
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_special_tokens: bool | None = None
    max_tokens: int | None = None  # >= 0 with echo, else >= 1 (below)

    @pydantic.model_validator(mode="after")
    def _max_tokens(self):
        low = 0 if self.echo else 1  # 0: echo's prompt alone
        if self.max_tokens is not None and self.max_tokens < low:
            raise _request_error(
                f"max_tokens must be >= {low}, got {self.max_tokens}", "max_tokens"
            )
        return self


class TextPart(pydantic.BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: str = ""


class Message(pydantic.BaseModel):
    """A chat message; keys beside these (name, ...) are left to the chat template's reading."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: Any = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content


class KVTransferParams(_Body):
    """vLLM's `kv_transfer_params`, of which this server takes the decode-side token reuse only:
    the prompt's ids as a prefill stage tokenized them, used verbatim instead of the messages.
    Its other keys (disaggregated prefill) are refused."""

    prompt_token_ids: TokenIds | None = None


def _template_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    reserved = sorted(set(kwargs) & TEMPLATE_RESERVED)
    if reserved:
        raise PydanticCustomError("request", f"chat_template_kwargs may not set {reserved[0]!r}")
    return kwargs


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    tools: _refused("tools") = None
    functions: _refused("functions") = None
    function_call: _refused("function_call") = None
    audio: _refused("audio output") = None
    prediction: _refused("predicted outputs") = None
    echo: _refused("echo") = None
    tool_choice: _neutral(None, "none") = None
    response_format: _neutral(None, {"type": "text"}) = None
    modalities: _neutral(None, ["text"]) = None
    parallel_tool_calls: _neutral(None, True, False) = None  # only means something with tools
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: Annotated[dict[str, Any], AfterValidator(_template_kwargs)] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    kv_transfer_params: KVTransferParams | None = None

    @pydantic.model_validator(mode="after")
    def _chat_consistent(self):
        if self.top_logprobs and not self.logprobs:
            raise _request_error("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.continue_final_message and self.add_generation_prompt is not False:
            raise _request_error(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                "continue_final_message",
            )
        for i, m in enumerate(self.messages):
            where = f"messages[{i}]"
            if m.content is None and m.tool_calls:
                raise _request_error(f"{where}: tool calls are not supported", where)
            if m.content is None:
                raise _request_error(f"{where}.content must be a string or text parts", where)
        return self


Body = TypeVar("Body", bound=_Body)

# Fixed messages for keys whose type is a union or a container, by (key, error type) or key.
_MESSAGES = {
    "prompt": "prompt must be a string, a list of strings or token ids",
    ("stop", "too_long"): f"stop takes at most {MAX_STOPS} strings",
    "stop": "stop must be a non-empty string or a list of them",
    "stop_token_ids": "stop_token_ids must be a list of integer token ids",
    "stream_options": "stream_options must be an object with include_usage, continuous_usage_stats",
    "logit_bias": "logit_bias must be an object of token id: bias",
    "allowed_token_ids": "allowed_token_ids must be a non-empty list of token ids",
    "min_tokens": "min_tokens must be an integer >= 0, got {input!r}",
    "truncation_side": "truncation_side must be 'left' or 'right'",
    "chat_template_kwargs": "chat_template_kwargs must be an object",
    ("kv_transfer_params", "extra_forbidden"): "kv_transfer_params takes only prompt_token_ids "
    "on this server (no disaggregated prefill)",
    "kv_transfer_params": "kv_transfer_params.prompt_token_ids must be a list of integer token ids",
}
_TYPES = {
    "bool_type": "a boolean",
    "int_type": "an integer",
    "float_type": "a finite number",
    "finite_number": "a finite number",
    "string_type": "a string",
    "dict_type": "an object",
    "list_type": "a list",
}
_BOUNDS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def validate(model: type[Body], body: dict) -> Body:
    """`body` as `model`, or a 400 naming the parameter of the first error (features refused
    by name first, then unknown keys, then the rest in the model's order)."""
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as e:
        errors = e.errors(include_url=False)
        rank = {"extra_forbidden": 1, **dict.fromkeys(_REFUSED_KINDS, 0)}
        first = min(errors, key=lambda er: rank.get(er["type"], 2))
        key = first["loc"][0] if first["loc"] else None
        same = [er for er in errors if er["loc"][:1] == first["loc"][:1]]
        message, param = _message(model, first, same), key
        if first["type"] == "request":
            param = (first.get("ctx") or {}).get("param", key)
        elif key == "messages" and len(first["loc"]) > 1:
            param = f"messages[{first['loc'][1]}]"
        raise HTTPError(400, message, param=param) from None


def _message(model, first: dict, same: list[dict]) -> str:
    kind, loc, value = first["type"], first["loc"], first.get("input")
    shown = repr(value)[:200]
    if kind in (*_REFUSED_KINDS, "request", "value_error"):
        return first["msg"]
    key = loc[0]
    if kind == "extra_forbidden" and len(loc) == 1:
        return f"the parameter {key!r} is not supported by this server"
    if key == "messages":
        return _messages_message(first, same)
    for er in same:  # a union's branches each report: the most specific message wins
        if (key, er["type"]) in _MESSAGES:
            return _MESSAGES[(key, er["type"])]
    if key in _MESSAGES:
        if key == "stream_options" and len(loc) == 2 and kind == "bool_type":
            return f"{loc[1]} must be a boolean, got {shown}"
        return _MESSAGES[key].format(input=value)
    if kind in _BOUNDS:
        return f"{key} must be {_bound(model.model_fields[key].metadata)}, got {value}"
    if kind in _TYPES:
        return f"{key} must be {_TYPES[kind]}, got {shown}"
    return f"{key}: {first['msg']}"


def _bound(metadata) -> str:
    """A field's range as "in [low, high]", "in (low, high]" or ">= low"."""
    low = high = None
    open_low = False
    for m in metadata:
        if isinstance(m, annotated_types.Ge):
            low = m.ge
        elif isinstance(m, annotated_types.Gt):
            low, open_low = m.gt, True
        elif isinstance(m, annotated_types.Le):
            high = m.le
    show = lambda x: f"{x:g}" if isinstance(x, float) else str(x)
    if high is None:
        return f"{'>' if open_low else '>='} {show(low)}"
    return f"in {'(' if open_low else '['}{show(low)}, {show(high)}]"


def _messages_message(first: dict, same: list[dict]) -> str:
    loc = first["loc"]
    if len(loc) == 1:
        return "messages must be a non-empty list"
    where = f"messages[{loc[1]}]"
    if len(loc) == 2 or loc[2] == "role":
        return f"{where} must be an object with a role"
    if any(er["type"] == "literal_error" for er in same if er["loc"][:2] == loc[:2]):
        return f"{where}: only text content parts are supported"
    return f"{where}.content must be a string or text parts"
