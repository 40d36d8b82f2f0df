"""OpenAI response bodies, stream chunks and errors, as pure functions of finished completions.

The server (`server.py`) turns a sampler batch into `Choice` records; everything here builds the
JSON the OpenAI API defines from them:
  /v1/completions       `completion_response`, `completion_chunks` (object "text_completion")
  /v1/chat/completions  `chat_response` ("chat.completion"), `chat_chunks` ("chat.completion.chunk")
  errors                `HTTPError.payload()`: {"error": {"message", "type", "param", "code"}}
Streams are server-sent events: `sse(chunk)` per chunk, then `SSE_DONE`. One chunk per generated
token (its text piece and, when asked, its log-probs), then a chunk with the finish reason, and with
`include_usage` a last chunk with empty choices and the usage, as OpenAI sends them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence

SSE_DONE = b"data: [DONE]\n\n"


class HTTPError(Exception):
    """An error answered in OpenAI's shape with HTTP `status` (`code`: OpenAI's string code)."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def payload(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return error_payload(self.message, kind=kind, param=self.param, code=self.code)


def error_payload(message: str, *, kind: str, param: str | None, code: str | None) -> dict:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclasses.dataclass(frozen=True)
class Choice:
    """One finished completion, in the terms the response bodies need.

    token_ids: the generated ids reported (a stop token included; cut after a stop string).
    logprobs: the sampler's log-prob of each of them.
    tokens: the text of each token alone (`Backend.token_strings`).
    text: the completion's text (without the stop token, cut before a stop string).
    pieces: per token, the text it adds; they join to `text` (None unless streamed or cut).
    top: per token, the k most likely tokens as (text, log-prob), most likely first (None: not
      asked for).
    prompt_logprobs: vLLM's list (`prompt_logprobs.vllm_prompt_logprobs`); echo: an `Echo`.
    """

    index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    tokens: list[str]
    text: str
    finish_reason: str
    stop_reason: int | str | None = None
    pieces: list[str] | None = None
    top: list[list[tuple[str, float]]] | None = None
    prompt_logprobs: list | None = None
    echo: Echo | None = None


@dataclasses.dataclass(frozen=True)
class Echo:
    """The prompt as `echo` puts it before a completion: text, token texts, and log-probs and top
    alternatives (None without logprobs)."""

    text: str
    tokens: list[str]
    logprobs: list[float | None] | None = None
    top: list[dict | None] | None = None


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's usage, with vLLM's `--enable-prompt-tokens-details` always on: cached_tokens is
    0 (this server keeps no prefix cache)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def choices_usage(choices: Sequence[Choice], prompt_tokens: int) -> dict:
    return usage(prompt_tokens, sum(len(c.token_ids) for c in choices))


def sse(chunk: dict) -> bytes:
    """One server-sent event carrying `chunk`."""
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


# ---- text of each token -------------------------------------------------------------------------


def text_pieces(decode: Callable[[Sequence[int]], str], ids: Sequence[int], text: str) -> list[str]:
    """Per-token text pieces of `ids` that join to exactly `text` (= decode(ids)).

    Decoded incrementally as vLLM does (a token's piece is what it adds to the text of the tokens
    since the previous piece; held back while it ends in a partial UTF-8 character, U+FFFD). If
    those pieces do not join to `text` (a tokenizer whose decode is not prefix-stable), each piece
    is instead where decode(ids[:k + 1]) stops agreeing with `text`: exact, in O(len(ids)^2).
    """
    pieces = _incremental_pieces(decode, ids)
    if "".join(pieces) == text:
        return pieces
    return _pieces_by_prefix([decode(ids[: k + 1]) for k in range(len(ids))], text)


def _incremental_pieces(decode: Callable[[Sequence[int]], str], ids: Sequence[int]) -> list[str]:
    """vLLM's incremental detokenizer: each token's new text, "" while it ends in U+FFFD."""
    pieces, start, read = [], 0, 0
    for k in range(len(ids)):
        before, now = decode(ids[start:read]), decode(ids[start : k + 1])
        if len(now) > len(before) and now.startswith(before) and not now.endswith("\ufffd"):
            pieces.append(now[len(before) :])
            start, read = read, k + 1
        else:
            pieces.append("")
    return pieces


def generated_text(decode: Callable[[Sequence[int]], str], ids: Sequence[int], text: str) -> str:
    """The text of generated `ids` as vLLM's detokenizer gives it: `text` (= decode(ids)) less
    a last character left unfinished (the bytes of a character the generation ended inside,
    U+FFFD in the decode), which vLLM holds back as it streams and never sends."""
    if not text.endswith("\ufffd"):
        return text
    joined = "".join(_incremental_pieces(decode, ids))
    return joined if text.startswith(joined) else text


