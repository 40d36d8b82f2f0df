"""Training-forward attention through one fused call, with the backend named in the config.

`dot_product` is grouped-query attention in `jax.nn.dot_product_attention`'s [N, T, H, D] layout
(keys/values [N, S, K, D], K < H heads natively), so that no transpose of q, k or v sits
between the projections and the attention, and no score matrix is written by our code:

  'xla'         jax.nn.dot_product_attention(implementation='xla'): the CPU default and the
                numerics reference (scores and softmax fp32, probabilities cast to v's dtype,
                as `attention.attend`).
  'cudnn'       cuDNN's fused flash attention (GPU; bf16/fp16, head dim a multiple of 8), the
                dense mask passed as a bias (T and S padded to even lengths).
  'cudnn_maskfree'  cuDNN with no bias: `is_causal` plus sequence lengths, over keys compacted
                per row (`_maskfree`); exact for causal and prompt-then-causal masks with any
                padding, not for packed segments.
  'pallas_tpu'  the Pallas splash-attention kernel (TPU; runs in interpret mode elsewhere),
                queries and keys padded up to its block size (any T and S).
  'unfused'     the einsum forms this replaced (`attention.attend`, and over a shared prompt
                `shared_prompt.attend_completions`: score matrices concatenated, no per-row
                keys); on CPU they measured a few % faster than 'xla' (docs/attention.md).
  'auto'        resolved once at start-up, outside any trace, by `attention_probe.choose`:
                on a GPU in bf16/fp16 the first cuDNN form that compiles, runs and matches
                'xla' on the run's attention structure, else 'xla'; on a TPU 'pallas_tpu'
                unless the completions are packed (`auto_off_gpu`); elsewhere 'unfused'.

Which keys a query sees is a `Mask`: a static [T, S] pattern (causal, or prompt-then-causal),
a per-row validity of the keys [N, S] (padding), and optionally a per-row [N, T, S] extra
condition (packed completions' segments). XLA and cuDNN get the dense mask; splash gets the
static pattern and the validity as segment ids (it takes no dense mask).

Shape legend (docs/design.md): N rows, T queries, S keys, H heads, K kv heads, R = H / K, D head
dim.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mmr_jax.kernels import compile_platform
from mmr_jax.models import attention, sharding
from mmr_jax.models import config as config_lib

IMPLEMENTATIONS = config_lib.ATTENTION_IMPLS


class Mask(NamedTuple):
    """Query t of row b sees key s iff static[t, s] and kv_valid[b, s] (and extra[b, t, s])."""

    static_TxS: np.ndarray  # bool, a host constant (splash compiles it into its kernel)
    kv_valid_NxS: jax.Array  # bool
    extra_NxTxS: jax.Array | None = None  # bool, or None

    def dense(self) -> jax.Array:
        """The [N, T, S] bool mask."""
        m = self._static_in_program()[None] & self.kv_valid_NxS[:, None, :]
        return m if self.extra_NxTxS is None else m & self.extra_NxTxS

    def _static_in_program(self) -> jax.Array:
        """`static_TxS` as the program computes it: the (prompt-then-)causal pattern from two
        iotas, anything else as a constant. Not the constant always: the completions' 3583 x 4095
        pattern was 16 MB of constant data in each compiled step (a v5p's generated code 16.3 MB
        against 1.9 MB with the iotas), for a mask XLA fuses into its use."""
        t, s = self.static_TxS.shape
        if not is_offset_causal(self.static_TxS):
            return jnp.asarray(self.static_TxS)
        query = jax.lax.broadcasted_iota(jnp.int32, (t, s), 0)
        key = jax.lax.broadcasted_iota(jnp.int32, (t, s), 1)
        return key <= query + (s - t)

    @property
    def is_causal(self) -> bool:
        """Whether the static pattern is the square lower triangle (cuDNN can skip the rest)."""
        t, s = self.static_TxS.shape
        return t == s and bool(np.array_equal(self.static_TxS, np.tril(np.ones((t, s), bool))))


def is_offset_causal(static_TxS: np.ndarray) -> bool:
    """Whether `static_TxS` is the last T rows of the S x S lower triangle: query t sees keys
    s <= S - T + t (causal when T = S; prompt-then-causal when S = P + T)."""
    t, s = static_TxS.shape
    return t <= s and bool(np.array_equal(static_TxS, np.tril(np.ones((s, s), bool))[s - t :]))


def causal(kv_valid_NxT: jax.Array) -> Mask:
    """Self-attention of T tokens: causal, over the keys where `kv_valid_NxT` holds."""
    t = kv_valid_NxT.shape[1]
    return Mask(np.tril(np.ones((t, t), bool)), kv_valid_NxT.astype(jnp.bool_))


def prompt_then_causal(pvalid_NxP, own_valid_NxT, extra_NxTxT=None) -> Mask:
    """T completion queries over keys [P prompt ; T own]: every valid prompt key, and the own
    keys causally (where `extra_NxTxT` holds too, when given); keys [N, P + T]."""
    p, t = pvalid_NxP.shape[1], own_valid_NxT.shape[1]
    static = np.concatenate([np.ones((t, p), bool), np.tril(np.ones((t, t), bool))], axis=1)
    valid = jnp.concatenate([pvalid_NxP.astype(jnp.bool_), own_valid_NxT.astype(jnp.bool_)], 1)
    extra = None
    if extra_NxTxT is not None:
        b = extra_NxTxT.shape[0]
        extra = jnp.concatenate([jnp.ones((b, t, p), jnp.bool_), extra_NxTxT], axis=2)
    return Mask(static, valid, extra)


def resolve(implementation: str, dtype, head_dim: int, *, packed: bool = False) -> str:
    """The backend `implementation` names here ('auto': by platform, dtype, head dim and whether
    the masks carry packed segments, which splash cannot take: `auto_off_gpu`)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"unknown attention implementation {implementation!r}; expected one of "
            f"{IMPLEMENTATIONS}"
        )
    if implementation != "auto":
        return implementation
    # Never an unprobed cuDNN: `attention_probe.choose` resolves 'auto' before any trace; an
    # 'auto' left in a config (a test, a script that skipped it) gets the safe default.
    platform = compile_platform.current()
    if platform == "gpu":
        return "xla" if cudnn_eligible(dtype, head_dim) else "unfused"
    return auto_off_gpu(platform, packed)[0]


