"""Continuous batching (`slot_scheduler`, `slot_engine`, `slot_programs`) on the tiny Llama:
each request's greedy tokens equal the plain sampler's for that request alone, whether it ran
alone or joined a batch already decoding; a finished row frees its slot at once; seeded draws do
not depend on the other rows; what could never fit is a 400. The grid is shrunk (chunks of 32
tokens) so that long prompts go through the chunked prefill."""

import queue

import numpy as np
import pytest

from mmr_jax.rollout import base, sampler
from mmr_jax.serving import (
    batching,
    embedded_backend,
    openai_params,
    slot_grid,
    slot_scheduler,
    token_controls,
)
from mmr_jax.serving.openai_format import HTTPError

SLOTS = 4


@pytest.fixture(scope="module")
def small_grid():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(slot_grid, "CHUNK", 32)
        mp.setattr(slot_grid, "MIN_WIDTH", 8)
        yield


@pytest.fixture(scope="module")
def batcher(tiny_llama_dir, small_grid):
    backend = embedded_backend.EmbeddedBackend.from_pretrained(
        tiny_llama_dir, model_name="tiny", max_model_len=128
    )
    lines = []
    per_token = slot_grid.Grid.from_budget(
        backend.engine.model.config, backend.engine.model.dtype,
        kv_cache_bytes=2**40, max_model_len=128, max_num_seqs=1,
    ).token_bytes  # fmt: skip
    grid = backend.enable_slots(
        kv_cache_bytes=SLOTS * 128 * per_token + per_token, max_num_seqs=64, log=lines.append
    )
    assert (grid.slots, grid.columns) == (SLOTS, 128)
    assert lines[-1].startswith("compiled ") and "programs in" in lines[-1]
    b = slot_scheduler.ContinuousBatcher(backend, chunk_steps=4)
    yield b
    b.close()


def _job(prompt, max_new=12, temperature=0.0, n=1, seed=None, ignore_eos=False):
    params = base.SamplingParams(max_new_tokens=max_new, temperature=temperature, n=n, seed=seed)
    request = openai_params.Request(prompts=[list(prompt)], params=params, ignore_eos=ignore_eos)
    return batching.Job(request, "tiny")


def _final(job, timeout=120):
    while True:
        update = job.updates.get(timeout=timeout)
        if isinstance(update, Exception):
            raise update
        if update.final:
            return update


def _alone(batcher, prompt, max_new=12):
    """The plain sampler's greedy tokens and log-probs for `prompt` alone."""
    out = sampler.sample(
        batcher.backend.engine.model,
        [list(prompt)],
        base.SamplingParams(max_new_tokens=max_new, temperature=0.0),
        stop_token_ids=batcher.backend.eos_token_ids,
        pad_id=batcher.backend.engine.pad_id,
    )
    length = int(out.mask[0, 0].sum())
    return out.tokens[0, 0, :length].tolist(), out.logprobs[0, 0, :length]


PROMPTS = [[5, 17, 33, 9, 100], [7, 8], list(range(40, 61)), list(range(3, 80))]


class TestContinuousBatcher:
    def test_alone_equals_the_sampler(self, batcher):
        for prompt in PROMPTS:  # the last is 77 tokens: three prefill chunks of 32
            update = _final(batcher.submit(_job(prompt)))
            ids, logps = _alone(batcher, prompt)
            assert update.ids[0] == ids
            np.testing.assert_allclose(update.logprobs[0], logps, atol=2e-5)

    def test_prompts_and_samples_of_one_request(self, batcher):
        params = base.SamplingParams(max_new_tokens=12, temperature=0.0, n=2)
        prompts = [PROMPTS[3], PROMPTS[0]]  # rows 1 and 3 get a copy of their prompt's cache
        request = openai_params.Request(prompts=prompts, params=params)
        update = _final(batcher.submit(batching.Job(request, "tiny")))
        expected = [_alone(batcher, p)[0] for p in prompts for _ in range(2)]
        assert update.ids == expected

    def test_joining_a_running_batch_keeps_each_output(self, batcher):
        first = batcher.submit(_job(PROMPTS[2], max_new=40, ignore_eos=True))
        while not first.updates.get(timeout=120).ids[0]:  # it is decoding
            pass
        others = [batcher.submit(_job(p)) for p in (PROMPTS[0], PROMPTS[3], PROMPTS[1])]
        results = [_final(j) for j in others]
        last = _final(first)
        assert all(j.admitted_step < first.finished_step for j in others)  # joined it
        assert all(j.admitted_step > first.admitted_step for j in others)
        for prompt, update in zip((PROMPTS[0], PROMPTS[3], PROMPTS[1]), results, strict=True):
            assert update.ids[0] == _alone(batcher, prompt)[0]
        ids, _ = _alone(batcher, PROMPTS[2], max_new=40)
        assert last.ids[0][: len(ids)] == ids  # the sampler stops at EOS, ignore_eos does not

    def test_a_finished_row_frees_its_slot_at_once(self, batcher):
        long_jobs = [_job(PROMPTS[0], max_new=30, ignore_eos=True) for _ in range(SLOTS - 1)]
        short = _job(PROMPTS[1], max_new=3, ignore_eos=True)
        waiting = _job(PROMPTS[2], max_new=3, ignore_eos=True)
        for job in [*long_jobs, short, waiting]:
            batcher.submit(job)
        for job in [waiting, short, *long_jobs]:
            _final(job)
        assert waiting.admitted_step == short.finished_step  # the next step boundary
        assert all(waiting.admitted_step < j.finished_step for j in long_jobs)

    def test_seeded_samples_do_not_depend_on_other_rows(self, batcher):
        def seeded():
            return _job(PROMPTS[0], max_new=10, temperature=1.0, n=2, seed=7, ignore_eos=True)

        alone = _final(batcher.submit(seeded())).ids
        crowd = [batcher.submit(_job(p, max_new=20, temperature=0.9)) for p in PROMPTS[1:3]]
        again = _final(batcher.submit(seeded())).ids
        for job in crowd:
            _final(job)
        assert again == alone and alone[0] != alone[1]

    def test_what_could_never_fit_is_a_400(self, batcher):
        with pytest.raises(HTTPError) as too_many:
            batcher.submit(_job(PROMPTS[0], n=SLOTS + 1))
        assert too_many.value.status == 400
        with pytest.raises(HTTPError) as too_long:
            batcher.submit(_job(list(range(3, 103)), max_new=29))
        assert too_long.value.status == 400

    def test_a_cancelled_waiting_job_never_runs(self, batcher):
        blockers = [_job(PROMPTS[0], max_new=20, ignore_eos=True) for _ in range(SLOTS)]
        for job in blockers:
            batcher.submit(job)
        gone = batcher.submit(_job(PROMPTS[1]))
        gone.cancel()
        update = _final(gone)
        assert update.ids == [[]] and not hasattr(gone, "admitted_step")
        for job in blockers:
            _final(job)
        with pytest.raises(queue.Empty):
            gone.updates.get_nowait()


