"""The jitted train step's ratio and metrics: the ratio's reference under LoRA dropout with TIS,
ratio extrema over iterations, and a batch without a loss token."""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mmr_jax.models import loading
from mmr_jax.models import lora as lora_lib
from mmr_jax.step import minibatch, train_step

from support import testing

jax.config.update("jax_numpy_rank_promotion", "raise")

N, P, T = 4, 3, 6
CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
TEMPERATURE = 0.7


def _policy(path, *, dropout: float | None = None) -> lora_lib.Policy:
    lora = None if dropout is None else lora_lib.LoraConfig(rank=4, alpha=8, dropout=dropout)
    model = loading.from_pretrained(path, lora=lora, rngs=nnx.Rngs(0))
    if lora is not None:  # fresh adapters have B = 0, where dropout changes nothing: set them
        for i, (name, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))):
            if name[-1] == "lora_b":  # [layers, r, out]
                val = var.get_value()
                var.set_value(0.5 * jax.random.normal(jax.random.key(i), val.shape))
                assert float(jnp.abs(var.get_value()).max()) > 0
    return lora_lib.split_policy(model)


def _fresh_state(params, optimizer, **extra) -> train_step.TrainState:
    """Step 0's state: a copy of `params` (the step donates it), fresh optimiser state, key 0."""
    params = jax.tree.map(jnp.copy, params)
    return train_step.TrainState(
        step=jnp.zeros([], jnp.int32),
        params=params,
        opt_state=optimizer.init(params),
        rng=jax.random.key_data(jax.random.key(0)),
        **extra,
    )


