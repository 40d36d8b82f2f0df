"""Embedded JAX sampler: packed prefill + KV-cache decode of a `Decoder`, each under one jit.

Legend: B prompts (padded to Bp), n samples per prompt, R = Bp * n rows, P prompt slots (padded),
N new-token slots (padded), V vocab.

Layout. Prompts are left-padded to P, so every prompt ends at slot P - 1: the prompt cache (Bp
prompts x P slots) holds prompt b's first len_b - 1 tokens at slots [P - len_b, P - 1), and its
last token is its rows' first decode input. The prefill is packed: those tokens go first-fit-
decreasing into rows of W = P - 1 (`layout.pack_prefill`; row count bucketed to a power of two), run
with segment ids so each attends to its own prompt only, and their keys/values are gathered into
the prompt cache's slots (`_prefill`, its own jit: a new row count does not recompile the decode
loop; its logits are unused, so XLA drops the vocab projection). Left-padded, more than half the
prefill tokens of the SmolLM2 benchmark were padding. The prompt cache is shared, not repeated:
row r = b * n + i reads prompt b's slots (`Decoder.forward_cached_shared_prompt`), so a prompt's
keys are stored and read once for its n samples. Each row has its own cache of N slots: decode
step t feeds token x_t (x_0 = the last prompt token) into slot t and samples generated token t. A
`lax.while_loop` stops when every row has hit a stop id or `max_new_tokens`.

Matmuls. On CPU the decode loop runs every linear layer weight-major, W @ x^T on kernels
transposed to [out, in] once per call (`weight_major`, `layers.weight_major_matmul`): XLA:CPU's
matmul packs its right-hand operand every call, which in the plain x @ W is all the weights (SmolLM2
8 x 4: a decode step 116 -> 90 ms). The copy lasts the call; other platforms keep x @ W.

Weights. The prefill and the decode loop read the weights in the compute dtype, cast once per
weight version (`sampling_weights`; the engine keeps the copy between weight syncs), not at
every step. The decode step's layer scan only reads the KV caches and writes every layer's new
slot once after it (`Decoder.forward_cached_shared_prompt`): the caches, carried by the while
loop, are updated in place, never copied (tests/decode_inplace_test.py checks the compiled HLO).

Sampling. logits / temperature, then (when asked) top-k and then top-p over the top-k-renormalised
distribution, as vLLM applies them; temperature 0 is greedy (argmax). The reported log-prob is
log softmax(logits / temperature)[token] *before* the top-k/top-p truncation (temperature 1 when
greedy): the quantity the trainer recomputes, so on-policy ratios are exactly 1 with top_p = 1 and
top_k = 0. (vLLM's `processed_logprobs` are renormalised after truncation; equal when it is off.)

Compaction. The first loop also exits once at most half its rows are still decoding; the live
rows go on alone in smaller loops (`decode_loop`, which explains it).

Randomness. Row r of a call with seed s draws from fold_in(fold_in(key(s), r), t) at step t, so a
completion depends on (seed, prompt index, sample index) and not on the padding buckets.

Data parallelism (`mesh=`). The padded prompts and their rows (and the packed prefill rows) are
split over the mesh's batch axes and the weights replicated, so each device decodes its own rows
(`shard_map`: its own while loop); nothing crosses devices but the prefill's gather. On
CPU, with one JAX device per core, this runs the small per-step ops (attention, sampling) on
every core, but each device also streams all the weights for its share of the rows. For
SmolLM2-135M at 8 and 32 prompts x 4, one device was as fast or faster (README, measured speed);
larger batches (evaluation's 32 x 16) are where the split can pay.

Compiles. Shapes are bucketed (prompt count and number of stop ids to powers of two, prompt length
and new tokens to 2^k or 1.5 * 2^k) and every sampling value, max_new_tokens included, is a traced
scalar; the static choices are n, greedy or not, and whether top-k/top-p filtering is on. The
prefill compiles per (Bp, P, packed rows).
`trace_count()` (decode) and `prefill_trace_count()` count compiled programs (from JAX's jit
caches) for tests; `sample(..., stats=LoopStats())` tells how many steps a call's loops ran.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmr_jax.models import kv_cache, sharding
from mmr_jax.rollout import base, decode_loop, layout

LoopStats = decode_loop.LoopStats


def trace_count() -> int:
    """Decode-loop programs compiled in this process (JAX's jit caches of the first loop and the
    compacted ones): a repeated call with the same shapes adds none."""
    return _generate._cache_size() + decode_loop.resume._cache_size()


def prefill_trace_count() -> int:
    """Packed-prefill programs compiled in this process (JAX's jit cache)."""
    return _prefill._cache_size()


@functools.partial(jax.jit, static_argnames=("graphdef", "cache_sharding"))
def _prefill(
    graphdef, state, tokens_RxW, positions_RxW, segment_ids_RxW, gather_BxP, *, cache_sharding=None
):
    """The prompt cache (split: keys [L, Bp, K, D, P], values [L, Bp, K, P, D]) from packed rows.

    Runs the packed rows against a temporary split cache of W slots, each token attending to its
    own segment, then gathers every layer's keys/values into the prompt-cache slots. The slots the
    gather index leaves at 0 hold copies of packed slot 0 (masked in the decode).
    `cache_sharding`: where the prompt cache goes (its prompt axis 1 split as the prompts' batch
    sharding: `cache_sharding(mesh)`), or None.
    """
    model = nnx.merge(graphdef, state)
    rows, w = tokens_RxW.shape
    packed = kv_cache.split(model.init_cache(rows, w))
    _, packed = model.forward_cached(
        tokens_RxW,
        positions_RxW,
        packed,
        write_index=0,
        kv_mask_BxS=segment_ids_RxW >= 0,
        segment_ids_BxS=segment_ids_RxW,
    )

    def gather_keys(k_LxRxKxDxW):
        nl, _, kh, d, _ = k_LxRxKxDxW.shape
        flat = jnp.transpose(k_LxRxKxDxW, (0, 2, 3, 1, 4)).reshape(nl, kh, d, rows * w)
        out = jnp.take(flat, gather_BxP, axis=3, mode="clip")  # [L, K, D, Bp, P]
        return jnp.transpose(out, (0, 3, 1, 2, 4))

    def gather_values(v_LxRxKxWxD):
        nl, _, kh, _, d = v_LxRxKxWxD.shape
        flat = jnp.transpose(v_LxRxKxWxD, (0, 2, 1, 3, 4)).reshape(nl, kh, rows * w, d)
        out = jnp.take(flat, gather_BxP, axis=2, mode="clip")  # [L, K, Bp, P, D]
        return jnp.transpose(out, (0, 2, 1, 3, 4))

    cache = kv_cache.KVCache(k=gather_keys(packed.k), v=gather_values(packed.v), split=True)
    if cache_sharding is not None:
        cache = jax.lax.with_sharding_constraint(cache, cache_sharding)
    return cache


def cache_sharding(mesh) -> jax.sharding.NamedSharding:
    """Sharding of a stacked cache [L, B, ...]: its batch axis 1 as batches are split."""
    (batch_axes,) = sharding.batch_sharding(mesh).spec
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, batch_axes))


