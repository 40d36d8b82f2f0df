"""`slot_programs`' pieces against the definitions they must equal: per-row sampling against
`sampling.sample_step` on each row alone, and the block-wise decode attention of rows at
different positions against plain attention over each row's columns."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmr_jax.models import attention
from mmr_jax.rollout import sampling
from mmr_jax.serving import slot_programs

jax.config.update("jax_numpy_rank_promotion", "raise")

# (temperature, top_k, top_p) per row: greedy, plain, top-k, top-p, both.
CONTROLS = [(0.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (0.8, 0, 0.9), (1.3, 40, 0.5)]


class TestSampleRows:
    @pytest.mark.parametrize("mode", sampling.LOGPROBS_MODES)
    def test_each_row_as_sample_step_alone(self, mode):
        v = 300
        logits = 3 * jax.random.normal(jax.random.key(0), (len(CONTROLS), v))
        keys = jax.random.split(jax.random.key(1), len(CONTROLS))
        t, k, p = (np.asarray(c) for c in zip(*CONTROLS, strict=True))
        tok, logp = slot_programs.sample_rows(
            logits, keys, t.astype(np.float32), k.astype(np.int32), p.astype(np.float32),
            use_filter=True, mode=mode,
        )  # fmt: skip
        for r, (temperature, top_k, top_p) in enumerate(CONTROLS):
            greedy = temperature == 0.0
            want_tok, want_logp = sampling.sample_step(
                logits[r : r + 1], keys[r : r + 1], np.float32(temperature or 1.0),
                np.int32(top_k), np.float32(top_p), greedy=greedy,
                use_filter=not greedy and (top_k > 0 or top_p < 1.0), logprobs_mode=mode,
            )  # fmt: skip
            assert int(tok[r]) == int(want_tok[0]), r
            np.testing.assert_allclose(logp[r], want_logp[0], rtol=1e-5, atol=1e-5)


class TestAttendRows:
    def test_rows_at_their_own_positions(self):
        r, kh, g, d, c, nl = 4, 2, 3, 8, 3 * slot_programs.BLOCK, 2
        ks = jax.random.split(jax.random.key(2), 5)
        q = jax.random.normal(ks[0], (r, 1, kh * g, d))
        k_new = jax.random.normal(ks[1], (r, 1, kh, d))
        v_new = jax.random.normal(ks[2], (r, 1, kh, d))
        ck = jax.random.normal(ks[3], (nl, r + 2, kh, d, c))  # two more slots than rows
        cv = jax.random.normal(ks[4], (nl, r + 2, kh, c, d))
        pos = np.array([0, 5, slot_programs.BLOCK, 2 * slot_programs.BLOCK + 7], np.int32)
        layer = 1
        blocks = jnp.int32(slot_programs.block_count(pos.max() + 1))
        got = slot_programs._attend_rows(q, k_new, v_new, ck, cv, layer, jnp.asarray(pos), blocks)
        for i in range(r):
            keys = jnp.concatenate([jnp.moveaxis(ck[layer, i], -1, 0)[: pos[i]], k_new[i]], 0)
            values = jnp.concatenate([jnp.swapaxes(cv[layer, i], 0, 1)[: pos[i]], v_new[i]], 0)
            mask = jnp.ones((1, 1, pos[i] + 1), bool)
            want = attention.attend(q[i : i + 1], keys[None], values[None], mask)
            np.testing.assert_allclose(got[i], want[0], rtol=1e-5, atol=1e-5)