def _rows(seed: int = 0, *, lengths=(6, 4, 2, 5)):
    """Full rows [N, P + T] of random tokens, completions of `lengths` tokens."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(4, 250, (N, P + T)).astype(np.int32)
    comp = np.arange(T)[None] < np.asarray(lengths)[:, None]
    attention = np.concatenate([np.ones((N, P), bool), comp], axis=1)
    adv = np.array([1.0, -1.0, 0.5, -0.5], np.float32)
    return jnp.asarray(tokens), jnp.asarray(attention), jnp.asarray(comp), jnp.asarray(adv)


def _logps(policy, params, tokens, attention, disable_lora=False):
    """Clean (eval-mode, no dropout) completion log-probs [N, T], as the trainer computes them
    (`disable_lora`: the base model's, the KL reference under LoRA)."""
    return minibatch.logprobs_fn(
        params,
        policy.frozen,
        policy.rest,
        tokens,
        attention,
        graphdef=policy.eval_graphdef,
        num_completion=T,
        temperature=TEMPERATURE,
        disable_lora=disable_lora,
    )


def _step(policy, batch, *, iterations=1, tis_cap=0.0, lr=0.5, minibatches=2):
    cfg = testing.step_config(
        minibatches=minibatches,
        iterations=iterations,
        temperature=TEMPERATURE,
        eps_low=0.2,
        eps_high=0.2,
        aggregation="token_mean",
        beta=0.0,
        kl_estimator="k3",
        max_completion_len=T,
        tis_cap=tis_cap,
    )
    optimizer = optax.sgd(lr)
    step = train_step.jit_train_step(
        graphdef=policy.graphdef, optimizer=optimizer, schedule=lambda _: lr, cfg=cfg
    )
    state = _fresh_state(policy.params, optimizer)
    new, metrics = step(state, batch, policy.frozen, policy.rest)
    return new, {k: float(v) for k, v in metrics.items()}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from support import testing

    return testing.make_tiny_checkpoint(
        tmp_path_factory.mktemp("train_step"), tokenizer=False, vocab_size=256
    )


class TestRatioReference:
    @pytest.mark.slow
    def test_first_pass_ratio_is_one_under_lora_dropout_with_tis(self, ckpt):
        # With dropout the step's forward differs from the clean old log-probs the trainer
        # passes for TIS; the ratio must still be taken against the same forward (exactly 1 on
        # the first pass), while TIS and the mismatch use the clean ones against the engine.
        policy = _policy(ckpt, dropout=0.5)
        tokens, attention, comp, adv = _rows()
        clean = _logps(policy, policy.params, tokens, attention)
        engine = jnp.where(comp, clean - 0.05, 0.0)  # trainer - engine = 0.05 on every token
        batch = train_step.Batch(
            tokens, attention, comp, adv, old_logps=clean, sampler_logps=engine
        )
        _, m = _step(policy, batch, tis_cap=2.0)
        assert m["ratio/min"] == m["ratio/max"] == 1.0, m
        assert m["clip/frac"] == 0.0
        np.testing.assert_allclose(m["mismatch/logp_abs_mean"], 0.05, atol=1e-5)
        np.testing.assert_allclose(m["mismatch/ratio_min"], np.exp(0.05), atol=1e-5)

    def test_dropout_really_moves_the_forward(self, ckpt):
        # The premise of the test above: with dropout 0.5 the training forward's log-probs are
        # not the clean ones (else a ratio of 1 would prove nothing).
        policy = _policy(ckpt, dropout=0.5)
        tokens, attention, comp, _ = _rows()
        clean = _logps(policy, policy.params, tokens, attention)
        model = nnx.merge(policy.graphdef, policy.params, policy.frozen, policy.rest)
        noisy = minibatch.completion_logprobs(
            model, tokens, attention, num_completion=T, temperature=TEMPERATURE
        )
        assert float(jnp.abs(jnp.where(comp, noisy - clean, 0.0)).max()) > 1e-2


class TestRatioMetrics:
    @pytest.mark.slow
    def test_extrema_over_iterations_are_min_and_max(self, ckpt):
        # Independent: pass 1's ratio is 1; pass 2's is exp(logp(params after update 1) -
        # logp(params before)), both computed here with the plain log-prob function.
        policy = _policy(ckpt)
        tokens, attention, comp, adv = _rows(1)
        old = _logps(policy, policy.params, tokens, attention)
        batch = train_step.Batch(tokens, attention, comp, adv, old_logps=old)
        after_one, _ = _step(policy, batch, iterations=1)
        _, m = _step(policy, batch, iterations=2)
        new = _logps(policy, after_one.params, tokens, attention)
        ratio = np.exp(np.asarray(new - old))[np.asarray(comp)]
        assert ratio.min() < 0.99 and ratio.max() > 1.01  # the update moved both ways
        np.testing.assert_allclose(m["ratio/min"], min(1.0, ratio.min()), rtol=1e-5)
        np.testing.assert_allclose(m["ratio/max"], max(1.0, ratio.max()), rtol=1e-5)

    @pytest.mark.parametrize("iterations", [1, pytest.param(2, marks=pytest.mark.slow)])
    def test_no_loss_token_logs_a_neutral_ratio(self, ckpt, iterations):
        policy = _policy(ckpt)
        tokens, attention, comp, adv = _rows(2)
        none = jnp.zeros_like(comp)
        old = _logps(policy, policy.params, tokens, attention)
        batch = train_step.Batch(tokens, attention, none, adv, old_logps=old)
        _, m = _step(policy, batch, iterations=iterations)
        assert m["tokens"] == 0.0 and m["loss"] == 0.0
        assert m["ratio/min"] == m["ratio/max"] == m["ratio/mean"] == 1.0, m


# Several optimiser updates per batch (issue 47): the step against a written-out loop.
N8, EPS = 8, 0.2


def _rows8(seed: int = 3):
    """Full rows [8, P + T]: ragged completions, one empty row, ragged across the two halves."""
    rng = np.random.default_rng(seed)
    lengths = np.array([6, 1, 0, 2, 6, 5, 6, 4])  # half 1: 9 tokens, half 2: 21
    tokens = rng.integers(4, 250, (N8, P + T)).astype(np.int32)
    comp = np.arange(T)[None] < lengths[:, None]
    attention = np.concatenate([np.ones((N8, P), bool), comp], axis=1)
    adv = rng.standard_normal(N8).astype(np.float32)
    return jnp.asarray(tokens), jnp.asarray(attention), jnp.asarray(comp), jnp.asarray(adv)


def _written_loss(lp, ref, adv, mask, aggregation):
    """The clipped surrogate of these rows as one batch, its own normaliser (losses docstring)."""
    m = mask.astype(jnp.float32)
    r = jnp.exp(jnp.where(mask, lp - ref, 0.0))
    a = adv[:, None]
    per = -jnp.minimum(r * a, jnp.clip(r, 1 - EPS, 1 + EPS) * a) * m
    if aggregation == "token_mean":
        return per.sum() / jnp.maximum(m.sum(), 1.0)
    if aggregation == "seq_mean_token_mean":
        n = m.sum(-1)
        return (per.sum(-1) / jnp.maximum(n, 1.0)).sum() / jnp.maximum((n > 0).sum(), 1)
    return per.sum() / (mask.shape[0] * T)  # Dr.GRPO: rows x max_completion_len


def _reference_updates(policy, batch, optimizer, *, updates, iterations, aggregation):
    """`iterations` passes of `updates` sequential updates, update j on rows j*N/U..(j+1)*N/U,
    each the gradient of `_written_loss` of its rows; -> (params, losses before each update)."""
    params = jax.tree.map(jnp.copy, policy.params)
    opt_state = optimizer.init(params)
    rows, out = N8 // updates, []
    for it in range(iterations):
        for j in range(updates):
            sl = slice(j * rows, (j + 1) * rows)

            def loss(p, first=(it == 0 and j == 0), sl=sl):
                model = nnx.merge(policy.graphdef, p, policy.frozen, policy.rest)
                lp = minibatch.completion_logprobs(
                    model,
                    batch.tokens[sl],
                    batch.attention_mask[sl],
                    num_completion=T,
                    temperature=TEMPERATURE,
                )
                ref = jax.lax.stop_gradient(lp) if first else batch.old_logps[sl]
                return _written_loss(
                    lp, ref, batch.advantages[sl], batch.completion_mask[sl], aggregation
                )

            value, grads = jax.value_and_grad(loss)(params)
            updates_, opt_state = optimizer.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates_)
            out.append(float(value))
    return params, out


