"""The ski-rental choice between padding to a compiled packed length and compiling a new one."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mmr_jax.step import batch_layout
from mmr_jax.step.shape_reuse import LengthChooser


def test_hand_worked_sequence():
    c = LengthChooser(price_steps=1.0)
    assert c.choose(192) == 192  # nothing compiled: build it
    assert c.compiled == {192} and c.rent_steps == 0.0
    assert c.choose(128) == 192  # a third of the row is padding: rent 1/3 <= 1
    assert c.rent_steps == pytest.approx(1 / 3)
    assert c.choose(128) == 192  # 2/3 <= 1
    assert c.choose(96) == 96  # 2/3 + 1/2 > 1: the padding would exceed a compile ...
    assert c.compiled == {96, 192} and c.rent_steps == 0.0  # ... so 96 was bought, rent reset
    assert c.choose(64) == 96  # the shortest compiled length that fits: rent 1/3
    assert c.choose(192) == 192 and c.choose(96) == 96  # compiled: as needed, no rent
    assert c.rent_steps == pytest.approx(1 / 3)
    assert c.choose(256) == 256  # longer than anything compiled: no choice
    assert c.compiled == {96, 192, 256} and c.rent_steps == 0.0


def test_price_zero_compiles_every_length_and_a_high_price_pads_more():
    lengths = [192, 128, 128, 96, 64, 192, 64, 96]
    never = LengthChooser(price_steps=0.0)
    assert [never.choose(n) for n in lengths] == lengths
    pads = LengthChooser(price_steps=2.0)
    # rent: 1/3, 2/3, then 96 at 192: 7/6, 64 at 192: 11/6 (<= 2), 64 again: 5/2 > 2: buy 64;
    # 96 then pads to 192 (64 is shorter than it needs): 1/2.
    assert [pads.choose(n) for n in lengths] == [192, 192, 192, 192, 192, 192, 64, 192]


def test_state_round_trip_makes_the_same_choices():
    lengths = [192, 128, 128, 96, 64, 192, 64, 96, 128, 64, 256, 64]
    whole = LengthChooser(price_steps=1.0)
    expected = [whole.choose(n) for n in lengths]
    first = LengthChooser(price_steps=1.0)
    got = [first.choose(n) for n in lengths[:5]]
    state = json.loads(json.dumps(first.state()))  # through the checkpoint's JSON metadata
    resumed = LengthChooser.from_state(state, price_steps=1.0)
    got += [resumed.choose(n) for n in lengths[5:]]
    assert got == expected
    assert LengthChooser.from_state(None, 1.5) == LengthChooser(price_steps=1.5)


def _packed(seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 9, 6)
    mask = np.arange(8)[None] < lengths[:, None]
    tokens = np.where(mask, rng.integers(4, 50, (6, 8)), 0).astype(np.int32)
    return batch_layout.pack_completions(tokens, mask, 3, pad_id=0, buckets=(8, 12, 16, 24))


def test_pad_packed_appends_masked_padding_only():
    p = _packed()
    longer = batch_layout.pad_packed(p, 40, pad_id=0)
    have = p.inputs.shape[1]
    for name in ("inputs", "targets", "segments", "offsets"):
        a, b = getattr(p, name), getattr(longer, name)
        assert b.shape == (p.inputs.shape[0], 40)
        np.testing.assert_array_equal(b[:, :have], a)
    assert (longer.segments[:, have:] == -1).all()  # padding: in no completion
    assert (longer.inputs[:, have:] == 0).all() and (longer.targets[:, have:] == 0).all()
    np.testing.assert_array_equal(longer.index, p.index)
    with pytest.raises(ValueError, match="cannot pad packed rows"):
        batch_layout.pad_packed(p, have - 1, pad_id=0)
