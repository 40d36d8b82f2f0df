"""The train step's batch layouts, built in one place with one bucketing scheme.

One step's B groups of G completions become host arrays in one of three layouts (`LAYOUTS`):

'full'    every row is [prompt, completion]:
    tokens          int32 [N, P + T]  prompt left-padded to P, completion right-padded to T
    attention_mask  bool  [N, P + T]
'shared'  each prompt once per g rows (`models.shared_prompt`):
    prompt_tokens   int32 [N / g, P]  left-padded
    prompt_mask     bool  [N / g, P]
    tokens          int32 [N, T]      the completions alone, right-padded
    attention_mask  bool  [N, T]
'packed'  as 'shared', and the completions that share a stored prompt packed one after another
          into one row (`pack_completions`), so that the forward runs over real tokens only:
    packed          PackedCompletions of [N / k, L] arrays (below), k rows per stored prompt

and in all three:
    completion_mask bool    [N, T]  tokens in the loss (False on rows with an invalid gold answer)
    advantages      float32 [N]
    sampler_logps   float32 [N, T]  the engine's log-probs of the sampled tokens

Row r = q * g + i is the i-th completion sharing stored prompt q. g is the group size G when the
minibatch count divides the number of prompts B; otherwise the largest divisor of G whose groups
tile every minibatch (`group_size`), and each prompt is stored G / g times (still exact, less
shared). A packed row holds k completions: k = g when every group's inputs fit the longest packed
bucket, else the largest divisor of g whose sub-groups all fit (down to k = 1: one completion per
row, its prompt stored once for it), so a step with long groups still runs packed. Each stored
prompt then serves k rows.

Buckets (`Buckets`, `bucket_sizes`): P, T and L are the batch's longest prompt, completion and
packed row rounded up to the next of a few geometric sizes (m, 1.5m, 2m, 3m, ... up to the
configured maximum), so the step compiles for a handful of shapes; in the packed layout T is the
configured maximum (only L and k vary between packed steps). Nothing is ever truncated: a prompt
or completion longer than its maximum is a `TooLongError` (the trainer drops over-long prompts
when it loads the data, `problem_sets.load_prompts`).

    packed.inputs   int32 [N / k, L]  every completion token that predicts a next one, by row
    packed.targets  int32 [N / k, L]  the token each input predicts
    packed.segments int32 [N / k, L]  which of the row's k completions (0..k-1), -1 on padding
    packed.offsets  int32 [N / k, L]  the input's index in its completion (position - prompt len)
    packed.index    int32 [N, T]      where the input predicting token t >= 1 of row r sits in
                                      packed row r // k (0 elsewhere)

Shape legend: B prompts, G completions per prompt, N = B * G rows, L packed length.
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import numpy as np

from mmr_jax.config import schema

LAYOUTS = ("full", "shared", "packed")  # index = the `batch/layout` metric


class TooLongError(ValueError):
    """A prompt, completion or packed row is longer than the largest bucket (never truncated)."""


@flax.struct.dataclass
class PackedCompletions:
    """Completions packed into rows (module docstring); numpy on the host, jax on device."""

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
    """The smallest size >= n; `TooLongError` when `n` exceeds every bucket (never truncates)."""
    for s in sizes:
        if s >= n:
            return s
    raise TooLongError(f"a {what} of {n} tokens is longer than the largest bucket {sizes[-1]}")


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The lengths a batch's prompts (P), completions (T) and packed rows (L) round up to."""

    prompt: tuple[int, ...]
    completion: tuple[int, ...]
    packed: tuple[int, ...] | None = None  # None: no packed layout

    @classmethod
    def geometric(
        cls, minimum: int, max_prompt_len: int, max_completion_len: int, pack_max_len: int = 0
    ) -> Buckets:
        """`bucket_sizes(minimum, max)` for each length (packed: none when pack_max_len is 0)."""
        return cls(
            prompt=bucket_sizes(minimum, max_prompt_len),
            completion=bucket_sizes(minimum, max_completion_len),
            packed=bucket_sizes(minimum, pack_max_len) if pack_max_len else None,
        )