def weight_major(state) -> bool:
    """Whether the decode loop runs its matmuls weight-major: on CPU, where XLA's matmul packs its
    right-hand operand (the weights, in the plain x @ W) on every call
    (`layers.weight_major_matmul`; SmolLM2 8 x 4: linear layers 104 -> 70 ms a step). It takes a
    transposed copy of the weights for the call, so accelerators, where it would not pay for the
    memory, keep the plain form."""
    leaf = jax.tree.leaves(state)[0]
    return all(d.platform == "cpu" for d in leaf.devices())


def sampling_weights(model: nnx.Module) -> nnx.State:
    """`model`'s state with every floating-point array in its compute dtype (`model.dtype`).

    The decoder casts its fp32 master weights to the compute dtype where it uses them; in the
    decode loop that was a cast of every weight at every step (12% of the 1.5B decode step's
    device time on an H200, issue 35). Sampling from this copy, made once per weight version
    (`EmbeddedEngine` keeps it until the next `sync_weights`), the casts in the step are no-ops
    and every value is the same (a cast commutes with the gather and matmul operands it feeds).
    When the compute dtype is the storage dtype this is the model's own state, not a copy.
    """
    state = nnx.state(model)
    dtype = getattr(model, "dtype", None)
    if dtype is None or all(
        x.dtype == dtype or not jnp.issubdtype(x.dtype, jnp.floating)
        for x in jax.tree.leaves(state)
    ):
        return state
    return _cast_floating(state, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnames=("dtype",))