def auto_off_gpu(platform: str, packed: bool) -> tuple[str, str]:
    """(backend, why) of 'auto' off a GPU: on a TPU splash (it compiles through Mosaic, on any
    mesh under `shard_map`), unless the completions are packed: splash's segment ids cannot let
    every packed completion see its prompt's keys as well as its own, so those runs keep
    'unfused'; elsewhere 'unfused' (a few % faster than 'xla' on CPU, docs/attention.md)."""
    if platform != "tpu":
        return "unfused", f"auto: no GPU or TPU ({platform})"
    if packed:
        return "unfused", "auto on a TPU: splash takes no packed completions (batch.pack_max_len)"
    return "pallas_tpu", "auto on a TPU: splash"


def cudnn_eligible(dtype, head_dim: int) -> bool:
    """Whether cuDNN's flash attention takes this dtype and head dim at all."""
    return jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 and head_dim <= 256


def dot_product(
    q_NxTxHxD, k_NxSxKxD, v_NxSxKxD, mask: Mask, *, implementation: str = "xla", dense=None
):
    """softmax(q k^T / sqrt(D) where mask) v per head; returns [N, T, H*D] in v's dtype.

    `dense`: `mask.dense()` computed once by the caller (e.g. outside the layer scan); made
    here when None. Fully masked queries (left padding) get a uniform softmax, not NaN.
    """
    b, t, n, d = q_NxTxHxD.shape
    impl = resolve(implementation, q_NxTxHxD.dtype, d, packed=mask.extra_NxTxS is not None)
    if impl == "pallas_tpu":
        o = _splash(q_NxTxHxD, k_NxSxKxD, v_NxSxKxD, mask)
    elif impl == "cudnn_maskfree":
        o = _maskfree(q_NxTxHxD, k_NxSxKxD, v_NxSxKxD, mask, "cudnn")
    elif impl == "unfused":
        return attention.attend(
            q_NxTxHxD, k_NxSxKxD, v_NxSxKxD, mask.dense() if dense is None else dense
        )
    else:
        dense = mask.dense() if dense is None else dense
        q, k, v = q_NxTxHxD, k_NxSxKxD, v_NxSxKxD
        if impl == "cudnn":
            q, k, v, dense = _even_lengths(q, k, v, dense)
        o = jax.nn.dot_product_attention(
            q,
            k,
            v,
            mask=dense[:, None],
            # cuDNN skips the blocks above the diagonal; XLA's mask already holds causality.
            is_causal=impl == "cudnn" and mask.is_causal,
            implementation=impl,
        )[:, :t]
    return o.reshape(b, t, n * d)


