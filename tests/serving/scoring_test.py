"""`scoring.Scorer`: the scoring pass's log-probs, ranks and top tokens equal a plain numpy
recomputation from the model's unpadded logits, whatever the padded length; once compiled, a
request's pass compiles nothing (JAX's own compile events), whichever k it asks."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax import monitoring

from mmr_jax.serving import scoring

PAD = 0


def _reference(model, row, temperature):
    """log softmax(logits / temperature) of the row alone (no padding), in numpy."""
    logits = np.asarray(model(np.asarray([row], np.int32)))[0].astype(np.float64) / temperature
    logps = logits - logits.max(-1, keepdims=True)
    logps -= np.log(np.exp(logps).sum(-1, keepdims=True))
    chosen = logps[np.arange(len(row) - 1), row[1:]]
    ranks = 1 + (logps[:-1] > chosen[:, None]).sum(-1)
    return logps, chosen, ranks


class _Compiles:
    """Counts JAX's backend compiles (a persistent-cache load counts too)."""

    count = 0

    @classmethod
    def on(cls, event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            cls.count += 1


monitoring.register_event_duration_secs_listener(_Compiles.on)


@pytest.fixture(scope="module")
def scorer(llama):
    s = scoring.Scorer(max_model_len=100, pad_id=PAD)
    assert s.lengths == [64, 128]
    graphdef, state = nnx.split(llama)
    lines = []
    s.compile("tiny", graphdef, state, log=lines.append)
    before = _Compiles.count  # the listener sees a compile, so its silence below means none
    jax.jit(lambda x: x * 3.25 + len(lines))(np.ones(7, np.float32)).block_until_ready()
    assert _Compiles.count == before + 1
    assert lines[:2] == [
        "compiled scoring pass (tiny, 64 tokens)",
        "compiled scoring pass (tiny, 128 tokens)",
    ]
    assert lines[2].startswith("compiled 2 scoring programs in ")
    return s, graphdef, state


class TestScore:
    @pytest.mark.parametrize("n,temperature", [(5, 1.0), (63, 0.7), (65, 1.3), (100, 1.0)])
    def test_equals_numpy_on_the_unpadded_row(self, llama, scorer, n, temperature):
        s, graphdef, state = scorer
        row = list(np.random.default_rng(n).integers(1, llama.config.vocab_size, n))
        before = _Compiles.count
        chosen, ranks, top_ids, top_logps = s.score("tiny", graphdef, state, row, temperature)
        assert _Compiles.count == before  # compiled ahead: nothing at request time
        logps, want_chosen, want_ranks = _reference(llama, row, temperature)
        assert chosen.shape == (n - 1,) and top_ids.shape == (n, scoring.K_MAX)
        np.testing.assert_allclose(chosen, want_chosen, atol=2e-4)
        np.testing.assert_array_equal(ranks, want_ranks)
        order = np.argsort(-logps, axis=-1, kind="stable")[:, : scoring.K_MAX]
        np.testing.assert_allclose(top_logps, np.take_along_axis(logps, order, -1), atol=2e-4)
        np.testing.assert_allclose(np.take_along_axis(logps, top_ids, -1), top_logps, atol=2e-4)

    def test_an_uncompiled_model_name_still_scores(self, llama, scorer):
        s, graphdef, state = scorer
        row = [3, 4, 5, 6]
        got = s.score("other", graphdef, state, row, 1.0)
        want = s.score("tiny", graphdef, state, row, 1.0)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6)
