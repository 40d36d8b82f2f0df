"""The host side of one training step, in the order it runs (docs/design.md, "One step"):

    prompts -> rollout -> rewards -> embeddings   `collect` (`experience.generate_and_score`), with
                                                  DAPO's dynamic sampling (rounds until B groups
                                                  have reward variance)
    -> reweighting and advantages                 `advantages` (the lambda MMR used comes from the
                                                  reweighter itself)
    -> layout                                     `batch_layout.lay_out` (lays out only)
    -> reference / old log-probs                  `logprobs` (`minibatch.jit_logprobs`)
    -> `train_step.Batch`                         `make_batch` runs the three stages above

The trainer calls `collect` (directly, or through the off-policy schedule) and `make_batch` once
per step; they take the run's parts (config, engine, policy), not the run, so that they can be
driven without a trainer. Host-side NumPy and jitted calls; the only side effects are the
engine's and logging.

Shape legend (docs/design.md): B prompts, G completions a prompt, N = B x G rows, T completion
tokens.
"""

from __future__ import annotations

import time

import numpy as np
from absl import logging

from mmr_jax import distributed, rewards
from mmr_jax.algorithms import advantages as advantages_lib
from mmr_jax.algorithms import mmr
from mmr_jax.config import schema
from mmr_jax.infra import faults
from mmr_jax.rollout import base as rollout_base
from mmr_jax.step import batch_layout, experience, minibatch, train_step


class EngineLogprobError(ValueError):
    """The rollout engine returned a NaN / inf log-prob for a sampled token."""


def check_engine_logps(logps_NxT: np.ndarray, mask_NxT: np.ndarray, engine: str) -> None:
    """Raises `EngineLogprobError` when a sampled token's engine log-prob is not finite."""
    bad = mask_NxT & ~np.isfinite(logps_NxT)
    if bad.any():
        row, col = (int(i[0]) for i in np.nonzero(bad))
        raise EngineLogprobError(
            f"the {engine} engine returned {int(bad.sum())} non-finite log-probs for sampled "
            f"tokens (first: row {row}, token {col}: {logps_NxT[row, col]}); the mismatch metrics "
            "and loss.tis_cap need them finite. Check the engine's logprobs mode (vLLM: "
            "--logprobs-mode processed_logprobs) and its dtype."
        )


def sampling_params(cfg: schema.TrainConfig, step: int, round_: int) -> rollout_base.SamplingParams:
    """The rollout's sampling parameters for generation round `round_` of `step`."""
    # The seed is a function of (seed, step, round), so a resumed run samples what it would have.
    seed = (cfg.seed * 1_000_003 + step * 1_009 + round_) % 2**31
    return rollout_base.SamplingParams(
        max_new_tokens=cfg.batch.max_completion_len,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        n=cfg.batch.generations,
        seed=seed,
    )


def reward_params(cfg: schema.TrainConfig) -> dict:
    """Keyword arguments of the reward functions, by name."""
    params = {}
    if "cosine" in cfg.rewards.weights:
        released = cfg.rewards.cosine_form == "released"
        params["cosine"] = (
            dict(rewards.RELEASED_COSINE) if released else {"max_len": cfg.batch.max_completion_len}
        )
    if "overlong" in cfg.rewards.weights:
        l_max = cfg.rewards.overlong_max_len or cfg.batch.max_completion_len
        cache = cfg.rewards.overlong_cache_len or l_max // 5
        params["overlong"] = {"max_len": l_max, "cache_len": cache}
    if cfg.rewards.accuracy_number_only and "accuracy" in cfg.rewards.weights:
        params["accuracy"] = {"number_only": True}
    return params


