"""`EmbeddedBackend`: hosts a checkpoint for `server.OpenAIServer` with the embedded JAX sampler.

Weight routes behave as vLLM's do for the rollout client:
  /collective_rpc `RELOAD_METHOD` {"weights_path": path}: loads the HF safetensors in `path` into
    the base model (vLLM's own `reload_weights` takes the same kwargs).
  /v1/load_lora_adapter: reads a PEFT folder (adapter_config.json + adapter_model.safetensors) and
    serves base + adapter under the new name; adapters follow later base reloads, as in vLLM.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import threading
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from mmr_jax.models import hub
from mmr_jax.rollout import (
    base,
    embedded,
    padding,
    sampler,
    sampler_weights,
    sampling,
    sampling_call,
    vllm_engine,
)
from mmr_jax.serving import prompt_logprobs, scoring, slot_engine, slot_grid

log = logging.getLogger(__name__)

_PEFT_PREFIX = "base_model.model."


def read_peft_adapter(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """(adapter_config, {HF module name: {'A': [r, in], 'B': [out, r]}}) of a PEFT folder."""
    from safetensors.numpy import load_file

    path = pathlib.Path(path)
    cfg_file, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not cfg_file.exists() or not weights.exists():
        raise FileNotFoundError(f"{path} has no adapter_config.json + adapter_model.safetensors")
    config = json.loads(cfg_file.read_text())
    if config.get("use_rslora") or config.get("use_dora"):
        raise ValueError(f"{path}: rsLoRA / DoRA adapters are not supported")
    tensors: dict[str, dict[str, np.ndarray]] = {}
    for name, value in load_file(str(weights)).items():
        name = name.removeprefix(_PEFT_PREFIX).replace(".default.", ".")
        for part in ("A", "B"):
            suffix = f".lora_{part}.weight"
            if name.endswith(suffix):
                tensors.setdefault(name[: -len(suffix)], {})[part] = value
    return config, tensors


def _adapter_value(path: tuple, tensors: dict, num_layers: int, used: set) -> np.ndarray:
    """Our stacked lora_a [L, in, r] / lora_b [L, r, out] at `path` from the PEFT tensors of
    each layer's module ('model.layers.3.self_attn.q_proj': A [r, in], B [out, r])."""
    from mmr_jax.models import loading

    part = "A" if path[-1] == "lora_a" else "B"
    per_layer = []
    for i in range(num_layers):
        module = loading.hf_module(path[:-1], i)
        pair = tensors.get(module)
        if pair is None or set(pair) != {"A", "B"}:
            raise ValueError(f"adapter has no lora_A/lora_B for {module}")
        used.add(module)
        per_layer.append(pair[part].T)
    return np.stack(per_layer)


def build_lora_model(base_model, config: dict, tensors: dict[str, dict[str, np.ndarray]]):
    """A LoRA decoder sharing `base_model`'s weights, with the adapter's A and B filled in."""
    import jax.numpy as jnp

    from mmr_jax.models import loading
    from mmr_jax.models import lora as lora_lib

    present = {n.rsplit(".", 1)[-1] for n in tensors}
    targets = tuple(t for t in lora_lib.ALL_TARGETS if t in present)
    lora_cfg = lora_lib.LoraConfig(  # As the trainer builds it, so jit caches are shared.
        rank=int(config["r"]),
        alpha=float(config["lora_alpha"]),
        dropout=float(config.get("lora_dropout", 0.0)),
        target_modules=targets,
    )
    abstract = loading.abstract_model(base_model.config, dtype=base_model.dtype, lora=lora_cfg)
    graphdef, state = nnx.split(abstract)
    base_flat = dict(nnx.to_flat_state(nnx.state(base_model)))
    flat, used = [], set()
    for path, var in nnx.to_flat_state(state):
        if isinstance(var, nnx.LoRAParam):
            value = _adapter_value(path, tensors, base_model.config.num_layers, used)
            flat.append((path, var.replace(jnp.asarray(value, var.get_value().dtype))))
        elif path in base_flat:
            flat.append((path, base_flat[path]))
        elif isinstance(var, nnx.RngKey):  # LoRA dropout stream (unused: eval mode)
            flat.append((path, var.replace(jax.random.key(0))))
        else:
            flat.append(
                (path, var.replace(jnp.zeros(var.get_value().shape, var.get_value().dtype)))
            )
    unused = sorted(set(tensors) - used)
    if unused:
        raise ValueError(f"adapter modules not in the model: {unused[:5]}")
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    model.eval()
    return model