def _step_u(policy, batch, optimizer, *, updates, iterations=1, aggregation, minibatches=4):
    cfg = testing.step_config(
        minibatches=minibatches,
        iterations=iterations,
        temperature=TEMPERATURE,
        eps_low=EPS,
        eps_high=EPS,
        aggregation=aggregation,
        beta=0.0,
        kl_estimator="k3",
        max_completion_len=T,
        updates_per_batch=updates,
    )
    step = train_step.jit_train_step(
        graphdef=policy.graphdef, optimizer=optimizer, schedule=lambda _: 0.0, cfg=cfg
    )
    state = _fresh_state(policy.params, optimizer)
    new, metrics = step(state, batch, policy.frozen, policy.rest)
    return new.params, {k: float(v) for k, v in metrics.items()}


def _rel_diff(a_tree, b_tree, base_tree):
    """max |a - b| / max |a - base|: the gap relative to the update's size."""

    def max_abs(x_tree, y_tree):
        pairs = zip(jax.tree.leaves(x_tree), jax.tree.leaves(y_tree), strict=True)
        return max(float(jnp.abs(x - y).max()) for x, y in pairs)

    size = max_abs(a_tree, base_tree)
    assert size > 1e-3  # the updates moved the parameters
    return max_abs(a_tree, b_tree) / size


