"""Finished sampler batches -> `openai_format.Choice` records (text, stop strings, log-probs).

`backend` is a `server.Backend` (decode, token_strings, eos_token_ids).
"""

from __future__ import annotations

import dataclasses
import functools

from mmr_jax.rollout import base
from mmr_jax.serving import openai_format as fmt
from mmr_jax.serving import openai_params, prompt_logprobs


@dataclasses.dataclass
class _Output:
    """One completion while it is being cut to what the request asked."""

    ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    stop_reason: int | str | None
    pieces: list[str] | None
    held: bool = False  # the text's last character is unfinished: held back (`generated_text`)


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
    whole = decode(text_ids)
    text = fmt.generated_text(decode, text_ids, whole)
    pieces = None
    if with_pieces:
        pieces = fmt.text_pieces(decode, text_ids, text)
        pieces += [""] * (len(ids) - len(text_ids))
    return _Output(ids, logprobs, text, reason, stop_reason, pieces, held=text != whole)


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
    backend,
    request: openai_params.Request,
    batch: base.RolloutBatch | None,
    tops,
    *,
    as_ids: bool,
    prompt_info=None,
) -> list[fmt.Choice]:
    """`Choice`s of a finished batch, prompt-major (index b * n + i).

    Per-token pieces are made when the request streams or has stop strings. `tops`:
    `Backend.top_logprobs` of each completion (same order), or None. `as_ids`: token texts as
    'token_id:<id>' (vLLM's return_tokens_as_token_ids). `prompt_info`: per prompt, its
    (`fmt.Echo` or None, vLLM prompt_logprobs or None) (`PromptInfo`). `batch` None: the
    request generates nothing (echo with max_tokens 0): each choice is its prompt alone.
    """
    choices = []
    for b, prompt in enumerate(request.prompts):
        echo, prompt_lps = prompt_info[b] if prompt_info is not None else (None, None)
        for i in range(request.params.n):
            if batch is None:
                out = _Output([], [], "", base.FINISH_LENGTH, None, [])
            else:
                ids = batch.completion_ids(b, i)
                logps = [float(x) for x in batch.logprobs[b, i, : len(ids)]]
                out = finished_output(backend, request, ids, logps, batch.finish_reasons[b][i])
            top = None if tops is None else tops[len(choices)]
            c = choice(backend, len(choices), prompt, out, top, as_ids=as_ids)
            choices.append(dataclasses.replace(c, echo=echo, prompt_logprobs=prompt_lps))
    return choices


def echo_of(backend, request, prompt, scores, *, as_ids: bool) -> fmt.Echo:
    """The `fmt.Echo` of `prompt` (its text, token texts and, with `scores`
    (`prompt_logprobs.PromptScores`), log-probs), as `choice` names a completion's tokens."""
    decode = functools.partial(backend.decode, skip_special_tokens=False)  # vLLM's prompt text
    text = decode(prompt)
    names = _namer(backend, as_ids)
    tokens = _readable(names(prompt), fmt.text_pieces(decode, prompt, text), as_ids)
    if scores is None:
        return fmt.Echo(text, tokens)
    logprobs, top = prompt_logprobs.echo_entries(scores, names, tokens)
    return fmt.Echo(text, tokens, logprobs, top)


def _namer(backend, as_ids: bool):
    return (lambda ids: [f"token_id:{t}" for t in ids]) if as_ids else backend.token_strings


def _readable(tokens: list[str], pieces: list[str] | None, as_ids: bool) -> list[str]:
    """Token texts with a byte-level token that ends inside a character replaced by its text
    piece ("" until the character completes; then the character), as vLLM's logprobs name
    them, so that text offsets count characters of the text."""
    if as_ids or pieces is None:
        return tokens
    return [p if s.endswith("\ufffd") else s for s, p in zip(tokens, pieces, strict=True)]


def finished_output(backend, request: openai_params.Request, ids, logps, reason) -> _Output:
    """A finished completion's `_Output`, cut at the request's stop strings."""
    with_pieces = bool(request.stream or request.stop or request.logprobs is not None)
    decode = decoder(backend, request)
    out = output(backend, ids, logps, reason, with_pieces=with_pieces, decode=decode)
    if request.stop:
        out = cut_at_stop(out, request.stop, include=request.include_stop_str)
    return out


def choice(backend, index: int, prompt, out: _Output, top, *, as_ids: bool) -> fmt.Choice:
    """The `Choice` of `out`; `top`: (ids [T, k], log-probs [T, k]) of its tokens, or None."""
    names = _namer(backend, as_ids)
    tokens = _readable(names(out.ids), out.pieces, as_ids)
    if top is not None:  # the sampled token among the alternatives: under the same text
        top_ids, top_lps = top
        top = [
            [
                (tokens[t] if tid == out.ids[t] else name, lp)
                for tid, name, lp in zip(
                    top_ids[t].tolist(), names(top_ids[t].tolist()), top_lps[t].tolist(),
                    strict=True,
                )
            ]
            for t in range(len(out.ids))
        ]  # fmt: skip
    return fmt.Choice(
        index=index,
        prompt_ids=list(prompt),
        token_ids=out.ids,
        logprobs=out.logprobs,
        tokens=tokens,
        text=out.text,
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
        pieces=out.pieces,
        top=top,
    )


def prompt_info(backend, request: openai_params.Request, model: str, *, as_ids: bool):
    """Per prompt (`fmt.Echo` or None, vLLM prompt_logprobs or None), or None when the
    request asks for neither (one forward pass per prompt when it asks log-probs)."""
    k_prompt, k_echo = request.prompt_logprobs, request.logprobs
    if not request.echo and k_prompt is None:
        return None
    info = []
    for prompt in request.prompts:
        scores = None
        if k_prompt is not None:
            k = max(k_prompt, k_echo or 0)
            scores = backend.prompt_scores(prompt, k, model=model)
        vllm_list = None
        if scores is not None:
            cut = _top(scores, k_prompt)
            vllm_list = prompt_logprobs.vllm_prompt_logprobs(
                cut, lambda t: backend.token_strings([t])[0]
            )
        echo = None
        if request.echo:
            echo_scores = None if k_echo is None else _top(scores, k_echo)
            echo = echo_of(backend, request, prompt, echo_scores, as_ids=as_ids)
        info.append((echo, vllm_list))
    return info


def _top(scores: prompt_logprobs.PromptScores, k: int) -> prompt_logprobs.PromptScores:
    """`scores` with its k most likely alternatives per position."""
    return dataclasses.replace(
        scores, top_ids=scores.top_ids[:, :k], top_logprobs=scores.top_logprobs[:, :k]
    )