def group_size(generations: int, rows: int, minibatches: int) -> int:
    """Rows per stored prompt: G if M divides B, else gcd(G, N / M) (whole groups per minibatch)."""
    if rows % minibatches:
        raise ValueError(f"{minibatches} minibatches do not divide {rows} rows")
    return math.gcd(generations, rows // minibatches)


def packed_group(inputs_N: np.ndarray, group: int, max_len: int) -> int:
    """The largest divisor k of `group` whose runs of k consecutive rows have <= max_len inputs."""
    for k in sorted((d for d in range(1, group + 1) if group % d == 0), reverse=True):
        if inputs_N.reshape(-1, k).sum(-1).max(initial=0) <= max_len:
            return k
    raise TooLongError(
        f"a completion of {int(inputs_N.max()) + 1} tokens does not fit a packed row of {max_len}"
    )


def _left_padded(prompt_ids, p: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    prompt = np.full((len(prompt_ids), p), pad_id, np.int32)
    mask = np.zeros((len(prompt_ids), p), bool)
    for i, ids in enumerate(prompt_ids):
        prompt[i, p - len(ids) :] = ids
        mask[i, p - len(ids) :] = True
    return prompt, mask


def pack(
    prompt_ids,
    tokens_BxGxT: np.ndarray,
    mask_BxGxT: np.ndarray,
    valid_BxG: np.ndarray,
    advantages_BxG: np.ndarray,
    sampler_logps_BxGxT: np.ndarray,
    *,
    layout: str,
    buckets: Buckets,
    group: int,
    pad_id: int,
) -> dict:
    """Host arrays of `layout` (module docstring) from B groups of G completions.

    `group` is g, the rows sharing a stored prompt (`group_size`; ignored by 'full').
    """
    b, g_all, t_in = tokens_BxGxT.shape
    if layout not in LAYOUTS:
        raise ValueError(f"unknown batch layout {layout!r}; known: {LAYOUTS}")
    if layout == "packed" and buckets.packed is None:
        raise ValueError("the packed layout needs packed buckets (batch.pack_max_len > 0)")
    if len(prompt_ids) != b or g_all % group:
        raise ValueError(f"{len(prompt_ids)} prompts, {g_all} completions each, group {group}")
    if min(len(x) for x in prompt_ids) < 1:
        raise ValueError("an empty prompt: every prompt needs at least one token")
    lengths = np.asarray(mask_BxGxT, bool).sum(-1)
    p = bucket_for(max(len(x) for x in prompt_ids), buckets.prompt, "prompt")
    t = bucket_for(max(int(lengths.max(initial=1)), 1), buckets.completion, "completion")
    if layout == "packed":
        t = buckets.completion[-1]  # one [N, T] shape: only L and k vary between packed steps
    # Only padding lies beyond t (t >= every row's length), so trimming loses no token.
    fit = lambda x: np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, max(0, t - t_in))])[..., :t]
    n = b * g_all
    comp_mask = fit(np.asarray(mask_BxGxT, bool)).reshape(n, t)
    comp = np.where(comp_mask, fit(tokens_BxGxT).reshape(n, t), pad_id).astype(np.int32)
    prompt, prompt_mask = _left_padded(prompt_ids, p, pad_id)
    out = {
        "completion_mask": comp_mask & np.asarray(valid_BxG, bool).reshape(n, 1),
        "advantages": np.asarray(advantages_BxG, np.float32).reshape(n),
        "sampler_logps": fit(np.asarray(sampler_logps_BxGxT, np.float32)).reshape(n, t),
    }
    if layout == "full":
        out["tokens"] = np.concatenate([np.repeat(prompt, g_all, 0), comp], axis=1)
        out["attention_mask"] = np.concatenate([np.repeat(prompt_mask, g_all, 0), comp_mask], 1)
        return out
    out["tokens"], out["attention_mask"] = comp, comp_mask
    k = group
    if layout == "packed":
        k = packed_group(np.maximum(lengths.reshape(n) - 1, 0), group, buckets.packed[-1])
        out["packed"] = pack_completions(comp, comp_mask, k, pad_id=pad_id, buckets=buckets.packed)
    out["prompt_tokens"] = np.repeat(prompt, g_all // k, axis=0)
    out["prompt_mask"] = np.repeat(prompt_mask, g_all // k, axis=0)
    return out


def lay_out(
    prompt_ids,
    tokens_BxGxT: np.ndarray,
    mask_BxGxT: np.ndarray,
    rows_BxG: np.ndarray,
    advantages_BxG: np.ndarray,
    sampler_logps_BxGxT: np.ndarray,
    *,
    batch: schema.BatchConfig,
    minibatches: int,
    pad_id: int,
    choose_packed_length=None,
) -> tuple[dict, dict]:
    """Host arrays of a step's batch in `batch.layout` (`pack`, with the `batch` section's
    buckets and whole groups in each of `minibatches`), and the layout's metrics.
    `choose_packed_length` maps the packed row length the batch needs to the one it runs at
    (`shape_reuse.LengthChooser.choose`; None: as needed)."""
    b = batch
    buckets = Buckets.geometric(
        b.min_bucket_len, b.max_prompt_len, b.max_completion_len, b.pack_max_len
    )
    group = group_size(b.generations, b.prompts * b.generations, minibatches)
    host = pack(
        prompt_ids,
        tokens_BxGxT,
        mask_BxGxT,
        rows_BxG,
        advantages_BxG,
        sampler_logps_BxGxT,
        layout=b.layout,
        buckets=buckets,
        group=group,
        pad_id=pad_id,
    )
    info = {}
    if "packed" in host:
        needed = host["packed"].inputs.shape[1]
        length = choose_packed_length(needed) if choose_packed_length is not None else needed
        if length != needed:  # a longer length the step is compiled for: same loss, no compile
            host["packed"] = pad_packed(host["packed"], length, pad_id=pad_id)
        info["batch/packed_len_needed"] = float(needed)
    info.update(layout_metrics(host))
    info["throughput/tokens"] = float(host["completion_mask"].sum())
    return host, info


def layout_metrics(arrays: dict) -> dict[str, float]:
    """The layout a step ran in: `batch/layout` (index in `LAYOUTS`), the rows each stored
    prompt serves, and the packed row length L (the compiled shapes)."""
    name = layout_of(arrays)
    rows = arrays["completion_mask"].shape[0]
    out = {
        "batch/layout": float(LAYOUTS.index(name)),
        "batch/rows_per_prompt": float(
            rows // arrays["prompt_tokens"].shape[0] if "prompt_tokens" in arrays else 1
        ),
    }
    if name == "packed":
        out["batch/packed_len"] = float(arrays["packed"].inputs.shape[1])
    return out


def layout_of(arrays: dict) -> str:
    """Which of `LAYOUTS` a `pack` result is."""
    if "packed" in arrays:
        return "packed"
    return "shared" if "prompt_tokens" in arrays else "full"


def pack_completions(
    tokens_NxT: np.ndarray, mask_NxT: np.ndarray, group: int, *, pad_id: int, buckets
) -> PackedCompletions:
    """Rows r = q * group + i (i < group) packed into row q, one after another (docstring above).

    A completion of n tokens contributes its first n - 1 (the last token is only a target; the
    first is predicted from the prompt). L is the longest packed row rounded up to a bucket; a
    row longer than every bucket is a `TooLongError`, never a truncation.
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


def pad_packed(packed: PackedCompletions, length: int, *, pad_id: int) -> PackedCompletions:
    """`packed` with its rows right-padded to `length` (a longer bucket the step is compiled for,
    `shape_reuse`): padding is segment -1 and masked, so the loss and gradients are unchanged."""
    have = packed.inputs.shape[1]
    if length < have:
        raise ValueError(f"cannot pad packed rows of {have} tokens to {length}")
    extra = [(0, 0), (0, length - have)]
    return PackedCompletions(
        inputs=np.pad(packed.inputs, extra, constant_values=pad_id),
        targets=np.pad(packed.targets, extra, constant_values=pad_id),
        segments=np.pad(packed.segments, extra, constant_values=-1),
        offsets=np.pad(packed.offsets, extra),
        index=packed.index,  # positions of real inputs: unchanged by padding at the end
    )
