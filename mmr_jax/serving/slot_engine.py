"""The KV cache of the continuous batch and the calls that fill and decode it (host side).

`SlotEngine` owns the cache (`slot_grid.empty_cache`, allocated once: the memory budget) and
the compiled programs of each model it serves (`slot_grid.Programs`: the base model's at
start-up, an adapter's when it is loaded), and turns the scheduler's rows into their calls:
prompts packed into a prefill call of the grid's widths, a long prompt's next chunk, a decode
step. Every call donates the cache and keeps the one it gets back.
"""

from __future__ import annotations

import numpy as np

from mmr_jax.serving import slot_grid


class SlotEngine:
    """The cache of `grid` and the programs per model name; `weights_of(name)` gives
    (graphdef, sampling weights, weight-major kernels or None) of a served model."""

    def __init__(self, grid: slot_grid.Grid, model, weights_of, *, logprobs_mode, log=print):
        self.grid, self._weights_of, self._log = grid, weights_of, log
        self.logprobs_mode = logprobs_mode
        self.cache = slot_grid.empty_cache(model, grid)
        self._programs: dict[str, slot_grid.Programs] = {}

    def prepare(self, name: str) -> slot_grid.Programs:
        """Compiles `name`'s programs (once per model name)."""
        if name not in self._programs:
            graphdef, state, kernels = self._weights_of(name)
            self._programs[name] = slot_grid.Programs(
                self.grid,
                graphdef,
                state,
                kernels,
                self.cache,
                logprobs_mode=self.logprobs_mode,
                log=self._log,
            )
        return self._programs[name]

    def forget(self, name: str) -> None:
        self._programs.pop(name, None)

    def weights(self, name: str):
        return (name, *self._weights_of(name)[1:])

    def prefill(self, weights, pieces) -> None:
        """One prefill call: each (slot, start, ids) writes the keys/values of prompt tokens
        `ids` at the slot's columns [start, start + len(ids)). First pieces (start 0) go packed
        into one row of the smallest width that holds them all (at most `slot_grid.CHUNK`
        tokens in all); a later piece of a long prompt (start > 0, a multiple of CHUNK, at most
        CHUNK tokens) goes alone, attending to the slot's columns before it."""
        name, state, _ = weights
        programs = self._programs[name]
        if len(pieces) == 1 and pieces[0][1] > 0:
            slot, start, ids = pieces[0]
            chunk = np.zeros((1, slot_grid.CHUNK), np.int32)
            chunk[0, : len(ids)] = ids
            self.cache = programs.prefill_more(
                state, self.cache, chunk, start, len(ids), np.int32(slot)
            )
            return
        fill = sum(len(ids) for _, _, ids in pieces)
        width = next(w for w in self.grid.prefill_widths if w >= fill)
        tokens = np.zeros((1, width), np.int32)
        positions = np.zeros((1, width), np.int32)
        segments = np.full((1, width), -1, np.int32)
        slots = np.zeros((1, width), np.int32)
        cols = np.full((1, width), self.grid.columns, np.int32)
        at = 0
        for i, (slot, start, ids) in enumerate(pieces):
            if start != 0:
                raise ValueError("only first pieces are packed")
            n = len(ids)
            tokens[0, at : at + n] = ids
            positions[0, at : at + n] = cols[0, at : at + n] = np.arange(n)
            segments[0, at : at + n], slots[0, at : at + n] = i, slot
            at += n
        self.cache = programs.prefill(state, self.cache, tokens, positions, segments, slots, cols)

    def copy_slots(self, pairs) -> None:
        """(source, destination) slot pairs: the destination gets the source's cache."""
        s = self.grid.slots
        src, dst = np.zeros(s, np.int32), np.full(s, s, np.int32)
        for i, (a, b) in enumerate(pairs):
            src[i], dst[i] = a, b
        self.cache = self._programs_any().copy_slots(self.cache, src, dst)

    def _programs_any(self) -> slot_grid.Programs:
        return next(iter(self._programs.values()))

    def decode(self, weights, rows, *, use_filter: bool):
        """One `slot_programs.decode_step`: (tokens [N], log-probs [N]) as host arrays."""
        name, state, kernels = weights
        self.cache, tok, logp = self._programs[name].decode(
            state, kernels, self.cache, rows, use_filter=use_filter
        )
        return np.asarray(tok), np.asarray(logp)
