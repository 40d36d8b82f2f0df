"""Finished sampler batches -> `openai_format.Choice` records (text, stop strings, log-probs).

`backend` is a `server.Backend` (decode, token_strings, eos_token_ids).
"""

from __future__ import annotations

import dataclasses
import functools

from mmr_jax.rollout import base
from mmr_jax.serving import openai_format as fmt
from mmr_jax.serving import openai_params


@dataclasses.dataclass
class _Output:
    """One completion while it is being cut to what the request asked."""

    ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    stop_reason: int | str | None
    pieces: list[str] | None


def decoder(backend, request: openai_params.Request):
    """`backend.decode` as the request asks (skip_special_tokens)."""
    if request.skip_special_tokens:
        return backend.decode
    return functools.partial(backend.decode, skip_special_tokens=False)


def output(backend, ids, logprobs, reason, *, with_pieces: bool, decode=None) -> _Output:
    """Text without the stop token; stop_reason: a stop id that is not an EOS id (as vLLM)."""
    decode = decode or backend.decode
    text_ids, stop_reason = ids, None
    if reason == base.FINISH_STOP and ids:
        text_ids = ids[:-1]
        stop_reason = ids[-1] if ids[-1] not in set(backend.eos_token_ids) else None
    text = decode(text_ids)
    pieces = None
    if with_pieces:
        pieces = fmt.text_pieces(decode, text_ids, text)
        pieces += [""] * (len(ids) - len(text_ids))
    return _Output(ids, logprobs, text, reason, stop_reason, pieces)


def cut_at_stop(out: _Output, stops, *, include: bool = False) -> _Output:
    """`out` ended by the first stop string it completes (tokens up to the one completing it,
    text up to where it starts, or where it ends with `include`), or unchanged."""
    cut = fmt.stop_at_strings(out.pieces, stops)
    if cut is None:
        return out
    keep, chars, stop = cut
    chars += len(stop) if include else 0
    pieces, done = [], 0
    for p in out.pieces[:keep]:
        pieces.append(p[: max(0, chars - done)])
        done += len(p)
    return _Output(
        out.ids[:keep], out.logprobs[:keep], out.text[:chars], base.FINISH_STOP, stop, pieces
    )


def build_choices(
    backend, request: openai_params.Request, batch: base.RolloutBatch, tops, *, as_ids: bool
) -> list[fmt.Choice]:
    """`Choice`s of a finished batch, prompt-major (index b * n + i).

    Per-token pieces are made when the request streams or has stop strings. `tops`:
    `Backend.top_logprobs` of each completion (same order), or None. `as_ids`: token texts as
    'token_id:<id>' (vLLM's return_tokens_as_token_ids).
    """
    choices = []
    for b, prompt in enumerate(request.prompts):
        for i in range(request.params.n):
            ids = batch.completion_ids(b, i)
            logps = [float(x) for x in batch.logprobs[b, i, : len(ids)]]
            out = finished_output(backend, request, ids, logps, batch.finish_reasons[b][i])
            top = None if tops is None else tops[len(choices)]
            choices.append(choice(backend, len(choices), prompt, out, top, as_ids=as_ids))
    return choices


def finished_output(backend, request: openai_params.Request, ids, logps, reason) -> _Output:
    """A finished completion's `_Output`, cut at the request's stop strings."""
    with_pieces = bool(request.stream or request.stop)
    decode = decoder(backend, request)
    out = output(backend, ids, logps, reason, with_pieces=with_pieces, decode=decode)
    if request.stop:
        out = cut_at_stop(out, request.stop, include=request.include_stop_str)
    return out


def choice(backend, index: int, prompt, out: _Output, top, *, as_ids: bool) -> fmt.Choice:
    """The `Choice` of `out`; `top`: (ids [T, k], log-probs [T, k]) of its tokens, or None."""
    names = (lambda ids: [f"token_id:{t}" for t in ids]) if as_ids else backend.token_strings
    if top is not None:
        top_ids, top_lps = top
        top = [
            list(zip(names(top_ids[t].tolist()), top_lps[t].tolist(), strict=True))
            for t in range(len(out.ids))
        ]
    return fmt.Choice(
        index=index,
        prompt_ids=list(prompt),
        token_ids=out.ids,
        logprobs=out.logprobs,
        tokens=names(out.ids),
        text=out.text,
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
        pieces=out.pieces,
        top=top,
    )