class EmbeddedBackend:
    """A checkpoint served by the embedded sampler (implements `server.Backend`).

    Args:
      engine: the base model's `EmbeddedEngine`.
      tokenizer: a transformers tokenizer (text prompts, output text, logprob token strings).
      model_name: the name clients use (vLLM's --served-model-name).
      max_model_len: prompt + completion limit (default: the model's max positions; more is
        refused).
      logprobs_mode: what the reported log-probs are (`sampling.LOGPROBS_MODES`).
    """

    def __init__(
        self,
        engine: embedded.EmbeddedEngine,
        tokenizer,
        *,
        model_name: str,
        max_model_len: int | None = None,
        logprobs_mode: str = "scaled_logprobs",
    ):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        if max_model_len and engine.max_len and max_model_len > engine.max_len:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's {engine.max_len} positions"
            )
        self.max_model_len = int(max_model_len or engine.max_len or 2**31 - 1)
        self.eos_token_ids = engine.stop_token_ids
        self.vocab_size = int(engine.model.config.vocab_size)
        if logprobs_mode not in sampling.LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {sampling.LOGPROBS_MODES}")
        self.logprobs_mode = logprobs_mode
        self._adapters: dict[str, tuple[str, dict, dict]] = {}
        self._adapter_models: dict[str, nnx.Module] = {}
        self._lock = threading.RLock()
        self._weight_cache: dict[str, tuple] = {}
        self._slots: slot_engine.SlotEngine | None = None
        self._scorer = scoring.Scorer(self.max_model_len, engine.pad_id)

    # ---- continuous batching ---------------------------------------------------------------------

    def enable_slots(self, *, kv_cache_bytes: int, max_num_seqs: int, log=print):
        """Sizes the continuous batch's KV cache by `kv_cache_bytes` (`slot_grid.Grid`),
        allocates it and compiles the base model's programs (a line per program to `log`)."""
        model = self.engine.model
        grid = slot_grid.Grid.from_budget(
            model.config,
            model.dtype,
            kv_cache_bytes=kv_cache_bytes,
            max_model_len=self.max_model_len,
            max_num_seqs=max_num_seqs,
        )
        log(
            f"KV cache: {grid.slots} slots x {grid.columns} tokens "
            f"({grid.cache_bytes / 2**30:.2f} GiB)"
        )
        with self._lock:
            self._slots = slot_engine.SlotEngine(
                grid, model, self._slot_weights, logprobs_mode=self.logprobs_mode, log=log
            )
            self._slots.prepare(self.model_name)
            self._compile_scoring(self.model_name, log)
        return grid

    def _compile_scoring(self, name: str, log) -> None:
        graphdef, state = nnx.split(self._decoder(name))
        self._scorer.compile(name, graphdef, state, log=log)

    def slot_engine(self) -> slot_engine.SlotEngine | None:
        """The continuous batch's engine (`enable_slots`), or None."""
        return self._slots

    def _slot_weights(self, model: str):
        state, kernels = self._weights(model)
        return nnx.graphdef(self._decoder(model)), state, kernels

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        model_name: str | None = None,
        tokenizer_path: str | os.PathLike | None = None,
        seed: int = 0,
        max_model_len: int | None = None,
        buckets=padding.DEFAULT_MIN_SIZES,
        logprobs_mode: str = "scaled_logprobs",
    ):
        tokenizer = hub.load_tokenizer(tokenizer_path or path)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        engine = embedded.EmbeddedEngine.from_pretrained(
            path, seed=seed, pad_id=pad, buckets=buckets
        )
        return cls(
            engine,
            tokenizer,
            model_name=model_name or str(path),
            max_model_len=max_model_len,
            logprobs_mode=logprobs_mode,
        )

    # ---- generation ------------------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: base.SamplingParams,
        *,
        model: str,
        ignore_eos: bool = False,
    ) -> base.RolloutBatch:
        with self._lock:
            call = self.start(prompt_ids, params, model=model, ignore_eos=ignore_eos)
            call.advance(None)
            return call.batch()

    def exclusive(self):
        """Held while a batch is decoded (and its top log-probs computed): weights stay put."""
        return self._lock

    def start(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: base.SamplingParams,
        *,
        model: str,
        ignore_eos: bool = False,
        n_slots: int | None = None,
    ) -> sampling_call.Sampling:
        """The prefilled decode of `prompt_ids` (`sampler.start`), to advance in chunks; call
        with `exclusive()` held until it is finished."""
        with self._lock:
            weights, kernels = self._weights(model)
            return sampler.start(
                self._decoder(model),
                prompt_ids,
                params,
                stop_token_ids=() if ignore_eos else self.eos_token_ids,
                seed=self.engine.next_seed(),
                pad_id=self.engine.pad_id,
                buckets=self.engine.buckets,
                max_len=self.max_model_len,
                n_slots=n_slots,
                logprobs_mode=self.logprobs_mode,
                weights=weights,
                kernels=kernels,
            )

    def _weights(self, model: str):
        """(sampling weights, weight-major kernels or None) of `model`, made once per weight
        version (the kernels are a transposed copy of the weights: made per call, they cost
        SmolLM2 a few hundred ms of every request's time to first token)."""
        if model not in self._weight_cache:
            decoder = self._decoder(model)
            state = sampler_weights.sampling_weights(decoder)
            kernels = None
            if sampler_weights.weight_major(state):
                kernels = sampler_weights.weight_major_kernels(nnx.graphdef(decoder), state)
            self._weight_cache[model] = (state, kernels)
        return self._weight_cache[model]

    def top_logprobs(
        self,
        sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
        k: int,
        *,
        temperature: float,
        model: str,
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per (prompt, completion): the k most likely tokens at each completion position, as
        (ids int32 [T, k], log-probs float32 [T, k]) of log softmax(logits / temperature), most
        likely first. One teacher-forced pass per sequence (`scoring`: one at a time, so the
        logits [1, length, V] stay small; compiled at start-up with `enable_slots`)."""
        out = []
        with self._lock:
            for prompt, completion in sequences:
                row = list(prompt) + list(completion)
                _, _, ids, logps = self._score(model, row, temperature)
                at = slice(len(prompt) - 1, len(row) - 1)  # the logits that predict `completion`
                out.append((ids[at, :k], logps[at, :k]))
        return out

    def prompt_scores(self, prompt: Sequence[int], k: int, *, model: str):
        """`prompt_logprobs.scores` of `prompt`."""
        with self._lock:
            return prompt_logprobs.scores(
                lambda row, temperature: self._score(model, row, temperature), prompt, k
            )

    def _score(self, model: str, row: Sequence[int], temperature: float):
        graphdef, state = nnx.split(self._decoder(model))
        return self._scorer.score(model, graphdef, state, row, temperature)

    def chat_prompt(self, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
        """The prompt ids of `messages`: the chat template rendered with the assistant's
        generation prompt (and `template_kwargs` as extra template variables), then tokenized
        without added special tokens (as vLLM does)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer of {self.model_name!r} has no chat template")
        kwargs = {"add_generation_prompt": True, **(template_kwargs or {})}
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        return [self.tokenizer.decode([int(t)]) for t in ids]

    # ---- weights ---------------------------------------------------------------------------------

    def adapters(self) -> dict[str, str]:
        return {name: entry[0] for name, entry in self._adapters.items()}

    def _decoder(self, model: str):
        return self.engine.model if model == self.model_name else self._adapter_model(model)

    def _adapter_model(self, name: str):
        if name not in self._adapter_models:
            _, config, tensors = self._adapters[name]
            self._adapter_models[name] = build_lora_model(self.engine.model, config, tensors)
        return self._adapter_models[name]

    def load_adapter(self, name: str, path: str) -> None:
        config, tensors = read_peft_adapter(path)
        with self._lock:  # Built now, so an adapter that does not fit fails here.
            self._adapter_models[name] = build_lora_model(self.engine.model, config, tensors)
            self._adapters[name] = (str(path), config, tensors)
            self._weight_cache.pop(name, None)
            if self._slots is not None:  # its programs now, not at its first request
                self._slots.prepare(name)
                self._compile_scoring(name, lambda line: log.info("%s", line))

    def unload_adapter(self, name: str) -> None:
        with self._lock:
            self._adapters.pop(name)
            self._adapter_models.pop(name, None)
            self._weight_cache.pop(name, None)
            self._scorer.forget(name)
            if self._slots is not None:
                self._slots.forget(name)

    def reload_weights(self, weights_path: str) -> dict:
        """Loads the HF safetensors in `path` (shapes of the served model) into the base model."""
        from mmr_jax.models import loading

        model = self.engine.model
        path = weights_path
        new = loading.load_weights(loading.abstract_model(model.config, dtype=model.dtype), path)
        with self._lock:
            nnx.update(model, nnx.state(new, nnx.Param))
            self._adapter_models.clear()  # Rebuilt on the new base when next used.
            self._weight_cache.clear()
        return {"path": str(path), "num_tensors": len(nnx.to_flat_state(nnx.state(new)))}

    def collective_rpc(self, method: str, args: list, kwargs: dict):
        if method == vllm_engine.RELOAD_METHOD:
            return self.reload_weights(*args, **kwargs)
        raise ValueError(f"unknown collective_rpc method {method!r}")
