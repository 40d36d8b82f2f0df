"""openai_params: what a completion or chat body asks, and the 400s for what cannot be answered."""

import pytest

from mmr_jax.serving import openai_chat_params, openai_params
from mmr_jax.serving.openai_format import HTTPError


class _Backend:
    max_model_len = 64
    vocab_size = 1000

    def __init__(self):
        self.rendered = []

    def encode(self, text, *, add_special_tokens=True):
        return [ord(c) for c in text]

    def chat_prompt(self, messages, template_kwargs=None):
        self.rendered.append(messages)
        self.template_kwargs = template_kwargs
        return [1] * (4 * len(messages))


def _chat(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


class TestParseCompletionRequest:
    def test_values(self):
        r = openai_params.parse_completion_request(
            {
                "prompt": "ab",
                "n": 2,
                "max_tokens": 5,
                "temperature": 0,
                "seed": 3,
                "stop": "x",
                "logprobs": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            _Backend(),
        )
        assert r.prompts == [[97, 98]] and r.params.n == 2 and r.params.max_new_tokens == 5
        assert r.params.temperature == 0 and r.params.seed == 3 and r.stop == ("x",)
        assert r.logprobs == 2 and r.stream and r.include_usage

    def test_defaults(self):
        r = openai_params.parse_completion_request({"prompt": [5, 6]}, _Backend())
        assert r.params.max_new_tokens == 16 and r.logprobs is None and not r.stream
        assert r.stop == () and not r.include_usage

    @pytest.mark.parametrize(
        "extra,match",
        [
            ({"logprobs": 21}, "logprobs must be in"),
            ({"logprobs": True}, "logprobs must be an integer"),
            ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
            ({"stop": [""]}, "stop must be"),
            ({"stream": "yes"}, "stream must be a boolean"),
            ({"stream_options": {"include_usage": True}}, "only allowed when stream"),
            ({"n": 0}, "n must be >= 1"),
            ({"temperature": -1}, "temperature must be >= 0"),
            ({"max_tokens": 60}, "maximum context length is 64"),
            ({"echo": "yes"}, "echo must be a boolean"),
            # Types and ranges: checked before anything is generated.
            ({"temperature": float("nan")}, "temperature must be a finite number"),
            ({"temperature": "0.5"}, "temperature must be a finite number"),
            ({"temperature": True}, "temperature must be a finite number"),
            ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
            ({"top_p": float("inf")}, "top_p must be a finite number"),
            ({"seed": 1.5}, "seed must be an integer"),
            ({"prompt": [1, 1000]}, "token id 1000 is out of vocabulary"),
            ({"prompt": [[1, 2], [-1]]}, "token id -1 is out of vocabulary"),
            ({"prompt": [True, 2]}, "prompt"),
            ({"stop_token_ids": "12"}, "stop_token_ids must be a list of integer"),
            ({"stop_token_ids": [1.0]}, "stop_token_ids must be a list of integer"),
            ({"stop_token_ids": [5000]}, "out of vocabulary"),
            ({"model": 3}, "model must be a string"),
            ({"ignore_eos": "yes"}, "ignore_eos must be a boolean"),
            # Parameters that would change the output: honoured below, or refused by name.
            ({"guided_json": {"type": "object"}}, "'guided_json' is not supported"),
            ({"guided_regex": "a+"}, "'guided_regex' is not supported"),
            ({"logprob_token_ids": [1]}, "'logprob_token_ids' is not supported"),
            ({"prompt_logprobs": -1}, "prompt_logprobs must be in"),
            ({"prompt_logprobs": 1, "stream": True}, "not available when `stream=True`"),
            ({"seed": 2**63}, "seed must be in"),
            ({"prompt": "x \ud83d y"}, "not valid Unicode"),
            ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be"),
            ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
            ({"logit_bias": {"10000000": 1}}, "out-of-vocab"),
            ({"min_tokens": 2, "max_tokens": 1}, "min_tokens must be less than or equal"),
            ({"min_tokens": 1, "stop": ["x"]}, "min_tokens with stop strings"),
            ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
            ({"best_of": True}, "best_of"),
            ({"no_such_parameter": 1}, "'no_such_parameter' is not supported"),
        ],
    )
    def test_refused(self, extra, match):
        with pytest.raises(HTTPError, match=match) as e:
            openai_params.parse_completion_request({"prompt": [1] * 8, **extra}, _Backend())
        assert e.value.status == 400

    def test_output_flags_are_honoured(self):
        body = {"prompt": [1], "include_stop_str_in_output": True, "skip_special_tokens": False}
        r = openai_params.parse_completion_request({**body, "stop_token_ids": [7]}, _Backend())
        assert r.include_stop_str and not r.skip_special_tokens and r.params.stop_token_ids == (7,)
        r = openai_params.parse_completion_request({"prompt": [1], "user": "u"}, _Backend())
        assert not r.include_stop_str and r.skip_special_tokens

    def test_context_error_has_openais_code(self):
        with pytest.raises(HTTPError) as e:
            openai_params.parse_completion_request(
                {"prompt": [1] * 60, "max_tokens": 5}, _Backend()
            )
        assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"


class TestParseChatRequest:
    def test_template_prompt_and_default_max_tokens(self):
        backend = _Backend()
        msgs = [
            {"role": "system", "content": "s"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ]
        r = openai_chat_params.parse_chat_request({"messages": msgs}, backend)
        assert backend.rendered == [
            [{"role": "system", "content": "s"}, {"role": "user", "content": "ab"}]
        ]
        assert r.prompts == [[1] * 8] and r.params.max_new_tokens == 64 - 8
        assert r.logprobs is None

    def test_default_max_tokens_caps_only_requests_without_one(self):
        def parse(body):
            return openai_chat_params.parse_chat_request(body, _Backend(), default_max_tokens=10)

        assert parse(_chat()).params.max_new_tokens == 10
        assert parse(_chat(max_tokens=30)).params.max_new_tokens == 30

    def test_max_completion_tokens_and_logprobs(self):
        r = openai_chat_params.parse_chat_request(
            _chat(max_completion_tokens=7, logprobs=True, top_logprobs=3), _Backend()
        )
        assert r.params.max_new_tokens == 7 and r.logprobs == 3
        r = openai_chat_params.parse_chat_request(_chat(logprobs=True), _Backend())
        assert r.logprobs == 0

    @pytest.mark.parametrize(
        "extra,match",
        [
            ({"top_logprobs": 2}, "requires logprobs"),
            ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be in"),
            ({"tools": [{"type": "function"}]}, "tools is not supported"),
            ({"response_format": {"type": "json_object"}}, "response_format"),
            ({"messages": []}, "messages must be a non-empty list"),
            ({"messages": [{"content": "x"}]}, "must be an object with a role"),
            ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text"),
            ({"max_tokens": 61}, "maximum context length"),
            ({"presence_penalty": 0.5}, "presence_penalty"),
            ({"chat_template": "{{ x }}"}, "'chat_template' is not supported"),
            ({"chat_template_kwargs": {"tokenize": True}}, "may not set 'tokenize'"),
            ({"chat_template_kwargs": [1]}, "chat_template_kwargs must be an object"),
            ({"guided_choice": ["a"]}, "'guided_choice' is not supported"),
        ],
    )
    def test_refused(self, extra, match):
        with pytest.raises(HTTPError, match=match) as e:
            openai_chat_params.parse_chat_request(_chat(**extra), _Backend())
        assert e.value.status == 400

    def test_chat_template_kwargs_reach_the_template(self):
        backend = _Backend()
        openai_chat_params.parse_chat_request(
            _chat(chat_template_kwargs={"enable_thinking": False}), backend
        )
        assert backend.template_kwargs == {"enable_thinking": False}

    def test_kv_transfer_prompt_token_ids_replace_the_template(self):
        backend = _Backend()
        r = openai_chat_params.parse_chat_request(
            _chat(kv_transfer_params={"prompt_token_ids": [7, 8, 9]}), backend
        )
        assert r.prompts == [[7, 8, 9]] and backend.rendered == []
        with pytest.raises(HTTPError, match="token id 1000 is out of vocabulary") as e:
            parse = openai_chat_params.parse_chat_request
            parse(_chat(kv_transfer_params={"prompt_token_ids": [1000]}), backend)
        assert e.value.param == "kv_transfer_params.prompt_token_ids"

    def test_template_error_is_a_400(self):
        backend = _Backend()
        backend.chat_prompt = lambda m: (_ for _ in ()).throw(ValueError("roles must alternate"))
        with pytest.raises(HTTPError, match="roles must alternate") as e:
            openai_chat_params.parse_chat_request(_chat(), backend)
        assert e.value.status == 400 and e.value.param == "messages"
