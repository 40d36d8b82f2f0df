"""openai_choices: a finished batch -> Choices (stop token out of the text, stop strings, tops),
with a byte-level fake backend so every value is worked out by hand."""

import numpy as np

from mmr_jax.rollout import base
from mmr_jax.serving import openai_choices, openai_params

EOS = 0


class _ByteBackend:
    """Token id = one UTF-8 byte (id 0 is EOS and decodes to nothing)."""

    eos_token_ids = (EOS,)

    def decode(self, ids):
        return bytes(t for t in ids if t != EOS).decode("utf-8", errors="replace")

    def token_strings(self, ids):
        return [self.decode([t]) for t in ids]


def _batch(completions, reasons):
    lps = [[[-0.1 * (k + 1) for k in range(len(c))] for c in comps] for comps in completions]
    return base.batch_from_lists(completions, lps, reasons)


def _request(n=1, **kw):
    params = base.SamplingParams(max_new_tokens=8, n=n)
    return openai_params.Request(prompts=[[7]] * kw.pop("prompts", 1), params=params, **kw)


HELLO = list(b"Hello world") + [EOS]


class TestBuildChoices:
    def test_stop_token_is_counted_but_not_in_the_text(self):
        batch = _batch([[HELLO, list(b"Hey")]], [["stop", "length"]])
        a, b = openai_choices.build_choices(
            _ByteBackend(), _request(n=2), batch, None, as_ids=False
        )
        assert a.text == "Hello world" and len(a.token_ids) == 12 and a.stop_reason is None
        assert a.finish_reason == "stop" and a.pieces is None
        assert b.index == 1 and b.text == "Hey" and b.finish_reason == "length"

    def test_stop_string_cuts_tokens_text_and_pieces(self):
        batch = _batch([[HELLO]], [["length"]])
        (c,) = openai_choices.build_choices(
            _ByteBackend(), _request(stop=("o w",)), batch, None, as_ids=False
        )
        # "Hello world": "o w" starts at 4 and is completed by token 6 ("w"): 7 tokens kept.
        assert c.text == "Hell" and c.token_ids == list(b"Hello w")
        assert c.pieces == ["H", "e", "l", "l", "", "", ""] and c.stop_reason == "o w"
        assert c.finish_reason == "stop"
        np.testing.assert_allclose(c.logprobs, [-0.1 * (k + 1) for k in range(7)], rtol=1e-6)

    def test_streamed_pieces_join_to_the_text(self):
        batch = _batch([[list("é!".encode()) + [EOS]]], [["stop"]])
        (c,) = openai_choices.build_choices(
            _ByteBackend(), _request(stream=True), batch, None, as_ids=False
        )
        assert c.pieces == ["", "é", "!", ""] and "".join(c.pieces) == c.text == "é!"

    def test_tops_are_named_and_cut_with_the_tokens(self):
        batch = _batch([[HELLO]], [["stop"]])
        top_ids = np.array([[ord("H"), ord("J")]] * 12)
        top_lps = np.array([[-0.1, -2.0]] * 12)
        (c,) = openai_choices.build_choices(
            _ByteBackend(), _request(stop=("e",)), batch, [(top_ids, top_lps)], as_ids=True
        )
        assert c.token_ids == [ord("H"), ord("e")] and c.text == "H"
        assert c.tokens == [f"token_id:{ord('H')}", f"token_id:{ord('e')}"]
        assert c.top == [[(f"token_id:{ord('H')}", -0.1), (f"token_id:{ord('J')}", -2.0)]] * 2
