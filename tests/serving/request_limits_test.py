"""request_limits: n buckets and the 400s for requests that ask more than the limits."""

import pytest

from mmr_jax.rollout import base
from mmr_jax.serving import openai_params, request_limits
from mmr_jax.serving.openai_format import HTTPError


def _request(prompts, n, max_tokens):
    params = base.SamplingParams(max_new_tokens=max_tokens, n=n)
    return openai_params.Request(prompts=prompts, params=params)


class TestNSlots:
    def test_powers_of_two(self):
        assert [request_limits.n_slots(n) for n in (1, 2, 3, 4, 5, 9, 64)] == [
            1,
            2,
            4,
            4,
            8,
            16,
            64,
        ]


class TestCheck:
    LIMITS = request_limits.Limits(max_num_seqs=8, max_request_tokens=100)

    def test_within_limits(self):
        request_limits.check(_request([[1] * 5] * 2, 4, 7), self.LIMITS)  # 8 rows, 96 tokens

    @pytest.mark.parametrize(
        "prompts,n,max_tokens,code",
        [
            ([[1]] * 3, 3, 1, "too_many_sequences"),  # 9 rows
            ([[1] * 5] * 2, 4, 8, "request_too_large"),  # 8 x 13 = 104 tokens
        ],
    )
    def test_excess_is_a_400(self, prompts, n, max_tokens, code):
        with pytest.raises(HTTPError) as e:
            request_limits.check(_request(prompts, n, max_tokens), self.LIMITS)
        assert e.value.status == 400 and e.value.code == code

    def test_limits_must_be_positive(self):
        with pytest.raises(ValueError, match="max_num_seqs"):
            request_limits.Limits(max_num_seqs=0)
