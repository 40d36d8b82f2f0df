"""What `peer_step.py` hands its sides besides the config: `torch_job`, the config as the PyTorch
peer reads it (plain JSON for its torch-only child; it refuses what the peer does not compute:
LoRA, a KL other than k3, several iterations, TIS), and `write_checkpoint`, one random fp32
checkpoint of an architecture that both sides load (`--weights=same`, `--cpu_smoke`).
"""

from __future__ import annotations

import pathlib


def torch_job(cfg, *, checkpoint: str | None, seed: int = 0) -> dict:
    """What the torch side needs of the config, as plain JSON."""
    import peer_ours

    if cfg.lora.enabled:
        raise ValueError("the torch peer runs full fine-tunes only; this config has LoRA on")
    if cfg.loss.beta > 0 and cfg.loss.kl_estimator != "k3":
        raise ValueError(f"the torch peer computes the k3 KL only, not {cfg.loss.kl_estimator}")
    if cfg.loss.iterations != 1 or cfg.loss.tis_cap > 0:
        raise ValueError("the torch peer computes one iteration without TIS (TRL's default)")
    shape = peer_ours.shape_of(cfg)
    o = cfg.optim
    return {
        "hf_config": str(peer_ours.hf_config_path(cfg, checkpoint)),
        "checkpoint": checkpoint,
        "seed": seed,
        "vocab_size": peer_ours.checkpoint_vocab(checkpoint)
        if checkpoint
        else peer_ours.vocab_size(cfg),
        "shape": {
            "prompts": shape.prompts,
            "generations": shape.generations,
            "prompt_len": shape.prompt_len,
            "completion_len": shape.completion_len,
        },
        "completion_len": shape.completion_len,
        "max_completion_len": cfg.batch.max_completion_len,
        "minibatches": cfg.loss.minibatches,
        "temperature": cfg.rollout.temperature,
        "eps_low": cfg.loss.eps_low,
        "eps_high": cfg.loss.eps_high,
        "beta": cfg.loss.beta,
        "aggregation": cfg.loss.aggregation,
        "compute_dtype": cfg.model.dtype,
        "optim": {
            "lr": o.lr,
            "b1": o.b1,
            "b2": o.b2,
            "eps": o.eps,
            "weight_decay": o.weight_decay,
            "grad_clip": o.grad_clip,
        },
    }


def write_checkpoint(config_json: str, out: pathlib.Path, seed: int, **overrides) -> str:
    """A random fp32 checkpoint of the architecture `config_json` (plus `overrides`) in `out`."""
    import peer_torch
    import torch
    import transformers

    config = peer_torch.hf_config(config_json, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return str(out)
