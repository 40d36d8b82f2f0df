"""The batches `bench_train_step.py` times: `make_groups` draws ragged groups of a shape (its
`Shape`: prompt lengths uniform, completion lengths Poisson, random tokens), `train_config` is
configs/cpu_smollm2.py at the shape's batch sizes, and `batches` lays the same groups out as each
path (full rows, shared prompt, packed) and places them on the device.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np

_CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def make_groups(shape, vocab: int, seed: int = 0, long_row: bool = False):
    """Ragged groups of the shape: `experience.Groups` with random tokens (rewards unused)."""
    from mmr_jax.step import experience

    rng = np.random.default_rng(seed)
    b, g, t = shape.prompts, shape.generations, shape.max_completion_len
    prompts = [
        [int(x) for x in rng.integers(4, vocab, rng.integers(*shape.prompt_lens, endpoint=True))]
        for _ in range(b)
    ]
    mean, lo, hi = shape.completion_lens
    lengths = np.clip(rng.poisson(mean, (b, g)), lo, hi)
    if long_row:
        lengths[0, 0] = t
    mask = np.arange(t)[None, None] < lengths[..., None]
    return experience.Groups(
        prompt_ids=prompts,
        answers=["0"] * b,
        tokens=np.where(mask, rng.integers(4, vocab, (b, g, t)), 0).astype(np.int32),
        mask=mask,
        sampler_logps=np.zeros((b, g, t), np.float32),
        truncated=lengths == t,
        texts=[[""] * g for _ in range(b)],
        per_fn={},
        total=np.zeros((b, g), np.float32),
        valid=np.ones((b, g), bool),
    ), rng.standard_normal((b, g)).astype(np.float32)


def train_config(shape, model_path: str):
    """configs/cpu_smollm2.py with the shape's batch sizes and `model_path`."""
    from mmr_jax.config import checks

    sys.path.insert(0, str(_CONFIGS))
    import cpu_smollm2

    c = cpu_smollm2.get_config()
    c.model.path = model_path
    c.batch.prompts, c.batch.generations = shape.prompts, shape.generations
    c.batch.max_prompt_len, c.batch.max_completion_len = (
        shape.max_prompt_len,
        shape.max_completion_len,
    )
    return checks.from_config_dict(c)


def batches(cfg, groups, adv, paths: dict[str, tuple[bool, int]]) -> dict:
    """{path name: Batch} of the same groups, on device; `paths`: name -> (batch.shared_prompt,
    batch.pack_max_len), as `bench_train_step.PATHS`."""
    import dataclasses as dc

    from mmr_jax.step import batch_layout, experience, pipeline, train_step

    out = {}
    for name, (shared, pack_max_len) in paths.items():
        b = dc.replace(cfg.batch, shared_prompt=shared, pack_max_len=pack_max_len)
        if not shared:  # one bucket, the maxima: full rows as they were before shared prompts
            b = dc.replace(b, min_bucket_len=max(b.max_prompt_len, b.max_completion_len))
        rows = pipeline.loss_rows(cfg, groups)
        g = groups
        host, _ = batch_layout.lay_out(
            g.prompt_ids,
            g.tokens,
            g.mask,
            rows,
            adv,
            g.sampler_logps,
            batch=b,
            minibatches=cfg.loss.minibatches,
            pad_id=0,
        )
        if pack_max_len and "packed" not in host:
            raise ValueError(f"{pack_max_len=} is too short to pack these groups")
        dev = experience.to_device({k: v for k, v in host.items() if k != "sampler_logps"})
        out[name] = train_step.Batch(
            dev["tokens"],
            dev["attention_mask"],
            dev["completion_mask"],
            dev["advantages"],
            prompt_tokens=dev.get("prompt_tokens"),
            prompt_mask=dev.get("prompt_mask"),
            packed=dev.get("packed"),
        )
    return out