class TestUpdatesPerBatch:
    @pytest.mark.parametrize(
        "aggregation,updates,iterations",
        [
            ("token_mean", 2, 1),
            pytest.param("seq_mean_token_mean", 4, 1, marks=pytest.mark.slow),
            pytest.param("seq_mean_token_sum_norm", 2, 2, marks=pytest.mark.slow),
        ],
    )
    def test_equals_sequential_updates_on_sub_batches(self, ckpt, aggregation, updates, iterations):
        policy = _policy(ckpt)
        tokens, attention, comp, adv = _rows8()
        old = _logps(policy, policy.params, tokens, attention)
        batch = train_step.Batch(tokens, attention, comp, adv, old_logps=old)
        opt = optax.sgd(0.5, momentum=0.9)  # state carried from update to update (linear:
        # Adam would blow rounding in near-zero gradients up to its step size)
        kw = dict(iterations=iterations, aggregation=aggregation)
        got, m = _step_u(policy, batch, opt, updates=updates, **kw)
        want, losses_ = _reference_updates(policy, batch, opt, updates=updates, **kw)
        assert _rel_diff(got, want, policy.params) < 1e-5
        # One update on the whole batch is another result (the test can fail).
        whole, _ = _reference_updates(policy, batch, opt, updates=1, **kw)
        assert _rel_diff(whole, want, policy.params) > 1e-2
        # A pass's loss: the mean of its updates' losses (each over its own rows).
        np.testing.assert_allclose(
            m["loss"], np.mean(np.reshape(losses_, (iterations, updates)), axis=1).mean(), rtol=1e-5
        )
        assert m["tokens"] == float(comp.sum())  # each row once per pass
        assert m["ratio/max"] > 1.0 > m["ratio/min"]  # later updates see a moved policy

    def test_token_mean_is_per_update(self, ckpt):
        # DAPO's token mean over each update's own tokens (9 and 21 here), not the batch's 30:
        # a loop dividing every update by 30 ends elsewhere.
        policy = _policy(ckpt)
        tokens, attention, comp, adv = _rows8()
        old = _logps(policy, policy.params, tokens, attention)
        batch = train_step.Batch(tokens, attention, comp, adv, old_logps=old)
        opt = optax.sgd(1.0)
        got, _ = _step_u(policy, batch, opt, updates=2, aggregation="token_mean")
        own, _ = _reference_updates(
            policy, batch, opt, updates=2, iterations=1, aggregation="token_mean"
        )
        assert _rel_diff(got, own, policy.params) < 1e-5
        # The same loop with Dr.GRPO's constant normaliser 4 * T = 24 per update (close to the
        # batch's 30 tokens, far from 9): a clearly different end point.
        const, _ = _reference_updates(
            policy, batch, opt, updates=2, iterations=1, aggregation="seq_mean_token_sum_norm"
        )
        assert _rel_diff(const, own, policy.params) > 1e-2

    def test_needs_old_logps_and_whole_minibatches(self, ckpt):
        policy = _policy(ckpt)
        tokens, attention, comp, adv = _rows8()
        batch = train_step.Batch(tokens, attention, comp, adv)
        with pytest.raises(ValueError, match="old_logps"):
            _step_u(policy, batch, optax.sgd(1.0), updates=2, aggregation="token_mean")
        old = _logps(policy, policy.params, tokens, attention)
        batch = train_step.Batch(tokens, attention, comp, adv, old_logps=old)
        with pytest.raises(ValueError, match="updates_per_batch=3 must divide"):
            _step_u(policy, batch, optax.sgd(1.0), updates=3, aggregation="token_mean")


# Issue 47's options off: the step is the one before them, bit for bit.
_OFF_VARIANTS = {
    "grpo": dict(aggregation="seq_mean_token_mean", beta=0.04),
    "dr_grpo": dict(aggregation="seq_mean_token_sum_norm", beta=0.04),
    "dapo": dict(aggregation="token_mean", eps_high=0.28),
    "gspo": dict(
        aggregation="seq_mean_token_mean",
        importance_sampling_level="sequence",
        iterations=2,
        eps_low=3e-4,
        eps_high=4e-4,
    ),
    "tis": dict(aggregation="token_mean", tis_cap=1.5, iterations=2),
    "lora_dropout": dict(aggregation="seq_mean_token_mean", beta=0.04, lora=0.05, iterations=2),
}


