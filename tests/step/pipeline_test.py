"""pipeline: which rows enter the loss (truncated completions), the old log-probs' need, and
the reward parameters of the overlong punishment."""

import pathlib

import numpy as np
import pytest

from mmr_jax.config import checks, command_line
from mmr_jax.step import batch_layout, experience, pipeline

B, G, T = 2, 4, 8
DAPO = str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "dapo.py")


def _cfg(**loss):
    c = command_line.load_config_file(DAPO + ":smoke")
    for k, v in loss.items():
        c.loss[k] = v
    c.batch.generations = G
    c.batch.max_completion_len = T
    c.batch.pack_max_len = 0
    return checks.from_config_dict(c)


def _groups():
    """Two groups; in the first, completions 1 and 3 hit max_completion_len ('length')."""
    rng = np.random.default_rng(0)
    lengths = np.array([[3, T, 0, T], [2, 5, 1, 7]])  # an empty completion in group 0
    mask = np.arange(T)[None, None] < lengths[..., None]
    truncated = np.zeros((B, G), bool)
    truncated[0, [1, 3]] = True
    valid = np.ones((B, G), bool)
    valid[1, 2] = False  # an unparseable gold answer's row: out of the loss either way
    return experience.Groups(
        prompt_ids=[[5, 6, 7], [8, 9]],
        answers=["1", "2"],
        tokens=np.where(mask, rng.integers(4, 99, (B, G, T)), 0).astype(np.int32),
        mask=mask,
        sampler_logps=-rng.random((B, G, T)).astype(np.float32),
        truncated=truncated,
        texts=[[""] * G for _ in range(B)],
        per_fn={},
        total=np.array([[1.0, -1.0, 0.5, -1.0], [0.0, 1.0, 2.0, 1.0]], np.float32),
        valid=valid,
    )


class TestTruncatedCompletions:
    @pytest.mark.parametrize("layout", ["full", "shared"])
    def test_leave_the_loss_not_the_group_statistics(self, layout):
        groups = _groups()
        cfg = _cfg(mask_truncated_completions=True, minibatches=2)
        adv = np.arange(B * G, dtype=np.float32).reshape(B, G)  # any advantages, passed through
        host = batch_layout.pack(
            groups.prompt_ids,
            groups.tokens,
            groups.mask,
            pipeline.loss_rows(cfg, groups),
            adv,
            groups.sampler_logps,
            layout=layout,
            buckets=batch_layout.Buckets.geometric(4, 8, T),
            group=G,
            pad_id=0,
        )
        rows = host["completion_mask"].reshape(B, G, -1).any(-1)
        # Written out: valid, not truncated, and with a token.
        np.testing.assert_array_equal(
            rows, [[True, False, False, False], [True, True, False, True]]
        )
        np.testing.assert_array_equal(host["advantages"], adv.reshape(-1))
        off = pipeline.loss_rows(_cfg(minibatches=2), groups)
        np.testing.assert_array_equal(off, groups.valid)

    def test_group_statistics_still_count_them(self):
        # The advantages come from every valid completion, truncated ones included: group 0's
        # mean is (1 - 1 + 0.5 - 1) / 4 with its two truncated rows (GRPO, ddof 1, eps 1e-4).
        groups = _groups()
        cfg = _cfg(mask_truncated_completions=True)
        _, adv, _ = pipeline.reweighted_advantages(
            groups.total, None, groups.valid, reweight=cfg.reweight, advantage=cfg.advantage
        )
        r = groups.total[0]
        want = (r - r.mean()) / (r.std(ddof=1) + 1e-4)
        np.testing.assert_allclose(np.asarray(adv)[0], want, rtol=1e-5)


class TestOldLogps:
    @pytest.mark.parametrize(
        "iterations,updates,needed", [(1, 1, False), (2, 1, True), (1, 2, True)]
    )
    def test_needed_after_the_first_update(self, iterations, updates, needed):
        cfg = _cfg(iterations=iterations, updates_per_batch=updates, minibatches=2)
        assert pipeline.needs_old_logps(cfg) == needed


class TestOverlongParams:
    def test_lengths_default_to_the_completion_length_and_a_fifth(self):
        c = command_line.load_config_file(DAPO + ":smoke,full")
        cfg = checks.from_config_dict(c)
        assert pipeline.reward_params(cfg)["overlong"] == {"max_len": 32, "cache_len": 6}
        c.rewards.overlong_max_len, c.rewards.overlong_cache_len = 30, 10
        cfg = checks.from_config_dict(c)
        assert pipeline.reward_params(cfg)["overlong"] == {"max_len": 30, "cache_len": 10}


def _advantages(cfg, groups):
    """The step's advantages as `pipeline.advantages` computes them (over `groups.trained`)."""
    return pipeline.reweighted_advantages(
        groups.total,
        groups.embeddings,
        groups.trained,
        reweight=cfg.reweight,
        advantage=cfg.advantage,
    )


class TestDynamicSamplingGivesUp:
    """DAPO's rounds end without B groups of reward variance: the step is filled with copies
    that stay out of the advantages and the loss, while the metrics report the rewards that were
    sampled and count as invalid only gold answers that do not parse."""

    def _collect(self, monkeypatch, totals):
        rounds = iter(totals)

        def generate_and_score(engine, tokenizer, prompt_ids, answers, *args, **kwargs):
            total = np.asarray(next(rounds), np.float32)
            g = _groups()
            g.total, g.per_fn = total, {"accuracy": total}
            g.valid = np.ones((B, G), bool)  # every gold answer parses
            return g

        monkeypatch.setattr(experience, "generate_and_score", generate_and_score)
        cfg = _cfg()
        prompts = iter(lambda: [([1, 2], "1"), ([3], "2")], None)
        groups, _ = pipeline.collect(cfg, prompts, None, None, None, 1, {})
        assert cfg.dynamic_sampling.enabled and cfg.batch.prompts == B
        return groups

    def test_no_group_with_variance_reports_the_sampled_reward(self, monkeypatch):
        flat = [[-0.5] * G] * B  # every completion wrong: reward -0.5, no variance anywhere
        groups = self._collect(monkeypatch, [flat] * 4)
        assert groups.filler.tolist() == [True, True] and not groups.trained.any()
        reweighted, adv, lam = _advantages(_cfg(), groups)
        assert np.all(adv == 0.0) and not pipeline.loss_rows(_cfg(), groups).any()
        m = experience.group_metrics(groups, reweighted, adv, lam, filter_reward="accuracy")
        assert m["reward/mean"] == -0.5  # was 0: the copies' rewards were hidden as invalid
        assert m["groups/invalid_gold_frac"] == 0.0  # was 1.0 though every gold answer parsed
        assert m["dynamic_sampling/filler_frac"] == 1.0

    def test_one_kept_group_trains_alone(self, monkeypatch):
        varied = [[1.0, 0.0, 0.0, 0.0], [0.0] * G]  # the first round: only group 0 varies
        groups = self._collect(monkeypatch, [varied] + [[[0.0] * G] * B] * 3)
        assert groups.filler.tolist() == [False, True]
        np.testing.assert_array_equal(groups.trained, [[True] * G, [False] * G])
        _, adv, lam = _advantages(_cfg(), groups)
        assert np.all(adv[1] == 0.0) and np.all(adv[0] != 0.0)
        m = experience.group_metrics(groups, groups.total, adv, lam, filter_reward="accuracy")
        # the kept group's mean only; the filler (a copy of it) is not counted twice
        assert m["reward/mean"] == 0.25 and m["groups/invalid_gold_frac"] == 0.0
        assert m["dynamic_sampling/filler_frac"] == 0.5
