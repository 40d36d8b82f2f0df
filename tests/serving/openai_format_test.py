"""openai_format: text pieces, stop strings, and the bodies and stream chunks built from `Choice`s
(hand-worked values; the real server with the `openai` client is in openai_server_test.py)."""

import json

import pytest

from mmr_jax.serving import openai_format as fmt


def _bytes_decode(ids):
    """A byte-level 'tokenizer': token id = one UTF-8 byte."""
    return bytes(ids).decode("utf-8", errors="replace")


def _choice(**kw):
    defaults = dict(
        index=0,
        prompt_ids=[1, 2],
        token_ids=[10, 11, 12],
        logprobs=[-0.5, -1.0, -0.25],
        tokens=["Hi", " é", ""],
        text="Hi é",
        finish_reason="stop",
        pieces=["Hi", " é", ""],
    )
    return fmt.Choice(**{**defaults, **kw})


class TestTextPieces:
    def test_multibyte_character_goes_to_the_token_that_completes_it(self):
        ids = list("hé€!".encode())  # h, c3 a9, e2 82 ac, !
        pieces = fmt.text_pieces(_bytes_decode, ids, "hé€!")
        assert pieces == ["h", "", "é", "", "", "€", "!"]

    def test_not_prefix_stable_decode_falls_back_to_exact_pieces(self):
        # A decode that strips leading spaces (as SentencePiece does): incremental pieces would
        # lose the spaces between words.
        words = {1: " a", 2: " b", 3: " c"}

        def decode(ids):
            return "".join(words[i] for i in ids).lstrip()

        pieces = fmt.text_pieces(decode, [1, 2, 3], "a b c")
        assert pieces == ["a", " b", " c"]

    def test_trailing_partial_character_stays_in_the_text(self):
        ids = list(b"a") + [0xE2, 0x82]  # "a" then an unfinished euro sign
        text = _bytes_decode(ids)
        pieces = fmt.text_pieces(_bytes_decode, ids, text)
        assert "".join(pieces) == text and pieces[0] == "a"

    def test_empty(self):
        assert fmt.text_pieces(_bytes_decode, [], "") == []


class TestGeneratedText:
    """vLLM's detokenizer holds back a character until its last byte comes, so a generation
    that ends inside one ends without it (vLLM's text for the same tokens)."""

    def test_an_unfinished_last_character_is_left_out(self):
        ids = list("hé€".encode())[:-1]  # the euro sign's last byte never came
        assert fmt.generated_text(_bytes_decode, ids, _bytes_decode(ids)) == "hé"
        ids = list(b"a") + [0xE2]  # "a", then the first byte of a character
        assert fmt.generated_text(_bytes_decode, ids, _bytes_decode(ids)) == "a"

    def test_finished_text_is_the_decode(self):
        ids = list("hé€!".encode())
        assert fmt.generated_text(_bytes_decode, ids, "hé€!") == "hé€!"
        ids = [0xE2, ord("x")]  # a broken character mid-text: kept as the decode has it
        assert fmt.generated_text(_bytes_decode, ids, _bytes_decode(ids)) == "\ufffdx"


class TestStopAtStrings:
    PIECES = ["Hel", "lo", " wor", "ld"]  # token ends at 3, 5, 9, 11

    def test_cut_at_the_token_that_completes_the_stop(self):
        assert fmt.stop_at_strings(self.PIECES, ["o w"]) == (3, 4, "o w")

    def test_first_completed_stop_wins(self):
        assert fmt.stop_at_strings(self.PIECES, ["ld", "wor"]) == (3, 6, "wor")

    def test_tie_on_one_token_goes_to_the_earlier_start(self):
        assert fmt.stop_at_strings(self.PIECES, ["orld", "rld"]) == (4, 7, "orld")

    def test_no_stop(self):
        assert fmt.stop_at_strings(self.PIECES, ["xyz"]) is None
        assert fmt.stop_at_strings(self.PIECES, []) is None