def _cast_floating(state, dtype):
    """Floating-point leaves cast to `dtype` (on their devices, with their shardings)."""
    cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    return jax.tree.map(cast, state)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _weight_major_kernels(graphdef, state):
    """`Decoder.weight_major_kernels` as the outputs of a jit, so laid out [out, in] in memory."""
    return nnx.merge(graphdef, state).weight_major_kernels()


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "n", "num_new", "greedy", "use_filter", "mesh", "keep_rows"),
)
def _generate(graphdef, *arrays, n, num_new, greedy, use_filter, mesh=None, keep_rows=False):
    """Decodes against the prompt cache (from `_prefill`); -> tokens [R, N] int32, logps [R, N]
    f32, stopped [R] bool (hit a stop id) and the decode steps run, [devices] int32, and with
    `keep_rows` the loop's `decode_loop.Rows` (to compact and continue; single device only).

    `arrays` are `_decode`'s, in its order: the state and the weight-major kernels (or None),
    five per-prompt or per-row arrays (split over the mesh), seven scalars and the stop ids
    (replicated). The loop also exits once at most `min_live` rows are still decoding (0: only
    when all are done). With a mesh, each device runs
    `_decode` on its own prompts and rows (`shard_map`): its own while loop, which stops when its
    rows are done, and no collective at all. (Under plain sharding propagation the CPU attention
    kernel, an FFI call XLA cannot split, would gather every row onto every device.)
    """
    decode = functools.partial(
        _decode, graphdef, n=n, num_new=num_new, greedy=greedy, use_filter=use_filter
    )
    if mesh is not None:
        if keep_rows:
            raise ValueError("keep_rows is single-device only")
        batch, whole = sharding.batch_sharding(mesh).spec, jax.sharding.PartitionSpec()
        cache = cache_sharding(mesh).spec
        per_device = decode
        decode = jax.shard_map(
            lambda *a: per_device(*a)[:4],
            mesh=mesh,
            in_specs=(whole,) * 2 + (batch,) * 2 + (cache,) + (batch,) * 2 + (whole,) * 7,
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
    row_ids_R,
    real_rows_R,
    seed,
    max_new_tokens,
    min_live,
    temperature,
    top_k,
    top_p,
    stop_ids,
    *,
    n: int,
    num_new: int,
    greedy: bool,
    use_filter: bool,
):
    """`_generate`'s work on one device's (or all) prompts and rows; returns its outputs."""
    model = nnx.merge(graphdef, state)
    bp, _ = prompts_BxP.shape
    r = bp * n
    lengths_B = prompt_mask_BxP.sum(-1).astype(jnp.int32)
    rows = decode_loop.Rows(
        prompt_cache=prompt_cache,
        # Slot P - 1 is not in the prompt cache: the last prompt token is each row's first input.
        prompt_mask=prompt_mask_BxP.at[:, -1].set(False),
        lengths=jnp.repeat(lengths_B, n),
        row_keys=jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(row_ids_R),
        t=jnp.int32(0),
        cache=kv_cache.split(model.init_cache(r, num_new)),
        cur=jnp.repeat(prompts_BxP[:, -1], n),
        done=~real_rows_R,
        stopped=jnp.zeros((r,), bool),
        toks=jnp.zeros((r, num_new), jnp.int32),
        logps=jnp.zeros((r, num_new), jnp.float32),
    )
    sampling = (temperature, top_k, top_p, stop_ids)
    rows = decode_loop.run(
        model, kernels_t, rows, max_new_tokens, min_live, sampling, greedy, use_filter
    )
    return rows.toks, rows.logps, rows.stopped, rows.t[None], rows


