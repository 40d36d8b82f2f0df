"""`attention_probe.choose` (issue 45: 'auto' never breaks a run) and the mask-free cuDNN form.

The probe is run on CPU with `platform='gpu'`, so it takes the GPU's path: the real cuDNN
candidates fail here (no cuDNN), and injected `attend` functions stand for a backend that
fails, one that computes a wrong answer and one that works. The mask-free form's arithmetic
(compacted keys, `is_causal` plus lengths) runs through XLA here against the dense mask.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest, parameterized

from mmr_jax.models import attention_impl, attention_probe

jax.config.update("jax_numpy_rank_promotion", "raise")

SHAPE = dict(num_heads=4, num_kv_heads=2, head_dim=16)  # GQA, a cuDNN-eligible head dim


def _xla_as(name_ok):
    """An `attend` whose backend `name_ok` is XLA's and whose other names fail at trace."""

    def attend(q, k, v, mask, *, implementation):
        if implementation in ("xla", name_ok):
            return attention_impl.dot_product(q, k, v, mask, implementation="xla")
        raise RuntimeError(f"{implementation} refused the bias")

    return attend


def _maskfree_as_xla(q, k, v, mask, *, implementation):
    """'cudnn_maskfree' as the same mask-free form through XLA; 'cudnn' refuses the bias."""
    if implementation == "cudnn":
        raise NotImplementedError("cuDNN refuses the bias")
    if implementation == "cudnn_maskfree":
        b, t = q.shape[:2]
        return attention_impl._maskfree(q, k, v, mask, "xla").reshape(b, t, -1)
    return attention_impl.dot_product(q, k, v, mask, implementation=implementation)


class ChooseTest(parameterized.TestCase):
    def test_no_cudnn_falls_back_to_xla_with_one_warning(self):
        """The real candidates on CPU: each fails (no cuDNN); 'xla', one warning naming both."""
        with self.assertLogs(level="WARNING") as logs:
            choice = attention_probe.choose("auto", jnp.bfloat16, **SHAPE, platform="gpu")
        self.assertEqual(choice.implementation, "xla")
        warnings = [r for r in logs.records if r.levelname == "WARNING"]
        self.assertLen(warnings, 1)
        self.assertIn("cudnn:", warnings[0].getMessage())
        self.assertIn("cudnn_maskfree:", warnings[0].getMessage())
        self.assertIn("fallback", choice.reason)

    def test_a_working_backend_is_chosen(self):
        choice = attention_probe.choose(
            "auto", jnp.bfloat16, **SHAPE, platform="gpu", attend=_xla_as("cudnn")
        )
        self.assertEqual(choice, attention_probe.Choice("cudnn", "auto: probe passed"))

    def test_a_wrong_answer_is_a_failure(self):
        """A backend that runs but is off by 5% is rejected (a numerical mismatch)."""

        def wrong(q, k, v, mask, *, implementation):
            o = attention_impl.dot_product(q, k, v, mask, implementation="xla")
            return o * 1.05 if implementation != "xla" else o

        with self.assertLogs(level="WARNING"):
            choice = attention_probe.choose(
                "auto", jnp.bfloat16, **SHAPE, platform="gpu", attend=wrong
            )
        self.assertEqual(choice.implementation, "xla")
        self.assertIn("output differs from xla", choice.reason)

    @parameterized.parameters((False, "cudnn_maskfree"), (True, "xla"))
    def test_mask_free_form_is_tried_when_the_bias_is_refused(self, packed, want):
        """Without segments the mask-free form passes; packed segments it cannot express."""
        choice = attention_probe.choose(
            "auto", jnp.bfloat16, **SHAPE, packed=packed, platform="gpu", attend=_maskfree_as_xla
        )
        self.assertEqual(choice.implementation, want)
        self.assertIn("cuDNN refuses the bias", choice.reason)
        if packed:
            self.assertIn("packed segments", choice.reason)

    def test_explicit_cudnn_fails_loudly(self):
        with self.assertRaisesRegex(RuntimeError, "attention_impl='cudnn' fails.*refused"):
            attention_probe.choose(
                "cudnn", jnp.bfloat16, **SHAPE, platform="gpu", attend=_xla_as("none")
            )

    def test_off_gpu_and_other_names_are_not_probed(self):
        def never(*a, **k):
            raise AssertionError("probed")

        for impl, platform, dtype, want in (
            ("auto", "cpu", jnp.bfloat16, "unfused"),
            ("auto", "gpu", jnp.float32, "unfused"),  # cuDNN takes no fp32
            ("xla", "gpu", jnp.bfloat16, "xla"),
            ("unfused", "gpu", jnp.bfloat16, "unfused"),
        ):
            got = attention_probe.choose(impl, dtype, **SHAPE, platform=platform, attend=never)
            self.assertEqual(got.implementation, want, (impl, platform, dtype))
        with self.assertRaisesRegex(ValueError, "unknown attention implementation"):
            attention_probe.choose("flash", jnp.bfloat16, **SHAPE)

    def test_auto_on_a_tpu_is_splash_unless_packed(self):
        """Start-up ('choose'), traced code ('resolve' while compiling for a TPU) and the dry
        run's plan agree: splash, or 'unfused' where the masks carry packed segments."""
        from mmr_jax.kernels import compile_platform
        from mmr_jax.training import aot_dry_run

        def never(*a, **k):
            raise AssertionError("probed")

        for packed, want in ((False, "pallas_tpu"), (True, "unfused")):
            got = attention_probe.choose(
                "auto", jnp.bfloat16, **SHAPE, packed=packed, platform="tpu", attend=never
            )
            self.assertEqual(got.implementation, want)
            with compile_platform.compiling_for("tpu"):
                self.assertEqual(
                    attention_impl.resolve("auto", jnp.float32, 64, packed=packed), want
                )
            cfg = types.SimpleNamespace(
                model=types.SimpleNamespace(attention_impl="auto", dtype="bfloat16"),
                batch=types.SimpleNamespace(layout="packed" if packed else "shared"),
            )
            mcfg = types.SimpleNamespace(head_dim=128)
            plan = aot_dry_run.attention_plan(cfg, mcfg, types.SimpleNamespace(platform="tpu"))
            self.assertEqual(plan, [(want, got.reason, True)])
        with compile_platform.compiling_for("cpu"):
            self.assertEqual(attention_impl.resolve("auto", jnp.bfloat16, 64), "unfused")

    def test_probe_cases_are_the_runs_structure(self):
        """Odd lengths, padding on both sides, GQA; segments only when packed."""
        plain, completions = attention_probe.probe_cases(jnp.bfloat16, 4, 2, 16, packed=True)
        q, k, _, mask = plain
        self.assertEqual((q.shape[1] % 2, q.dtype, k.shape[2]), (1, jnp.bfloat16, 2))
        self.assertFalse(bool(mask.kv_valid_NxS[1, 0]))  # a left-padded prompt
        q, k, _, mask = completions
        self.assertEqual((q.shape[1] % 2, k.shape[1] % 2), (1, 0))  # T odd, S = P + T even
        self.assertIsNotNone(mask.extra_NxTxS)
        self.assertFalse(bool(mask.kv_valid_NxS[2, -1]))  # a right-padded completion
        _, unpacked = attention_probe.probe_cases(jnp.bfloat16, 4, 2, 16, packed=False)
        self.assertIsNone(unpacked[3].extra_NxTxS)