def _pieces_by_prefix(prefix_texts: Sequence[str], text: str) -> list[str]:
    """Pieces from decode(ids[:k + 1]) for each k: token k ends where that agrees with `text`."""
    pieces, done = [], 0
    for k, prefix in enumerate(prefix_texts):
        if k == len(prefix_texts) - 1:
            end = len(text)
        else:
            end = 0
            while end < min(len(prefix), len(text)) and prefix[end] == text[end]:
                end += 1
            if prefix[:end].endswith("\ufffd"):
                end -= 1
        end = max(end, done)
        pieces.append(text[done:end])
        done = end
    return pieces


def stop_at_strings(pieces: Sequence[str], stops: Sequence[str]) -> tuple[int, int, str] | None:
    """Where the first stop string to be completed ends the output, as OpenAI's `stop` does.

    Returns (tokens kept: up to the token that completes it, characters of text kept: up to its
    start, the stop string), or None when no stop string occurs. Ties at one token go to the stop
    string that starts first.
    """
    text = "".join(pieces)
    ends, total = [], 0
    for p in pieces:
        total += len(p)
        ends.append(total)
    best = None
    for stop in stops:
        at = text.find(stop)
        if at < 0:
            continue
        token = next(k for k, e in enumerate(ends) if e >= at + len(stop))
        if best is None or (token, at) < best[:2]:
            best = (token, at, stop)
    return None if best is None else (best[0] + 1, best[1], best[2])


# ---- /v1/completions ----------------------------------------------------------------------------


def completion_logprobs(c: Choice, offset: int = 0) -> dict:
    """The legacy logprobs object: tokens, token_logprobs, text_offset, top_logprobs (per token a
    dict of the k most likely and the sampled token; the sampled one alone when k = 0), the
    echoed prompt's first. text_offset: where each token's text starts, counted from `offset` (a
    stream chunk's: the text of the tokens sent before), as the sum of the token texts before
    it, as vLLM's (a byte-level token that ends inside a character has the text "")."""
    tokens, logprobs, tops = [], [], []
    if c.echo is not None:
        tokens, logprobs, tops = list(c.echo.tokens), list(c.echo.logprobs), list(c.echo.top)
    for t, (s, lp) in enumerate(zip(c.tokens, c.logprobs, strict=True)):
        entry = dict(c.top[t]) if c.top is not None else {}
        entry[s] = float(lp)
        tokens.append(s)
        logprobs.append(float(lp))
        tops.append(entry)
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {
        "text_offset": offsets,
        "token_logprobs": logprobs,
        "tokens": tokens,
        "top_logprobs": tops,
    }


def completion_response(
    choices: Sequence[Choice],
    *,
    rid: str,
    created: int,
    model: str,
    prompt_tokens: int,
    logprobs: bool,
    token_ids: bool,
) -> dict:
    """The /v1/completions body (vLLM's extras: stop_reason, and token ids with `token_ids`)."""
    out = []
    for c in choices:
        out.append(
            {
                "index": c.index,
                "text": (c.echo.text if c.echo is not None else "") + c.text,
                "logprobs": completion_logprobs(c) if logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "token_ids": list(c.token_ids) if token_ids else None,
                "prompt_logprobs": c.prompt_logprobs,
                "prompt_token_ids": list(c.prompt_ids) if token_ids else None,
            }
        )
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": out,
        "usage": choices_usage(choices, prompt_tokens),
    }


def _one_token(c: Choice, t: int) -> Choice:
    """Choice `c` cut to its token t alone (a token's stream chunk; the echo has its own)."""
    return dataclasses.replace(
        c,
        token_ids=c.token_ids[t : t + 1],
        logprobs=c.logprobs[t : t + 1],
        tokens=c.tokens[t : t + 1],
        top=None if c.top is None else c.top[t : t + 1],
        echo=None,
    )


def text_before(c: Choice, t: int) -> int:
    """The text_offset of token t of `c` (the echoed prompt's tokens counted)."""
    echoed = sum(len(s) for s in c.echo.tokens) if c.echo is not None else 0
    return echoed + sum(len(s) for s in c.tokens[:t])


