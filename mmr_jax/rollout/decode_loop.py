"""The sampler's decode loop and its compaction.

A `lax.while_loop` (`run`) decodes one token per row per step against the prompt cache until
every row is done, or until at most `min_live` rows are still decoding. Early in training (most
completions ~9 tokens, a few 32) most of a full loop's steps were spent on finished rows, so the
loop hands over once at most half its rows are live: those rows go on alone in a loop half the
size (`compact`: each takes its own copy of its prompt's cache, its keys, own cache and outputs
so far; `resume`), and again, down to 4 rows, so a call compiles at most log2(N / 4) extra
loops, each once per shape. (SmolLM2 decode step at 32 rows 121 ms, at 8 rows 60 ms; halving,
not quartering, gave 1.22x on the CPU default's rollouts against 1.03x:
benchmarks/bench_rollout.py.)
Rows keep their random keys, so the tokens are those of the uncompacted loop, up to rounding.
The loop also stops at a traced step `until`, so the host can run it in chunks (`Chunked`: a
server streaming, or ending rows early between chunks) without recompiling.

Legend: B prompts, G samples per prompt (the static `n`), N = B * G rows, P prompt slots, T
new-token slots.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmr_jax.models import kv_cache
from mmr_jax.rollout import sampling as sampling_lib


@flax.struct.dataclass
class Rows:
    """The decode loop's state: its rows, their prompts' cache and how far they got.

    Rows r = b * G + i read prompt b of `prompt_cache` / `prompt_mask` (G static, passed beside
    as `n`). `cache` is the rows' own (split, T slots); `cur` each row's next input; `t` the next
    slot.
    """

    prompt_cache: kv_cache.KVCache
    prompt_mask: jax.Array  # [B, P] bool, slot P - 1 off (the last prompt token is an input)
    lengths: jax.Array  # [N] int32 prompt lengths
    row_keys: jax.Array  # [N] PRNG keys
    t: jax.Array  # () int32
    cache: kv_cache.KVCache
    cur: jax.Array  # [N] int32
    done: jax.Array  # [N] bool
    stopped: jax.Array  # [N] bool
    toks: jax.Array  # [N, T] int32
    logps: jax.Array  # [N, T] float32


def run(model, kernels_t, rows, limits, sampling, greedy, use_filter, logprobs_mode):
    """The decode `while_loop` from `rows.t` until every row is done, at most `min_live` are
    still decoding (`min_live` 0: to the end) or step `until` is reached (a traced scalar: the
    host runs the loop in chunks without recompiling). `limits` is (max_new_tokens, min_live,
    until). Rows are grouped G = N / B per prompt (`n`); `sampling` is (temperature, top_k, top_p,
    stop_ids)."""
    temperature, top_k, top_p, stop_ids = sampling
    max_new_tokens, min_live, until = limits

    def cond(rows):
        live = jnp.sum(~rows.done)
        t_end = jnp.minimum(max_new_tokens, until)
        return (rows.t < t_end) & (live > 0) & (live > min_live)

    def body(rows):
        t = rows.t
        logits, cache = model.forward_cached_shared_prompt(
            rows.cur[:, None],
            (rows.lengths - 1 + t)[:, None],
            rows.prompt_cache,
            rows.cache,
            write_index=t,
            prompt_mask_BxP=rows.prompt_mask,
            kernels_t=kernels_t,
        )
        keys = jax.vmap(lambda k: jax.random.fold_in(k, t))(rows.row_keys)
        tok, logp = sampling_lib.sample_step(
            logits[:, 0],
            keys,
            temperature,
            top_k,
            top_p,
            greedy=greedy,
            use_filter=use_filter,
            logprobs_mode=logprobs_mode,
        )
        live = ~rows.done
        hit = live & jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)
        return rows.replace(
            t=t + 1,
            cache=cache,
            cur=tok,
            toks=rows.toks.at[:, t].set(jnp.where(live, tok, 0)),
            logps=rows.logps.at[:, t].set(jnp.where(live, logp, 0.0)),
            stopped=rows.stopped | hit,
            done=rows.done | hit | (t + 1 >= max_new_tokens),
        )

    return jax.lax.while_loop(cond, body, rows)


@functools.partial(jax.jit, static_argnames=("n",))
def compact(rows: Rows, keep_N, real_N, *, n: int) -> Rows:
    """The rows `keep_N` of `rows` (N of them: the compacted loop's rows), each with its own copy
    of its prompt's cache, so the result has one row per prompt (G = 1); rows where `real_N` is
    False are padding (done).

    Row r keeps its keys, own cache and outputs so far, so it continues exactly as it would have.
    """
    prompt_of = keep_N // n
    take = functools.partial(jnp.take, indices=keep_N, axis=0)
    return Rows(
        prompt_cache=jax.tree.map(  # caches are [L, rows, ...]: rows are axis 1
            functools.partial(jnp.take, indices=prompt_of, axis=1), rows.prompt_cache
        ),
        prompt_mask=jnp.take(rows.prompt_mask, prompt_of, axis=0),
        lengths=take(rows.lengths),
        row_keys=rows.row_keys[keep_N],
        t=rows.t,
        cache=jax.tree.map(functools.partial(jnp.take, indices=keep_N, axis=1), rows.cache),
        cur=take(rows.cur),
        done=take(rows.done) | ~real_N,
        stopped=take(rows.stopped) & real_N,
        toks=take(rows.toks),
        logps=take(rows.logps),
    )


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "greedy", "use_filter", "logprobs_mode"),
    donate_argnames=("rows",),
)
def resume(
    graphdef, state, kernels_t, rows, limits, sampling, *, greedy, use_filter, logprobs_mode
):
    """The decode loop resumed on `rows` (compacted, or a chunk's end; donated: the loop's caches
    are updated in place, not copied first); `limits` and `sampling` as `run`'s."""
    model = nnx.merge(graphdef, state)
    return run(model, kernels_t, rows, limits, sampling, greedy, use_filter, logprobs_mode)


_COMPACT_FACTOR = 2  # rows halve at each compaction
# No loop below 4 rows: each shape compiles once (seconds, for SmolLM2 on 2 cores), and below a few
# rows a decode step costs about the same (reading the weights), so smaller ones do not repay it.
_MIN_COMPACT_ROWS = 4


def compacted_size(rows: int) -> int:
    return max(min(rows, _MIN_COMPACT_ROWS), rows // _COMPACT_FACTOR)


def min_live(rows: int) -> int:
    """Live rows at or below which a loop of `rows` rows hands over to a compacted one (0: never,
    when the compacted loop would not be smaller)."""
    smaller = compacted_size(rows)
    return smaller if smaller < rows else 0


@dataclasses.dataclass
class LoopStats:
    """What a `sample` call's decode loops did: the steps run (the most on any device) and the
    rows of each loop (more than one: it compacted)."""

    decode_steps: int = 0
    loop_rows: tuple[int, ...] = ()


class Chunked:
    """A decode driven from the host in chunks of steps, with compaction between them.

    `start(until)` runs the first loop (`sampler.decode_program` with `keep_rows`) up to step
    `until`; `resume_loop(rows, min_live, until)` runs `resume`. After each `advance`, `toks`,
    `logps`, `stopped` and `done` ([N, T] / [N] host arrays of the original rows) hold what is
    decoded so far and `t` the steps run; `cancel(rows)` ends rows at the next chunk (stop
    strings, clients that left). Rows keep their keys, so the tokens do not depend on the chunk
    sizes.
    """

    def __init__(self, start, resume_loop, *, n: int, rows: int, num_new: int, max_new: int):
        self._start, self._resume = start, resume_loop
        self._rows, self._group, self._size, self.max_new = None, n, rows, max_new
        self.toks = np.zeros((rows, num_new), np.int32)
        self.logps = np.zeros((rows, num_new), np.float32)
        self.stopped = np.zeros((rows,), bool)
        self.done = np.zeros((rows,), bool)
        self._cancel = np.zeros((rows,), bool)
        self._origin = np.arange(rows)  # the original row of each current row (-1: padding)
        self.t, self.finished = 0, False
        self.stats = LoopStats(loop_rows=(rows,))

    def cancel(self, rows) -> None:
        self._cancel[np.asarray(rows, int)] = True

    def advance(self, steps: int | None = None) -> None:
        """Runs up to `steps` more decode steps (None: to the end), compacting when at most
        `min_live` rows are live."""
        if self.finished:
            return
        until = self.max_new if steps is None else self.t + steps
        if self._rows is None:
            self._rows = self._start(until)
            self._collect()
        while not self.finished:
            rows, real = self._rows, self._origin >= 0
            cancel = np.zeros(self._size, bool)
            cancel[real] = self._cancel[self._origin[real]]
            if cancel.any():
                self._rows = rows = rows.replace(done=rows.done | jnp.asarray(cancel))
            live = np.flatnonzero(~np.asarray(rows.done))
            if len(live) == 0:
                self._collect()
                break
            if self.t >= until:
                break
            if len(live) <= min_live(self._size):
                self._compact(live)
            self._rows = self._resume(self._rows, min_live(self._size), until)
            self._collect()

    def _compact(self, live) -> None:
        """Goes on with the `live` rows alone, in a loop of `compacted_size` rows."""
        self._size = size = compacted_size(self._size)
        keep = np.full((size,), live[0], np.int32)
        keep[: len(live)] = live
        real = jnp.asarray(np.arange(size) < len(live))
        self._rows = compact(self._rows, jnp.asarray(keep), real, n=self._group)
        self._origin = np.where(np.arange(size) < len(live), self._origin[keep], -1)
        self._group = 1
        self.stats.loop_rows += (size,)

    def _collect(self) -> None:
        rows, origin = self._rows, self._origin
        real = origin >= 0
        self.toks[origin[real]] = np.asarray(rows.toks)[real]
        self.logps[origin[real]] = np.asarray(rows.logps)[real]
        self.stopped[origin[real]] = np.asarray(rows.stopped)[real]
        self.done[origin[real]] = np.asarray(rows.done)[real]
        self.t = self.stats.decode_steps = int(rows.t)
        self.finished = bool(self.done.all())