def sample(
    model: nnx.Module,
    prompt_ids,
    params: base.SamplingParams,
    *,
    stop_token_ids=(),
    seed: int = 0,
    pad_id: int = 0,
    buckets: layout.Buckets = layout.DEFAULT_BUCKETS,
    max_len: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
    compact: bool = True,
    first_row: int = 0,
    stats: LoopStats | None = None,
    weights: nnx.State | None = None,
) -> base.RolloutBatch:
    """Samples `params.n` completions for each prompt with a `Decoder`; see the module docstring.

    Args:
      model: a `Decoder` (anything with `init_cache` and `forward_cached`).
      prompt_ids: B non-empty lists of token ids.
      params: sampling parameters; `params.seed` overrides `seed`.
      stop_token_ids: ids that end a completion besides `params.stop_token_ids` (the EOS ids).
      seed: the seed used when `params.seed` is None.
      pad_id: id written after the end of each completion.
      buckets: minimum padded sizes.
      max_len: positions the model supports; prompt + new tokens beyond it raise ValueError.
      mesh: data-parallel sampling: prompts (and their rows) split over the mesh's batch axes,
        the weights replicated on it (a copy per device, made here unless already so). On CPU
        with a device per core (`sharding.use_cpu_cores_as_devices`) this runs every core.
        The tokens do not depend on it (same row keys), up to float rounding.
      compact: once at most half of the rows are still decoding, go on with those alone
        (module docstring, "Compaction"); single device only. The tokens do not depend on it.
      first_row: row index (for the random keys) of the first prompt's first sample: a process
        sampling its share of a batch passes its offset, so it draws what one process would.
      stats: a `LoopStats` to fill with what the decode loops did (tests, benchmarks).
      weights: `sampling_weights(model)`, made once per weight version by the caller; None:
        made here, for this call.
    Returns:
      A `RolloutBatch` with T = the longest completion.
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
    ways = sharding.batch_size(mesh)
    # A multiple of the split, so every device gets whole prompts.
    bp = -(-layout.bucket(num_prompts, buckets.min_prompts) // ways) * ways
    p = layout.length_bucket(longest, max(buckets.min_prompt_len, 2))
    num_new = layout.length_bucket(params.max_new_tokens, buckets.min_new_tokens)
    stops = sorted(set(stop_token_ids) | set(params.stop_token_ids))
    stop_arr = np.full((layout.bucket(len(stops), buckets.min_stop_ids),), -1, np.int32)
    stop_arr[: len(stops)] = stops
    tokens, mask = layout.left_pad(prompt_ids, bp, p, pad_id)
    packed = layout.pack_prefill(prompt_ids, bp, p, pad_id, row_multiple=ways)
    n = params.n
    row_ids = np.arange(bp * n, dtype=np.int32)
    greedy = params.temperature == 0.0
    graphdef = nnx.graphdef(model)
    state = sampling_weights(model) if weights is None else weights
    if mesh is None:
        rows = scalar = jnp.asarray
    else:
        state = jax.device_put(state, sharding.replicated(mesh))
        rows = functools.partial(jax.device_put, device=sharding.batch_sharding(mesh))
        scalar = functools.partial(jax.device_put, device=sharding.replicated(mesh))
    prompt_cache = _prefill(
        graphdef,
        state,
        rows(packed.tokens),
        rows(packed.positions),
        rows(packed.segment_ids),
        rows(packed.gather),
        cache_sharding=None if mesh is None else cache_sharding(mesh),
    )
    kernels_t = _weight_major_kernels(graphdef, state) if weight_major(state) else None
    sampling = (
        scalar(np.float32(params.temperature if not greedy else 1.0)),
        scalar(np.int32(params.top_k)),
        scalar(np.float32(params.top_p)),
        scalar(stop_arr),
    )
    static = dict(greedy=greedy, use_filter=not greedy and (params.top_k > 0 or params.top_p < 1.0))
    max_new = scalar(np.int32(params.max_new_tokens))
    size = bp * n
    compacting = compact and mesh is None
    out = _generate(
        graphdef,
        state,
        kernels_t,
        rows(tokens),
        rows(mask),
        prompt_cache,
        rows(row_ids + np.int32(first_row)),
        rows(row_ids < num_prompts * n),
        scalar(np.uint32((params.seed if params.seed is not None else seed) % 2**32)),
        max_new,
        scalar(np.int32(decode_loop.min_live(size) if compacting else 0)),
        *sampling,
        n=n,
        num_new=num_new,
        mesh=mesh,
        keep_rows=compacting,
        **static,
    )
    stats = LoopStats() if stats is None else stats
    stats.loop_rows = (size,)
    if not compacting:
        toks, logps, stopped, steps = out
        stats.decode_steps = int(np.max(steps))
        return _to_batch(
            np.asarray(toks),
            np.asarray(logps),
            np.asarray(stopped),
            num_prompts,
            n,
            params.max_new_tokens,
            stops,
            pad_id,
        )
    stats.decode_steps, state_rows = int(out[3][0]), out[4]

    def resume_loop(rows, min_live):
        min_live = scalar(np.int32(min_live))
        return decode_loop.resume(
            graphdef, state, kernels_t, rows, max_new, min_live, sampling, **static
        )

    toks, logps, stopped = decode_loop.finish_compacting(state_rows, resume_loop, n=n, stats=stats)
    return _to_batch(toks, logps, stopped, num_prompts, n, params.max_new_tokens, stops, pad_id)


def _to_batch(toks, logps, stopped, num_prompts, n, max_new, stops, pad_id) -> base.RolloutBatch:
    """Device outputs [R, N] -> a host `RolloutBatch` [B, n, T] with T = the longest completion."""
    r = num_prompts * n
    toks, logps, stopped = toks[:r, :max_new], logps[:r, :max_new], stopped[:r]
    is_stop = np.isin(toks, np.asarray(stops, np.int32)) if stops else np.zeros_like(toks, bool)
    first_stop = np.where(is_stop.any(-1), is_stop.argmax(-1) + 1, max_new)
    lengths = np.where(stopped, first_stop, max_new)
    t = max(1, int(lengths.max()))
    mask = np.arange(t)[None, :] < lengths[:, None]
    toks = np.where(mask, toks[:, :t], pad_id).astype(np.int32)
    logps = np.where(mask, logps[:, :t], 0.0).astype(np.float32)
    reasons = np.where(stopped, base.FINISH_STOP, base.FINISH_LENGTH).reshape(num_prompts, n)
    return base.RolloutBatch(
        tokens=toks.reshape(num_prompts, n, t),
        mask=mask.reshape(num_prompts, n, t),
        logprobs=logps.reshape(num_prompts, n, t),
        finish_reasons=reasons.tolist(),
    )
