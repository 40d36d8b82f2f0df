"""Pad to a length the train step is already compiled for, or compile the one a step needs.

A packed train step is compiled once per packed row length L (`batch_layout`'s buckets). Early in
a run completion lengths move (they shrink as a model learns the answer format), so a short run
compiles the step for three or four lengths, each costing seconds on CPU (a minute or more for a
7B step on a GPU), some used once or twice. A step whose batch fits a shorter bucket can instead
run padded to a longer length already compiled: the same loss and gradients (padding is masked;
equal to fp32 rounding, not bit for bit), at the price of computing the padding.

`LengthChooser` decides between the two as the ski-rental problem does (rent until the rent paid
equals the price of buying, then buy): it runs padded while the padding paid since the last
compile is worth less than one compile, then compiles the length the step needs. Whatever the
sequence of lengths, that spends at most about twice what the best choice in hindsight would,
and a run whose lengths settle pays one compile for the settled length.

Prices are in steps, not seconds, so that the choices depend on the data alone: the rent of a
padded step is the share of its row that is padding (its cost taken as proportional to its
length), and one compile costs `price_steps` steps (`batch.compile_price_steps`; on the CPU
default a train-step compile takes about as long as a step: compare `time/compile` with
`time/train`). Measured seconds would make the lengths, and so the rounding, differ between a run
and its resume; with the chooser's state in the checkpoint (`state`, `from_state`) a resumed run
makes the same choices as one never interrupted, and every process makes the same choice.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class LengthChooser:
    """The packed length each step runs at (module docstring)."""

    price_steps: float = 1.0  # one compile of the train step, in steps
    compiled: set[int] = dataclasses.field(default_factory=set)  # lengths chosen so far
    rent_steps: float = 0.0  # padding paid since the last compile, in steps

    def choose(self, needed: int) -> int:
        """The length to run a step at whose batch needs `needed` (a bucket length); records it."""
        longer = sorted(length for length in self.compiled if length >= needed)
        if longer and longer[0] != needed:
            reuse = longer[0]  # the shortest compiled length that fits
            rent = (reuse - needed) / reuse
            if self.rent_steps + rent <= self.price_steps:
                self.rent_steps += rent
                return reuse
        if needed not in self.compiled:  # bought: the rent starts again
            self.compiled.add(needed)
            self.rent_steps = 0.0
        return needed

    def state(self) -> dict:
        """JSON-able state, for the checkpoint's metadata."""
        return {"compiled": sorted(self.compiled), "rent_steps": self.rent_steps}

    @classmethod
    def from_state(cls, state: dict | None, price_steps: float) -> LengthChooser:
        """The chooser a checkpoint's `state()` describes (None: a new one)."""
        if not state:
            return cls(price_steps)
        return cls(price_steps, set(state["compiled"]), float(state["rent_steps"]))