class TestResponses:
    def test_completion_response_and_usage(self):
        c = _choice(top=[[("Hi", -0.5), ("Ho", -1.5)], [(" a", -0.9)], [("", -0.25)]])
        body = fmt.completion_response(
            [c], rid="x", created=1, model="m", prompt_tokens=2, logprobs=True, token_ids=True
        )
        assert body["usage"] == {
            "prompt_tokens": 2,
            "completion_tokens": 3,
            "total_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        lp = body["choices"][0]["logprobs"]
        assert lp["text_offset"] == [0, 2, 4] and lp["token_logprobs"] == [-0.5, -1.0, -0.25]
        assert lp["top_logprobs"][0] == {"Hi": -0.5, "Ho": -1.5}
        assert lp["top_logprobs"][1] == {" a": -0.9, " é": -1.0}  # the sampled token is added
        assert body["choices"][0]["token_ids"] == [10, 11, 12]

    def test_chat_logprobs_have_bytes_and_top(self):
        c = _choice(top=[[("Hi", -0.5)], [(" a", -0.9)], [("", -0.25)]])
        body = fmt.chat_response([c], rid="x", created=1, model="m", prompt_tokens=2, logprobs=True)
        entry = body["choices"][0]["logprobs"]["content"][1]
        assert entry["token"] == " é" and entry["bytes"] == [32, 0xC3, 0xA9]
        assert entry["top_logprobs"] == [{"token": " a", "logprob": -0.9, "bytes": [32, 97]}]
        assert body["choices"][0]["message"] == {
            "role": "assistant",
            "content": "Hi é",
            "refusal": None,
        }

    def test_chat_logprobs_without_alternatives_have_empty_top(self):
        body = fmt.chat_response(
            [_choice()], rid="x", created=1, model="m", prompt_tokens=2, logprobs=True
        )
        assert [e["top_logprobs"] for e in body["choices"][0]["logprobs"]["content"]] == [[]] * 3


class TestChunks:
    @pytest.mark.parametrize("include_usage", [False, True])
    def test_chat_chunks(self, include_usage):
        choices = [
            _choice(),
            _choice(index=1, text="x", pieces=["x", "", ""], finish_reason="length"),
        ]
        chunks = list(
            fmt.chat_chunks(
                choices,
                rid="r",
                created=1,
                model="m",
                prompt_tokens=2,
                logprobs=True,
                include_usage=include_usage,
            )
        )
        assert all(c["object"] == "chat.completion.chunk" and c["id"] == "r" for c in chunks)
        for i, choice in enumerate(choices):
            mine = [
                c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i
            ]
            assert mine[0]["delta"] == {"role": "assistant", "content": ""}
            assert "".join(m["delta"].get("content", "") for m in mine) == choice.text
            assert [m["finish_reason"] for m in mine] == [None] * 4 + [choice.finish_reason]
            assert mine[-1]["delta"] == {}
            tokens = [m["logprobs"]["content"][0]["token"] for m in mine[1:-1]]
            assert tokens == choice.tokens
        if include_usage:
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
            assert all(c["usage"] is None for c in chunks[:-1])
        else:
            assert all("usage" not in c for c in chunks)

    def test_completion_chunks_join_to_the_text(self):
        c = _choice()
        chunks = list(
            fmt.completion_chunks(
                [c],
                rid="r",
                created=1,
                model="m",
                prompt_tokens=2,
                logprobs=False,
                include_usage=False,
            )
        )
        assert "".join(ch["choices"][0]["text"] for ch in chunks) == c.text
        assert [ch["choices"][0]["finish_reason"] for ch in chunks] == [None, None, None, "stop"]
        assert all(ch["object"] == "text_completion" for ch in chunks)

    def test_sse_framing(self):
        event = fmt.sse({"a": "é"})
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        assert json.loads(event[6:]) == {"a": "é"}
        assert fmt.SSE_DONE == b"data: [DONE]\n\n"


class TestHTTPError:
    def test_payload_is_openais_shape(self):
        e = fmt.HTTPError(
            404, "The model `x` does not exist.", param="model", code="model_not_found"
        )
        assert e.payload() == {
            "error": {
                "message": "The model `x` does not exist.",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
        }
        assert fmt.HTTPError(500, "boom").payload()["error"]["type"] == "server_error"