def _controlled(batcher, prompt, body, max_new=8, temperature=0.0, seed=None, ignore_eos=True):
    vocab = batcher.backend.vocab_size
    controls = token_controls.parse(body, vocab_size=vocab, max_tokens=max_new)
    params = base.SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=seed)
    request = openai_params.Request(
        prompts=[list(prompt)], params=params, ignore_eos=ignore_eos, controls=controls
    )
    return batching.Job(request, "tiny")


def _greedy_loop(model, prompt, max_new, bias_at, stops=()):
    """Greedy decoding by full forward passes (no KV cache, no slots): argmax(logits + bias_at(t))
    in float64 numpy, ending at a stop token."""
    ids, out = list(prompt), []
    for t in range(max_new):
        logits = np.asarray(model(np.asarray([ids], np.int32)))[0, -1].astype(np.float64)
        tok = int(np.argmax(logits + bias_at(t)))
        out.append(tok)
        ids.append(tok)
        if tok in stops:
            break
    return out


class TestTokenControls:
    """vLLM's logit_bias, allowed_token_ids and min_tokens against a plain greedy loop whose
    bias is written out here in numpy."""

    def test_logit_bias_and_allowed_ids_equal_a_plain_greedy_loop(self, batcher):
        model, vocab = batcher.backend.engine.model, batcher.backend.vocab_size
        prompt = [5, 6, 7]
        plain = _greedy_loop(model, prompt, 8, lambda t: 0.0)
        # Biases of the size of the logits' spread on 300 tokens, and the plain path's first
        # token pushed out, so the biased path is neither the plain one nor one forced token.
        spread = float(np.std(np.asarray(model(np.asarray([prompt], np.int32)))[0, -1]))
        rng = np.random.default_rng(0)
        picked = rng.choice(vocab, 300, replace=False)
        bias = {str(t): float(rng.normal(0, 2 * spread)) for t in picked}
        bias[str(plain[0])] = -100.0
        only_bias = np.zeros(vocab)
        for key, value in bias.items():
            only_bias[int(key)] = value
        want = _greedy_loop(model, prompt, 8, lambda t: only_bias)
        job = _controlled(batcher, prompt, {"logit_bias": bias})
        assert _final(batcher.submit(job)).ids[0] == want and want[0] != plain[0]
        allowed = list(range(8, 40))
        restricted = np.full(vocab, -np.inf)
        restricted[8:40] = only_bias[8:40]
        want = _greedy_loop(model, prompt, 8, lambda t: restricted)
        job = _controlled(batcher, prompt, {"logit_bias": bias, "allowed_token_ids": allowed})
        assert _final(batcher.submit(job)).ids[0] == want
        assert all(8 <= t < 40 for t in want) and len(set(want)) > 1

    def test_min_tokens_bans_the_stop_tokens_until_reached(self, batcher):
        model, vocab = batcher.backend.engine.model, batcher.backend.vocab_size
        stops = tuple(batcher.backend.eos_token_ids)
        body = {"logit_bias": {str(stops[0]): 100.0}, "min_tokens": 4}
        update = _final(batcher.submit(_controlled(batcher, [5, 6, 7], body, ignore_eos=False)))
        pushed = np.zeros(vocab)
        pushed[stops[0]] = 100.0
        banned = pushed.copy()
        banned[list(stops)] = -np.inf
        want = _greedy_loop(model, [5, 6, 7], 8, lambda t: banned if t < 4 else pushed, stops)
        assert update.ids[0] == want and len(want) == 5 and want[-1] == stops[0]
        assert update.reasons[0] == base.FINISH_STOP

    def test_sampled_tokens_stay_inside_allowed_ids(self, batcher):
        job = _controlled(batcher, [5, 6, 7], {"allowed_token_ids": [9, 10, 11]}, max_new=24,
                          temperature=1.5, seed=3)  # fmt: skip
        ids = _final(batcher.submit(job)).ids[0]
        assert set(ids) <= {9, 10, 11} and len(set(ids)) > 1  # drawn, not forced
