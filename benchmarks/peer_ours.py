"""Our side of the peer benchmark: the trainer's jitted train step on the peer's batch.

The step is `train_step.jit_train_step` for the config (its dtypes, LoRA, remat, minibatches,
loss), on the shared-prompt layout of `peer_batch.make_batch`'s batch (prompts [B, P] once,
completions [B * G, T]). Weights: a checkpoint (the parity test: the torch side's own weights),
or random weights of the config's architecture drawn on the device, at the shapes and shardings
`compiled_dry_run` compiles for (`bench_gpu.py`'s way: no checkpoint read).
"""

from __future__ import annotations

import dataclasses

import peer_batch

from mmr_jax.infra import bench_harness as harness


def load_config(spec: str, overrides: list[str]):
    """`path[:arg]`'s TrainConfig with `key=value` overrides (values parsed as Python literals)."""
    from mmr_jax.config import checks, command_line

    parsed = command_line.parse_assignments(overrides)
    return checks.from_config_dict(
        command_line.set_keys(command_line.load_config_file(spec), parsed)
    )


def _device_batch(cfg, batch: peer_batch.PeerBatch, abstract):
    """The train step's Batch of `batch`, placed as `abstract` (the compiled shapes) says."""
    import jax
    import numpy as np

    from mmr_jax.step import train_step

    n, t = batch.completions_NxT.shape
    ones_nt = np.ones((n, t), bool)
    host = train_step.Batch(
        tokens=batch.completions_NxT,
        attention_mask=ones_nt,
        completion_mask=ones_nt,
        advantages=batch.advantages_N,
        ref_logps=batch.ref_logps_NxT if cfg.loss.beta > 0 else None,
        prompt_tokens=batch.prompts_BxP,
        prompt_mask=np.ones(batch.prompts_BxP.shape, bool),
    )
    if abstract is None:
        return jax.tree.map(jax.numpy.asarray, host)
    return jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), host, abstract)


def make_step(cfg, batch: peer_batch.PeerBatch, checkpoint: str | None):
    """-> (jitted step, [state, batch, frozen, rest] on device, compile figures)."""
    import jax

    from mmr_jax.step import train_step
    from mmr_jax.training import build, compiled_dry_run, dry_run_programs

    optimizer, schedule = train_step.make_optimizer(cfg.optim, total_updates=cfg.total_updates)
    if checkpoint:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=checkpoint))
        policy = build.load_policy(cfg)
        step = train_step.jit_train_step(
            graphdef=policy.graphdef,
            optimizer=optimizer,
            schedule=schedule,
            cfg=train_step.StepConfig.from_config(cfg),
        )
        state = train_step.init_state(policy.params, optimizer, seed=cfg.seed, loss=cfg.loss)
        args = [state, _device_batch(cfg, batch, None), policy.frozen, policy.rest]
    else:
        # The shared-prompt layout the peer's batch is in (`_device_batch`), not the packed one
        # a config's pack_max_len (4096 by default) asks for: the program's Batch must be that
        # batch's tree. The H200 run of 2026-11-29 failed here on the packed default.
        cfg = dataclasses.replace(cfg, batch=dataclasses.replace(cfg.batch, pack_max_len=0))
        mesh = compiled_dry_run.config_mesh(cfg)
        step, (state_a, batch_a, frozen_a, rest_a) = dry_run_programs.train_step_program(cfg, mesh)
        state = harness.random_on_device(state_a)
        # The optimiser's moments as at step 0 (random ones would be nonsense, not slower).
        state = state.replace(opt_state=jax.jit(optimizer.init)(state.params))
        args = [
            state,
            _device_batch(cfg, batch, batch_a),
            harness.random_on_device(frozen_a),
            harness.random_on_device(rest_a),
        ]
    figures, compiled = compiled_dry_run.measure("train", step, *args)
    return compiled, args, figures


def metrics_of(out) -> dict:
    """The step's metrics named as the torch side names them."""
    m = out[1]
    return {k: float(m[k]) for k in ("loss", "grad_norm", "entropy", "kl")}


def run(
    cfg,
    *,
    checkpoint: str | None,
    steps: int,
    warmup: int,
    seed: int = 0,
    profile_dir: str | None = None,
    profile_steps: int = 2,
) -> dict:
    """The side's figures; with `profile_dir`, a `jax.profiler` trace of `profile_steps` more
    steps there and its per-kernel table (`kernel_profile`) under 'profile'."""
    import jax

    from mmr_jax.models import config as model_config

    shape = shape_of(cfg)
    vocab = vocab_size(cfg) if not checkpoint else checkpoint_vocab(checkpoint)
    batch = peer_batch.make_batch(shape, vocab_size=vocab, beta=cfg.loss.beta, seed=seed)
    harness.progress("ours: compiling")
    compiled, args, figures = make_step(cfg, batch, checkpoint)
    compile_s = figures.trace_s + figures.lower_s + figures.compile_s
    harness.progress(f"ours: compiled in {compile_s:.1f} s")
    first = {}

    def call():
        out = jax.block_until_ready(compiled(*args))
        first.setdefault("metrics", metrics_of(out))
        args[0] = out[0]  # the state is donated: the new one takes its place

    timing = harness.timed(call, steps=steps, warmup=warmup)
    peak = harness.jax_peak_bytes()
    device = jax.local_devices()[0]
    mcfg = model_config.ModelConfig.from_hf(hf_config_path(cfg, checkpoint))
    result = {
        "side": "ours",
        "device": device.device_kind,
        "versions": {"jax": jax.__version__},
        "remat": cfg.model.remat,
        "metrics": first["metrics"],
        "timing": timing.as_dict(),
        "step_s": timing.median_s,
        "compile_s": compile_s,
        "peak_gib": peak / harness.GIB if peak else None,
        "xla_peak_gib": figures.peak_bytes / harness.GIB,
        "tokens": shape.tokens_shared(),
        "layers": mcfg.num_layers,
    }
    if profile_dir:
        import kernel_profile

        harness.progress(f"ours: tracing {profile_steps} steps into {profile_dir}")
        with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
            for _ in range(profile_steps):
                call()
        result["profile"] = kernel_profile.profile_table(profile_dir, steps=profile_steps)
    return result


def shape_of(cfg) -> peer_batch.Shape:
    b = cfg.batch
    return peer_batch.Shape(b.prompts, b.generations, b.max_prompt_len, b.max_completion_len)


def hf_config_path(cfg, checkpoint: str | None = None):
    from mmr_jax.models import config as model_config

    return model_config.config_file(checkpoint or cfg.model.path)


def vocab_size(cfg) -> int:
    import json

    return int(json.loads(hf_config_path(cfg).read_text())["vocab_size"])


def checkpoint_vocab(checkpoint: str) -> int:
    import json
    import pathlib

    return int(json.loads((pathlib.Path(checkpoint) / "config.json").read_text())["vocab_size"])