def _even_lengths(q_NxTxHxD, k_NxSxKxD, v_NxSxKxD, dense_NxTxS):
    """Pads T and S to even lengths (cuDNN's training kernels with a mask require it; the
    completions' T = bucket - 1 is odd): a query that sees key 0 (its output is dropped) and a
    key nobody sees. One token of q, k and v, and only when a length is odd."""
    t, s = q_NxTxHxD.shape[1], k_NxSxKxD.shape[1]
    pt, ps = t % 2, s % 2
    if not (pt or ps):
        return q_NxTxHxD, k_NxSxKxD, v_NxSxKxD, dense_NxTxS

    def pad(x, n):
        return jnp.pad(x, ((0, 0), (0, n)) + ((0, 0),) * (x.ndim - 2))

    dense = jnp.pad(dense_NxTxS, ((0, 0), (0, pt), (0, ps)))
    if pt:
        dense = dense.at[:, t, 0].set(True)
    return pad(q_NxTxHxD, pt), pad(k_NxSxKxD, ps), pad(v_NxSxKxD, ps), dense


def _maskfree(q_NxTxHxD, k_NxSxKxD, v_NxSxKxD, mask: Mask, backend: str):
    """`dot_product` with no mask array: `is_causal` plus sequence lengths (cuDNN's
    PADDING_CAUSAL, which needs no bias, so no bias gradient and no even-length rule).

    The static pattern must be the last T rows of the S x S lower triangle (causal when T = S,
    prompt-then-causal when S = P + T). Queries go to key positions S - T .. S - 1 of a square
    S x S problem (the other S - T queries are zeros whose outputs are dropped), then keys and
    queries are compacted per row so that the valid keys come first in their order: valid query
    t then sees, causally, exactly the valid keys s <= S - T + t. Packed segments (`extra`) are
    not expressible so. `backend` 'xla' runs the same form on any platform (the CPU tests).
    """
    b, t, n, d = q_NxTxHxD.shape
    s = k_NxSxKxD.shape[1]
    if mask.extra_NxTxS is not None:
        raise NotImplementedError(
            "the mask-free cuDNN form takes causal and prompt-then-causal masks with padding; "
            "packed segments need the dense mask ('cudnn' or 'xla')"
        )
    if not is_offset_causal(mask.static_TxS):
        raise NotImplementedError("the mask-free cuDNN form needs a (prompt-then-)causal pattern")
    valid = mask.kv_valid_NxS
    # order[b, j]: the key at compacted position j (valid keys first, each group in order)
    order = jnp.argsort(~valid, axis=1, stable=True).astype(jnp.int32)
    lengths = jnp.sum(valid, axis=1, dtype=jnp.int32)
    q_full = jnp.pad(q_NxTxHxD, ((0, 0), (s - t, 0), (0, 0), (0, 0)))

    def gather(x):
        return jnp.take_along_axis(x, order[:, :, None, None], axis=1)

    o = jax.nn.dot_product_attention(
        gather(q_full),
        gather(k_NxSxKxD),
        gather(v_NxSxKxD),
        is_causal=True,
        query_seq_lengths=lengths,
        key_value_seq_lengths=lengths,
        implementation=backend,
    )
    # back to the original positions: position order[b, j] holds compacted output j
    inverse = jnp.argsort(order, axis=1).astype(jnp.int32)
    o = jnp.take_along_axis(o, inverse[:, :, None, None], axis=1)[:, s - t :]
    # queries that see no key (padding) are zeros here, uniform elsewhere: nothing uses them
    return o


