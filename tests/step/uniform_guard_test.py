"""The uniform-group guard wired through the config and the trainer's advantage stage."""

import os
import sys

import numpy as np

from mmr_jax.config import checks
from mmr_jax.step import experience, pipeline

from support import testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "configs"))
import base


def _groups():
    rng = np.random.default_rng(3)
    r = np.array([[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 1]], np.float32)
    return r, rng.normal(size=(3, 4, 8)).astype(np.float32), np.ones((3, 4), bool)


def test_config_key_defaults_off_and_reaches_the_typed_config():
    c = base.get_config()
    assert c.reweight.uniform_group_guard is False
    c.reweight.uniform_group_guard = True
    assert checks.from_config_dict(c).reweight.uniform_group_guard is True


def _advantages(r, e, valid, reweight):
    return pipeline.reweighted_advantages(
        r, e, valid, reweight=reweight, advantage=testing.base_section("advantage")
    )


def test_advantages_zero_uniform_groups_only_with_the_guard_uniform_groups_only_with_the_guard():
    r, e, valid = _groups()
    for scope in ("group", "batch"):
        off = testing.base_section("reweight", method="mmr", scope=scope)
        on = testing.base_section("reweight", method="mmr", scope=scope, uniform_group_guard=True)
        _, adv_off, _ = _advantages(r, e, valid, off)
        _, adv_on, lam_on = _advantages(r, e, valid, on)
        assert np.abs(adv_off[:2]).mean() > 0.3  # MMR alone moves uniform groups
        np.testing.assert_array_equal(adv_on[:2], 0.0)
        assert np.abs(adv_on[2]).min() > 0.1  # the varying group still learns
        if scope == "batch":
            # lambda from the varying group's rewards alone: sigmoid(0.5) for [1, 0, 0, 1].
            np.testing.assert_allclose(lam_on, [1 / (1 + np.exp(-0.5))], rtol=1e-6)


def test_metrics_report_the_advantage_of_uniform_groups():
    r, e, valid = _groups()
    b, g = r.shape
    groups = experience.Groups(
        prompt_ids=[[1]] * b, answers=["1"] * b, tokens=np.ones((b, g, 2), np.int32),
        mask=np.ones((b, g, 2), bool), sampler_logps=np.zeros((b, g, 2), np.float32),
        truncated=np.zeros((b, g), bool), texts=[["x"] * g] * b, per_fn={"accuracy": r},
        total=r, valid=valid, embeddings=e,
    )  # fmt: skip
    for guard in (False, True):
        opts = testing.base_section("reweight", method="mmr", uniform_group_guard=guard)
        reweighted, adv, lam = _advantages(r, e, valid, opts)
        m = experience.group_metrics(groups, reweighted, adv, lam, filter_reward=None)
        want = np.abs(adv[:2]).mean()  # groups 0 and 1 are uniform
        assert m["advantage/uniform_abs_mean"] == (0.0 if guard else want) and (guard or want > 0.3)
    m = experience.group_metrics(groups.take([2]), r[2:], adv[2:], None, filter_reward=None)
    assert "advantage/uniform_abs_mean" not in m  # no uniform group: no value, not a false 0