class TestOptionsOff:
    @pytest.mark.parametrize(
        "variant",
        [v if v == "dapo" else pytest.param(v, marks=pytest.mark.slow) for v in _OFF_VARIANTS],
    )
    def test_bit_identical_to_the_step_before_issue_47(self, ckpt, variant):
        from support import legacy_train_step

        opts = dict(_OFF_VARIANTS[variant])
        lora = opts.pop("lora", None)
        policy = _policy(ckpt, dropout=lora)
        cfg = testing.step_config(
            minibatches=2,
            temperature=TEMPERATURE,
            kl_estimator="k3",
            max_completion_len=T,
            **{"iterations": 1, "eps_low": 0.2, "eps_high": 0.2, "beta": 0.0, **opts},
        )
        tokens, attention, comp, adv = _rows8()
        old = _logps(policy, policy.params, tokens, attention)
        ref = None
        if cfg.loss.beta:
            ref = _logps(policy, policy.params, tokens, attention, disable_lora=lora is not None)
        engine = jnp.where(comp, old - 0.3, 0.0)
        batch = train_step.Batch(
            tokens, attention, comp, adv, old_logps=old, ref_logps=ref, sampler_logps=engine
        )
        optimizer = optax.adamw(1e-3)
        results = []
        for fn in (train_step.train_step, legacy_train_step.train_step):
            step = jax.jit(
                functools.partial(
                    fn,
                    graphdef=policy.graphdef,
                    optimizer=optimizer,
                    schedule=lambda s: 1e-3 * (s + 1),
                    cfg=cfg,
                ),
                donate_argnums=(0,),
            )
            state = _fresh_state(policy.params, optimizer)
            results.append(step(state, batch, policy.frozen, policy.rest))
        (new, m_new), (old_state, m_old) = results
        assert m_new.keys() == m_old.keys()
        for k in m_old:
            assert np.array_equal(m_new[k], m_old[k], equal_nan=True), (k, m_new[k], m_old[k])
        for a, b in zip(*map(jax.tree.leaves, (new.params, old_state.params)), strict=True):
            assert np.array_equal(a, b)
        assert float(m_new["grad_norm"]) > 0

    @pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo", "dapo_nods", "gspo"])
    def test_variant_configs_leave_the_options_off(self, name):
        from mmr_jax.config import checks, command_line
        from mmr_jax.step import pipeline

        cfg = checks.from_config_dict(command_line.load_config_file(f"{CONFIGS}/{name}.py:smoke"))
        sc = train_step.StepConfig.from_config(cfg)
        assert sc.loss.updates_per_batch == 1 and not sc.entropy_on
        assert not cfg.loss.mask_truncated_completions
        assert "overlong" not in pipeline.reward_params(cfg)
        assert pipeline.needs_old_logps(cfg) == (cfg.loss.iterations > 1)
        assert (
            train_step.init_state({}, optax.sgd(1.0), seed=cfg.seed, loss=cfg.loss).entropy_coef
            is None
        )


