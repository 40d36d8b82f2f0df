"""Every config key that changes what a run compiles changes the dry run's figures (issue 52).

The train step of a tiny Llama is compiled on 4 virtual CPU devices for a base config and for
the base with one key flipped: the dtypes (compute, parameters, the frozen base under LoRA),
LoRA, the remat policy, the mesh, micro-batches, the attention backend, the batch layout
(shared prompt, packing) and the updates per batch. Where the change is a known number of bytes
(the frozen base's storage, the old log-probs an extra update needs, a replicated parameter) it
is checked to the byte against the shapes; elsewhere the direction the figure must move.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from support import testing

pytest.importorskip("transformers")
# 12 compiles of the train step: 3 minutes on 2 idle cores. One xdist group: the module fixture
# that compiles them runs once, not once on each worker that draws one of these tests.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("dry_run_flips")]

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    from configs import grpo
    from mmr_jax.config import checks
    from mmr_jax.training import compiled_dry_run, dry_run_programs

    def base():
        c = grpo.get_config("smoke")
        c.model.path = sys.argv[1]
        c.model.dtype, c.model.param_dtype, c.model.frozen_dtype = "float32", "float32", ""
        c.model.remat, c.model.attention_impl = "none", "unfused"
        c.lora.enabled, c.lora.rank, c.lora.dropout = False, 4, 0.0
        c.batch.prompts, c.batch.generations = 4, 4
        c.batch.max_prompt_len, c.batch.max_completion_len = 16, 16
        c.batch.min_bucket_len, c.batch.pack_max_len, c.batch.shared_prompt = 8, 0, True
        c.loss.minibatches, c.loss.updates_per_batch, c.loss.iterations = 1, 1, 1
        c.loss.beta, c.loss.tis_cap = 0.0, 0.0
        c.mesh.shape = (1, 4, 1)
        return c

    FLIPS = {
        "base": [],
        "dtype": [("model.dtype", "bfloat16")],
        "param_dtype": [("model.param_dtype", "bfloat16")],
        "lora": [("lora.enabled", True)],
        "lora_frozen_bf16": [("lora.enabled", True), ("model.frozen_dtype", "bfloat16")],
        "remat": [("model.remat", "full")],
        "mesh": [("mesh.shape", (4, 1, 1))],
        "minibatches": [("loss.minibatches", 2)],
        "attention": [("model.attention_impl", "xla")],
        "full_rows": [("batch.shared_prompt", False)],
        "packed": [("batch.pack_max_len", 64)],
        "updates": [("loss.minibatches", 2), ("loss.updates_per_batch", 2)],
    }
    out = {}
    for name, changes in FLIPS.items():
        c = base()
        for key, value in changes:
            section, field = key.split(".")
            setattr(getattr(c, section), field, value)
        cfg = checks.from_config_dict(c)
        mesh = compiled_dry_run.config_mesh(cfg)
        fn, args = dry_run_programs.train_step_program(
            cfg, mesh, attention=cfg.model.attention_impl
        )
        got, _ = compiled_dry_run.measure(name, fn, *args)
        sizes = compiled_dry_run.dry_run(cfg)
        out[name] = dict(args=got.argument_bytes, temp=got.temp_bytes, peak=got.peak_bytes,
                         param_gib=sizes["param_gib_per_device"],
                         frozen=[[list(x.shape), str(x.dtype)] for x in jax.tree.leaves(args[2])])
    print("RESULT", json.dumps(out))
    """
)


# Session scope: under --dist loadgroup a worker may run other modules' tests between this
# group's, which tears a module-scoped fixture down and builds it again (two setups of 85-94 s
# in one CI run, 2026-11-29).
@pytest.fixture(scope="session")
def figures(tmp_path_factory):
    ckpt = testing.make_tiny_checkpoint(
        tmp_path_factory.mktemp("ckpt"), tokenizer=False, vocab_size=384
    )
    proc = testing.run_in_fresh_jax(_SCRIPT, str(ckpt), timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def _frozen_bytes(entry) -> int:
    """Bytes of the frozen base a device holds (fsdp over 4 splits every 2-D weight's first
    axis the rules shard; here counted whole and divided by the 4 devices' share below)."""
    import numpy as np

    return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in entry["frozen"])


def test_every_flip_moves_the_figures(figures):
    for name, f in figures.items():
        ref = figures["minibatches" if name == "updates" else "base"]  # one key flipped each
        if name != "base":
            assert (f["args"], f["temp"]) != (ref["args"], ref["temp"]), name


def test_directions(figures):
    f = figures
    assert f["param_dtype"]["args"] < f["base"]["args"]  # half the parameter bytes
    # (model.dtype moves the figures, but its direction at this size is not the activations':
    # the bf16 copies of the fp32 weights outweigh them in a 2-layer model of width 64.)
    assert f["remat"]["temp"] < f["base"]["temp"]  # layer inputs kept, not everything
    assert f["minibatches"]["temp"] < f["base"]["temp"]  # half the rows' activations at once
    assert f["mesh"]["args"] > f["base"]["args"]  # data parallel: every parameter on every device
    assert f["lora"]["args"] < f["base"]["args"]  # Adam state of the adapters only


def test_frozen_dtype_halves_the_frozen_base(figures):
    # The dry run honours model.frozen_dtype: the frozen base is bf16 arguments of the step, and
    # the sizes summary counts it so (before issue 52 both built the model without it).
    fp32, bf16 = figures["lora"], figures["lora_frozen_bf16"]
    import numpy as np

    elements = lambda e, dtype: sum(int(np.prod(x)) for x, d in e["frozen"] if d == dtype)
    assert elements(fp32, "bfloat16") == 0
    # Every frozen weight matrix (projections, embedding, LM head) is bf16; only the RMSNorm
    # scales (hidden-sized, per layer) stay fp32.
    assert elements(bf16, "float32") < 0.05 * elements(bf16, "bfloat16")
    assert elements(bf16, "bfloat16") + elements(bf16, "float32") == elements(fp32, "float32")
    saved = _frozen_bytes(fp32) - _frozen_bytes(bf16)
    # Arguments per device: the frozen weights are split over the 4 devices where they divide;
    # the saving is between a quarter (all split) and all of it (all replicated) of the total.
    delta = fp32["args"] - bf16["args"]
    assert saved / 4 <= delta <= saved, (delta, saved)
    assert bf16["param_gib"] < fp32["param_gib"]


def test_updates_per_batch_add_the_old_logps(figures):
    # Two updates a batch (of its 2 minibatches): the step takes the pre-update log-probs,
    # float32 [N, T] split over the 4 devices: 16 rows x 16 tokens x 4 bytes / 4.
    assert figures["updates"]["args"] - figures["minibatches"]["args"] == 16 * 16 * 4 // 4
