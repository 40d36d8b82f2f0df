"""LoRA adapters and export: zero-B equals base, PEFT adapter parity, save_hf round trip.

Measured (fp32, CPU): PEFT-loaded torch logits vs ours max |diff| ~2e-6; save_hf round trip ~2.2e-6.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mmr_jax import models
from mmr_jax.models import export, layers
from mmr_jax.models import lora as lora_lib

from support import testing

jax.config.update("jax_numpy_rank_promotion", "raise")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

_forward = nnx.jit(
    lambda m, t, disable_lora=False: m(t, disable_lora=disable_lora), static_argnums=2
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return testing.make_tiny_checkpoint(tmp_path_factory.mktemp("lora") / "qwen", family="qwen2")


def _tokens():
    return jnp.asarray(np.random.RandomState(0).randint(0, 300, (2, 24)), jnp.int32)


def _randomise_b(model, scale=0.1):
    for path, module in nnx.iter_graph(model):
        if isinstance(module, layers.Dense) and module.lora_b is not None:
            key = jax.random.key(len(path) * 1000 + sum(map(ord, "".join(map(str, path)))))
            module.lora_b[...] = scale * jax.random.normal(key, module.lora_b.shape)


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


class TestLora:
    def test_config_rejects_unknown_target(self):
        with pytest.raises(ValueError, match="lm_head"):
            lora_lib.LoraConfig(target_modules=("q_proj", "lm_head"))

    def test_zero_b_equals_base_and_only_adapters_train(self, ckpt):
        base = models.from_pretrained(ckpt)
        model = models.from_pretrained(ckpt, lora=lora_lib.LoraConfig(rank=8, alpha=16))
        np.testing.assert_array_equal(_forward(model, _tokens()), _forward(base, _tokens()))
        assert lora_lib.trainable_filter(model) is nnx.LoRAParam
        assert lora_lib.trainable_filter(base) is nnx.Param
        n_lora = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
        # 2 layers x r=8 x (in + out): q 64+64, k 64+32, v 64+32, o 64+64, gate/up/down 64+128
        assert n_lora == 2 * 8 * (128 + 96 + 96 + 128 + 192 * 3)

    def test_disable_lora_gives_base_and_dropout_only_in_train(self, ckpt):
        base = models.from_pretrained(ckpt)
        model = models.from_pretrained(ckpt, lora=lora_lib.LoraConfig(rank=4, alpha=8, dropout=0.5))
        _randomise_b(model)
        tokens = _tokens()
        np.testing.assert_array_equal(_forward(model, tokens, True), _forward(base, tokens))
        eval_out = _forward(model, tokens)
        assert np.abs(eval_out - _forward(base, tokens)).max() > 1e-2
        np.testing.assert_array_equal(eval_out, _forward(model, tokens))  # eval: deterministic
        model.train()
        a, b = _forward(model, tokens), _forward(model, tokens)
        assert np.abs(a - b).max() > 0  # dropout stream advances between calls
        model.eval()


class TestExport:
    def test_peft_adapter_loads_in_peft_with_same_logits(self, ckpt, tmp_path):
        cfg = lora_lib.LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))
        model = models.from_pretrained(ckpt, lora=cfg)
        _randomise_b(model)
        export.save_peft_adapter(model, tmp_path, base_model_name_or_path=str(ckpt))
        adapter_cfg = json.loads((tmp_path / "adapter_config.json").read_text())
        assert (adapter_cfg["r"], adapter_cfg["lora_alpha"]) == (4, 8)
        hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        ref = _torch_logits(peft.PeftModel.from_pretrained(hf, tmp_path).eval(), _tokens())
        diff = np.abs(np.asarray(_forward(model, _tokens())) - ref).max()
        assert diff <= 1e-4, diff  # measured ~2e-6

    @pytest.mark.parametrize("shard_bytes", [5 * 2**30, 60_000])
    def test_save_hf_round_trip_merges_lora(self, ckpt, tmp_path, shard_bytes):
        model = models.from_pretrained(ckpt, lora=lora_lib.LoraConfig(rank=4, alpha=8))
        _randomise_b(model)
        export.save_hf(model, tmp_path, tokenizer_dir=ckpt, max_shard_bytes=shard_bytes)
        assert (tmp_path / "tokenizer.json").exists()
        sharded = (tmp_path / "model.safetensors.index.json").exists()
        assert sharded == (shard_bytes < 2**20)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
        diff = np.abs(np.asarray(_forward(model, _tokens())) - _torch_logits(hf, _tokens())).max()
        assert diff <= 1e-4, diff  # measured ~2.2e-6
        reloaded = models.from_pretrained(tmp_path)  # and our own loader reads it back
        np.testing.assert_allclose(
            _forward(reloaded, _tokens()), _forward(model, _tokens()), atol=1e-4
        )

    def test_save_hf_bf16_loads_in_transformers(self, ckpt, tmp_path):
        model = models.from_pretrained(ckpt)
        export.save_hf(model, tmp_path, dtype=jnp.bfloat16)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
        ref, ours = _torch_logits(hf, _tokens()), np.asarray(_forward(model, _tokens()))
        assert np.abs(ref - ours).max() < 0.05 * np.abs(ours).max()
        bf16 = models.from_pretrained(tmp_path)  # bf16 on disk -> fp32 params
        assert bf16.embed_tokens.embedding[...].dtype == jnp.float32

    @pytest.mark.parametrize("tied", [True, False])
    def test_save_hf_tied_head_writes_the_embedding_as_lm_head(self, tmp_path, tied):
        # For vLLM's in-place reload (rollout.vllm_engine); HF and our loader still read it.
        from safetensors.numpy import load_file

        ckpt = testing.make_tiny_checkpoint(tmp_path / "ckpt", tie_word_embeddings=tied)
        model = models.from_pretrained(ckpt)
        export.save_hf(model, tmp_path / "plain")
        export.save_hf(model, tmp_path / "head", tied_head=True)
        plain, head = (load_file(tmp_path / n / "model.safetensors") for n in ("plain", "head"))
        assert ("lm_head.weight" in plain) == (not tied)
        assert set(head) == set(plain) | {"lm_head.weight"}
        assert np.array_equal(head["lm_head.weight"], head["model.embed_tokens.weight"]) == tied
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "head").eval()
        reloaded = models.from_pretrained(tmp_path / "head")
        np.testing.assert_allclose(
            _forward(reloaded, _tokens()), _forward(model, _tokens()), atol=1e-5
        )
        diff = np.abs(np.asarray(_forward(model, _tokens())) - _torch_logits(hf, _tokens())).max()
        assert diff <= 1e-4, diff


def _lora_step_loss(ckpt, *, dtype, frozen_dtype):
    """Loss and grad norm of one jitted LoRA train step (random B) on a fixed full-row batch."""
    import optax

    from mmr_jax.step import train_step

    lora = lora_lib.LoraConfig(rank=4, alpha=8, dropout=0.0)
    model = models.from_pretrained(
        ckpt, dtype=dtype, lora=lora, rngs=nnx.Rngs(0), frozen_dtype=frozen_dtype
    )
    _randomise_b(model)
    policy = lora_lib.split_policy(model)
    n, length, t = 4, 14, 6
    rng = np.random.default_rng(0)
    completion = jnp.asarray(np.arange(t)[None] < np.array([6, 4, 2, 5])[:, None])
    batch = train_step.Batch(
        tokens=jnp.asarray(rng.integers(4, 250, (n, length)), jnp.int32),
        attention_mask=jnp.concatenate([jnp.ones((n, length - t), bool), completion], axis=1),
        completion_mask=completion,
        advantages=jnp.asarray([1.0, -1.0, 0.5, -0.5], jnp.float32),
    )
    cfg = testing.step_config(
        minibatches=2,
        iterations=1,
        temperature=1.0,
        eps_low=0.2,
        eps_high=0.2,
        aggregation="token_mean",
        beta=0.0,
        kl_estimator="k3",
        max_completion_len=t,
    )
    opt = optax.sgd(0.1)
    step = train_step.jit_train_step(
        graphdef=policy.graphdef, optimizer=opt, schedule=lambda _: 0.1, cfg=cfg
    )
    state = train_step.TrainState(
        step=jnp.zeros([], jnp.int32),
        params=policy.params,
        opt_state=opt.init(policy.params),
        rng=jax.random.key_data(jax.random.key(0)),
    )
    _, metrics = step(state, batch, policy.frozen, policy.rest)
    return float(metrics["loss"]), float(metrics["grad_norm"]), float(metrics["entropy"])


def _nbytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


class TestFrozenDtype:
    """`frozen_dtype`: the frozen base under LoRA stored in bf16, the adapters in fp32."""

    def test_param_dtypes(self, ckpt):
        lora = lora_lib.LoraConfig(rank=4, alpha=8)
        model = models.from_pretrained(ckpt, lora=lora, frozen_dtype=jnp.bfloat16)
        dtypes = {
            "/".join(map(str, p)): v.get_value().dtype
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
        }
        for name, dtype in dtypes.items():
            wide = name.endswith(("lora_a", "lora_b", "bias")) or "norm" in name
            assert dtype == (jnp.float32 if wide else jnp.bfloat16), (name, dtype)
        assert dtypes["embed_tokens/embedding"] == jnp.bfloat16
        assert dtypes["layers/self_attn/q_proj/kernel"] == jnp.bfloat16
        # no LoRA: everything is trained, so nothing is frozen and frozen_dtype is ignored
        full = models.from_pretrained(ckpt, frozen_dtype=jnp.bfloat16)
        assert {v.dtype for v in jax.tree.leaves(nnx.state(full, nnx.Param))} == {
            np.dtype("float32")
        }

    def test_bf16_compute_step_is_unchanged(self, ckpt):
        """In bf16 compute the base is cast to bf16 at use anyway: storing it in bf16 gives the
        same step (same rounding of the same fp32 values), to bf16 tolerance and in fact exactly."""
        ref = _lora_step_loss(ckpt, dtype=jnp.bfloat16, frozen_dtype=None)
        got = _lora_step_loss(ckpt, dtype=jnp.bfloat16, frozen_dtype=jnp.bfloat16)
        np.testing.assert_allclose(got, ref, rtol=2.0**-8)
        assert got == ref

    def test_fp32_compute_step_within_bf16_rounding(self, ckpt):
        """fp32 compute over a bf16-stored base: the weights differ by one bf16 rounding (2^-9
        relative), so loss, grad norm and entropy agree to 2^-8 relative."""
        ref = _lora_step_loss(ckpt, dtype=jnp.float32, frozen_dtype=None)
        got = _lora_step_loss(ckpt, dtype=jnp.float32, frozen_dtype=jnp.bfloat16)
        np.testing.assert_allclose(got, ref, rtol=2.0**-8, atol=1e-6)
        assert got != ref  # the weights did change: the comparison is not vacuous

    def test_argument_memory_halves(self, ckpt):
        """Frozen state bytes (eval_shape, no weights) halve; trainable bytes are unchanged."""
        from mmr_jax.models import config as config_lib
        from mmr_jax.models import loading

        cfg = config_lib.ModelConfig.from_hf(ckpt)
        lora = lora_lib.LoraConfig(rank=4, alpha=8)

        def sizes(frozen_dtype):
            m = loading.abstract_model(cfg, lora=lora, frozen_dtype=frozen_dtype)
            _, trainable, frozen, _ = nnx.split(m, nnx.LoRAParam, nnx.Param, ...)
            return _nbytes(trainable), _nbytes(frozen)

        (t32, f32), (t16, f16) = sizes(None), sizes(jnp.bfloat16)
        assert t16 == t32
        assert 0.5 * f32 < f16 < 0.52 * f32  # all but the norms and biases (kept fp32) halve
