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

Sampling. logits / temperature, then (when asked) top-k and then top-p over the top-k-renormalised
distribution, as vLLM applies them; temperature 0 is greedy (argmax). The reported log-prob is
log softmax(logits / temperature)[token] *before* the top-k/top-p truncation (temperature 1 when
greedy): the quantity the trainer recomputes, so on-policy ratios are exactly 1 with top_p = 1 and
top_k = 0. (vLLM's `processed_logprobs` are renormalised after truncation; equal when it is off.)

Compaction. A loop runs until every row is done, so a few long completions keep every row
decoding: early in training (completions of ~9 tokens, a few of 32) most of the loop's steps
were spent on finished rows. The loop therefore also exits once at most half of its rows are
live; those rows go on alone in a loop half the size (`_compact`: each takes its own copy of
its prompt's cache, its keys, own cache and outputs so far; `_continue`), and again, down to 4
rows, so a call compiles at most log2(R / 4) extra loops, each once per shape. (SmolLM2 decode
step at 32 rows 121 ms, at 8 rows 60 ms; halving, not quartering, gave 1.22x on the CPU
default's rollouts against 1.03x: `scripts/bench_rollout.py`.) Rows keep their random keys, so
the tokens are those of the uncompacted loop (`compact=False`), up to float rounding.

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
`trace_count()` (decode) and `prefill_trace_count()` count traces for tests;
`last_decode_steps()` tells how many steps the last call's loop ran.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmr_jax.models import kv_cache, sharding
from mmr_jax.rollout import base, layout

_TRACES = {"generate": 0, "prefill": 0}
_LAST = {"decode_steps": 0, "loop_rows": ()}


def trace_count() -> int:
    """How many times the jitted generate function has been traced (= compiled) in this process."""
    return _TRACES["generate"]


def last_decode_steps() -> int:
    """Decode steps the last `sample` call ran (the most on any device): shows the early exit."""
    return _LAST["decode_steps"]


def last_loop_rows() -> tuple[int, ...]:
    """Rows of each decode loop the last `sample` call ran (more than one: it compacted)."""
    return _LAST["loop_rows"]


def prefill_trace_count() -> int:
    """How many times the jitted packed prefill has been traced (= compiled) in this process."""
    return _TRACES["prefill"]


_FILTER_CANDIDATES = 256  # tokens the nucleus is looked for in before a full sort


def filter_top_k_top_p(logits_RxV: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Masks (to -inf) tokens outside the top-k, then outside the top-p nucleus of what is left.

    `top_k` 0 = off; `top_p` 1 = off. Ties at a threshold are kept. logits [R, V] -> [R, V].

    The same as `filter_top_k_top_p_sorted` (the definition), without sorting the vocabulary on
    every decode step (at R=128, V=49152 on CPU the sort took ~1.2 s, top_k(256) ~20 ms): the
    threshold is found among the `_FILTER_CANDIDATES` largest logits, with the normaliser over all
    V (or the top-k) taken directly, and the batch falls back to the full sort when some row's
    nucleus or top-k may reach beyond them.
    """
    v = logits_RxV.shape[-1]
    c = min(_FILTER_CANDIDATES, v)
    # XLA:CPU keeps TopK fast only when its result is reduced, not sliced (a slice of it turned
    # the whole filter into a ~1 s sort here): positions are picked with masks, not indexing.
    desc = jax.lax.top_k(logits_RxV, c)[0]  # [R, C], the C largest in descending order
    pos = jnp.arange(c)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    in_k = pos < k
    # softmax over the top-k set: when k <= C it is inside desc; when top-k is off, all of V.
    top = jnp.max(logits_RxV, axis=-1, keepdims=True)
    norm = jnp.where(
        k <= c,
        jnp.sum(jnp.where(in_k, jnp.exp(desc - top), 0.0), axis=-1, keepdims=True),
        jnp.sum(jnp.exp(logits_RxV - top), axis=-1, keepdims=True),
    )
    probs = jnp.where(in_k, jnp.exp(desc - top) / norm, 0.0)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (in_k & (mass_before < top_p)) | (pos == 0)
    # Exact when the top-k lies within the candidates, or top-k is off and the nucleus ends
    # before the last candidate; otherwise the sort decides, for the whole batch (rare).
    k_inside = (top_k > 0) & (top_k <= c)
    exact = k_inside | ((top_k == 0) & ~(keep & (pos == c - 1)).any())
    threshold = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    fast = jnp.where(logits_RxV >= threshold, logits_RxV, -jnp.inf)
    if c == v:
        return fast
    return jax.lax.cond(
        exact, lambda: fast, lambda: filter_top_k_top_p_sorted(logits_RxV, top_k, top_p)
    )


def filter_top_k_top_p_sorted(
    logits_RxV: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
    """`filter_top_k_top_p` by a full sort of each row: the definition, and its fallback."""
    v = logits_RxV.shape[-1]
    desc = -jnp.sort(-logits_RxV, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    in_k = jnp.arange(v)[None, :] < k
    desc = jnp.where(in_k, desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_k & (mass_before < top_p)
    keep = keep.at[:, 0].set(True)
    threshold = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits_RxV >= threshold, logits_RxV, -jnp.inf)


_CDF_BLOCK = 128


def categorical(keys_R: jax.Array, logits_RxV: jax.Array) -> jax.Array:
    """One token per row from softmax(logits) by inverse-CDF sampling: [R] keys, [R, V] -> [R].

    `jax.random.categorical` draws V Gumbel variates per row; at R=128, V=49152 on CPU that is
    a large part of a SmolLM2 decode step (about 140 of 520 ms). This draws one uniform per row
    (as torch's multinomial does) and finds where it falls in the CDF in two levels, the sums of
    blocks of 128 tokens and then the cumulative sum inside the chosen block, so no cumsum over the
    whole vocabulary is needed either. Tokens with logit -inf are never drawn: the chosen index
    always has p > 0 (see the clamps below), whatever the rounding.
    """
    r, v = logits_RxV.shape
    nb = -(-v // _CDF_BLOCK)
    logits = jnp.pad(logits_RxV, ((0, 0), (0, nb * _CDF_BLOCK - v)), constant_values=-jnp.inf)
    top = jnp.max(logits, axis=-1, keepdims=True)
    p_RxNBxK = jnp.exp(logits - top).reshape(r, nb, _CDF_BLOCK)
    block_cdf = jnp.cumsum(jnp.sum(p_RxNBxK, axis=-1), axis=-1)  # [R, NB]
    # u in (0, 1], so the target is > 0 and <= the last CDF value: some block reaches it.
    u = 1.0 - jax.vmap(jax.random.uniform)(keys_R)
    target = u * block_cdf[:, -1]
    b = jnp.minimum(jnp.sum(block_cdf < target[:, None], axis=-1), nb - 1)
    before = jnp.where(b > 0, jnp.take_along_axis(block_cdf, (b - 1)[:, None], -1)[:, 0], 0.0)
    # block_cdf rose at b (it passed the target there), so block b holds some p > 0.
    p_RxK = jnp.take_along_axis(p_RxNBxK, b[:, None, None], axis=1)[:, 0]
    inner = jnp.sum(jnp.cumsum(p_RxK, axis=-1) < (target - before)[:, None], axis=-1)
    # The first index whose running sum reaches the rest of the target has p > 0; rounding can
    # carry the count past the block's last token with p > 0, so clamp to that one.
    last_nonzero = jnp.max(jnp.where(p_RxK > 0, jnp.arange(_CDF_BLOCK), -1), axis=-1)
    return (b * _CDF_BLOCK + jnp.minimum(inner, last_nonzero)).astype(jnp.int32)


def _sample_step(logits_RxV, keys_R, temperature, top_k, top_p, *, greedy, use_filter):
    """Next token [R] and its log-prob [R] under log softmax(logits / temperature)."""
    if greedy:
        tok = jnp.argmax(logits_RxV, axis=-1).astype(jnp.int32)
        logp_all = jax.nn.log_softmax(logits_RxV, axis=-1)
    else:
        scaled = logits_RxV / temperature
        logp_all = jax.nn.log_softmax(scaled, axis=-1)
        if use_filter:
            scaled = filter_top_k_top_p(scaled, top_k, top_p)
        tok = categorical(keys_R, scaled)
    logp = jnp.take_along_axis(logp_all, tok[:, None], axis=-1)[:, 0]
    return tok, logp


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
    _TRACES["prefill"] += 1
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


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _weight_major_kernels(graphdef, state):
    """`Decoder.weight_major_kernels` as the outputs of a jit, so laid out [out, in] in memory."""
    return nnx.merge(graphdef, state).weight_major_kernels()


@flax.struct.dataclass
class _Rows:
    """The decode loop's state: its rows, their prompts' cache and how far they got.

    Rows r = b * n + i read prompt b of `prompt_cache` / `prompt_mask` (n static, passed beside).
    `cache` is the rows' own (split, N slots); `cur` each row's next input; `t` the next slot.
    """

    prompt_cache: kv_cache.KVCache
    prompt_mask: jax.Array  # [B, P] bool, slot P - 1 off (the last prompt token is an input)
    lengths: jax.Array  # [R] int32 prompt lengths
    row_keys: jax.Array  # [R] PRNG keys
    t: jax.Array  # () int32
    cache: kv_cache.KVCache
    cur: jax.Array  # [R] int32
    done: jax.Array  # [R] bool
    stopped: jax.Array  # [R] bool
    toks: jax.Array  # [R, N] int32
    logps: jax.Array  # [R, N] float32


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "n", "num_new", "greedy", "use_filter", "mesh", "keep_rows"),
)
def _generate(graphdef, *arrays, n, num_new, greedy, use_filter, mesh=None, keep_rows=False):
    """Decodes against the prompt cache (from `_prefill`); -> tokens [R, N] int32, logps [R, N]
    f32, stopped [R] bool (hit a stop id) and the decode steps run, [devices] int32, and with
    `keep_rows` the loop's `_Rows` (to compact and continue; single device only).

    `arrays` are `_decode`'s, in its order: the state and the weight-major kernels (or None),
    five per-prompt or per-row arrays (split over the mesh), seven scalars and the stop ids
    (replicated). The loop also exits once at most `min_live` rows are still decoding (0: only
    when all are done). With a mesh, each device runs
    `_decode` on its own prompts and rows (`shard_map`): its own while loop, which stops when its
    rows are done, and no collective at all. (Under plain sharding propagation the CPU attention
    kernel, an FFI call XLA cannot split, would gather every row onto every device.)
    """
    _TRACES["generate"] += 1
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
    rows = _Rows(
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
    rows = _loop(model, kernels_t, rows, max_new_tokens, min_live, sampling, greedy, use_filter)
    return rows.toks, rows.logps, rows.stopped, rows.t[None], rows


def _loop(model, kernels_t, rows, max_new_tokens, min_live, sampling, greedy, use_filter):
    """The decode `while_loop` from `rows.t` until every row is done or at most `min_live` are
    still decoding (`min_live` 0: to the end). Rows are grouped n = R / B per prompt; `sampling`
    is (temperature, top_k, top_p, stop_ids)."""
    temperature, top_k, top_p, stop_ids = sampling

    def cond(rows):
        live = jnp.sum(~rows.done)
        return (rows.t < max_new_tokens) & (live > 0) & (live > min_live)

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
        tok, logp = _sample_step(
            logits[:, 0], keys, temperature, top_k, top_p, greedy=greedy, use_filter=use_filter
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
def _compact(rows: _Rows, keep_S, real_S, *, n: int) -> _Rows:
    """The rows `keep_S` of `rows` (S of them), each with its own copy of its prompt's cache, so
    the result has one row per prompt (n = 1); rows where `real_S` is False are padding (done).

    Row r keeps its keys, own cache and outputs so far, so it continues exactly as it would have.
    """
    prompt_of = keep_S // n
    take = functools.partial(jnp.take, indices=keep_S, axis=0)
    return _Rows(
        prompt_cache=jax.tree.map(  # caches are [L, rows, ...]: rows are axis 1
            functools.partial(jnp.take, indices=prompt_of, axis=1), rows.prompt_cache
        ),
        prompt_mask=jnp.take(rows.prompt_mask, prompt_of, axis=0),
        lengths=take(rows.lengths),
        row_keys=rows.row_keys[keep_S],
        t=rows.t,
        cache=jax.tree.map(functools.partial(jnp.take, indices=keep_S, axis=1), rows.cache),
        cur=take(rows.cur),
        done=take(rows.done) | ~real_S,
        stopped=take(rows.stopped) & real_S,
        toks=take(rows.toks),
        logps=take(rows.logps),
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "greedy", "use_filter"))
def _continue(
    graphdef, state, kernels_t, rows, max_new_tokens, min_live, sampling, *, greedy, use_filter
):
    """The decode loop resumed on compacted `rows` (one row per prompt); `sampling` as `_loop`'s."""
    _TRACES["generate"] += 1
    model = nnx.merge(graphdef, state)
    return _loop(model, kernels_t, rows, max_new_tokens, min_live, sampling, greedy, use_filter)


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
    graphdef, state = nnx.split(model)
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
        scalar(np.int32(_min_live(size) if compacting else 0)),
        *sampling,
        n=n,
        num_new=num_new,
        mesh=mesh,
        keep_rows=compacting,
        **static,
    )
    _LAST["loop_rows"] = (size,)
    if not compacting:
        toks, logps, stopped, steps = out
        _LAST["decode_steps"] = int(np.max(steps))
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
    state_rows = out[4]
    toks = np.zeros((size, num_new), np.int32)
    logps = np.zeros((size, num_new), np.float32)
    stopped = np.zeros((size,), bool)
    origin = np.arange(size)  # the original row of each current row (-1: padding)
    group = n
    while True:
        done = np.asarray(state_rows.done)
        real = origin >= 0
        toks[origin[real]] = np.asarray(state_rows.toks)[real]
        logps[origin[real]] = np.asarray(state_rows.logps)[real]
        stopped[origin[real]] = np.asarray(state_rows.stopped)[real]
        if done.all():  # (a loop that reached max_new_tokens marked every row done)
            break
        # At most _min_live(size) rows are live: go on with them alone, in half as many rows.
        live = np.flatnonzero(~done)
        size = _compacted_size(size)
        keep = np.full((size,), live[0], np.int32)
        keep[: len(live)] = live
        state_rows = _compact(
            state_rows, jnp.asarray(keep), jnp.asarray(np.arange(size) < len(live)), n=group
        )
        origin = np.where(np.arange(size) < len(live), origin[keep], -1)
        group = 1
        _LAST["loop_rows"] += (size,)
        min_live = scalar(np.int32(_min_live(size)))
        state_rows = _continue(
            graphdef, state, kernels_t, state_rows, max_new, min_live, sampling, **static
        )
    _LAST["decode_steps"] = int(state_rows.t)
    return _to_batch(toks, logps, stopped, num_prompts, n, params.max_new_tokens, stops, pad_id)


_COMPACT_FACTOR = 2  # rows halve at each compaction
# No loop below 4 rows: each shape compiles once (seconds, for SmolLM2 on 2 cores), and below a few
# rows a decode step costs about the same (reading the weights), so smaller ones do not repay it.
_MIN_COMPACT_ROWS = 4


def _compacted_size(rows: int) -> int:
    return max(min(rows, _MIN_COMPACT_ROWS), rows // _COMPACT_FACTOR)


def _min_live(rows: int) -> int:
    """Live rows at or below which a loop of `rows` rows hands over to a compacted one (0: never,
    when the compacted loop would not be smaller)."""
    smaller = _compacted_size(rows)
    return smaller if smaller < rows else 0


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
