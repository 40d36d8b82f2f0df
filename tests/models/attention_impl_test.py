"""`attention_impl.dot_product` (jax.nn.dot_product_attention, fused backends) against the unfused
attention it replaces: `attention.attend` (full rows, the prompts) and
`shared_prompt.attend_completions` (completions over their shared prompt), values and gradients,
fp32 and bf16, ragged lengths, padding, GQA; the whole model against the unfused path; the
train step's layout traffic; splash (Pallas, interpret mode) and cuDNN against XLA.

Tolerances: fp32 paths compute the same sums in another order (errors ~1e-6 of the values).
In bf16 both paths take fp32 scores and softmax, round the probabilities to bf16 and run the
PV product with bf16 inputs: they may differ by a rounding of the output (2^-8 relative, bf16
has 8 significant bits) on either side, so 2 * 2^-8 of the output's magnitude; gradients go
through two more bf16 products (dP = dO V^T, dQ = dS K), so 4 * 2^-8 of theirs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl.testing import parameterized
from flax import nnx

from mmr_jax.models import attention, attention_impl, decoder, logprobs, shared_prompt
from mmr_jax.models import config as config_lib
from mmr_jax.models import lora as lora_lib
from mmr_jax.step import train_step

from support import testing

jax.config.update("jax_numpy_rank_promotion", "raise")

BF16_EPS = 2.0**-8


def _tol(dtype, ref, ulps):
    """Absolute tolerance: `ulps` bf16 roundings of max |ref|, or 1e-5 of it in fp32."""
    scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32)))) or 1.0
    return (ulps * BF16_EPS if dtype == jnp.bfloat16 else 1e-5) * scale


def _close(got, ref, dtype, ulps):
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=_tol(dtype, ref, ulps)
    )


def _qkv(key, b, t, s, n, k, d, dtype):
    kq, kk, kv = jax.random.split(key, 3)
    return (
        jax.random.normal(kq, (b, t, n, d)).astype(dtype),
        jax.random.normal(kk, (b, s, k, d)).astype(dtype),
        jax.random.normal(kv, (b, s, k, d)).astype(dtype),
    )


def _value_and_grads(fn, args, weight):
    """fn(*args) and the gradient of sum(fn * weight) with respect to every argument."""

    def loss(*a):
        return jnp.sum(fn(*a).astype(jnp.float32) * weight)

    return fn(*args), jax.grad(loss, argnums=tuple(range(len(args))))(*args)


class DotProductTest(parameterized.TestCase):
    @parameterized.product(
        dtype=(jnp.float32, jnp.bfloat16), heads=((4, 2), (4, 4), (6, 1)), left_pad=(0, 3)
    )
    def test_full_rows_equal_attend(self, dtype, heads, left_pad):
        """Causal rows with left padding (row 1 shorter, row 0 `left_pad` pads) against
        `attention.attend` on the same dense mask: values and gradients."""
        n, k = heads
        b, t, d = 2, 9, 8
        q, kk, v = _qkv(jax.random.key(0), b, t, t, n, k, d, dtype)
        valid = jnp.asarray(np.arange(t)[None] >= np.array([left_pad, 5])[:, None])
        mask = attention_impl.causal(valid)
        weight = jax.random.normal(jax.random.key(1), (b, t, n * d)) * valid[..., None]

        def new(q, kk, v):
            return attention_impl.dot_product(q, kk, v, mask, implementation="xla")

        def old(q, kk, v):
            return attention.attend(q, kk, v, mask.dense())

        out, grads = _value_and_grads(new, (q, kk, v), weight)
        ref, ref_grads = _value_and_grads(old, (q, kk, v), weight)
        assert out.shape == (b, t, n * d) and out.dtype == dtype
        # padded queries see no key: outputs of both are defined (uniform softmax), compare all
        _close(out, ref, dtype, 2)
        for g, rg in zip(grads, ref_grads, strict=True):
            _close(g, rg, dtype, 4)

    def test_mask_matters(self):
        """Independent check: a query that may see only key 0 returns v[0] exactly (fp32)."""
        q, kk, v = _qkv(jax.random.key(2), 1, 3, 3, 2, 1, 4, jnp.float32)
        mask = attention_impl.causal(jnp.asarray([[True, False, False]]))
        out = attention_impl.dot_product(q, kk, v, mask, implementation="xla").reshape(1, 3, 2, 4)
        np.testing.assert_allclose(out[0, 2, 0], v[0, 0, 0], rtol=1e-6)
        np.testing.assert_allclose(out[0, 2, 1], v[0, 0, 0], rtol=1e-6)

    def test_unknown_implementation_is_named(self):
        q, kk, v = _qkv(jax.random.key(2), 1, 2, 2, 2, 1, 4, jnp.float32)
        mask = attention_impl.causal(jnp.ones((1, 2), bool))
        with self.assertRaisesRegex(ValueError, "unknown attention implementation 'flash'"):
            attention_impl.dot_product(q, kk, v, mask, implementation="flash")
        with self.assertRaisesRegex(ValueError, "attention_impl"):
            config_lib.ModelConfig(1, 1, 1, 1, 1, 1, 1, attention_impl="flash")

    @parameterized.parameters((7, 12), (8, 13), (7, 7))
    def test_even_lengths_padding_changes_nothing(self, t, s):
        """cuDNN's masked training kernels need even T and S: the padded problem (a query, a
        key nobody sees) gives the same outputs on the original queries."""
        q, kk, v = _qkv(jax.random.key(8), 2, t, s, 4, 2, 8, jnp.float32)
        dense = jax.random.bernoulli(jax.random.key(9), 0.6, (2, t, s)).at[:, :, 0].set(True)
        q2, k2, v2, d2 = attention_impl._even_lengths(q, kk, v, dense)
        self.assertEqual((q2.shape[1] % 2, k2.shape[1] % 2), (0, 0))
        ref = jax.nn.dot_product_attention(q, kk, v, mask=dense[:, None])
        out = jax.nn.dot_product_attention(q2, k2, v2, mask=d2[:, None])[:, :t]
        np.testing.assert_allclose(out, ref, atol=1e-6)

    def test_auto_is_unfused_off_gpu_and_in_fp32(self):
        self.assertEqual(attention_impl.resolve("auto", jnp.float32, 64), "unfused")
        if jax.default_backend() != "gpu":
            self.assertEqual(attention_impl.resolve("auto", jnp.bfloat16, 64), "unfused")


class CompletionsTest(parameterized.TestCase):
    """Completions over [prompt keys ; own keys] in one fused call (prompt K/V repeated per row)
    against the unfused `shared_prompt.attend_completions` (scores concatenated)."""

    @parameterized.product(dtype=(jnp.float32, jnp.bfloat16), packed=(False, True))
    def test_equal_attend_completions(self, dtype, packed):
        b, rows_per, p, t, n, k, d = 2, 3, 5, 7, 4, 2, 8
        r = b * rows_per
        key = jax.random.key(3)
        q, kc, vc = _qkv(key, r, t, t, n, k, d, dtype)
        _, pk, pv = _qkv(jax.random.fold_in(key, 1), b, p, p, n, k, d, dtype)
        pvalid = jnp.asarray(np.arange(p)[None] >= np.array([2, 0])[:, None])  # left-padded
        lengths = np.array([7, 3, 1, 5, 6, 2])
        valid = jnp.asarray(np.arange(t)[None] < lengths[:, None])  # right-padded, ragged
        causal = np.tril(np.ones((t, t), bool))[None]
        if packed:  # two segments a row: tokens 0..2 and 3..6 (padding is invalid)
            seg = jnp.asarray(np.where(np.arange(t) < 3, 0, 1)[None].repeat(r, 0))
            same = seg[:, :, None] == seg[:, None, :]
            own = jnp.asarray(causal) & same & valid[:, None, :]
        else:
            same = None
            own = jnp.asarray(causal) & valid[:, None, :]
        mask = attention_impl.prompt_then_causal(jnp.repeat(pvalid, rows_per, 0), valid, same)
        weight = jax.random.normal(jax.random.key(4), (r, t, n * d)) * valid[..., None]

        def new(q, pk, pv, kc, vc):
            keys = shared_prompt.completion_keys(pk, kc)
            values = shared_prompt.completion_keys(pv, vc)
            return attention_impl.dot_product(q, keys, values, mask, implementation="xla")

        def old(q, pk, pv, kc, vc):
            return shared_prompt.attend_completions(q, pk, pv, kc, vc, pvalid, own)

        args = (q, pk, pv, kc, vc)
        out, grads = _value_and_grads(new, args, weight)
        ref, ref_grads = _value_and_grads(old, args, weight)
        _close(out, ref, dtype, 2)
        for g, rg in zip(grads, ref_grads, strict=True):  # prompt grads: the group's sum
            _close(g, rg, dtype, 4)
        self.assertGreater(float(jnp.abs(grads[1].astype(jnp.float32)).max()), 0.0)


def _tiny_model(impl="xla", **kw):
    cfg = config_lib.ModelConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        attention_impl=impl,
        **kw,
    )
    return decoder.Decoder(cfg, rngs=nnx.Rngs(0))


def _unfused(monkeypatch):
    """Routes every training-forward attention through the unfused einsum forms."""

    def dot_product(q, k, v, mask, *, implementation="xla", dense=None):
        del implementation
        return attention.attend(q, k, v, mask.dense() if dense is None else dense)

    monkeypatch.setattr(attention_impl, "dot_product", dot_product)


class WholeModelTest(parameterized.TestCase):
    def test_unfused_config_equals_xla_config(self):
        """`attention_impl='unfused'` (the CPU default through 'auto') and 'xla': the same
        shared-prompt and packed-free log-probs and their gradients (fp32)."""
        rng = np.random.default_rng(1)
        pt = jnp.asarray(rng.integers(0, 97, (2, 5)))
        pm = jnp.asarray(np.arange(5)[None] >= np.array([2, 0])[:, None])
        ct = jnp.asarray(rng.integers(0, 97, (6, 7)))
        cm = jnp.asarray(np.arange(7)[None] < np.array([7, 3, 1, 5, 6, 2])[:, None])

        def grads(impl):
            def loss(m):
                lp = logprobs.shared_prompt_logprobs(m, pt, pm, ct, cm)
                return lp.sum(), lp

            return nnx.grad(loss, has_aux=True)(_tiny_model(impl))

        (g_xla, lp_xla), (g_un, lp_un) = grads("xla"), grads("unfused")
        np.testing.assert_allclose(lp_un, lp_xla, atol=2e-5)
        for a, b in zip(jax.tree.leaves(g_xla), jax.tree.leaves(g_un), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)

    @pytest.fixture(autouse=True)
    def _mp(self, monkeypatch):
        self.monkeypatch = monkeypatch

    def test_logits_and_shared_prompt_logprobs_equal_unfused(self):
        model = _tiny_model()
        rng = np.random.default_rng(0)
        b, rows_per, p, t = 2, 3, 5, 7
        tokens = jnp.asarray(rng.integers(0, 97, (2, 9)))
        amask = jnp.asarray(np.arange(9)[None] >= np.array([0, 4])[:, None])
        pt = jnp.asarray(rng.integers(0, 97, (b, p)))
        pm = jnp.asarray(np.arange(p)[None] >= np.array([2, 0])[:, None])
        ct = jnp.asarray(rng.integers(0, 97, (b * rows_per, t)))
        cm = jnp.asarray(np.arange(t)[None] < np.array([7, 3, 1, 5, 6, 2])[:, None])

        def run():
            logits = model(tokens, attention_mask_NxT=amask)
            lp = logprobs.shared_prompt_logprobs(model, pt, pm, ct, cm)
            return logits, lp

        logits, lp = run()
        _unfused(self.monkeypatch)
        ref_logits, ref_lp = run()
        valid = np.asarray(amask)[..., None]
        np.testing.assert_allclose(
            np.where(valid, logits, 0), np.where(valid, ref_logits, 0), atol=2e-5
        )
        np.testing.assert_allclose(lp, ref_lp, atol=2e-5)


def _layout_bytes(text: str) -> dict:
    """{op: [count, total bytes, largest bytes]} of the transposes, concatenations and pads a
    lowered (StableHLO) program asks for: the layout work around the matmuls, before XLA
    fuses anything."""
    import re

    sizes = {"f32": 4, "bf16": 2, "i32": 4, "i1": 1, "ui32": 4}
    out = {op: [0, 0, 0] for op in ("transpose", "concatenate", "pad")}
    pattern = r"stablehlo\.(transpose|concatenate|pad)\b.*->\s*tensor<((?:\d+x)*)(\w+)>"
    for line in text.splitlines():
        m = re.search(pattern, line)
        if m:
            dims = [int(x) for x in m.group(2).split("x") if x]
            nbytes = sizes.get(m.group(3), 4) * int(np.prod(dims))
            c = out[m.group(1)]
            c[0], c[1], c[2] = c[0] + 1, c[1] + nbytes, max(c[2], nbytes)
    return out


def _train_step_text(model_kw=None, chunk=0):
    """StableHLO of the shared-prompt train step (tiny model, bf16, remat full)."""
    cfg = config_lib.ModelConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        remat="full",
        **(model_kw or {}),
    )
    policy = lora_lib.split_policy(decoder.Decoder(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    b, rows_per, p, t = 2, 3, 16, 24
    rng = np.random.default_rng(0)
    cm = jnp.asarray(np.arange(t)[None] < rng.integers(5, t + 1, b * rows_per)[:, None])
    batch = train_step.Batch(
        tokens=jnp.asarray(rng.integers(4, 500, (b * rows_per, t)), jnp.int32),
        attention_mask=cm,
        completion_mask=cm,
        advantages=jnp.asarray(rng.normal(size=b * rows_per), jnp.float32),
        prompt_tokens=jnp.asarray(rng.integers(4, 500, (b, p)), jnp.int32),
        prompt_mask=jnp.asarray(np.arange(p)[None] >= np.array([3, 0])[:, None]),
    )
    scfg = testing.step_config(
        minibatches=1,
        iterations=1,
        temperature=1.0,
        eps_low=0.2,
        eps_high=0.2,
        aggregation="token_mean",
        beta=0.0,
        kl_estimator="k3",
        max_completion_len=t,
        logprob_chunk=chunk,
    )
    opt = optax.sgd(1e-3)
    step = train_step.jit_train_step(
        graphdef=policy.graphdef, optimizer=opt, schedule=lambda _: 1e-3, cfg=scfg
    )
    state = train_step.TrainState(
        step=jnp.zeros([], jnp.int32),
        params=policy.params,
        opt_state=opt.init(policy.params),
        rng=jax.random.key_data(jax.random.key(0)),
    )
    return step.lower(state, batch, policy.frozen, policy.rest).as_text()


class LayoutTrafficTest(parameterized.TestCase):
    def test_no_score_sized_concat_or_pad_in_the_train_step(self):
        """The unfused form concatenated the completions' fp32 scores [N, K, R, T, P+T] and its
        backward padded them: at this shape 14 concatenations (315 KB, the largest 86 KB = one
        score tensor, 6*4*23*39*4 bytes) and 11 pads (221 KB). Now only each row's keys and
        values [N, P+T, K, D] and [N, T] vectors are concatenated, and the rotary embedding's
        halves no longer are (nor padded in its backward)."""
        counts = _layout_bytes(_train_step_text())
        score_bytes = 6 * 4 * 23 * 39 * 4
        kv_bytes = 6 * 39 * 2 * 16 * 4  # a row's keys [N, P+T, K, D] (fp32 in the backward)
        self.assertLessEqual(counts["concatenate"][2], kv_bytes, counts)
        self.assertLess(counts["concatenate"][1], 315_000 // 4, counts)
        self.assertLess(counts["pad"][1], score_bytes // 16, counts)


class MaskInProgramTest(parameterized.TestCase):
    @parameterized.parameters((16, 15), (0, 15), (0, 1))
    def test_offset_causal_mask_is_computed_not_a_constant(self, p, t):
        """The (prompt-then-)causal pattern is built from iotas in the program, with the values
        of the host pattern; no [T, P + T] constant is baked in (a 16 MB one at the 1.5B's
        shapes). A pattern that is not offset-causal still is a constant, so the test sees one."""
        valid = np.random.default_rng(0).random((2, p + t)) < 0.8
        make = attention_impl.causal if p == 0 else attention_impl.prompt_then_causal
        split = (lambda v: (v,)) if p == 0 else (lambda v: (v[:, :p], v[:, p:]))

        def dense(v):
            return make(*split(v)).dense()

        got = np.asarray(jax.jit(dense)(valid))
        want = np.concatenate([np.ones((t, p), bool), np.tril(np.ones((t, t), bool))], 1)
        np.testing.assert_array_equal(got, want[None] & valid[:, None, :])
        text = jax.jit(dense).lower(valid).as_text()
        constants = [x for x in text.splitlines() if "stablehlo.constant dense<" in x]
        self.assertFalse([x for x in constants if f"tensor<{t}x{p + t}xi1>" in x], constants)

        other = attention_impl.Mask(~want, jnp.asarray(valid))  # not offset-causal
        text = jax.jit(lambda: other.dense()).lower().as_text()
        self.assertTrue(any(f"tensor<{t}x{p + t}xi1>" in x for x in text.splitlines()))


class OtherBackendsTest(parameterized.TestCase):
    """Splash (Pallas TPU kernel; Pallas' interpret mode off TPU) and cuDNN against XLA."""

    def _cases(self, dtype, t=128, p=128):
        """(plain causal rows with left padding, completions over a shared prompt), by default
        at lengths the kernels' blocks take (multiples of 128, head dim 128); `t` and `p` other
        lengths (the train step's completions are a bucket less one: odd)."""
        b, n, k, d = 2, 4, 2, 128
        q, kk, v = _qkv(jax.random.key(5), b, t, t, n, k, d, dtype)
        left_padded = jnp.asarray(np.arange(t)[None] >= 5 * np.arange(b)[:, None])
        plain = (q, kk, v, attention_impl.causal(left_padded))
        _, pk, pv = _qkv(jax.random.key(6), 1, p, p, n, k, d, dtype)
        pvalid = jnp.asarray(np.arange(p)[None] >= p // 3)  # one left-padded prompt, two rows
        valid = jnp.asarray(np.arange(t)[None] < np.array([t, t // 4])[:, None])
        mask = attention_impl.prompt_then_causal(jnp.repeat(pvalid, b, 0), valid)
        keys, values = (shared_prompt.completion_keys(x, y) for x, y in ((pk, kk), (pv, v)))
        return {"plain": plain, "completions": (q, keys, values, mask)}

    @staticmethod
    def _weight(q, mask):
        """Loss weights on the queries that see a key (fully masked ones are padding, whose
        outputs the backends define differently and nothing uses)."""
        seen = jnp.any(mask.dense(), axis=-1)[..., None]
        return jax.random.normal(jax.random.key(7), q.shape[:2] + (q.shape[2] * q.shape[3],)) * seen

    @parameterized.product(case=("plain", "completions"), lengths=((128, 128), (45, 37), (133, 61)))
    def test_splash_interpret_equals_xla(self, case, lengths):
        """At the blocks' lengths, and at odd ones (T = 45 or 133 queries, keys T or P + T),
        which splash takes only padded to its block (128; 133 leaves a last block of 5 real
        queries): the padding changes no value. Compared on the queries that see a key."""
        q, k, v, mask = self._cases(jnp.float32, *lengths)[case]
        weight = self._weight(q, mask)
        seen = weight != 0

        def run(impl):
            return _value_and_grads(
                lambda q, k, v: attention_impl.dot_product(q, k, v, mask, implementation=impl),
                (q, k, v),
                weight,
            )

        (out, grads), (ref, ref_grads) = run("pallas_tpu"), run("xla")
        _close(jnp.where(seen, out, 0), jnp.where(seen, ref, 0), jnp.float32, 1)
        for g, rg in zip(grads, ref_grads, strict=True):
            np.testing.assert_allclose(g, rg, atol=1e-4 * float(jnp.abs(rg).max()))

    def test_splash_rejects_packed_segments(self):
        q, k, v, mask = self._cases(jnp.float32)["completions"]
        packed = mask._replace(extra_NxTxS=mask.dense())
        with self.assertRaisesRegex(NotImplementedError, "packed-completion"):
            attention_impl.dot_product(q, k, v, packed, implementation="pallas_tpu")


@pytest.mark.gpu  # on the class: absl's parameterized tests then carry the marker (issue 45)
class CudnnAtOurShapesTest(parameterized.TestCase):
    """cuDNN's two forms against XLA at the 1.5B's attention (12 heads, 2 kv heads, head dim
    128, bf16) and the train step's real structure (`attention_probe.probe_cases`): prompts of
    511 tokens, left-padded, causal; completions of T = 1023 (a bucket of 1024 less one: odd),
    right-padded, over [prompt ; own] keys, with and without packed segments. Values within 2
    bf16 roundings of the output's magnitude, gradients within 4 (module docstring). The mask-free
    form cannot express packed segments: that case checks it says so. GPU only: skipped
    elsewhere (conftest), run by scripts/gpu_check.sh's run A."""

    @parameterized.named_parameters(
        (f"{impl}_{case}", impl, case)
        for impl in ("cudnn", "cudnn_maskfree")
        for case in ("prompts", "completions", "packed")
    )
    def test_equals_xla(self, impl, case):
        if jax.default_backend() != "gpu":
            self.skipTest("needs JAX on a GPU")
        from mmr_jax.models import attention_probe

        prompts, completions = attention_probe.probe_cases(
            jnp.bfloat16, 12, 2, 128, packed=case == "packed", p=511, t=1023
        )
        q, k, v, mask = prompts if case == "prompts" else completions
        if impl == "cudnn_maskfree" and case == "packed":
            with self.assertRaisesRegex(NotImplementedError, "packed segments"):
                attention_impl.dot_product(q, k, v, mask, implementation=impl)
            return
        weight = attention_probe._query_weight(q, mask)
        (out, *grads) = attention_probe._value_and_grads(
            attention_impl.dot_product, impl, q, k, v, mask, weight
        )
        ref, *ref_grads = attention_probe._value_and_grads(
            attention_impl.dot_product, "xla", q, k, v, mask, weight
        )
        seen = np.asarray(weight != 0)
        _close(
            np.asarray(out, np.float32) * seen, np.asarray(ref, np.float32) * seen, jnp.bfloat16, 2
        )
        for g, rg in zip(grads, ref_grads, strict=True):
            _close(g, rg, jnp.bfloat16, 4)


_SPLASH_ON_A_MESH = """
import jax
jax.config.update("jax_num_cpu_devices", 4)
import jax.numpy as jnp, numpy as np
from mmr_jax.models import attention_impl, sharding

def case(b, n, k, t, p):  # completions over [prompt ; own], odd lengths, padding on both sides
    ks = jax.random.split(jax.random.key(b * n + k), 4)
    q = jax.random.normal(ks[0], (b, t, n, 128))
    kv = [jax.random.normal(x, (b, p + t, k, 128)) for x in ks[1:3]]
    pvalid = jnp.asarray(np.arange(p)[None] >= 3 * np.arange(b)[:, None])
    valid = jnp.asarray(np.arange(t)[None] < t - 7 * np.arange(b)[:, None])
    mask = attention_impl.prompt_then_causal(pvalid, valid)
    w = jax.random.normal(ks[3], (b, t, n * 128)) * jnp.any(mask.dense(), -1)[..., None]
    return (q, *kv), mask, w

def run(impl, args, mask, w, mesh=None):
    def loss(q, k, v):
        o = attention_impl.dot_product(q, k, v, mask, implementation=impl)
        return jnp.sum(o * w), jnp.where(w != 0, o, 0)
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    with jax.set_mesh(mesh) if mesh is not None else jax.set_mesh(None):
        text = fn.lower(*args).as_text()
        (_, out), grads = fn(*args)
    return out, grads, text.count("manual_computation")

# rows 3 (padded to the mesh's 2 or 4 rows) and 2; kv heads 2 (split over tensor) and 1 (the
# group's query heads split instead)
for b, n, k in ((3, 4, 2), (2, 4, 1)):
    args, mask, w = case(b, n, k, t=45, p=19)
    ref, ref_grads, _ = run("xla", args, mask, w)
    one, one_grads, calls = run("pallas_tpu", args, mask, w)
    assert calls == 0, calls
    for shape in ((1, 4, 1), (2, 1, 2), (1, 1, 4)):
        out, grads, calls = run("pallas_tpu", args, mask, w, sharding.make_mesh(*shape))
        assert calls >= 2, (shape, calls)  # the forward's and the backward's shard_map
        for got, single, xla in zip((out, *grads), (one, *one_grads), (ref, *ref_grads)):
            scale = float(jnp.abs(xla).max())
            to_one = float(jnp.abs(got - single).max()) / scale
            to_xla = float(jnp.abs(got - xla).max()) / scale
            assert scale > 1e-3 and to_one < 1e-6 and to_xla < 1e-5, (shape, to_one, to_xla)
        print("MESH", b, n, k, shape, "ok")
"""


@pytest.mark.slow
def test_splash_on_a_mesh_equals_one_device_and_xla():
    """Splash under `shard_map` on 4 (fake CPU) devices, rows over data/fsdp (3 rows: padded to
    the split), heads over tensor (kv heads, or a group's query heads when the kv heads do not
    divide), in Pallas' interpret mode: outputs and gradients equal to the one-device call's
    (within 1e-6 of their magnitude: only the kv-head gradients' sums over the split group's
    devices reorder) and to XLA's (1e-5, as the fp32 tests above)."""
    proc = testing.run_in_fresh_jax(_SPLASH_ON_A_MESH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("MESH") == 6, proc.stdout


def test_splash_layout_splits_rows_and_heads():
    """Hand-worked layouts: rows over the batch axes of size > 1 (padded to their product),
    heads over tensor (kv heads when they divide, else a group's query heads, else none)."""
    from jax.sharding import AbstractMesh
    from jax.sharding import PartitionSpec as P

    def layout(shape, kv_heads, group, rows=6):
        mesh = AbstractMesh(shape, ("data", "fsdp", "tensor"))
        return attention_impl.splash_layout(mesh, rows, kv_heads, group)

    got = layout((2, 2, 2), kv_heads=2, group=6)
    assert got.row_multiple == 4
    assert got.specs == (
        P(("data", "fsdp"), "tensor", None, None, None),
        P(("data", "fsdp"), "tensor", None, None),
        P(("data", "fsdp"), None),
    )
    got = layout((1, 4, 2), kv_heads=1, group=6)  # one kv head: the group's 6 query heads split
    assert got.row_multiple == 4
    assert got.specs[:2] == (
        P(("fsdp",), None, "tensor", None, None),
        P(("fsdp",), None, None, None),
    )
    got = layout((1, 1, 4), kv_heads=2, group=3)  # neither divides 4: heads whole, rows whole
    assert got.row_multiple == 1 and got.specs[0] == P(None, None, None, None, None)
    assert layout((1, 1, 1), kv_heads=2, group=6).mesh is None  # one device: the plain call
    assert attention_impl.splash_layout(None, 6, 2, 6).mesh is None