class MaskFreeTest(parameterized.TestCase):
    """`_maskfree` through XLA against the dense mask: valid queries' outputs and gradients."""

    @parameterized.parameters("causal", "prompt_then_causal")
    def test_equals_dense_mask(self, case):
        b, p, t, n, kh, d = 4, 5, 7, 4, 2, 8
        s = t if case == "causal" else p + t
        keys = jax.random.split(jax.random.key(0), 4)
        q = jax.random.normal(keys[0], (b, t, n, d))
        k, v = (jax.random.normal(x, (b, s, kh, d)) for x in keys[1:3])
        if case == "causal":  # left-padded rows
            mask = attention_impl.causal(
                jnp.asarray(np.arange(t)[None] >= np.array([0, 3, 6, 2])[:, None])
            )
        else:
            pvalid = jnp.asarray(np.arange(p)[None] >= np.array([2, 0, 4, 1])[:, None])
            own = jnp.asarray(np.arange(t)[None] < np.array([7, 3, 1, 5])[:, None])
            mask = attention_impl.prompt_then_causal(pvalid, own)
        weight = jax.random.normal(keys[3], (b, t, n * d)) * mask.kv_valid_NxS[:, -t:, None]

        def dense(q, k, v):
            return attention_impl.dot_product(q, k, v, mask, implementation="xla")

        def free(q, k, v):
            return attention_impl._maskfree(q, k, v, mask, "xla").reshape(b, t, n * d)

        for fn in (dense, free):
            fn.grads = jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a) * weight), (0, 1, 2))(q, k, v)
        np.testing.assert_allclose(
            free(q, k, v) * (weight != 0), dense(q, k, v) * (weight != 0), atol=1e-5
        )
        for g, r in zip(free.grads, dense.grads, strict=True):
            np.testing.assert_allclose(g, r, atol=1e-5)

    def test_rejects_packed_segments_and_other_patterns(self):
        q = jnp.zeros((1, 3, 2, 8))
        k = jnp.zeros((1, 3, 1, 8))
        mask = attention_impl.causal(jnp.ones((1, 3), bool))
        with self.assertRaisesRegex(NotImplementedError, "packed segments"):
            attention_impl._maskfree(q, k, k, mask._replace(extra_NxTxS=mask.dense()), "xla")
        full = mask._replace(static_TxS=np.ones((3, 3), bool))
        with self.assertRaisesRegex(NotImplementedError, "causal pattern"):
            attention_impl._maskfree(q, k, k, full, "xla")


@pytest.mark.gpu
def test_auto_on_this_gpu_passes_its_own_probe():
    """On a GPU: what 'auto' picks for the 1.5B's attention (12 heads, 2 kv heads, head dim 128)
    is a backend whose probe passed; printed for the check's log."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs JAX on a GPU")
    for packed in (False, True):
        choice = attention_probe.choose("auto", jnp.bfloat16, 12, 2, 128, packed=packed)
        print(f"attention auto (packed={packed}): {choice}")
        assert choice.implementation in ("cudnn", "cudnn_maskfree", "xla")


if __name__ == "__main__":
    absltest.main()
