"""The `vllm serve` command line (pinned vLLM 0.33) and environment the rollout client relies on.

Flags and why:
  --logprobs-mode processed_logprobs   log-probs after temperature (and top-k/top-p), not of the raw
                                       logits; with top_p=1, top_k=0 exactly the trainer's quantity
  --worker-extension-cls vllm_worker_ext.WeightSyncExtension   full-weight reload from safetensors
  --generation-config vllm             ignore the checkpoint's generation_config.json defaults
                                       (e.g. a repetition_penalty the trainer would not model);
                                       the client passes the EOS ids as stop_token_ids instead
  --enable-lora --max-lora-rank R --max-loras 2
                                       LoRA runs: the new adapter loads before the old one is
                                       unloaded, so two may be resident
  --gpu-memory-utilization F           share of the whole GPU vLLM takes (weights + KV cache)
Environment: VLLM_SERVER_DEV_MODE=1 (exposes /collective_rpc and /reset_prefix_cache),
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (exposes /v1/load_lora_adapter and /v1/unload_lora_adapter),
third_party/ prepended to PYTHONPATH (so the worker extension imports). These dev routes have no
authentication: bind to localhost or a private network.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import urllib.parse

WORKER_EXTENSION = "vllm_worker_ext.WeightSyncExtension"
THIRD_PARTY = pathlib.Path(__file__).resolve().parents[2] / "third_party"


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """What a run needs from the server; `lora_rank` 0 = full-weight sync (no LoRA)."""

    model: str
    served_model_name: str | None = None  # default: vLLM names the model by `model`
    host: str = "127.0.0.1"
    port: int = 8000
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    lora_rank: int = 0
    max_loras: int = 2
    seed: int = 0
    enable_prefix_caching: bool = True
    cuda_visible_devices: str | None = None
    extra_args: tuple[str, ...] = ()


def command(opts: LaunchOptions) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) that start `vllm serve` for `opts`."""
    argv = [
        "vllm",
        "serve",
        opts.model,
        "--host",
        opts.host,
        "--port",
        str(opts.port),
        "--dtype",
        opts.dtype,
        "--seed",
        str(opts.seed),
        "--gpu-memory-utilization",
        str(opts.gpu_memory_utilization),
        "--tensor-parallel-size",
        str(opts.tensor_parallel_size),
        "--logprobs-mode",
        "processed_logprobs",
        "--worker-extension-cls",
        WORKER_EXTENSION,
        "--generation-config",
        "vllm",
    ]
    if opts.served_model_name:
        argv += ["--served-model-name", opts.served_model_name]
    if opts.max_model_len:
        argv += ["--max-model-len", str(opts.max_model_len)]
    argv.append(
        "--enable-prefix-caching" if opts.enable_prefix_caching else "--no-enable-prefix-caching"
    )
    if opts.lora_rank:
        argv += [
            "--enable-lora",
            "--max-lora-rank",
            str(opts.lora_rank),
            "--max-loras",
            str(opts.max_loras),
        ]
    argv += list(opts.extra_args)
    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if opts.lora_rank:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(THIRD_PARTY)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    if opts.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = opts.cuda_visible_devices
    return argv, env


def options_from_config(config, **overrides) -> LaunchOptions:
    """LaunchOptions for a training ConfigDict (model, LoRA rank, lengths, seed, rollout.url)."""
    url = urllib.parse.urlparse(config.rollout.url)
    kw = dict(
        model=config.model.path,
        port=url.port or 8000,
        max_model_len=int(config.batch.max_prompt_len + config.batch.max_completion_len),
        lora_rank=int(config.lora.rank) if config.lora.enabled else 0,
        seed=int(config.seed),
        dtype="bfloat16" if config.model.dtype == "bfloat16" else "auto",
    )
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return LaunchOptions(**kw)
