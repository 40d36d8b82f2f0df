"""Host-side layout of a sampler call: buckets, left padding, first-fit-decreasing packing."""

import numpy as np
import pytest

from mmr_jax.rollout import padding


def _check_packing(lengths, width, row, offset, num_rows):
    lengths = np.asarray(lengths)
    used = int(row.max()) + 1 if (row >= 0).any() else 0
    assert num_rows == padding.bucket(max(used, 1)) and num_rows >= used
    occupied = np.zeros((max(used, 1), width), np.int32)
    for b, size in enumerate(lengths):
        if size == 0:
            assert row[b] == -1
            continue
        assert 0 <= row[b] < used and 0 <= offset[b] and offset[b] + size <= width
        occupied[row[b], offset[b] : offset[b] + size] += 1
    assert occupied.max(initial=0) <= 1  # segments never overlap
    assert occupied.sum() == lengths.sum()  # every token placed once


class TestPackPrompts:
    def test_first_fit_decreasing_by_hand(self):
        # Width 10, longest first: 7 -> row 0; 6 -> row 1; 5 -> row 2; 4 -> row 1 (6 + 4 = 10);
        # 3 -> row 0 (7 + 3 = 10); 2 -> row 2 (5 + 2); the empty segment -> no row. 3 rows -> 4.
        row, offset, num_rows = padding.pack_prompts([3, 7, 5, 2, 0, 4, 6], 10)
        assert row.tolist() == [0, 0, 2, 2, -1, 1, 1]
        assert offset.tolist() == [7, 0, 0, 5, 0, 6, 0]
        assert num_rows == 4
        _check_packing([3, 7, 5, 2, 0, 4, 6], 10, row, offset, num_rows)

    def test_ties_by_index_and_empty(self):
        row, offset, num_rows = padding.pack_prompts([2, 2, 2], 3)
        assert row.tolist() == [0, 1, 2] and offset.tolist() == [0, 0, 0] and num_rows == 4
        row, offset, num_rows = padding.pack_prompts([0, 0], 5)
        assert row.tolist() == [-1, -1] and num_rows == 1
        with pytest.raises(ValueError):
            padding.pack_prompts([6], 5)

    def test_random_packings_are_valid(self):
        rng = np.random.default_rng(0)
        for _ in range(200):
            width = int(rng.integers(1, 40))
            lengths = rng.integers(0, width + 1, size=int(rng.integers(1, 30)))
            _check_packing(lengths, width, *padding.pack_prompts(lengths, width))

    def test_pack_prefill_gathers_the_left_padded_layout(self):
        prompts = [list(range(100, 124)), [7], [5, 6, 7, 8, 9], list(range(200, 213)), [3, 4]]
        bp, p = 8, 24
        packed = padding.pack_prefill(prompts, bp, p, pad_id=0, row_multiple=3)
        w = p - 1
        assert packed.tokens.shape == packed.segment_ids.shape == (3, w)  # 2 rows -> 2 -> 3
        assert packed.gather.shape == (bp, p) and packed.gather.dtype == np.int32
        tokens, mask = padding.left_pad(prompts, bp, p, 0)
        flat_tok, flat_pos = packed.tokens.reshape(-1), packed.positions.reshape(-1)
        flat_seg = packed.segment_ids.reshape(-1)
        for b in range(bp):
            for s in range(p):
                g = packed.gather[b, s]
                if s < p - 1 and mask[b, s]:
                    assert flat_tok[g] == tokens[b, s] and flat_seg[g] == b
                    assert flat_pos[g] == s - (p - len(prompts[b]))
                else:
                    assert g == 0
        assert (flat_seg >= 0).sum() == sum(len(x) - 1 for x in prompts)
        assert not (flat_seg == 1).any()  # the 1-token prompt packs nothing
