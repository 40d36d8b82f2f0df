"""Embedded JAX sampler: packed prefill + KV-cache decode of a `Decoder`, each under one jit.

Legend: B prompts (padded to Bp), G samples per prompt (`params.n`), N = Bp * G rows, P prompt
slots (padded), T new-token slots (padded), V vocab.

Layout. Prompts are left-padded to P, so every prompt ends at slot P - 1: the prompt cache (Bp
prompts x P slots) holds prompt b's first len_b - 1 tokens at slots [P - len_b, P - 1), and its
last token is its rows' first decode input. The prefill is packed: those tokens go first-fit-
decreasing into rows of W = P - 1 (`padding.pack_prefill`; row count bucketed to a power of two),
run
with segment ids so each attends to its own prompt only, and their keys/values are gathered into
the prompt cache's slots (`prefill.prefill`, its own jit: a new row count does not recompile the
decode loop; its logits are unused, so XLA drops the vocab projection). Left-padded, more than half
the prefill tokens of the SmolLM2 benchmark were padding. The prompt cache is shared, not repeated:
row r = b * G + i reads prompt b's slots (`Decoder.forward_cached_shared_prompt`), so a prompt's
keys are stored and read once for its G samples. Each row has its own cache of T slots: decode
step t feeds token x_t (x_0 = the last prompt token) into slot t and samples generated token t. A
`lax.while_loop` stops when every row has hit a stop id or `max_new_tokens`.

Matmuls and weights: `sampler_weights`.

Sampling. logits / temperature, then (when asked) top-k and then top-p over the top-k-renormalised
distribution, as vLLM applies them; temperature 0 is greedy (argmax). The reported log-prob is
log softmax(logits / temperature)[token] *before* the top-k/top-p truncation (temperature 1 when
greedy): the quantity the trainer recomputes, so on-policy ratios are exactly 1 with top_p = 1 and
top_k = 0. `logprobs_mode='processed_logprobs'` reports vLLM's processed form instead (renormalised
after the truncation; equal when it is off), 'raw_logprobs' the untempered one (`sampling`).

Chunks. `start` prefills and returns a `sampling_call.Sampling`: the decode loop stops at a traced
step `until`, so the host can run it K steps at a time, read the new tokens and resume (a server
streaming, ending rows early) without recompiling; `sample` runs it to the end in one go.

Compaction. The first loop also exits once at most half its rows are still decoding; the live
rows go on alone in smaller loops (`decode_loop`, which explains it).

Randomness. Row r of a call with seed s draws from fold_in(fold_in(key(s), r), t) at step t, so a
completion depends on (seed, prompt index, sample index) and not on the padding buckets.

Data parallelism (`mesh=`). The padded prompts and their rows (and the packed prefill rows) are
split over the mesh's batch axes and the weights replicated, so each device decodes its own rows
(`shard_map`: its own while loop); nothing crosses devices but the prefill's gather. On
CPU, with one JAX device per core, this runs the small per-step ops (attention, sampling) on
every core, but each device also streams all the weights for its share of the rows. For
SmolLM2-135M at 8 and 32 prompts x 4, one device was about as fast (docs/performance.md,
"Measured speed"); larger batches (evaluation's 32 x 16) are where the split can pay.

Compiles. Shapes are bucketed (prompt count and number of stop ids to powers of two, prompt length
and new tokens to 2^k or 1.5 * 2^k) and every sampling value, max_new_tokens included, is a traced
scalar; the static choices are n, greedy or not, and whether top-k/top-p filtering is on. The
prefill compiles per (Bp, P, packed rows).
`trace_count()` (decode) and `prefill_trace_count()` count compiled programs (from JAX's jit
caches) for tests; `sample(..., stats=decode_loop.LoopStats())` tells how many steps a call's
loops ran.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmr_jax.models import kv_cache, sharding
from mmr_jax.rollout import base, decode_loop, padding, prefill, sampler_weights, sampling_call


def trace_count() -> int:
    """Decode-loop programs compiled in this process (JAX's jit caches of the first loop and the
    compacted ones): a repeated call with the same shapes adds none."""
    return decode_program._cache_size() + decode_loop.resume._cache_size()


def prefill_trace_count() -> int:
    """Packed-prefill programs compiled in this process (JAX's jit cache)."""
    return prefill.prefill._cache_size()


@functools.partial(
    jax.jit,
    static_argnames=(
        "graphdef",
        "n",
        "num_new",
        "greedy",
        "use_filter",
        "logprobs_mode",
        "mesh",
        "keep_rows",
    ),
)
def decode_program(
    graphdef,
    *arrays,
    n,
    num_new,
    greedy,
    use_filter,
    logprobs_mode="scaled_logprobs",
    mesh=None,
    keep_rows=False,
):
    """Decodes against the prompt cache (from `prefill.prefill`); -> tokens [N, T] int32, logps
    [N, T] f32, stopped [N] bool (hit a stop id) and the decode steps run, [devices] int32, and with
    `keep_rows` the loop's `decode_loop.Rows` (to compact and continue; single device only).

    `arrays` are `_decode`'s, in its order: the state and the weight-major kernels (or None),
    five per-prompt or per-row arrays (split over the mesh), eight scalars and the stop ids
    (replicated). The loop also exits once at most `min_live` rows are still decoding (0: only
    when all are done). With a mesh, each device runs
    `_decode` on its own prompts and rows (`shard_map`): its own while loop, which stops when its
    rows are done, and no collective at all. (Under plain sharding propagation the CPU attention
    kernel, an FFI call XLA cannot split, would gather every row onto every device.)
    """
    decode = functools.partial(
        _decode,
        graphdef,
        n=n,
        num_new=num_new,
        greedy=greedy,
        use_filter=use_filter,
        logprobs_mode=logprobs_mode,
    )
    if mesh is not None:
        if keep_rows:
            raise ValueError("keep_rows is single-device only")
        batch, whole = sharding.batch_sharding(mesh).spec, jax.sharding.PartitionSpec()
        cache = prefill.cache_sharding(mesh).spec
        per_device = decode
        decode = jax.shard_map(
            lambda *a: per_device(*a)[:4],
            mesh=mesh,
            in_specs=(whole,) * 2 + (batch,) * 2 + (cache,) + (batch,) * 2 + (whole,) * 8,
            out_specs=(batch,) * 4,
            check_vma=False,
        )
        return decode(*arrays)
    out = decode(*arrays)
    return out if keep_rows else out[:4]


def _decode(
    graphdef,
    state,
    kernels_t,
    prompts_BxP,
    prompt_mask_BxP,
    prompt_cache,
    row_ids_N,
    real_rows_N,
    seed,
    max_new_tokens,
    min_live,
    until,
    temperature,
    top_k,
    top_p,
    stop_ids,
    *,
    n: int,
    num_new: int,
    greedy: bool,
    use_filter: bool,
    logprobs_mode: str,
):
    """`decode_program`'s work on one device's (or all) prompts and rows; returns its outputs."""
    model = nnx.merge(graphdef, state)
    bp, _ = prompts_BxP.shape
    num_rows = bp * n
    lengths_B = prompt_mask_BxP.sum(-1).astype(jnp.int32)
    rows = decode_loop.Rows(
        prompt_cache=prompt_cache,
        # Slot P - 1 is not in the prompt cache: the last prompt token is each row's first input.
        prompt_mask=prompt_mask_BxP.at[:, -1].set(False),
        lengths=jnp.repeat(lengths_B, n),
        row_keys=jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(row_ids_N),
        t=jnp.int32(0),
        cache=kv_cache.split(model.init_cache(num_rows, num_new)),
        cur=jnp.repeat(prompts_BxP[:, -1], n),
        done=~real_rows_N,
        stopped=jnp.zeros((num_rows,), bool),
        toks=jnp.zeros((num_rows, num_new), jnp.int32),
        logps=jnp.zeros((num_rows, num_new), jnp.float32),
    )
    sampling = (temperature, top_k, top_p, stop_ids)
    limits = (max_new_tokens, min_live, until)
    rows = decode_loop.run(
        model, kernels_t, rows, limits, sampling, greedy, use_filter, logprobs_mode
    )
    return rows.toks, rows.logps, rows.stopped, rows.t[None], rows


def sample(
    model: nnx.Module,
    prompt_ids,
    params: base.SamplingParams,
    *,
    mesh: jax.sharding.Mesh | None = None,
    compact: bool = True,
    stats: decode_loop.LoopStats | None = None,
    **kwargs,
) -> base.RolloutBatch:
    """Samples `params.n` completions for each prompt with a `Decoder`; see the module docstring.

    Args:
      model: a `Decoder` (anything with `init_cache` and `forward_cached`).
      prompt_ids: B non-empty lists of token ids.
      params: sampling parameters; `params.seed` overrides `seed`.
      mesh: data-parallel sampling: prompts (and their rows) split over the mesh's batch axes,
        the weights replicated on it (a copy per device, made here unless already so). On CPU
        with a device per core (`sharding.use_cpu_cores_as_devices`) this runs every core.
        The tokens do not depend on it (same row keys), up to float rounding.
      compact: once at most half of the rows are still decoding, go on with those alone
        (module docstring, "Compaction"); single device only. The tokens do not depend on it.
      stats: a `decode_loop.LoopStats` to fill with what the decode loops did (tests, benchmarks).
      **kwargs: `start`'s (stop_token_ids, seed, pad_id, buckets, max_len, first_row, weights,
        n_slots, logprobs_mode).
    Returns:
      A `RolloutBatch` with T = the longest completion.
    """
    call = start(model, prompt_ids, params, mesh=mesh, compact=compact, **kwargs)
    call.advance(None)
    if stats is not None:
        stats.decode_steps, stats.loop_rows = call.stats.decode_steps, call.stats.loop_rows
    return call.batch()


def start(
    model: nnx.Module,
    prompt_ids,
    params: base.SamplingParams,
    *,
    stop_token_ids=(),
    seed: int = 0,
    pad_id: int = 0,
    buckets: padding.MinSizes = padding.DEFAULT_MIN_SIZES,
    max_len: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
    compact: bool = True,
    first_row: int = 0,
    weights: nnx.State | None = None,
    n_slots: int | None = None,
    logprobs_mode: str = "scaled_logprobs",
    kernels=None,
) -> sampling_call.Sampling:
    """Prefills `prompt_ids` and returns the `Sampling` that decodes them (`sample`'s arguments).

    Args (beside `sample`'s):
      stop_token_ids: ids that end a completion besides `params.stop_token_ids` (the EOS ids).
      seed: the seed used when `params.seed` is None.
      pad_id: id written after the end of each completion.
      buckets: minimum padded sizes.
      max_len: positions the model supports; prompt + new tokens beyond it raise ValueError.
      first_row: row index (for the random keys) of the first prompt's first sample: a process
        sampling its share of a batch passes its offset, so it draws what one process would.
      weights: `sampler_weights.sampling_weights(model)`, made once per weight version by the
        caller; None: made here, for this call.
      n_slots: rows per prompt in the compiled program (>= n; default n): a server buckets n so
        that a few programs serve every request. Rows keep the keys of b * n + i, so the tokens
        do not depend on it.
      logprobs_mode: what the reported log-probs are (`sampling.LOGPROBS_MODES`).
      kernels: with `weights`, their weight-major kernels (`sampler_weights`), kept by a caller
        that samples many times from one weight version (None: made here when used).
    """
    num_prompts = len(prompt_ids)
    if num_prompts == 0:
        raise ValueError("no prompts")
    if any(len(ids) == 0 for ids in prompt_ids):
        raise ValueError("every prompt needs at least one token")
    longest = max(len(ids) for ids in prompt_ids)
    if max_len is not None and longest + params.max_new_tokens > max_len:
        raise ValueError(
            f"prompt ({longest}) + max_new_tokens ({params.max_new_tokens}) exceeds the "
            f"model's {max_len} positions"
        )
    n = params.n
    slots = n if n_slots is None else n_slots
    if slots < n:
        raise ValueError(f"n_slots ({slots}) < n ({n})")
    ways = sharding.batch_size(mesh)
    # A multiple of the split, so every device gets whole prompts.
    bp = -(-padding.bucket(num_prompts, buckets.min_prompts) // ways) * ways
    p = padding.length_bucket(longest, max(buckets.min_prompt_len, 2))
    num_new = padding.length_bucket(params.max_new_tokens, buckets.min_new_tokens)
    stops = sorted(set(stop_token_ids) | set(params.stop_token_ids))
    stop_arr = np.full((padding.bucket(len(stops), buckets.min_stop_ids),), -1, np.int32)
    stop_arr[: len(stops)] = stops
    tokens, mask = padding.left_pad(prompt_ids, bp, p, pad_id)
    packed = padding.pack_prefill(prompt_ids, bp, p, pad_id, row_multiple=ways)
    b_N, i_N = np.divmod(np.arange(bp * slots, dtype=np.int32), slots)
    real_N = (b_N < num_prompts) & (i_N < n)
    row_ids = np.where(i_N < n, b_N * n + i_N, bp * n + b_N * slots + i_N).astype(np.int32)
    greedy = params.temperature == 0.0
    graphdef = nnx.graphdef(model)
    state = sampler_weights.sampling_weights(model) if weights is None else weights
    if mesh is None:
        rows = scalar = jnp.asarray
    else:
        state = jax.device_put(state, sharding.replicated(mesh))
        rows = functools.partial(jax.device_put, device=sharding.batch_sharding(mesh))
        scalar = functools.partial(jax.device_put, device=sharding.replicated(mesh))
    prompt_cache = prefill.prefill(
        graphdef,
        state,
        rows(packed.tokens),
        rows(packed.positions),
        rows(packed.segment_ids),
        rows(packed.gather),
        cache_sharding=None if mesh is None else prefill.cache_sharding(mesh),
    )
    kernels_t = kernels
    if kernels_t is None and sampler_weights.weight_major(state):
        kernels_t = sampler_weights.weight_major_kernels(graphdef, state)
    sampling = (
        scalar(np.float32(params.temperature if not greedy else 1.0)),
        scalar(np.int32(params.top_k)),
        scalar(np.float32(params.top_p)),
        scalar(stop_arr),
    )
    static = dict(
        greedy=greedy,
        use_filter=not greedy and (params.top_k > 0 or params.top_p < 1.0),
        logprobs_mode=logprobs_mode,
    )
    max_new = scalar(np.int32(params.max_new_tokens))
    size = bp * slots
    compacting = compact and mesh is None
    seed_value = scalar(np.uint32((params.seed if params.seed is not None else seed) % 2**32))

    def first(until):
        return decode_program(
            graphdef,
            state,
            kernels_t,
            rows(tokens),
            rows(mask),
            prompt_cache,
            rows(row_ids + np.int32(first_row)),
            rows(real_N),
            seed_value,
            max_new,
            scalar(np.int32(decode_loop.min_live(size) if compacting else 0)),
            scalar(np.int32(until)),
            *sampling,
            n=slots,
            num_new=num_new,
            mesh=mesh,
            keep_rows=compacting,
            **static,
        )

    def resume_loop(state_rows, min_live, until):
        limits = (max_new, scalar(np.int32(min_live)), scalar(np.int32(until)))
        return decode_loop.resume(
            graphdef, state, kernels_t, state_rows, limits, sampling, **static
        )

    if compacting:
        loop = decode_loop.Chunked(
            lambda until: first(until)[4],
            resume_loop,
            n=slots,
            rows=size,
            num_new=num_new,
            max_new=params.max_new_tokens,
        )
    else:
        loop = sampling_call.Whole(lambda: first(params.max_new_tokens), size)
    return sampling_call.Sampling(
        loop,
        num_prompts=num_prompts,
        n=n,
        n_slots=slots,
        max_new=params.max_new_tokens,
        stops=stops,
        pad_id=pad_id,
    )