def collect(
    cfg: schema.TrainConfig, prompts, engine, tokenizer, encoder, step: int, timings: dict
) -> tuple[experience.Groups, dict]:
    """B groups for `step`: one generation round, or DAPO's rounds until B groups have variance.

    `prompts` yields batches of B (prompt ids, gold answer) pairs (`data.PromptIterator`).
    """
    ds, scoring = cfg.dynamic_sampling, reward_params(cfg)
    kept, rounds, seen, dropped = [], 0, 0, 0
    max_rounds = ds.max_generation_batches if ds.enabled else 1
    while rounds < max_rounds:
        batch, sampling = next(prompts), sampling_params(cfg, step, rounds)
        groups = experience.generate_and_score(
            engine,
            tokenizer,
            [p for p, _ in batch],
            [a for _, a in batch],
            sampling,
            cfg.rewards.weights,
            reward_params=scoring,
            encoder=encoder,
            timings=timings,
        )
        if rounds == 0:
            faults.point("rollout", step)
        rounds += 1
        seen += groups.num_groups
        last = groups
        if ds.enabled:
            keep = np.flatnonzero(experience.has_variance(groups, ds.filter_reward))
            dropped += groups.num_groups - len(keep)
            groups = groups.take(keep)
        kept.append(groups)
        if sum(g.num_groups for g in kept) >= cfg.batch.prompts:
            break
    groups = experience.concat(kept)
    if groups.num_groups < cfg.batch.prompts:  # DAPO gave up: fill with masked copies (no loss)
        logging.warning(
            "step %d: only %d of %d groups with reward variance after %d rounds",
            step,
            groups.num_groups,
            cfg.batch.prompts,
            rounds,
        )
        source = groups if groups.num_groups else last  # no group at all: a step without signal
        fill = source.take(
            [i % source.num_groups for i in range(cfg.batch.prompts - groups.num_groups)]
        )
        fill.filler = np.ones(fill.num_groups, bool)  # out of the loss; their gold stays valid
        groups = experience.concat([groups, fill])
    groups = groups.take(range(cfg.batch.prompts))
    info = {
        "dynamic_sampling/generation_batches": rounds,
        "dynamic_sampling/dropped_frac": dropped / seen,
    }
    return groups, info if ds.enabled else {}


def advantages(
    cfg: schema.TrainConfig, groups: experience.Groups, timings: dict
) -> tuple[np.ndarray, dict]:
    """float32 [B, G] advantages of the step's groups (`reweighted_advantages`), and the group
    metrics (`experience.group_metrics`)."""
    t0 = time.perf_counter()
    reweighted_BxG, adv_BxG, lam = reweighted_advantages(
        groups.total,
        groups.embeddings,
        groups.trained,  # DAPO's filler groups (when it gives up) sit out of the advantages
        reweight=cfg.reweight,
        advantage=cfg.advantage,
    )
    timings["reweighting"] = time.perf_counter() - t0
    ds = cfg.dynamic_sampling
    filter_reward = ds.filter_reward if ds.enabled else None
    info = experience.group_metrics(
        groups, reweighted_BxG, adv_BxG, lam, filter_reward=filter_reward
    )
    return adv_BxG, info