def _stream(choices, *, head: dict, usage_chunk: dict | None, first, token, last) -> Iterator[dict]:
    """Per choice: first(c) (or nothing), token(c, t) per token, last(c); then the usage chunk."""
    extra = {} if usage_chunk is None else {"usage": None}
    for c in choices:
        opening = first(c)
        if opening is not None:
            yield {**head, "choices": [opening], **extra}
        for t in range(len(c.token_ids)):
            yield {**head, "choices": [token(c, t)], **extra}
        yield {**head, "choices": [last(c)], **extra}
    if usage_chunk is not None:
        yield {**head, "choices": [], "usage": usage_chunk}


def completion_chunks(
    choices: Sequence[Choice],
    *,
    rid: str,
    created: int,
    model: str,
    prompt_tokens: int,
    logprobs: bool,
    include_usage: bool,
) -> Iterator[dict]:
    """The /v1/completions stream: a chunk per token (its text piece), then the finish reason."""
    head = {"id": rid, "object": "text_completion", "created": created, "model": model}
    first, token, last = completion_stream_parts(logprobs=logprobs)
    use = choices_usage(choices, prompt_tokens) if include_usage else None
    yield from _stream(choices, head=head, usage_chunk=use, first=first, token=token, last=last)


def completion_stream_parts(*, logprobs: bool):
    """(first, token, last): the choice entries of a /v1/completions stream's chunks for a
    `Choice` (first: None, no opening chunk; token(c, t): token t's piece; last: the finish)."""

    def token(c, t):
        lp = completion_logprobs(_one_token(c, t), text_before(c, t)) if logprobs else None
        return {"index": c.index, "text": c.pieces[t], "logprobs": lp, "finish_reason": None}

    def last(c):
        return {
            "index": c.index,
            "text": "",
            "logprobs": None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }

    def first(c):  # the echoed prompt, in a chunk of its own
        if c.echo is None:
            return None
        lp = None
        if logprobs:
            lp = completion_logprobs(dataclasses.replace(c, token_ids=[], logprobs=[], tokens=[]))
        text = c.echo.text
        return {"index": c.index, "text": text, "logprobs": lp, "finish_reason": None}

    return first, token, last


# ---- /v1/chat/completions -----------------------------------------------------------------------


def _token_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(c: Choice) -> dict:
    """Chat's logprobs object: {"content": [{token, logprob, bytes, top_logprobs}], "refusal"}."""
    content = []
    for t, (s, lp) in enumerate(zip(c.tokens, c.logprobs, strict=True)):
        top = [] if c.top is None else [_token_entry(a, b) for a, b in c.top[t]]
        content.append({**_token_entry(s, lp), "top_logprobs": top})
    return {"content": content, "refusal": None}


def chat_response(
    choices: Sequence[Choice],
    *,
    rid: str,
    created: int,
    model: str,
    prompt_tokens: int,
    logprobs: bool,
    token_ids: bool = False,
) -> dict:
    """The /v1/chat/completions body (vLLM's extras: stop_reason, prompt_logprobs, and token ids
    with `token_ids`)."""
    out = [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text, "refusal": None},
            "logprobs": chat_logprobs(c) if logprobs else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            "token_ids": list(c.token_ids) if token_ids else None,
        }
        for c in choices
    ]
    first = choices[0] if choices else None
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": out,
        "usage": choices_usage(choices, prompt_tokens),
        "prompt_logprobs": first.prompt_logprobs if first is not None else None,
        "prompt_token_ids": list(first.prompt_ids) if token_ids and first is not None else None,
    }


def chat_chunks(
    choices: Sequence[Choice],
    *,
    rid: str,
    created: int,
    model: str,
    prompt_tokens: int,
    logprobs: bool,
    include_usage: bool,
) -> Iterator[dict]:
    """The chat stream: per choice a delta with the role, one per token with its content, then an
    empty delta with the finish reason."""
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    first, token, last = chat_stream_parts(logprobs=logprobs)
    use = choices_usage(choices, prompt_tokens) if include_usage else None
    yield from _stream(choices, head=head, usage_chunk=use, first=first, token=token, last=last)


def chat_stream_parts(*, logprobs: bool):
    """(first, token, last) of the chat stream (`completion_stream_parts`); first: the role."""

    def first(c):
        delta = {"role": "assistant", "content": ""}
        return {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}

    def token(c, t):
        lp = chat_logprobs(_one_token(c, t)) if logprobs else None
        delta = {"content": c.pieces[t]}
        return {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": None}

    def last(c):
        return {
            "index": c.index,
            "delta": {},
            "logprobs": None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }

    return first, token, last
