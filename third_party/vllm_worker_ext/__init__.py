"""vLLM worker extension: reload a model's weights from HF safetensors on a path.

Runs inside every vLLM worker process, mixed into vLLM's Worker class by

    vllm serve MODEL --worker-extension-cls vllm_worker_ext.WeightSyncExtension

(with `third_party/` on PYTHONPATH; scripts/launch_vllm.py sets both). The trainer then calls

    POST /collective_rpc {"method": "mmr_reload_weights", "args": ["/shared/sync/weights-v12"]}
    POST /reset_prefix_cache

(both routes need VLLM_SERVER_DEV_MODE=1 on the server). Each worker streams the tensors of
`*.safetensors` in the folder through `model.load_weights`, which takes HF names and does the
tensor-parallel slicing and q/k/v and gate/up packing itself. Unquantised models only.

Import-light on purpose: nothing from mmr_jax, torch and safetensors only when called.
"""

from __future__ import annotations

import glob
import os

RELOAD_METHOD = "mmr_reload_weights"  # Kept equal to mmr_jax.rollout.vllm_engine.RELOAD_METHOD.


def iter_safetensors(path: str, device: str = "cpu"):
    """Yields (HF name, tensor) for every tensor of the *.safetensors files in `path`."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for file in files:
        with safe_open(file, framework="pt", device=device) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


class WeightSyncExtension:
    """Methods added to vLLM's Worker; `self.model_runner` is the worker's model runner."""

    def _mmr_model(self):
        runner = self.model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def mmr_reload_weights(self, path: str) -> dict:
        """Loads every tensor under `path` into the served model; returns a small JSON summary."""
        import torch

        count = 0

        def counted():
            nonlocal count
            for item in iter_safetensors(path):
                count += 1
                yield item

        self._mmr_model().load_weights(weights=counted())
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {"path": path, "num_tensors": count}
