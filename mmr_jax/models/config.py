"""Model configuration read from a Hugging Face `config.json` (Llama and Qwen2 families).

Sizes always come from the checkpoint's config, never from presets. Fields whose values the decoder
does not implement (another activation, sliding-window attention, an unknown rope type, a quantised
checkpoint, ...) raise a `ValueError` that names the field, instead of silently computing something
else.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
_ROPE_KEYS_LLAMA3 = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


# What the backward pass keeps of each scanned layer (decoder.scan_layers maps them to JAX's
# checkpoint policies): none = everything (no recomputation), full = the layer's input only,
# dots_saveable = matmul outputs, dots_with_no_batch_dims_saveable = weight matmuls' outputs.
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")


# Backends of the training forwards' attention (`attention_impl.dot_product`).
ATTENTION_IMPLS = ("auto", "xla", "unfused", "cudnn", "cudnn_maskfree", "pallas_tpu")


def config_file(path: str | os.PathLike) -> pathlib.Path:
    """config.json of a checkpoint folder (or the file itself), else the upstream config kept as
    third_party/hf_configs/<name>.json: a random-weights run needs only the architecture."""
    p = pathlib.Path(path)
    stem = p.name.lower().replace("-", "_").replace(".", "_")
    models_dir = pathlib.Path(__file__).resolve().parents[2] / "third_party" / "hf_configs"
    for cand in (p / "config.json", p, models_dir / f"{stem}.json"):
        if cand.is_file():
            return cand
    raise FileNotFoundError(f"no config.json in {path} (nor third_party/hf_configs/{stem}.json)")


def remat_policy_name(value) -> str:
    """The remat policy named by a config value (bools, the old form: True = full, False = none)."""
    if isinstance(value, bool):
        return "full" if value else "none"
    if value not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {value!r}; expected one of {REMAT_POLICIES}")
    return value


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder hyper-parameters.

    `rope_scaling` is None (plain RoPE) or a tuple of (key, value) pairs of a `llama3` scaling,
    kept as a tuple so the config stays hashable (usable as a static jit argument).
    `attention_bias` is the q/k/v bias (always on for Qwen2); `o_proj_bias` the output-projection
    bias (Llama's `attention_bias` flag sets both).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    max_position_embeddings: int = 2048
    model_type: str = "llama"
    remat: str = "none"  # remat policy of the scanned layer (REMAT_POLICIES)
    scan_unroll: int = 1  # lax.scan's unroll over the layers (num_layers: an unrolled program)
    attention_impl: str = "xla"  # training forwards' attention backend (attention_impl.py)

    def __post_init__(self):
        object.__setattr__(self, "remat", remat_policy_name(self.remat))
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"unknown attention_impl {self.attention_impl!r}; expected one of {ATTENTION_IMPLS}"
            )
        if not 1 <= self.scan_unroll <= max(self.num_layers, 1):
            raise ValueError(
                f"scan_unroll must be in [1, {self.num_layers}], got {self.scan_unroll}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @classmethod
    def from_hf(cls, config: dict | str | os.PathLike, **overrides) -> ModelConfig:
        """Builds the config from a `config.json` dict, a path to the file, or its folder.

        `overrides` replace fields after parsing (e.g. `remat='full'`).
        """
        if not isinstance(config, dict):
            path = pathlib.Path(config)
            if path.is_dir():
                path = path / "config.json"
            config = json.loads(path.read_text())
        return dataclasses.replace(_parse(config), **overrides)

    def to_hf(self) -> dict[str, Any]:
        """A transformers-loadable `config.json` dict for this config (used by export)."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[self.model_type]
        rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope.update(self.rope_scaling_dict)
            rope["rope_type"] = "llama3"
        out = dict(
            architectures=[arch],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            rope_scaling=None if self.rope_scaling is None else rope,
            rope_parameters=rope,
        )
        if self.model_type == "llama":
            out.update(attention_bias=self.attention_bias, mlp_bias=False)
        else:
            out.update(use_sliding_window=False, sliding_window=None)
        return out


def _rope(config: dict) -> tuple[float, tuple | None]:
    """(rope_theta, llama3 scaling or None) from `rope_scaling` / `rope_parameters` (v5 name)."""
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling")
    if scaling:
        params.update(scaling)
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: None, 'llama3')")
    missing = [k for k in _ROPE_KEYS_LLAMA3 if k not in params]
    if missing:
        raise ValueError(f"rope_scaling 'llama3' lacks {missing}")
    return theta, tuple((k, float(params[k])) for k in _ROPE_KEYS_LLAMA3)


def _check_unsupported(config: dict) -> None:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    checks = [
        ("hidden_act", config.get("hidden_act", "silu") == "silu"),
        ("mlp_bias", not config.get("mlp_bias", False)),
        ("use_sliding_window", not config.get("use_sliding_window", False)),
        ("quantization_config", config.get("quantization_config") is None),
        ("pretraining_tp", config.get("pretraining_tp", 1) == 1),
        ("rope_interleaved", not config.get("rope_interleaved", False)),
    ]
    layer_types = config.get("layer_types")
    if layer_types:
        checks.append(("layer_types", all(t == "full_attention" for t in layer_types)))
    for field, ok in checks:
        if not ok:
            raise ValueError(f"unsupported config field {field}={config.get(field)!r}")


def _parse(config: dict) -> ModelConfig:
    _check_unsupported(config)
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    theta, scaling = _rope(config)
    is_qwen = config["model_type"] == "qwen2"
    bias = bool(config.get("attention_bias", False))
    return ModelConfig(
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=True if is_qwen else bias,
        o_proj_bias=False if is_qwen else bias,
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        model_type=config["model_type"],
    )
