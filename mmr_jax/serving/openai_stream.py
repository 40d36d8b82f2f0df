"""A `batching.Job`'s updates -> its reply: finished `Choice`s, or chunks as tokens come.

Streamed, each choice sends the tokens decoded so far after every decode chunk: their text pieces
are `openai_format.text_pieces`' incremental decode, so a piece once sent is the piece the whole
reply has (a partial UTF-8 character is held back until it completes). With stop strings, the
last (longest stop - 1) characters are held back until they cannot start one; a completed stop
string ends that choice (its rows end at the next decode chunk). With top log-probs (k > 0) the
tokens are sent at the end, since the alternatives are computed after generation. Choices' chunks
interleave (each carries its index), and a choice's last token chunk carries its finish reason,
as vLLM's do. Not streamed, stop strings end rows early too.
"""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Callable, Iterator

from mmr_jax.rollout import base
from mmr_jax.serving import batching, openai_choices
from mmr_jax.serving import openai_format as fmt

POLL_S = 0.25  # how often a waiting handler checks that its client is still there


def updates(job: batching.Job, client_gone: Callable[[], bool]):
    """The job's `Update`s up to the final one; cancels the job when the client leaves."""
    while True:
        try:
            update = job.updates.get(timeout=POLL_S)
        except queue.Empty:
            if client_gone():
                job.cancel()
                raise ConnectionAbortedError("client left") from None
            continue
        if isinstance(update, Exception):
            raise update
        yield update
        if update.final:
            return


def _stop_rows(backend, job, update) -> None:
    """Marks the rows whose text so far completes a stop string (they end at the next chunk)."""
    request = job.request
    for r, ids in enumerate(update.ids):
        if r in job.stop_rows or update.finished[r]:
            continue
        decode = openai_choices.decoder(backend, request)
        pieces = fmt.text_pieces(decode, ids, decode(ids))
        if fmt.stop_at_strings(pieces, request.stop) is not None:
            job.stop_rows.add(r)


def collect(backend, job, client_gone, *, as_ids: bool, prompt_info=None) -> list[fmt.Choice]:
    """The finished choices of `job` (not streamed; `prompt_info`: `build_choices`')."""
    request, n = job.request, job.request.params.n
    for update in updates(job, client_gone):
        if request.stop and not update.final:
            _stop_rows(backend, job, update)

    def grid(values):  # rows b * n + i -> [B][n]
        return [values[b * n : (b + 1) * n] for b in range(len(request.prompts))]

    batch = base.batch_from_lists(grid(update.ids), grid(update.logprobs), grid(update.reasons))
    return openai_choices.build_choices(
        backend, request, batch, update.tops, as_ids=as_ids, prompt_info=prompt_info
    )


class _Row:
    """One choice while it streams: tokens sent so far, and whether it has ended."""

    def __init__(self, index: int, prompt, echo=None):
        self.index, self.prompt, self.sent, self.ended = index, prompt, 0, False
        self.out, self.echo = None, echo
        self.prompt_sent = False  # its prompt_token_ids (return_token_ids) went out


def _advance(backend, job, row: _Row, update, parts, *, as_ids) -> Iterator[tuple[dict, list]]:
    """Chunk entries for what `update` adds to `row`, each with the token ids it sends."""
    request, r = job.request, row.index
    finished = update.finished[r] or update.final
    reason = update.reasons[r] if finished else base.FINISH_LENGTH
    decode = openai_choices.decoder(backend, request)
    ids, lps = update.ids[r], update.logprobs[r]
    out = openai_choices.output(backend, ids, lps, reason, with_pieces=True, decode=decode)
    if request.stop:
        cut = openai_choices.cut_at_stop(out, request.stop, include=request.include_stop_str)
        if cut is not out:
            job.stop_rows.add(r)
            finished, out = True, cut
    ready = len(out.ids)
    if not finished:
        if out.held:
            ready = row.sent
        elif request.stop:
            hold, end = max(len(s) for s in request.stop) - 1, 0
            safe = len(out.text) - hold
            ready = 0
            for t, piece in enumerate(out.pieces):
                end += len(piece)
                if end > safe:
                    break
                ready = t + 1
    top_k = request.logprobs
    if top_k and not update.final:
        return  # alternatives come with the final update
    top = update.tops[r] if update.tops is not None else None
    c = openai_choices.choice(backend, r, row.prompt, out, top, as_ids=as_ids)
    c = dataclasses.replace(c, echo=row.echo)
    first, token, last = parts
    end = max(row.sent, ready)
    for t in range(row.sent, end):
        entry = token(c, t)
        row.sent = t + 1  # before the yield: the chunk's usage counts its token
        if finished and t == end - 1:  # the last token's chunk carries the finish, as vLLM's
            row.ended, row.out = True, c
            ending = last(c)
            entry = {**entry, "finish_reason": ending["finish_reason"]}
            entry["stop_reason"] = ending["stop_reason"]
        yield entry, [c.token_ids[t]]
    if finished and not row.ended:  # nothing left to send: the finish alone
        row.ended, row.out = True, c
        yield last(c), []


def stream(
    backend,
    job,
    client_gone,
    *,
    head: dict,
    chat: bool,
    as_ids: bool,
    prompt_info=None,
    token_ids: bool = False,
    on_finish=lambda choices: None,
) -> Iterator[dict]:
    """The stream chunks of `job` as its updates arrive (`head`: id, object, created, model;
    `prompt_info`: `build_choices`'). With include_usage the last chunk has the usage; with
    continuous_usage_stats every chunk has the usage of its choice so far (as vLLM's). With
    `token_ids` (vLLM's return_token_ids) each token's chunk has its `token_ids`, and a choice's
    first chunk its prompt's (`prompt_token_ids`: in the choice for completions, beside the
    choices for chat, as vLLM's). `on_finish(choices)` runs once every choice has ended."""
    request = job.request
    logprobs = request.logprobs is not None
    parts = (fmt.chat_stream_parts if chat else fmt.completion_stream_parts)(logprobs=logprobs)
    n = request.params.n
    echoes = [
        None if prompt_info is None else prompt_info[b][0] for b in range(len(request.prompts))
    ]
    rows = [_Row(r, request.prompts[r // n], echoes[r // n]) for r in range(job.rows)]

    def chunk(row, entry, ids=None):
        top = head
        if token_ids:
            entry = entry if ids is None else {**entry, "token_ids": ids}
            if not row.prompt_sent:
                row.prompt_sent = True
                if chat:
                    top = {**head, "prompt_token_ids": list(row.prompt)}
                else:
                    entry = {**entry, "prompt_token_ids": list(row.prompt)}
        if not request.include_usage:
            return {**top, "choices": [entry]}
        use = None
        if request.continuous_usage:
            use = fmt.usage(len(row.prompt), row.sent if not row.ended else len(row.out.token_ids))
        return {**top, "choices": [entry], "usage": use}

    for row in rows:
        opening = parts[0](fmt.Choice(row.index, [], [], [], [], "", "", echo=row.echo))
        if opening is not None:
            yield chunk(row, opening)
    for update in updates(job, client_gone):
        for row in rows:
            if row.ended:
                continue
            for entry, ids in _advance(backend, job, row, update, parts, as_ids=as_ids):
                yield chunk(row, entry, ids)
    on_finish([row.out for row in rows])
    if request.include_usage:
        prompt_tokens = sum(len(p) for p in request.prompts)
        use = fmt.choices_usage([row.out for row in rows], prompt_tokens)
        yield {**head, "choices": [], "usage": use}
