"""Host-side layout of a sampler call: padded-size buckets, left padding, packed prefill rows.

Shapes are bucketed so a training run compiles a handful of times: prompt counts to powers of two,
lengths to 2^k or 1.5 * 2^k. Prompts are left-padded to P slots (every prompt ends at slot P - 1);
for the prefill, the first len_b - 1 tokens of each prompt are instead packed first-fit-decreasing
into rows of W = P - 1 slots with segment ids, and a gather index maps packed slots back to the
left-padded prompt-cache layout (`mmr_jax.rollout.sampler` runs both). All NumPy, no JAX.
"""

from __future__ import annotations

import dataclasses

import numpy as np


def bucket(x: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(x, minimum)."""
    x = max(int(x), int(minimum), 1)
    return 1 << (x - 1).bit_length()


def length_bucket(x: int, minimum: int = 1) -> int:
    """The smallest of 2^k and 1.5 * 2^k that is >= max(x, minimum) (..., 128, 192, 256, 384, ...).

    Lengths set the cache size S, and a decode step costs about linearly in S, so they get two
    buckets per octave; the prompt count keeps powers of two.
    """
    x = max(int(x), int(minimum), 1)
    p = bucket(x)
    return 3 * p // 4 if x <= 3 * p // 4 else p


@dataclasses.dataclass(frozen=True)
class MinSizes:
    """Smallest padded sizes; raise them to compile fewer shapes when inputs vary a lot."""

    min_prompts: int = 1
    min_prompt_len: int = 16
    min_new_tokens: int = 16
    min_stop_ids: int = 4


DEFAULT_MIN_SIZES = MinSizes()


def left_pad(prompt_ids, num_rows: int, length: int, pad_id: int):
    """Left-padded int32 tokens [num_rows, length] and bool mask; rows past the prompts are pad."""
    tokens = np.full((num_rows, length), pad_id, np.int32)
    mask = np.zeros((num_rows, length), bool)
    for b, ids in enumerate(prompt_ids):
        if len(ids):
            tokens[b, length - len(ids) :] = ids
            mask[b, length - len(ids) :] = True
    return tokens, mask


def pack_prompts(lengths, width: int):
    """First-fit-decreasing packing of segments of `lengths` tokens into rows of `width` slots.

    Longest first (ties by index), each segment goes to the first row with room, else a new row.
    Returns (row_of_prompt [B] int32, -1 for an empty segment; offset_of_prompt [B] int32, its
    first column; num_rows, the rows used bucketed to a power of two, at least 1).
    """
    lengths = np.asarray(lengths, np.int64).reshape(-1)
    if np.any(lengths < 0) or np.any(lengths > width):
        raise ValueError(f"segment lengths must lie in [0, {width}], got {lengths.tolist()}")
    row = np.full(lengths.shape, -1, np.int32)
    offset = np.zeros(lengths.shape, np.int32)
    fill: list[int] = []
    for b in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        size = int(lengths[b])
        if size == 0:
            continue
        r = next((r for r, used in enumerate(fill) if used + size <= width), len(fill))
        if r == len(fill):
            fill.append(0)
        row[b], offset[b] = r, fill[r]
        fill[r] += size
    return row, offset, bucket(len(fill))


@dataclasses.dataclass(frozen=True)
class PackedPrefill:
    """Host inputs of `prefill.prefill`: W = P - 1 packed columns, N packed rows."""

    tokens: np.ndarray  # [N, W] int32, pad_id where no prompt
    positions: np.ndarray  # [N, W] int32, 0..len_b - 2 along prompt b's segment
    segment_ids: np.ndarray  # [N, W] int32, the prompt index b, -1 for padding
    gather: np.ndarray  # [Bp, P] int32: flat packed index row * W + col of prompt-cache slot (b, s)


def pack_prefill(prompt_ids, num_rows: int, length: int, pad_id: int, row_multiple: int = 1):
    """`PackedPrefill` of prompts left-padded to `num_rows` x `length` (see the module docstring).

    Prompt b's first len_b - 1 tokens are packed (`pack_prompts`, W = length - 1); the gather
    index sends them to slots [length - len_b, length - 1) of row b, the other slots to 0 (they
    are masked). The packed row count is rounded up to a multiple of `row_multiple`.
    """
    w = length - 1
    seg_lens = np.array([max(len(ids) - 1, 0) for ids in prompt_ids], np.int64)
    row, offset, rows = pack_prompts(seg_lens, w)
    rows = -(-rows // row_multiple) * row_multiple
    tokens = np.full((rows, w), pad_id, np.int32)
    positions = np.zeros((rows, w), np.int32)
    segment_ids = np.full((rows, w), -1, np.int32)
    gather = np.zeros((num_rows, length), np.int32)
    for b, ids in enumerate(prompt_ids):
        size = int(seg_lens[b])
        if size == 0:
            continue
        r, o = int(row[b]), int(offset[b])
        tokens[r, o : o + size] = ids[:size]
        positions[r, o : o + size] = np.arange(size)
        segment_ids[r, o : o + size] = b
        gather[b, w - size : w] = r * w + o + np.arange(size)
    return PackedPrefill(tokens, positions, segment_ids, gather)