def reweighted_advantages(
    total_BxG: np.ndarray,
    embeddings_BxGxD: np.ndarray | None,
    valid_BxG: np.ndarray,
    *,
    reweight: schema.ReweightConfig,
    advantage: schema.AdvantageConfig,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(reweighted rewards [B, G], advantages [B, G], lambda or None) on the host, float32.

    The rewards are reweighted by `reweight.method` (`mmr.reweight_with_lambda`: the lambda is
    the one MMR used, [B] by group or [1] in batch scope), then made advantages by
    `advantage.estimator` over the valid completions; invalid rows get advantage 0.
    """
    if reweight.uniform_group_guard:  # this project's variant: groups of equal rewards sit out
        valid_BxG = np.asarray(advantages_lib.varying_groups_mask(total_BxG, mask=valid_BxG))
    reweighted_BxG, lam = mmr.reweight_with_lambda(
        reweight.method,
        total_BxG,
        embeddings_BxGxD,
        lam=reweight.lam,
        mask=valid_BxG,
        scope=reweight.scope,
    )
    scaled = advantage.estimator in ("grpo", "batch_std")  # the estimators with a std convention
    kwargs = {"ddof": advantage.std_ddof, "eps": advantage.eps} if scaled else {}
    estimate = advantages_lib.ESTIMATORS[advantage.estimator]
    adv_BxG = estimate(reweighted_BxG, mask=np.asarray(valid_BxG), **kwargs)
    adv_BxG = np.where(np.asarray(valid_BxG), np.asarray(adv_BxG), 0.0).astype(np.float32)
    lam = None if lam is None else np.asarray(lam)
    return np.asarray(reweighted_BxG, np.float32), adv_BxG, lam


def loss_rows(cfg: schema.TrainConfig, groups: experience.Groups) -> np.ndarray:
    """bool [B, G] the completions whose tokens enter the loss: valid ones outside DAPO's filler
    groups (`Groups.trained`), less the truncated
    (finish reason 'length') under `loss.mask_truncated_completions`. The advantages are computed
    before, over every valid completion, so truncated ones still count in their group's stats."""
    if cfg.loss.mask_truncated_completions:
        return groups.trained & ~groups.truncated
    return groups.trained


def needs_old_logps(cfg: schema.TrainConfig) -> bool:
    """Whether the step compares with the pre-update policy: after its first optimiser update."""
    return cfg.loss.iterations * cfg.loss.updates_per_batch > 1


def logprobs(cfg: schema.TrainConfig, dev: dict, *, policy, params, ref_params, mesh=None):
    """(reference, old) log-probs [N, T] of the batch `dev` (None where the loss needs none).

    `policy` is the run's `lora.Policy`, `params` the trainable parameters of this step,
    `ref_params` the reference policy's (full fine-tune with beta > 0; else None: the base is the
    adapters switched off). `mesh`: the run's (splash attention splits over it).
    """
    kw = dict(
        mesh=mesh,
        graphdef=policy.eval_graphdef,
        num_completion=dev["completion_mask"].shape[1],
        temperature=cfg.rollout.temperature,
        chunk=cfg.model.logprob_chunk,
        minibatches=cfg.loss.minibatches,
        prompt_tokens=dev.get("prompt_tokens"),
        prompt_mask=dev.get("prompt_mask"),
        packed=dev.get("packed"),
    )
    args = (policy.frozen, policy.rest, dev["tokens"], dev["attention_mask"])
    ref = old = None
    if cfg.loss.beta > 0:
        ref_p = ref_params if ref_params is not None else params
        ref = minibatch.jit_logprobs(ref_p, *args, disable_lora=policy.lora, **kw)
    # With LoRA dropout the step's own log-probs are noisy; TIS needs the clean pre-update ones.
    dropout = policy.lora and cfg.lora.dropout > 0
    if dropout and not needs_old_logps(cfg) and cfg.loss.tis_cap == 0:
        logging.log_first_n(
            logging.WARNING,
            "mismatch/* metrics include LoRA dropout noise (lora.dropout=%s, loss.iterations=1): "
            "set loss.tis_cap > 0 or lora.dropout=0 to measure the engine mismatch alone",
            1,
            cfg.lora.dropout,
        )
    if needs_old_logps(cfg) or (dropout and cfg.loss.tis_cap > 0):
        old = minibatch.jit_logprobs(params, *args, **kw)
    return ref, old


def make_batch(
    cfg: schema.TrainConfig,
    groups: experience.Groups,
    *,
    policy,
    params,
    ref_params,
    pad_id: int,
    timings: dict,
    choose_packed_length=None,
    mesh=None,
) -> tuple[train_step.Batch, dict]:
    """The step's `train_step.Batch` from its groups, and its metrics: advantages -> layout ->
    device arrays -> reference / old log-probs (`logprobs`, whose arguments these are).

    `mesh`: the run's; the batch becomes global arrays with rows split over its (data, fsdp)
    axes, each device holding only its rows (`distributed.global_batch`; a collective with
    several processes). None: one device.
    """
    rows_BxG = loss_rows(cfg, groups)
    engine_logps_NxT = groups.sampler_logps.reshape(-1, groups.sampler_logps.shape[-1])
    loss_tokens_NxT = (groups.mask & rows_BxG[..., None]).reshape(engine_logps_NxT.shape)
    check_engine_logps(engine_logps_NxT, loss_tokens_NxT, cfg.rollout.engine)
    adv_BxG, info = advantages(cfg, groups, timings)
    host, layout_info = batch_layout.lay_out(
        groups.prompt_ids,
        groups.tokens,
        groups.mask,
        rows_BxG,
        adv_BxG,
        groups.sampler_logps,
        batch=cfg.batch,
        minibatches=cfg.loss.minibatches,
        pad_id=pad_id,
        choose_packed_length=choose_packed_length,
    )
    dev = distributed.global_batch(host, mesh)
    ref, old = logprobs(cfg, dev, policy=policy, params=params, ref_params=ref_params, mesh=mesh)
    batch = train_step.Batch(
        dev["tokens"],
        dev["attention_mask"],
        dev["completion_mask"],
        dev["advantages"],
        old_logps=old,
        ref_logps=ref,
        sampler_logps=dev["sampler_logps"],
        prompt_tokens=dev.get("prompt_tokens"),
        prompt_mask=dev.get("prompt_mask"),
        packed=dev.get("packed"),
    )
    return batch, {**info, **layout_info}
