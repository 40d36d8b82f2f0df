"""The KV cache of the continuous batch and the calls that fill and decode it (host side).

`SlotEngine` owns the cache (`slot_grid.empty_cache`, allocated once: the memory budget) and
the compiled programs of each model it serves (`slot_grid.Programs`: the base model's at
start-up, an adapter's when it is loaded), and turns the scheduler's rows into their calls:
prompts grouped into prefill calls of the grid's shapes, long prompts continued chunk by chunk,
a decode step. Every call donates the cache and keeps the one it gets back.
"""

from __future__ import annotations

import numpy as np

from mmr_jax.rollout import layout
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

    def prefill(self, weights, prompts, cancelled=lambda slot: False) -> None:
        """Writes each (slot, prompt ids)'s keys/values but its last token's into the slot.

        First chunks (up to `slot_grid.CHUNK` tokens) are packed first-fit-decreasing into rows
        (`layout.pack_prompts`) and run `PREFILL_ROWS` rows a call; the rest of a longer prompt
        follows a chunk a call. A prompt whose slot `cancelled` says is cancelled is skipped
        between calls.
        """
        name, state, _ = weights
        programs = self._programs[name]
        todo = [(slot, list(p[:-1])) for slot, p in prompts if len(p) > 1]
        firsts = [min(len(ids), slot_grid.CHUNK) for _, ids in todo]
        row_of, offset, _ = layout.pack_prompts(firsts, slot_grid.CHUNK)
        used = int(row_of.max()) + 1 if todo else 0
        for first_row in range(0, used, slot_grid.PREFILL_ROWS):
            part = [
                i
                for i in range(len(todo))
                if first_row <= row_of[i] < first_row + slot_grid.PREFILL_ROWS
            ]
            part = [i for i in part if not cancelled(todo[i][0])]
            if part:
                self._prefill_rows(programs, state, todo, firsts, row_of - first_row, offset, part)
        for slot, ids in todo:
            for start in range(slot_grid.CHUNK, len(ids), slot_grid.CHUNK):
                if cancelled(slot):
                    break
                piece = ids[start : start + slot_grid.CHUNK]
                chunk = np.zeros((1, slot_grid.CHUNK), np.int32)
                chunk[0, : len(piece)] = piece
                self.cache = programs.prefill_more(
                    state, self.cache, chunk, start, len(piece), np.int32(slot)
                )

    def _prefill_rows(self, programs, state, todo, firsts, row_of, offset, part) -> None:
        """One `slot_programs.prefill` call of the first chunks `part` (indices into `todo`),
        packed at rows `row_of` and columns `offset`."""
        rows = int(max(row_of[i] for i in part)) + 1
        width = slot_grid.CHUNK
        if rows == 1:
            fill = max(int(offset[i]) + firsts[i] for i in part)
            width = next(w for r, w in self.grid.prefill_shapes if r == 1 and w >= fill)
        else:
            rows = next(r for r, w in self.grid.prefill_shapes if r >= rows and w == width)
        tokens = np.zeros((rows, width), np.int32)
        positions = np.zeros((rows, width), np.int32)
        segments = np.full((rows, width), -1, np.int32)
        slots = np.zeros((rows, width), np.int32)
        cols = np.full((rows, width), self.grid.columns, np.int32)
        for i in part:
            slot, ids = todo[i]
            r, o, n = int(row_of[i]), int(offset[i]), firsts[i]
            tokens[r, o : o + n] = ids[:n]
            positions[r, o : o + n] = cols[r, o : o + n] = np.arange(n)
            segments[r, o : o + n], slots[r, o : o + n] = i, slot
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
        """One `slot_programs.decode_step`: (tokens [R], log-probs [R]) as host arrays."""
        name, state, kernels = weights
        self.cache, tok, logp = self._programs[name].decode(
            state, kernels, self.cache, rows, use_filter=use_filter
        )
        return np.asarray(tok), np.asarray(logp)