class TestEntropyCoefficient:
    def test_adaptive_coefficient_moves_and_is_logged(self, ckpt):
        from mmr_jax.algorithms import entropy_control

        policy = _policy(ckpt)
        tokens, attention, comp, adv = _rows8()
        batch = train_step.Batch(tokens, attention, comp, adv)
        results = {}
        for name, target in (("low", 0.01), ("high", 100.0), ("off", None)):
            control = None
            if target is not None:
                control = entropy_control.Control(target=target, step=0.001, low=0.0, high=0.01)
            cfg = testing.step_config(
                minibatches=2,
                iterations=1,
                temperature=TEMPERATURE,
                eps_low=0.2,
                eps_high=0.2,
                aggregation="token_mean",
                beta=0.0,
                kl_estimator="k3",
                max_completion_len=T,
                entropy_coef=0.0 if control is None else 0.004,
                entropy_control=control,
            )
            optimizer = optax.sgd(0.1)
            step = train_step.jit_train_step(
                graphdef=policy.graphdef, optimizer=optimizer, schedule=lambda _: 0.1, cfg=cfg
            )
            state = _fresh_state(
                policy.params,
                optimizer,
                entropy_coef=None if control is None else jnp.float32(0.004),
            )
            results[name] = step(state, batch, policy.frozen, policy.rest)
        (low, m_low), (high, m_high), (off, m_off) = results["low"], results["high"], results["off"]
        # The random tiny model's entropy (~5 nats) is above 0.01 and below 100.
        assert 0.01 < float(m_low["entropy"]) < 100.0
        np.testing.assert_allclose(float(low.entropy_coef), 0.003, atol=1e-9)
        np.testing.assert_allclose(float(high.entropy_coef), 0.005, atol=1e-9)
        assert float(m_low["entropy_coef"]) == float(m_high["entropy_coef"]) == np.float32(0.004)
        assert off.entropy_coef is None and "entropy_coef" not in m_off
        assert float(m_low["loss"]) != float(m_off["loss"])  # the bonus reaches the loss


class TestLoraDropout:
    def test_several_updates_train_without_dropout(self, ckpt):
        # At learning rate 0 the second update sees unchanged weights: with the dropout forward
        # its ratio against the clean old log-probs is dropout's noise alone; with the forward
        # `train_step.step_graphdef` picks for several updates, exactly the same forward.
        from mmr_jax.config import checks, command_line

        policy = _policy(ckpt, dropout=0.5)
        tokens, attention, comp, adv = _rows8()
        old = _logps(policy, policy.params, tokens, attention)
        batch = train_step.Batch(tokens, attention, comp, adv, old_logps=old)
        c = command_line.load_config_file(f"{CONFIGS}/gspo.py:8b,smoke")
        c.loss.iterations, c.loss.updates_per_batch, c.loss.minibatches = 1, 2, 2
        cfg = checks.from_config_dict(c)
        assert any("lora.dropout" in line for line in checks.advisories(cfg))
        graphdef = train_step.step_graphdef(policy, cfg.loss, cfg.lora.dropout)
        assert graphdef is policy.eval_graphdef
        c.loss.updates_per_batch = 1  # one update: dropout stays (its ratio is the same forward)
        assert (
            train_step.step_graphdef(policy, checks.from_config_dict(c).loss, c.lora.dropout)
            is policy.graphdef
        )
        spread = {}
        for name, gd in (("dropout", policy.graphdef), ("clean", graphdef)):
            step_cfg = testing.step_config(
                minibatches=2,
                iterations=1,
                temperature=TEMPERATURE,
                eps_low=3e-4,
                eps_high=4e-4,
                aggregation="seq_mean_token_mean",
                beta=0.0,
                kl_estimator="k3",
                max_completion_len=T,
                importance_sampling_level="sequence",
                updates_per_batch=2,
            )
            optimizer = optax.sgd(0.0)
            step = train_step.jit_train_step(
                graphdef=gd, optimizer=optimizer, schedule=lambda _: 0.0, cfg=step_cfg
            )
            state = _fresh_state(policy.params, optimizer)
            _, m = step(state, batch, policy.frozen, policy.rest)
            spread[name] = (float(m["ratio/max"]) - 1.0, 1.0 - float(m["ratio/min"]))
            spread[name + "_clip"] = float(m["clip/frac"])
        assert max(spread["dropout"]) > 1e-3 and spread["dropout_clip"] > 0  # noise past the band
        assert max(spread["clean"]) < 1e-6 and spread["clean_clip"] == 0.0
