"""The compiled dry run: the real train and decode steps compiled for a mesh of virtual devices.

Runs in a fresh process (the virtual device count is set before JAX starts). What XLA reports as
each device's arguments must equal the bytes of the shards the arguments' shardings give, summed
independently here: parameters, optimiser state and batch split over the mesh, as the trainer
places them (a replicated optimiser state, say, would show as 4x its share).
"""

from __future__ import annotations

import json
import textwrap

import pytest

from support import testing

pytest.importorskip("transformers")

_SCRIPT = textwrap.dedent(
    """
    import json, math, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    import numpy as np
    from configs import grpo
    from mmr_jax.training import compiled_dry_run, dry_run_programs
    from mmr_jax.config import schema
    from mmr_jax.config import checks

    c = grpo.get_config("smoke")
    c.model.path = sys.argv[1]
    c.model.remat = "full"
    c.batch.prompts, c.batch.generations = 4, 2
    c.batch.max_prompt_len, c.batch.max_completion_len = 16, 8
    c.loss.minibatches = 1
    c.mesh.shape = (1, 4, 1)
    cfg = checks.from_config_dict(c)
    mesh = compiled_dry_run.config_mesh(cfg)

    def shard_bytes(tree):
        total = 0
        for x in jax.tree.leaves(tree):
            shape = x.sharding.shard_shape(x.shape)
            total += math.prod(shape) * np.dtype(x.dtype).itemsize
        return total

    out = {}
    for remat in ("none", "full"):
        fn, args = dry_run_programs.train_step_program(cfg, mesh, remat=remat)
        got = compiled_dry_run.compile_train_step(cfg, mesh, remat=remat)
        out[remat] = dict(args=got.argument_bytes, temp=got.temp_bytes, want=shard_bytes(args),
                          replicated=sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(args)))
    fn, args = dry_run_programs.decode_step_program(cfg, mesh)
    got = compiled_dry_run.compile_decode_step(cfg, mesh)
    out["decode"] = dict(args=got.argument_bytes, want=shard_bytes(args), alias=got.alias_bytes)

    def layout(tree):  # what a call's donated argument must look like on the next call
        leaves = [(list(x.shape), str(x.dtype)) for x in jax.tree.leaves(tree)]
        return [str(jax.tree.structure(tree)), leaves]

    out["donated"] = {}
    for kind in ("train", "decode"):
        fn, args, (arg, result) = dry_run_programs.program(kind, cfg, mesh)
        outputs = jax.eval_shape(fn, *args)
        out["donated"][kind] = [layout(args[arg]), layout(outputs[result])]
    print("RESULT", json.dumps(out))
    """
)


def test_compiled_steps_hold_the_shards_their_shardings_give(tmp_path):
    ckpt = testing.make_tiny_checkpoint(tmp_path / "ckpt", tokenizer=False, vocab_size=384)
    proc = testing.run_in_fresh_jax(_SCRIPT, str(ckpt))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT ") :])
    for remat in ("none", "full"):
        r = out[remat]
        assert r["args"] == r["want"], r
        assert r["want"] < r["replicated"] / 2  # sharded, not replicated
    # Keeping each layer's input only (full) holds less for the backward pass than everything.
    assert out["full"]["temp"] < out["none"]["temp"], out
    assert out["decode"]["args"] == out["decode"]["want"]
    assert out["decode"]["alias"] > 0  # the rows' cache is donated: updated in place
    # The benchmarks call each program again with the donated argument replaced by the output
    # `DONATED` names: it must be that argument's new value (same tree, shapes and dtypes).
    for kind, (argument, output) in out["donated"].items():
        assert argument == output, kind


def test_program_names_are_checked():
    from mmr_jax.training import dry_run_programs

    with pytest.raises(ValueError, match="unknown program 'prefill'"):
        dry_run_programs.program("prefill", cfg=None, mesh=None)


def test_decode_program_takes_the_samplers_compute_dtype_weights(tiny_llama_dir):
    # The sampler decodes from weights cast once to the compute dtype
    # (sampler_weights.sampling_weights); the dry run's decode program must be fed the same, or its
    # figures include a cast of every weight at every step that the sampler does not do (issue 35).
    import jax
    import jax.numpy as jnp

    from configs import grpo
    from mmr_jax.config import checks
    from mmr_jax.training import compiled_dry_run, dry_run_programs

    c = grpo.get_config("smoke")
    c.model.path = str(tiny_llama_dir)
    c.model.dtype, c.model.param_dtype = "bfloat16", "float32"
    c.batch.prompts, c.batch.generations = 2, 2
    c.batch.max_prompt_len, c.batch.max_completion_len = 8, 4
    cfg = checks.from_config_dict(c)
    mesh = compiled_dry_run.config_mesh(cfg)
    fn, args = dry_run_programs.decode_step_program(cfg, mesh)
    weights = jax.tree.leaves(args[:3])
    floating = [x for x in weights if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floating and all(x.dtype == jnp.bfloat16 for x in floating)
    # And the lowered step casts no weight: no f32 -> bf16 convert of a weight's shape.
    shapes = {"x".join(map(str, x.shape)) for x in floating if x.ndim >= 2}
    text = fn.lower(*args).as_text()
    casts = [
        line
        for line in text.splitlines()
        if "stablehlo.convert" in line
        and any(f"tensor<{s}xf32>" in line and f"tensor<{s}xbf16>" in line for s in shapes)
    ]
    assert not casts, casts[:3]
    train_fn, train_args = dry_run_programs.train_step_program(cfg, mesh)
    masters = [x for x in jax.tree.leaves(train_args[0]) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert any(x.dtype == jnp.float32 for x in masters)  # the train step keeps fp32 masters
