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

With `packed_buckets`, each stored prompt's g completions are also packed into one row
(`pack_completions`) when the longest group fits the largest of them, so the forward runs over
the group's real tokens, not g rows padded to the longest (a step whose groups are longer keeps
the layout above: a packed row attends over all of its L tokens, so L is capped). The [N, T]
arrays stay (the loss reads them; T is then the configured maximum, so that only the packed
length L varies between packed steps):

    packed.inputs   int32 [N / g, L]  every completion token that predicts a next one, by group
    packed.targets  int32 [N / g, L]  the token each input predicts
    packed.segments int32 [N / g, L]  which of the g completions (0..g-1), -1 on padding
    packed.offsets  int32 [N / g, L]  the input's index in its completion (position - prompt len)
    packed.index    int32 [N, T]      where the input predicting token t >= 1 of row r sits in
                                      row r // g of the packed arrays (0 elsewhere)

Shape legend: B prompts, G completions per prompt, N = B * G rows, M minibatches, L packed length.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import numpy as np


@flax.struct.dataclass
class PackedCompletions:
    """A group's completions in one row (module docstring); numpy on the host, jax on device."""

    inputs: jax.Array
    targets: jax.Array
    segments: jax.Array
    offsets: jax.Array
    index: jax.Array


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
    packed_buckets: tuple[int, ...] | None = None,
) -> dict:
    """Host arrays of the layout above (module docstring) from B groups of G completions.

    With `packed_buckets` (lengths for a packed row of g completions), also "packed": a
    `PackedCompletions` of numpy arrays, when every group fits `packed_buckets[-1]`.
    """
    b, g_all, t_in = tokens_BxGxT.shape
    if len(prompt_ids) != b or g_all % group:
        raise ValueError(f"{len(prompt_ids)} prompts, {g_all} completions each, group {group}")
    if min(len(x) for x in prompt_ids) < 1:
        raise ValueError("an empty prompt: every prompt needs at least one token")
    lengths = mask_BxGxT.sum(-1)
    p = bucket_for(max(len(x) for x in prompt_ids), prompt_buckets, "prompt")
    t = bucket_for(max(int(lengths.max(initial=1)), 1), completion_buckets, "completion")
    inputs_per_row = np.maximum(lengths - 1, 0).reshape(b * g_all // group, group).sum(-1)
    packed = packed_buckets is not None and inputs_per_row.max() <= packed_buckets[-1]
    if packed:
        t = completion_buckets[-1]  # one [N, T] shape: only L varies between packed steps
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
    out = {
        "prompt_tokens": np.repeat(prompt, reps, axis=0),
        "prompt_mask": np.repeat(prompt_mask, reps, axis=0),
        "tokens": comp.reshape(n, t).astype(np.int32),
        "attention_mask": comp_mask.reshape(n, t),
        "completion_mask": (comp_mask & valid_BxG[..., None]).reshape(n, t),
        "advantages": np.asarray(advantages_BxG, np.float32).reshape(n),
        "sampler_logps": fit(np.asarray(sampler_logps_BxGxT, np.float32)).reshape(n, t),
    }
    if packed:
        out["packed"] = pack_completions(
            out["tokens"], out["attention_mask"], group, pad_id=pad_id, buckets=packed_buckets
        )
    return out


def pack_completions(
    tokens_NxT: np.ndarray, mask_NxT: np.ndarray, group: int, *, pad_id: int, buckets
) -> PackedCompletions:
    """Rows r = q * group + i (i < group) packed into row q, one after another (docstring above).

    A completion of n tokens contributes its first n - 1 (the last token is only a target; the
    first is predicted from the prompt). L is the longest packed row rounded up to a bucket; a
    group longer than every bucket is an error, never a truncation.
    """
    n, t = tokens_NxT.shape
    if n % group:
        raise ValueError(f"{n} rows do not split into groups of {group}")
    q = n // group
    lengths = np.asarray(mask_NxT, bool).sum(-1)
    if (np.asarray(mask_NxT, bool) != (np.arange(t)[None] < lengths[:, None])).any():
        raise ValueError("completion masks must be a prefix of each row (right padding)")
    n_in = np.maximum(lengths - 1, 0)  # inputs per completion
    row_len = n_in.reshape(q, group).sum(-1)
    length = bucket_for(max(int(row_len.max(initial=0)), 1), tuple(buckets), "packed group")
    inputs = np.full((q, length), pad_id, np.int32)
    targets = np.full((q, length), pad_id, np.int32)
    segments = np.full((q, length), -1, np.int32)
    offsets = np.zeros((q, length), np.int32)
    index = np.zeros((n, t), np.int32)
    for r in range(n):
        row, seg, k = r // group, r % group, int(n_in[r])
        start = int(n_in[row * group : r].sum())
        inputs[row, start : start + k] = tokens_NxT[r, :k]
        targets[row, start : start + k] = tokens_NxT[r, 1 : k + 1]
        segments[row, start : start + k] = seg
        offsets[row, start : start + k] = np.arange(k)
        index[r, 1 : k + 1] = start + np.arange(k)
    return PackedCompletions(inputs, targets, segments, offsets, index)
