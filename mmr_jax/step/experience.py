"""Experience of one generation round, on the host: rollout, decode, rewards, embeddings
(`generate_and_score`), the DAPO variance filter (`has_variance`), and the reward / group /
length metrics of a step's groups (`group_metrics`).

The step's collection loop (dynamic sampling), its advantages and its layout are `pipeline`'s.

Shape legend (docs/design.md): B prompts, G completions a prompt, T completion tokens,
D embedding width. Everything here is host-side NumPy around the engines and the reward
functions; `has_variance` calls `algorithms.advantages` eagerly.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import time
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from mmr_jax import distributed, rewards
from mmr_jax.algorithms import advantages as advantages_lib
from mmr_jax.rollout import base as rollout_base


@dataclasses.dataclass
class Groups:
    """B groups of G completions with their scores (host arrays)."""

    prompt_ids: list[list[int]]  # [B] prompt token ids
    answers: list[str]  # [B] gold answers
    tokens: np.ndarray  # int32 [B, G, T]
    mask: np.ndarray  # bool [B, G, T]
    sampler_logps: np.ndarray  # float32 [B, G, T]
    truncated: np.ndarray  # bool [B, G] finish reason 'length'
    texts: list[Sequence[str]]  # [B][G] (another process's groups: decoded when read)
    per_fn: dict[str, np.ndarray]  # name -> float32 [B, G], unweighted
    total: np.ndarray  # float32 [B, G] weighted reward
    valid: np.ndarray  # bool [B, G] gold answer parseable
    embeddings: np.ndarray | None = None  # float32 [B, G, D]
    filler: np.ndarray | None = (
        None  # bool [B] DAPO's copies that fill a step (no loss); None: none
    )

    @property
    def num_groups(self) -> int:
        return len(self.prompt_ids)

    @property
    def trained(self) -> np.ndarray:
        """bool [B, G] completions that enter the advantages and the loss: a parseable gold
        answer, in a group that is not a filler copy."""
        if self.filler is None:
            return self.valid
        return self.valid & ~self.filler[:, None]

    def take(self, idx: Sequence[int]) -> Groups:
        """The groups at `idx` (in that order)."""
        idx = list(idx)
        pick = lambda x: None if x is None else x[idx]
        return Groups(
            prompt_ids=[self.prompt_ids[i] for i in idx],
            answers=[self.answers[i] for i in idx],
            tokens=self.tokens[idx],
            mask=self.mask[idx],
            sampler_logps=self.sampler_logps[idx],
            truncated=self.truncated[idx],
            texts=[self.texts[i] for i in idx],
            per_fn={k: v[idx] for k, v in self.per_fn.items()},
            total=self.total[idx],
            valid=self.valid[idx],
            embeddings=pick(self.embeddings),
            filler=pick(self.filler),
        )


def _pad_time(x: np.ndarray, t: int, value=0) -> np.ndarray:
    pad = [(0, 0)] * (x.ndim - 1) + [(0, t - x.shape[-1])]
    return np.pad(x, pad, constant_values=value)


def concat(groups: Sequence[Groups]) -> Groups:
    """Groups of several generation rounds, padded to a common T."""
    if len(groups) == 1:
        return groups[0]
    t = max(g.tokens.shape[-1] for g in groups)
    cat = lambda xs: np.concatenate(xs, axis=0)
    embs = [g.embeddings for g in groups]
    return Groups(
        prompt_ids=[p for g in groups for p in g.prompt_ids],
        answers=[a for g in groups for a in g.answers],
        tokens=cat([_pad_time(g.tokens, t) for g in groups]),
        mask=cat([_pad_time(g.mask, t) for g in groups]),
        sampler_logps=cat([_pad_time(g.sampler_logps, t) for g in groups]),
        truncated=cat([g.truncated for g in groups]),
        texts=[x for g in groups for x in g.texts],
        per_fn={k: cat([g.per_fn[k] for g in groups]) for k in groups[0].per_fn},
        total=cat([g.total for g in groups]),
        valid=cat([g.valid for g in groups]),
        embeddings=None if any(e is None for e in embs) else cat(embs),
        filler=(
            None
            if all(g.filler is None for g in groups)
            else cat(
                [np.zeros(g.num_groups, bool) if g.filler is None else g.filler for g in groups]
            )
        ),
    )


def generate_and_score(
    engine,
    tokenizer,
    prompt_ids,
    answers,
    sampling: rollout_base.SamplingParams,
    weights: Mapping[str, float],
    *,
    reward_params=None,
    encoder=None,
    timings: dict | None = None,
) -> Groups:
    """Rollout -> decode -> rewards -> embeddings for one generation round of B prompts.

    With several processes (`engine` a `distributed.ShareEngine`), each process samples, decodes,
    scores and embeds only its own share of the prompts; the completions travel with their
    rewards and embeddings in one gather (`_gather`), so that every process returns the same B
    groups without scoring anyone else's.
    """
    timings = timings if timings is not None else {}
    score = lambda batch, part: _score(
        batch, tokenizer, prompt_ids[part], answers[part], weights, reward_params, encoder, timings
    )
    t0 = time.perf_counter()
    if not isinstance(engine, distributed.ShareEngine):
        batch = engine.generate(prompt_ids, sampling)
        _add_time(timings, "rollout", t0)
        return score(batch, slice(None))
    batch = engine.generate_local(prompt_ids, sampling)  # this process's share, or None
    _add_time(timings, "rollout", t0)
    mine = distributed.share_slices(len(prompt_ids))[jax.process_index()]
    local = None if batch is None else score(batch, mine)
    t0 = time.perf_counter()
    pad_id = getattr(engine, "pad_id", 0)
    groups = _gather(local, tokenizer, prompt_ids, answers, sampling, weights, encoder, pad_id)
    _add_time(timings, "rollout", t0)  # the round ends when every process holds every group
    return groups


def _add_time(timings: dict, key: str, since: float) -> None:
    timings[key] = timings.get(key, 0.0) + time.perf_counter() - since


def _score(
    batch: rollout_base.RolloutBatch,
    tokenizer,
    prompt_ids,
    answers,
    weights: Mapping[str, float],
    reward_params,
    encoder,
    timings: dict,
) -> Groups:
    """Decode -> rewards -> embeddings of the completions in `batch`."""
    t1 = time.perf_counter()
    b, g, _ = batch.tokens.shape
    texts = [
        [tokenizer.decode(batch.completion_ids(i, j), skip_special_tokens=True) for j in range(g)]
        for i in range(b)
    ]
    flat_texts = [t for row in texts for t in row]
    lengths = batch.lengths.reshape(-1).tolist()
    scores = rewards.score(
        flat_texts,
        [a for a in answers for _ in range(g)],
        lengths,
        dict(weights),
        params=reward_params,
    )
    _add_time(timings, "rewards", t1)
    t2 = time.perf_counter()
    emb = None
    if encoder is not None:
        # One call per group: an encoder pads a text with the others of its call, which changes
        # its embedding in the last bits; a group never spans processes, so per-group calls give
        # the same embeddings on any number of processes (issue 39).
        emb = np.stack([np.asarray(encoder.encode(row), np.float32) for row in texts])
        emb = emb.reshape(b, g, -1)
    _add_time(timings, "embeddings", t2)
    return Groups(
        prompt_ids=[list(p) for p in prompt_ids],
        answers=list(answers),
        tokens=batch.tokens,
        mask=batch.mask,
        sampler_logps=batch.logprobs,
        truncated=np.array(
            [[r == rollout_base.FINISH_LENGTH for r in rs] for rs in batch.finish_reasons]
        ),
        texts=texts,
        per_fn={k: v.reshape(b, g) for k, v in scores.per_fn.items()},
        total=scores.total.reshape(b, g),
        valid=scores.valid.reshape(b, g),
        embeddings=emb,
    )


def _gather(
    local: Groups | None, tokenizer, prompt_ids, answers, sampling, weights, encoder, pad_id=0
) -> Groups:
    """Every process's scored share (`local`: this process's, None when empty) as the round's
    B groups, in prompt order: completions, rewards, validity and embeddings in one collective
    (`distributed.gather_rows`). Texts of the other processes' groups are decoded when read.
    Tokens are padded in time with the engine's `pad_id`, as one engine pads the whole batch
    (the same tokens as one process, padding included)."""
    g, max_len = sampling.n, sampling.max_new_tokens
    specs = {
        **distributed.shares.rollout_specs(g, max_len),
        **{f"reward/{k}": ((g,), np.float32) for k in weights},
        "total": ((g,), np.float32),
        "valid": ((g,), np.bool_),
    }
    if encoder is not None:
        specs["embeddings"] = ((g, int(encoder.dim)), np.float32)
    fields = None
    if local is not None:
        fields = {
            "tokens": _pad_time(local.tokens, max_len, pad_id),
            "mask": _pad_time(local.mask, max_len),
            "logprobs": _pad_time(local.sampler_logps, max_len),
            "truncated": local.truncated,
            **{f"reward/{k}": v for k, v in local.per_fn.items()},
            "total": local.total,
            "valid": local.valid,
        }
        if encoder is not None:
            fields["embeddings"] = local.embeddings
    parts = distributed.share_slices(len(prompt_ids))
    rows = distributed.gather_rows(fields, sizes=[p.stop - p.start for p in parts], specs=specs)
    batch = distributed.shares.rollout_from_rows(rows)
    mine = parts[jax.process_index()]
    texts = [
        local.texts[i - mine.start]
        if mine.start <= i < mine.stop
        else _TextsOnRead(tokenizer, batch.tokens[i], batch.mask[i])
        for i in range(len(prompt_ids))
    ]
    return Groups(
        prompt_ids=[list(p) for p in prompt_ids],
        answers=list(answers),
        tokens=batch.tokens,
        mask=batch.mask,
        sampler_logps=batch.logprobs,
        truncated=rows["truncated"],
        texts=texts,
        per_fn={k: rows[f"reward/{k}"] for k in weights},
        total=rows["total"],
        valid=rows["valid"],
        embeddings=rows.get("embeddings"),
    )


class _TextsOnRead(collections.abc.Sequence):
    """The G completion texts of a group another process sampled and scored, decoded when read
    (rewards and embeddings came with the gather; only sample logging reads these)."""

    def __init__(self, tokenizer, tokens_GxT: np.ndarray, mask_GxT: np.ndarray):
        self.tokenizer, self.tokens, self.lengths = tokenizer, tokens_GxT, mask_GxT.sum(-1)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        ids = self.tokens[i, : int(self.lengths[i])].tolist()
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def has_variance(groups: Groups, reward: str) -> np.ndarray:
    """bool [B]: the group's `reward` is not constant over its valid completions (DAPO filter)."""
    return np.asarray(advantages_lib.has_variance(groups.per_fn[reward], mask=groups.valid))


