"""The continuous batch's shapes, sized by one memory budget, and its programs compiled ahead.

`Grid` is what the server can decode at once: S slots of C columns each (C = max_model_len,
rounded up to the prefill chunk), so the KV cache is S x C tokens of keys and values, allocated
once. S comes from the budget: `kv_cache_bytes` // (C x bytes per token), at most
`max_num_seqs`. A request whose rows need more slots than S, or more columns than C, could never
run and is refused; one that fits waits until its rows' slots are free.

`Programs` compiles every program the batch uses for one weight structure ahead of any request
(`slot_programs`; a progress line each, through `log`), so no request waits for a compile:
  decode: one per row count N in `Grid.decode_rows` (powers of two up to S, and S), with and
    without top-k/top-p filtering;
  prefill: one per width in `Grid.prefill_widths` (prompts packed into one row of a
    power-of-two width from `MIN_WIDTH` to `CHUNK`), and one `prefill_more` (a CHUNK of a
    longer prompt): a step boundary prefills at most CHUNK tokens;
  copy_slots: one.
With the persistent compile cache (`infra.compile_cache`) a restarted server loads them.
"""

from __future__ import annotations

import dataclasses
import time

import jax.numpy as jnp
import numpy as np

from mmr_jax.models import kv_cache
from mmr_jax.serving import slot_programs

CHUNK = 512  # prompt tokens prefilled at a step boundary at most; longer prompts go on in chunks
MIN_WIDTH = 32


def _powers_of_two(upto: int) -> list[int]:
    return [1 << i for i in range(int(upto).bit_length()) if 1 << i <= upto]


@dataclasses.dataclass(frozen=True)
class Grid:
    """slots S and columns C of the KV cache; `token_bytes` its bytes per token (keys and
    values of every layer)."""

    slots: int
    columns: int
    token_bytes: int
    vocab_size: int = 0  # the decode step's bias rows [N, V] (`token_controls`)

    @classmethod
    def from_budget(cls, model_config, dtype, *, kv_cache_bytes, max_model_len, max_num_seqs):
        c = model_config
        token_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * jnp.dtype(dtype).itemsize
        unit = max(CHUNK, slot_programs.BLOCK)
        columns = -(-int(max_model_len) // unit) * unit
        slots = min(int(max_num_seqs), int(kv_cache_bytes) // (columns * token_bytes))
        if slots < 1:
            need = columns * token_bytes / 2**30
            raise ValueError(
                f"the KV cache budget ({kv_cache_bytes / 2**30:.2f} GiB) holds no sequence of "
                f"max_model_len {max_model_len} ({need:.2f} GiB): raise it or lower max_model_len"
            )
        return cls(slots, columns, token_bytes, int(c.vocab_size))

    @property
    def cache_bytes(self) -> int:
        return self.slots * self.columns * self.token_bytes

    @property
    def decode_rows(self) -> list[int]:
        return sorted(set(_powers_of_two(self.slots)) | {self.slots})

    def rows_for(self, highest_slot: int) -> int:
        """The decode row count that covers slots [0, highest_slot]."""
        return next(r for r in self.decode_rows if r > highest_slot)

    @property
    def prefill_widths(self) -> list[int]:
        """Widths of the prefill programs: one row of a power of two from MIN_WIDTH to CHUNK."""
        return [w for w in _powers_of_two(CHUNK) if w >= MIN_WIDTH]


class Programs:
    """The compiled grid for one model (`graphdef`) and weight structure; `log(line)` gets a
    progress line per program. Call with weights of that structure (a reload keeps it)."""

    def __init__(self, grid: Grid, graphdef, state, kernels, cache, *, logprobs_mode, log=print):
        self.grid, self.logprobs_mode = grid, logprobs_mode
        self._decode, self._prefill = {}, {}
        start, count = time.perf_counter(), 0

        def build(name, fn, *args, **kwargs):
            nonlocal count
            t = time.perf_counter()
            compiled = fn.lower(*args, **kwargs).compile()
            count += 1
            log(f"compiled {name} in {time.perf_counter() - t:.1f} s")
            return compiled

        for r in grid.decode_rows:
            for use_filter in (False, True):
                rows = _idle_rows(r, grid.columns, grid.vocab_size)
                self._decode[r, use_filter] = build(
                    f"decode rows={r} filter={use_filter}",
                    slot_programs.decode_step,
                    graphdef, state, kernels, cache, rows,
                    use_filter=use_filter, logprobs_mode=logprobs_mode,
                )  # fmt: skip
        for w in grid.prefill_widths:
            args = (np.zeros((1, w), np.int32),) * 5
            self._prefill[w] = build(
                f"prefill width={w}", slot_programs.prefill, graphdef, state, cache, *args
            )
        i32 = np.int32(0)
        tokens = np.zeros((1, CHUNK), np.int32)
        self._more = build(
            f"prefill_more width={CHUNK}",
            slot_programs.prefill_more, graphdef, state, cache, tokens, i32, i32, i32,
        )  # fmt: skip
        index = np.zeros(grid.slots, np.int32)
        self._copy = build("copy_slots", slot_programs.copy_slots, cache, index, index)
        self.compile_s = time.perf_counter() - start
        log(f"compiled {count} programs in {self.compile_s:.1f} s")

    def decode(self, state, kernels, cache, rows, *, use_filter):
        return self._decode[len(rows["cur"]), use_filter](state, kernels, cache, rows)

    def prefill(self, state, cache, tokens_NxW, positions_NxW, segments_NxW, slots_NxW, cols_NxW):
        return self._prefill[tokens_NxW.shape[1]](
            state, cache, tokens_NxW, positions_NxW, segments_NxW, slots_NxW, cols_NxW
        )

    def prefill_more(self, state, cache, tokens_1xW, start, length, slot):
        return self._more(state, cache, tokens_1xW, np.int32(start), np.int32(length), slot)

    def copy_slots(self, cache, src_S, dst_S):
        return self._copy(cache, src_S, dst_S)


def _idle_rows(r: int, columns: int, vocab_size: int) -> dict:
    """`decode_step`'s rows for N idle rows (every write dropped)."""
    return {
        "cur": np.zeros(r, np.int32),
        "pos": np.full(r, columns, np.int32),
        "seed": np.zeros(r, np.uint32),
        "row_id": np.zeros(r, np.int32),
        "step": np.zeros(r, np.int32),
        "temperature": np.zeros(r, np.float32),
        "top_k": np.zeros(r, np.int32),
        "top_p": np.ones(r, np.float32),
        "bias": np.zeros((r, vocab_size), np.float32),
        "n_blocks": np.int32(1),
    }


def empty_cache(model, grid: Grid) -> kv_cache.KVCache:
    """The zero KV cache of `grid` (split form) in the model's compute dtype."""
    c = model.config
    k = jnp.zeros((c.num_layers, grid.slots, c.num_kv_heads, c.head_dim, grid.columns), model.dtype)
    v = jnp.zeros((c.num_layers, grid.slots, c.num_kv_heads, grid.columns, c.head_dim), model.dtype)
    return kv_cache.KVCache(k=k, v=v, split=True)
