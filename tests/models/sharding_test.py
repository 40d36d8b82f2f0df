"""Sharded loading on 8 fake CPU devices (a 2x2x2 data/fsdp/tensor mesh) gives single-device logits.

Runs in a subprocess because the fake device count must be set before jax initialises.
"""

from __future__ import annotations

import textwrap

import pytest
from jax.sharding import PartitionSpec as P

from mmr_jax.models import sharding

from support import testing

pytest.importorskip("transformers")

_SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from mmr_jax import models
    from mmr_jax.models import lora, sharding

    assert jax.device_count() == 8, jax.devices()
    path = sys.argv[1]
    cfg = lora.LoraConfig(rank=4, alpha=8)
    mesh = sharding.make_mesh(2, 2, 2)
    single = models.from_pretrained(path, lora=cfg)
    sharded = models.from_pretrained(path, mesh=mesh, lora=cfg)
    q = sharded.layers.self_attn.q_proj  # stacked: [L, in, out], the layer axis unsharded
    assert q.kernel[...].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert q.lora_b[...].sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor")
    assert len(q.kernel[...].addressable_shards) == 8
    # Fresh adapters have B = 0 (no effect): give both models the same nonzero B, so the
    # adapters' numerics run under the sharding too.
    rng = np.random.default_rng(1)
    for (path, a), (_, b) in zip(
        nnx.to_flat_state(nnx.state(single, nnx.LoRAParam)),
        nnx.to_flat_state(nnx.state(sharded, nnx.LoRAParam)),
    ):
        if path[-1] == "lora_b":
            value = rng.normal(0, 0.05, a.get_value().shape).astype(np.float32)
            a.set_value(jnp.asarray(value))
            b.set_value(jax.device_put(value, b.get_value().sharding))
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 300, (4, 16)), jnp.int32)
    fwd = nnx.jit(lambda m, t: m(t))
    ref = np.asarray(fwd(single, tokens))
    got = np.asarray(fwd(sharded, jax.device_put(tokens, sharding.batch_sharding(mesh))))
    diff = float(np.abs(ref - got).max())
    print("MAXDIFF", diff)
    assert diff <= 1e-4, diff
    """
)


class TestPartitionSpec:
    def test_rules_and_divisibility_fallback(self):
        class FakeMesh:
            shape = {"data": 1, "fsdp": 2, "tensor": 4}

        # Stacked layer parameters: [L, ...], the layer axis (4 = divisible by tensor) unsharded.
        path = ("layers", "self_attn", "q_proj", "kernel")
        assert sharding.partition_spec(path, (4, 64, 64), FakeMesh) == P(None, "fsdp", "tensor")
        assert sharding.partition_spec(path, (4, 64, 6), FakeMesh) == P(None, "fsdp", None)
        down = ("layers", "mlp", "down_proj", "kernel")
        assert sharding.partition_spec(down, (4, 128, 64), FakeMesh) == P(None, "tensor", "fsdp")
        lora_a = ("layers", "mlp", "down_proj", "lora_a")
        assert sharding.partition_spec(lora_a, (4, 128, 8), FakeMesh) == P(None, "tensor", None)
        norm = ("layers", "input_layernorm", "weight")
        assert sharding.partition_spec(norm, (4, 64), FakeMesh) == P()
        assert sharding.partition_spec(("norm", "weight"), (64,), FakeMesh) == P()
        assert sharding.partition_spec(("embed_tokens", "embedding"), (512, 64), FakeMesh) == P(
            "tensor", "fsdp"
        )

    def test_make_mesh_sizes(self):
        with pytest.raises(ValueError, match="needs 8 devices"):
            sharding.make_mesh(2, 2, 2, devices=[object()])


def test_mesh_2x2x2_logits_equal_single_device(tmp_path):
    # Qwen2: q/k/v biases are sharded too. Written here, so the child process imports no torch.
    path = testing.make_tiny_checkpoint(
        tmp_path / "ckpt", family="qwen2", tokenizer=False, vocab_size=384
    )
    proc = testing.run_in_fresh_jax(
        _SCRIPT, str(path), env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "MAXDIFF" in proc.stdout