def _splash_blocks():
    """Splash's block sizes (its defaults, passed explicitly so the padding below matches) and
    the multiples the query and key lengths must be of: every forward and backward block."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    blocks = splash.BlockSizes.get_default()
    q_side = (blocks.block_q, blocks.block_q_dkv, blocks.block_q_dq)
    kv_side = (blocks.block_kv, blocks.block_kv_dkv, blocks.block_kv_dq, blocks.block_kv_compute)
    return blocks, math.lcm(*q_side), math.lcm(*kv_side)


def splash_padded_mask(static_TxS: np.ndarray, q_multiple: int, kv_multiple: int) -> np.ndarray:
    """The static pattern padded to [T', S'] (the next multiples): padded keys are seen by no
    query; padded queries (outputs dropped) see what the last real query sees, so that no query
    block of the kernel is empty (an empty block row would leave its softmax sum at 0: 0/0)."""
    t, s = static_TxS.shape
    tp, sp = -(-t // q_multiple) * q_multiple, -(-s // kv_multiple) * kv_multiple
    out = np.zeros((tp, sp), bool)
    out[:t, :s] = static_TxS
    out[t:, :s] = static_TxS[-1]
    return out


def _splash(q_NxTxHxD, k_NxSxKxD, v_NxSxKxD, mask: Mask):
    """`dot_product` through Pallas splash attention (one MQA kernel per kv head and row).

    Splash takes no dense mask: the static pattern is compiled into the kernel and padding
    enters as segment ids (queries 0, keys 0 where valid, else 1). Its blocks must divide the
    lengths, and the train step's are odd (completions T = bucket - 1, keys P + T): queries and
    keys are padded with zeros up to the block (`splash_padded_mask`; padded keys get segment 1,
    so no real query sees them, and the padded queries' outputs are dropped), so the values are
    those of the unpadded problem. Lowered for anything but a TPU it runs in Pallas' interpret
    mode (slow; for tests).
    """
    if mask.extra_NxTxS is not None:
        raise NotImplementedError(
            "attention_impl='pallas_tpu' takes a static pattern and key padding only; the "
            "packed-completion layout (per-row segments) needs 'xla' or 'cudnn'"
        )
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    b, t, n, d = q_NxTxHxD.shape
    kh = k_NxSxKxD.shape[2]
    blocks, q_multiple, kv_multiple = _splash_blocks()
    static = splash_padded_mask(mask.static_TxS, q_multiple, kv_multiple)
    tp, sp = static.shape
    layout = splash_layout(jax.sharding.get_abstract_mesh(), b, kh, n // kh)
    bp = -(-b // layout.row_multiple) * layout.row_multiple  # rows padded to split evenly

    def pad(x, to, value=0, axis=1):  # `value` after `axis`
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, to - x.shape[axis])
        return jnp.pad(x, widths, constant_values=value)

    def rows(x, value=0):
        return pad(x, bp, value, axis=0)

    q = (pad(q_NxTxHxD, tp) * jnp.asarray(d**-0.5, q_NxTxHxD.dtype)).reshape(b, tp, kh, n // kh, d)
    q_NxKxRxTxD = rows(jnp.transpose(q, (0, 2, 3, 1, 4)))
    k_NxKxSxD = rows(jnp.swapaxes(pad(k_NxSxKxD, sp), 1, 2))
    v_NxKxSxD = rows(jnp.swapaxes(pad(v_NxSxKxD, sp), 1, 2))
    # padded rows' keys are all valid (segment 0): zeros attended, never a row that sees nothing
    kv_valid = rows(pad(mask.kv_valid_NxS, sp), True)
    seg = splash.SegmentIds(
        q=jnp.zeros((bp, tp), jnp.int32), kv=jnp.where(kv_valid, 0, 1).astype(jnp.int32)
    )

    def attend(interpret, q, k, v, seg):  # q [N, K, R, T', D], k/v [N, K, S', D] (a device's)
        heads_mask = splash.MultiHeadMask([splash.NumpyMask(static)] * q.shape[2])
        kernel = splash.make_splash_mqa_single_device(
            heads_mask, block_sizes=blocks, interpret=interpret
        )

        def one(q, k, v, seg):
            return jax.vmap(functools.partial(kernel, segment_ids=seg))(q, k, v)

        return jax.vmap(one)(q, k, v, seg)

    def per_device(q, k, v, seg):
        # The kernel through Mosaic where the program is lowered for a TPU (also compile-only TPU
        # devices on a CPU host, where the default backend is not 'tpu'), Pallas' interpreter
        # elsewhere; only the branch of the lowering platform is compiled.
        return jax.lax.platform_dependent(
            q,
            k,
            v,
            seg,
            tpu=functools.partial(attend, False),
            default=functools.partial(attend, True),
        )

    if layout.mesh is not None:
        # A Mosaic call is not partitioned by XLA ("wrap the call in a shard_map"): each device
        # runs the kernel on its own rows and heads, which attention never mixes.
        q_spec, kv_spec, seg_spec = layout.specs
        per_device = jax.shard_map(
            per_device,
            mesh=layout.mesh,
            in_specs=(q_spec, kv_spec, kv_spec, splash.SegmentIds(q=seg_spec, kv=seg_spec)),
            out_specs=q_spec,
            check_vma=False,  # pallas_call's outputs carry no varying-axes type
        )
    o = per_device(q_NxKxRxTxD, k_NxKxSxD, v_NxKxSxD, seg)[:b]  # [N, K, R, T', D]
    return jnp.transpose(o[:, :, :, :t], (0, 3, 1, 2, 4)).astype(v_NxSxKxD.dtype)


class SplashLayout(NamedTuple):
    """How splash's operands split over the trace's mesh: `mesh` None (no mesh, or one device:
    the plain call); else the PartitionSpecs of q [N, K, R, T', D], k/v [N, K, S', D] and the
    segment ids [N, L], and the multiple the rows are padded to (1 when not split)."""

    mesh: jax.sharding.AbstractMesh | None
    specs: tuple = ()
    row_multiple: int = 1


def splash_layout(mesh, rows: int, kv_heads: int, group: int) -> SplashLayout:
    """Rows over the mesh's batch axes (`sharding.BATCH_AXES`, as the activations are), heads
    over its `tensor` axis: the kv heads when they divide (each device keeps its query heads'
    kv heads), else the query heads of a group (kv heads then whole on every device), else
    none; sequences whole. Rows that do not divide are padded (`row_multiple`)."""
    if mesh is None or mesh.empty or mesh.size == 1:
        return SplashLayout(None)
    from jax.sharding import PartitionSpec as P

    batch = tuple(a for a in sharding.BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
    row_multiple = math.prod(mesh.shape[a] for a in batch)
    heads = sharding.TENSOR_AXIS if sharding.TENSOR_AXIS in mesh.axis_names else None
    ways = mesh.shape[heads] if heads else 1
    on_kv = heads if ways > 1 and kv_heads % ways == 0 else None
    on_group = heads if ways > 1 and on_kv is None and group % ways == 0 else None
    b = batch or None
    specs = (P(b, on_kv, on_group, None, None), P(b, on_kv, None, None), P(b, None))
    return SplashLayout(mesh, specs, row_multiple)
