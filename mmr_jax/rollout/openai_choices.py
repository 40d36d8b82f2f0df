"""Finished sampler batches -> `openai_format.Choice` records (text, stop strings, log-probs).

`backend` is a `server.Backend` (decode, token_strings, eos_token_ids).
"""

from __future__ import annotations

import dataclasses

from mmr_jax.rollout import base, openai_params
from mmr_jax.rollout import openai_format as fmt


@dataclasses.dataclass
class _Output:
    """One completion while it is being cut to what the request asked."""

    ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    stop_reason: int | str | None
    pieces: list[str] | None


def _output(backend, ids, logprobs, reason, *, with_pieces: bool) -> _Output:
    """Text without the stop token; stop_reason: a stop id that is not an EOS id (as vLLM)."""
    text_ids, stop_reason = ids, None
    if reason == base.FINISH_STOP and ids:
        text_ids = ids[:-1]
        stop_reason = ids[-1] if ids[-1] not in set(backend.eos_token_ids) else None
    text = backend.decode(text_ids)
    pieces = None
    if with_pieces:
        pieces = fmt.text_pieces(backend.decode, text_ids, text)
        pieces += [""] * (len(ids) - len(text_ids))
    return _Output(ids, logprobs, text, reason, stop_reason, pieces)


def _cut_at_stop(out: _Output, stops) -> _Output:
    """`out` ended by the first stop string it completes (tokens up to the one completing it,
    text up to where it starts), or unchanged."""
    cut = fmt.stop_at_strings(out.pieces, stops)
    if cut is None:
        return out
    keep, chars, stop = cut
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
    names = (lambda ids: [f"token_id:{t}" for t in ids]) if as_ids else backend.token_strings
    choices = []
    for b, prompt in enumerate(request.prompts):
        for i in range(request.params.n):
            ids = batch.completion_ids(b, i)
            logps = [float(x) for x in batch.logprobs[b, i, : len(ids)]]
            reason = batch.finish_reasons[b][i]
            out = _output(
                backend, ids, logps, reason, with_pieces=bool(request.stream or request.stop)
            )
            if request.stop:
                out = _cut_at_stop(out, request.stop)
            top = None
            if tops is not None:
                top_ids, top_lps = tops[len(choices)]
                top = [
                    list(zip(names(top_ids[t].tolist()), top_lps[t].tolist(), strict=True))
                    for t in range(len(out.ids))
                ]
            choices.append(
                fmt.Choice(
                    index=len(choices),
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
            )
    return choices
