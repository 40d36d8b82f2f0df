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
    q = sharded.layers[0].self_attn.q_proj
    assert q.kernel[...].sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert q.lora_b[...].sharding.spec == jax.sharding.PartitionSpec(None, "tensor")
    assert len(q.kernel[...].addressable_shards) == 8
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

        path = ("layers", 0, "self_attn", "q_proj", "kernel")
        assert sharding.partition_spec(path, (64, 64), FakeMesh) == P("fsdp", "tensor")
        assert sharding.partition_spec(path, (64, 6), FakeMesh) == P("fsdp", None)
        down = ("layers", 3, "mlp", "down_proj", "kernel")
        assert sharding.partition_spec(down, (128, 64), FakeMesh) == P("tensor", "fsdp")
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
