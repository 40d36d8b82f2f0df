"""`token_controls`: vLLM's `logit_bias`, `allowed_token_ids` and `min_tokens` parsed and
refused as vLLM refuses them (the messages its own tests check), and the bias row they add."""

import numpy as np
import pytest

from mmr_jax.serving import token_controls
from mmr_jax.serving.openai_format import HTTPError

V = 50


def _parse(**body):
    return token_controls.parse(body, vocab_size=V, max_tokens=8)


class TestParse:
    def test_absent_is_none(self):
        assert _parse() == token_controls.NONE

    def test_bias_keys_are_ids_and_values_are_clamped(self):
        got = _parse(logit_bias={"3": 1.5, 7: -250, "49": 250.0})
        assert got.bias == ((3, 1.5), (7, -100.0), (49, 100.0))  # vLLM clamps to [-100, 100]

    @pytest.mark.parametrize(
        "body,words",
        [
            (dict(logit_bias={str(V + 1): 1.0}), [str(V + 1), str(V)]),  # id and vocab size
            (dict(logit_bias={"bad1": 50.0, "bad2": 20.0}), ["bad1", "bad2", "logit_bias"]),
            (dict(logit_bias={"1": "not_a_number"}), ["logit_bias"]),
            (dict(logit_bias=[1, 2]), ["logit_bias"]),
            (dict(allowed_token_ids=[]), ["allowed_token_ids"]),
            (dict(allowed_token_ids=[1, V]), ["allowed_token_ids", str(V)]),
            (dict(min_tokens=9), ["min_tokens", "max_tokens"]),
            (dict(min_tokens=-1), ["min_tokens"]),
        ],
    )
    def test_refused_as_vllm_refuses(self, body, words):
        with pytest.raises(HTTPError) as e:
            _parse(**body)
        assert e.value.status == 400
        for word in words:
            assert word in e.value.message, e.value.message


class TestBias:
    def test_base_bias_and_ban(self):
        controls = _parse(logit_bias={"2": 3.0, "4": -1.0}, allowed_token_ids=[2, 3])
        row = token_controls.base_bias(controls, V)
        want = np.full(V, -np.inf, np.float32)
        want[2], want[3] = 3.0, 0.0
        np.testing.assert_array_equal(row, want)  # 4 is not allowed: its bias stays -inf
        assert token_controls.base_bias(_parse(logit_bias={"1": 2.0}), V)[[0, 1]].tolist() == [0, 2]
