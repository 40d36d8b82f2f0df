"""The PyTorch peer of our train step: transformers + torch eager, the way TRL's GRPOTrainer
computes a step (trl 1.x `_compute_loss`, `_get_per_token_logps_and_entropies`).

Every row holds its prompt ([N, P + T]); SDPA attention; fp32 master weights with bf16 autocast
(when the config computes in bf16); the logits of the last T + 1 positions, shifted, divided by
the temperature, `selective_log_softmax` as TRL's (fp32: gather - logsumexp; bf16: a row at a
time); the per-token clipped surrogate with the k3 KL term against the reference log-probs;
gradient accumulation over the config's minibatches, each minibatch's loss over the whole batch's
normaliser (as ours; for the grpo aggregation also TRL's mean over sequences / accumulation
steps); clip by global norm; AdamW (fused on CUDA); gradient checkpointing on or off.
No JAX here: this runs in its own process.
"""

from __future__ import annotations

import json
import pathlib

import peer_batch

from mmr_jax.infra import bench_harness as harness


def hf_config(config_json: str, **overrides):
    """transformers config of an upstream config.json (third_party/hf_configs or a checkpoint),
    with `overrides` (before the config derives anything from them: per-layer lists)."""
    import transformers

    raw = json.loads(pathlib.Path(config_json).read_text())
    for key in ("torch_dtype", "dtype", "layer_types", "architectures"):
        raw.pop(key, None)
    raw.update(overrides)
    return transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)


def build_model(job: dict, device, checkpointing: bool):
    """fp32 model on `device`: the checkpoint `job['checkpoint']`, else random weights (seeded) of
    the architecture `job['hf_config']`."""
    import torch
    import transformers

    kw = {"attn_implementation": "sdpa", "dtype": torch.float32}
    if job.get("checkpoint"):
        model = transformers.AutoModelForCausalLM.from_pretrained(job["checkpoint"], **kw)
        model.to(device)
    else:
        torch.manual_seed(job["seed"])
        with torch.device(device):  # drawn on the device: a 1.5B model on the host takes minutes
            model = transformers.AutoModelForCausalLM.from_config(hf_config(job["hf_config"]), **kw)
    model.config.use_cache = False
    if checkpointing:  # renamed in transformers 5.2x; the lent image has 5.17
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    return model


def selective_log_softmax(logits, index):
    """TRL's: log_softmax(logits)[index] without the [.., V] log-probs in fp32 at once."""
    import torch

    if logits.dtype in (torch.float32, torch.float64):
        selected = torch.gather(logits, -1, index.unsqueeze(-1)).squeeze(-1)
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return selected - lse
    rows = []
    for row_logits, row_labels in zip(logits, index, strict=True):
        row_logps = torch.log_softmax(row_logits, dim=-1)
        rows.append(row_logps.gather(-1, row_labels.unsqueeze(-1)).squeeze(-1))
    return torch.stack(rows)


def entropy(logits):
    """Per-token entropy of softmax(logits), a row at a time (no gradient: a metric)."""
    import torch

    with torch.no_grad():
        out = []
        for row in logits:
            logp = torch.log_softmax(row.float(), dim=-1)
            out.append(-(logp.exp() * logp).sum(-1))
        return torch.stack(out)


def minibatch_loss(model, ids, adv, ref, job: dict, autocast_dtype, normaliser: float):
    """One minibatch's loss (already over the whole batch's normaliser) and its metric sums."""
    import torch

    t = job["completion_len"]
    with torch.autocast(ids.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        logits = model(input_ids=ids, logits_to_keep=t + 1).logits
    logits = logits[:, :-1, :][:, -t:, :] / job["temperature"]
    completion = ids[:, -t:]
    logps = selective_log_softmax(logits, completion)
    ent = entropy(logits)
    ratio = torch.exp(logps - logps.detach())
    clipped = torch.clamp(ratio, 1 - job["eps_low"], 1 + job["eps_high"])
    adv = adv[:, None]
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = torch.zeros_like(logps)
    if job["beta"] > 0:
        d = ref - logps
        kl = torch.expm1(d) - d  # k3, as ours (`losses.kl_divergence`)
        per_token = per_token + job["beta"] * kl
    if job["aggregation"] == "seq_mean_token_mean":
        numerator = per_token.mean(-1).sum()  # every token valid: the per-sequence means
    else:
        numerator = per_token.sum()
    return numerator / normaliser, ent.detach().sum(), kl.detach().sum()


def make_step(job: dict, device, checkpointing: bool):
    """-> (step(), model): `step` runs one optimiser update on the batch and returns its metrics
    (loss, grad_norm, entropy, kl: the same names and reductions as our train step's)."""
    import torch

    if job["aggregation"] not in peer_batch.AGGREGATIONS:
        raise ValueError(f"unknown aggregation {job['aggregation']!r}")
    model = build_model(job, device, checkpointing)
    shape = peer_batch.Shape(**job["shape"])
    batch = peer_batch.make_batch(shape, vocab_size=job["vocab_size"], beta=job["beta"])
    ids = torch.as_tensor(batch.rows_with_prompts(), dtype=torch.long, device=device)
    adv = torch.as_tensor(batch.advantages_N, device=device)
    ref = (
        None if batch.ref_logps_NxT is None else torch.as_tensor(batch.ref_logps_NxT, device=device)
    )
    m = job["minibatches"]
    n = shape.rows
    if n % m:
        raise ValueError(f"{n} rows do not split into {m} minibatches")
    normaliser = peer_batch.loss_normaliser(
        job["aggregation"], n, shape.completion_len, job["max_completion_len"]
    )
    autocast = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(job["compute_dtype"])
    o = job["optim"]
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=o["lr"],
        betas=(o["b1"], o["b2"]),
        eps=o["eps"],
        weight_decay=o["weight_decay"],
        fused=device.type == "cuda",
    )
    size = n // m

    def step() -> dict:
        optimizer.zero_grad(set_to_none=True)
        loss = ent = kl = 0.0
        for i in range(m):
            rows = slice(i * size, (i + 1) * size)
            mb_ref = None if ref is None else ref[rows]
            mb_loss, mb_ent, mb_kl = minibatch_loss(
                model, ids[rows], adv[rows], mb_ref, job, autocast, normaliser
            )
            mb_loss.backward()
            loss, ent, kl = loss + mb_loss.detach(), ent + mb_ent, kl + mb_kl
        clip = o["grad_clip"] or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        tokens = n * shape.completion_len
        return {
            "loss": float(loss),
            "grad_norm": float(grad_norm),
            "entropy": float(ent) / tokens,
            "kl": float(kl) / tokens,
        }

    return step, model


def run(job: dict, *, checkpointing: bool, steps: int, warmup: int) -> dict:
    """The side's figures: metrics of the first step (the initial weights), seconds, peak memory."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step, _ = make_step(job, device, checkpointing)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    first = {}

    def call():
        metrics = step()
        sync()
        first.setdefault("metrics", metrics)

    timing = harness.timed(call, steps=steps, warmup=warmup)
    shape = peer_batch.Shape(**job["shape"])
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return {
        "side": "torch_ckpt" if checkpointing else "torch",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "transformers": _version("transformers")},
        "metrics": first["metrics"],
        "timing": timing.as_dict(),
        "step_s": timing.median_s,
        "peak_gib": peak / harness.GIB if peak else None,
        "tokens": shape.tokens_per_row(),
    }


def _version(name: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(name)