def group_metrics(groups: Groups, reweighted, adv, lam, *, filter_reward: str | None) -> dict:
    """Reward, reweighting, group and length statistics of the step's batch.

    Rewards are those of the completions that train (`groups.trained`); when every group is a
    filler copy (DAPO gave up without one group of reward variance) those of the sampled copies,
    so a step without signal still shows what was sampled. `groups/invalid_gold_frac` counts only
    gold answers that do not parse."""
    valid = groups.trained if groups.trained.any() else groups.valid
    out = {
        "reward/mean": groups.total[valid].mean() if valid.any() else 0.0,
        "reward/std": groups.total[valid].std() if valid.any() else 0.0,
    }
    for name, r in groups.per_fn.items():
        out[f"reward/{name}/mean"] = float(r.mean())
        out[f"reward/{name}/std"] = float(r.std())
    out["reward/reweighted_mean"] = (
        float(np.asarray(reweighted)[valid].mean()) if valid.any() else 0.0
    )
    out["reward/reweighted_std"] = (
        float(np.asarray(reweighted)[valid].std()) if valid.any() else 0.0
    )
    out["advantage/abs_mean"] = float(np.abs(adv).mean())
    if lam is not None:
        out["mmr/lambda_mean"] = float(np.mean(lam))
    stds = np.array(
        [
            groups.total[i][valid[i]].std() if valid[i].any() else 0.0
            for i in range(groups.num_groups)
        ]
    )
    out["groups/zero_variance_frac"] = float(np.mean(stds < 1e-6))
    if np.any(stds < 1e-6):  # what reweighting hands groups of uniform raw rewards (issue 26)
        out["advantage/uniform_abs_mean"] = float(np.abs(np.asarray(adv)[stds < 1e-6]).mean())
    if filter_reward is not None:
        out["groups/filter_zero_variance_frac"] = float(
            1 - has_variance(groups, filter_reward).mean()
        )
    out["groups/invalid_gold_frac"] = float(1 - groups.valid.mean())
    if groups.filler is not None:
        out["dynamic_sampling/filler_frac"] = float(groups.filler.mean())
    lengths = groups.mask.sum(-1)
    out["completion/length_mean"] = float(lengths.mean())
    out["completion/length_max"] = float(lengths.max())
    out["completion/truncated_frac"] = float(groups.truncated.mean())
    return {k: float(v) for k, v in out.items()}


def to_device(arrays: Mapping[str, np.ndarray], sharding=None) -> dict[str, jax.Array]:
    """Explicit host -> device transfer of the packed batch."""
    return {k: jax.device_put(v, sharding) for k, v in arrays.items()}
