"""The C++ decode attention (mmr_jax/kernels) against the pure-JAX `_attend_shared_prompt`.

The reference reads every slot and masks; the kernel reads only each prompt's unmasked span and
the first own_len own slots. Shapes cover the kernel's code paths: query groups of 1..9 (blocks
of up to 8), head dims and slot counts that are not multiples of its 16-float vectors, fully
masked prompts (1-token prompts) and masks with holes inside the span.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmr_jax.kernels import decode_attention
from mmr_jax.models import attention

TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def kernel():
    # g++ is on every machine this project runs its tests on (CI included): a failed build is a
    # failure here, not a silent fallback.
    assert decode_attention.available()


def _inputs(seed, b, n, kh, g, d, p, s, lengths, holes=()):
    rng = np.random.default_rng(seed)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    q, pk, pv = f(b * n, 1, kh * g, d), f(b, kh, d, p), f(b, kh, p, d)
    k, v = f(b * n, kh, d, s), f(b * n, kh, s, d)
    slots = np.arange(p)
    # Left padding, slot P - 1 excluded (as the sampler lays prompts out), plus any holes.
    pmask = (slots[None, :] >= p - np.asarray(lengths)[:, None]) & (slots[None, :] < p - 1)
    for bi, slot in holes:
        pmask[bi, slot] = False
    return q, pk, pv, k, v, pmask


def _reference(q, pk, pv, k, v, pmask, own_len):
    own_mask = np.arange(k.shape[-1]) < own_len
    return attention.attend_shared_prompt(q, pk, pv, k, v, pmask, own_mask)


def _stack(a, layer, num_layers):
    """`a` as layer `layer` of a stack whose other layers are NaN: reading one shows."""
    out = np.full((num_layers, *a.shape), np.nan, np.float32)
    out[layer] = a
    return out


def _kernel(q, pk, pv, k, v, pmask, own_len, *, layer=1, num_layers=3):
    # The kernel reads one layer of the stacked caches (the decoder's scan carry) in place.
    caches = [_stack(a, layer, num_layers) for a in (pk, pv, k, v)]
    fn = jax.jit(decode_attention.attend_shared_prompt)
    return fn(q, *caches, pmask, own_len, layer)


CASES = {
    # name: (b, n, kv heads, group, head dim, prompt slots, own slots, prompt lengths)
    "smollm2_like": (2, 4, 3, 3, 64, 48, 32, (20, 48)),
    "mha_group1": (3, 2, 4, 1, 16, 24, 16, (1, 7, 24)),
    "group7_dim20": (1, 3, 2, 7, 20, 19, 21, (12,)),
    "group9_two_blocks": (2, 1, 1, 9, 32, 33, 17, (33, 2)),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("own_len", ["one", "half", "all"])
def test_kernel_equals_reference(case, own_len):
    b, n, kh, g, d, p, s, lengths = CASES[case]
    length = {"one": 1, "half": s // 2, "all": s}[own_len]
    args = _inputs(0, b, n, kh, g, d, p, s, lengths, holes=[(b - 1, p - 3)])
    want = np.asarray(_reference(*args, length))
    got = np.asarray(_kernel(*args, length))
    assert got.shape == want.shape == (b * n, 1, kh * g * d)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)


def test_kernel_reads_only_unmasked_span_and_written_slots():
    # NaN in every slot the kernel should not read: prompt slots before a prompt's first unmasked
    # one and after its last, own slots from own_len on. The reference (which reads them all)
    # gets zeros there; a kernel that touched one would return NaN.
    b, n, kh, g, d, p, s, lengths = CASES["smollm2_like"]
    q, pk, pv, k, v, pmask = _inputs(1, b, n, kh, g, d, p, s, lengths)
    own_len = 9
    want = np.asarray(_reference(q, pk, pv, k, v, pmask, own_len))
    outside = np.ones((b, p), bool)
    for bi in range(b):
        idx = np.flatnonzero(pmask[bi])
        outside[bi, idx.min() : idx.max() + 1] = False
    pk_nan = np.where(outside[:, None, None, :], np.nan, pk).astype(np.float32)
    pv_nan = np.where(outside[:, None, :, None], np.nan, pv).astype(np.float32)
    k_nan, v_nan = k.copy(), v.copy()
    k_nan[..., own_len:] = np.nan
    v_nan[:, :, own_len:] = np.nan
    got = np.asarray(_kernel(q, pk_nan, pv_nan, k_nan, v_nan, pmask, own_len))
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)


def test_kernel_rejects_own_len_outside_cache():
    args = _inputs(2, *CASES["mha_group1"])
    with pytest.raises(Exception, match="own_len"):
        np.asarray(_kernel(*args, CASES["mha_group1"][6] + 1))


@pytest.mark.parametrize("layer", [0, 2])
def test_kernel_reads_the_given_layer_of_the_stack(layer):
    # First and last layer of 3: the offsets into the stacked buffers (other layers are NaN).
    args = _inputs(4, *CASES["group7_dim20"][:7], CASES["group7_dim20"][7])
    want = np.asarray(_reference(*args, 5))
    got = np.asarray(_kernel(*args, 5, layer=layer))
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)


def test_kernel_rejects_a_layer_outside_the_stack():
    args = _inputs(2, *CASES["mha_group1"])
    caches = [_stack(a, 0, 2) for a in args[1:5]]
    fn = jax.jit(decode_attention.attend_shared_prompt)
    with pytest.raises(Exception, match="layer outside"):
        np.asarray(fn(args[0], *caches, args[5], 1, 2))


def test_decoder_lowers_to_the_kernel_on_cpu_only_for_fp32():
    # The decode step's attention is the custom call on CPU in fp32; bf16 caches keep pure JAX.
    b, n, kh, g, d, p, s, lengths = CASES["smollm2_like"]
    q, *caches, pmask = _inputs(3, b, n, kh, g, d, p, s, lengths)
    args = [q, *(c[None] for c in caches), pmask]  # caches stacked over 1 layer

    def step(q, pk, pv, k, v, pmask):
        return attention.attend_shared_prompt_decode(
            q, pk, pv, k, v, pmask, jnp.int32(4), jnp.int32(0)
        )

    hlo = jax.jit(step).lower(*args).as_text()
    assert decode_attention.TARGET in hlo
    as_bf16 = [jnp.asarray(a, jnp.bfloat16) for a in args[:5]]
    hlo_bf16 = jax.jit(step).lower(*as_bf16, args[5]).as_text()
    assert decode_attention.TARGET not in hlo_bf16


def test_not_built_or_used_off_the_cpu(monkeypatch):
    # On a GPU or TPU host the kernel is neither built (no g++ run) nor used.
    def build_attempt():
        raise AssertionError("the CPU kernel was built on a non-CPU host")

    monkeypatch.setattr(decode_attention, "available", build_attempt)
    monkeypatch.setattr(decode_attention.jax, "default_backend", lambda: "gpu")
    assert decode_attention.usable() is False
    b, n, kh, g, d, p, s, lengths = CASES["smollm2_like"]
    q, *caches, pmask = _inputs(5, b, n, kh, g, d, p, s, lengths)
    args = [q, *(c[None] for c in caches), pmask]
    out = attention.attend_shared_prompt_decode(*args, jnp.int32(3), jnp.int32(0))
    want = _reference(q, *caches, pmask, 4)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=TOL, rtol=TOL)
