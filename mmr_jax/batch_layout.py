"""The shared-prompt batch layout of the train step: each group's prompt once, completions trimmed.

    prompt_tokens  int32 [N / g, P]  each prompt once per g rows, left-padded to a bucket P
    prompt_mask    bool  [N / g, P]
    tokens         int32 [N, T]      completions, right-padded to a bucket T
    attention_mask bool  [N, T]      real completion tokens
    completion_mask bool [N, T]      tokens in the loss (False on rows with an invalid gold answer)
    advantages     float32 [N]
    sampler_logps  float32 [N, T]

Row r = q * g + i is the i-th completion sharing prompt row q. g is the group size G when the
minibatch count divides the number of prompts B; otherwise the largest divisor of G whose groups
tile every minibatch (`group_size`), and each prompt is stored G / g times (still exact, less
shared). P and T are the batch's longest prompt and completion rounded up to the next bucket
(`bucket_sizes`: few geometric sizes, so the step compiles only a few times), never beyond the
configured maxima; a longer prompt or completion is an error, not a silent truncation.

Shape legend: B prompts, G completions per prompt, N = B * G rows, M minibatches.
"""

from __future__ import annotations

import math

import numpy as np


def bucket_sizes(minimum: int, maximum: int) -> tuple[int, ...]:
    """Lengths minimum * (1, 1.5, 2, 3, 4, 6, ...) below `maximum`, then `maximum` itself.

    Padding waste is under a third of a bucket and the count grows with log(maximum / minimum)
    (8 -> 32: 8, 12, 16, 24, 32; 16 -> 3584: 17 sizes).
    """
    if minimum < 1 or maximum < 1:
        raise ValueError(f"bucket lengths must be >= 1, got minimum={minimum} maximum={maximum}")
    sizes, base = [], minimum
    while base < maximum:
        sizes.append(base)
        if base * 3 // 2 < maximum and base * 3 % 2 == 0:
            sizes.append(base * 3 // 2)
        base *= 2
    sizes.append(maximum)
    return tuple(sorted(set(sizes)))


def bucket_for(n: int, sizes: tuple[int, ...], what: str) -> int:
    """The smallest size >= n; ValueError when `n` exceeds every bucket (never truncates)."""
    for s in sizes:
        if s >= n:
            return s
    raise ValueError(f"a {what} of {n} tokens is longer than the largest bucket {sizes[-1]}")


def group_size(generations: int, rows: int, minibatches: int) -> int:
    """Rows per stored prompt: G if M divides B, else gcd(G, N / M) (whole groups per minibatch)."""
    if rows % minibatches:
        raise ValueError(f"{minibatches} minibatches do not divide {rows} rows")
    return math.gcd(generations, rows // minibatches)


def pack(
    prompt_ids,
    tokens_BxGxT: np.ndarray,
    mask_BxGxT: np.ndarray,
    valid_BxG: np.ndarray,
    advantages_BxG: np.ndarray,
    sampler_logps_BxGxT: np.ndarray,
    *,
    pad_id: int,
    prompt_buckets: tuple[int, ...],
    completion_buckets: tuple[int, ...],
    group: int,
) -> dict[str, np.ndarray]:
    """Host arrays of the layout above (module docstring) from B groups of G completions."""
    b, g_all, t_in = tokens_BxGxT.shape
    if len(prompt_ids) != b or g_all % group:
        raise ValueError(f"{len(prompt_ids)} prompts, {g_all} completions each, group {group}")
    if min(len(x) for x in prompt_ids) < 1:
        raise ValueError("an empty prompt: every prompt needs at least one token")
    lengths = mask_BxGxT.sum(-1)
    p = bucket_for(max(len(x) for x in prompt_ids), prompt_buckets, "prompt")
    t = bucket_for(max(int(lengths.max(initial=1)), 1), completion_buckets, "completion")
    prompt = np.full((b, p), pad_id, np.int32)
    prompt_mask = np.zeros((b, p), bool)
    for i, ids in enumerate(prompt_ids):
        prompt[i, p - len(ids) :] = ids
        prompt_mask[i, p - len(ids) :] = True
    # Only padding lies beyond t (t >= every row's length), so trimming loses no token.
    fit = lambda x: np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, max(0, t - t_in))])[..., :t]
    comp_mask = fit(mask_BxGxT.astype(bool))
    comp = np.where(comp_mask, fit(tokens_BxGxT), pad_id)
    n, reps = b * g_all, g_all // group
    return {
        "prompt_tokens": np.repeat(prompt, reps, axis=0),
        "prompt_mask": np.repeat(prompt_mask, reps, axis=0),
        "tokens": comp.reshape(n, t).astype(np.int32),
        "attention_mask": comp_mask.reshape(n, t),
        "completion_mask": (comp_mask & valid_BxG[..., None]).reshape(n, t),
        "advantages": np.asarray(advantages_BxG, np.float32).reshape(n),
        "sampler_logps": fit(np.asarray(sampler_logps_BxGxT, np.float32)).reshape(n, t),
    }
