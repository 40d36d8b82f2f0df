"""Export a `decoder.Decoder` as a Hugging Face folder or a PEFT LoRA adapter folder.

`save_hf` writes config.json, safetensors (sharded with an index above `max_shard_bytes`) with LoRA
merged into the kernels, and copies the tokenizer files, so transformers and vLLM load it directly.
`save_peft_adapter` writes `adapter_config.json` + `adapter_model.safetensors` with PEFT's tensor
names (`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`; lora_A [r, in],
lora_B [out, r]).
Tensors are fetched to the host and written one at a time. Single-host only (`np.asarray` of a
sharded array gathers it on this host).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from mmr_jax.models import layers, loading

_ST_DTYPES = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.float64): "F64",
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)

EMBEDDING, TIED_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def write_safetensors(path: str | os.PathLike, tensors: dict, *, metadata=None) -> None:
    """Writes {name: array or zero-arg callable returning one} as safetensors, one tensor at a time.

    Callables let the caller produce (and fetch) each tensor only when it is written. Every value's
    shape and dtype must be known up front: callables are given as (shape, dtype, fn) tuples.
    """
    entries, dtypes, offset = {}, {}, 0
    for name, item in tensors.items():
        shape, dtype = (
            (item[0], np.dtype(item[1])) if isinstance(item, tuple) else (item.shape, item.dtype)
        )
        dtypes[name] = dtype
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        entries[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header = dict(entries)
    header["__metadata__"] = metadata or {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, item in tensors.items():
            arr = item[2]() if isinstance(item, tuple) else item
            arr = np.ascontiguousarray(np.asarray(arr).astype(dtypes[name]))
            assert list(arr.shape) == entries[name]["shape"], name
            f.write(arr.tobytes())


def _np_dtype(dtype) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(dtype)


def _hf_tensors(model, dtype) -> dict:
    """{HF name: (shape, dtype, fetch)} of the base weights with LoRA merged, in HF's order
    (embedding, layer 0's tensors, layer 1's, ..., final norm, head); stacked layer parameters
    are written one layer at a time."""
    embed, per_layer, rest = {}, {}, {}

    def entry(value, transpose):
        shape = value.shape[::-1] if transpose else value.shape

        def fetch():
            arr = np.asarray(value.astype(jnp.float32))
            return (arr.T if transpose else arr).astype(dtype)

        return tuple(shape), dtype, fetch

    for path, value in layers.merged_params(model):
        if loading.is_stacked(path):
            for i in range(value.shape[0]):
                name, transpose = loading.hf_name(path, i)
                per_layer.setdefault(i, {})[name] = entry(value[i], transpose)
        else:
            name, transpose = loading.hf_name(path)
            (embed if name == EMBEDDING else rest)[name] = entry(value, transpose)
    out = dict(embed)
    for i in sorted(per_layer):
        out.update(per_layer[i])
    out.update(rest)
    return out


def _shard(tensors: dict, max_bytes: int) -> list[dict]:
    shards, cur, size = [], {}, 0
    for name, item in tensors.items():
        nbytes = int(np.prod(item[0], dtype=np.int64)) * np.dtype(item[1]).itemsize
        if cur and size + nbytes > max_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = item
        size += nbytes
    return [*shards, cur]


def save_hf(
    model,
    out_dir: str | os.PathLike,
    *,
    tokenizer_dir=None,
    dtype=jnp.float32,
    max_shard_bytes: int = 5 * 2**30,
    tied_head: bool = False,
) -> pathlib.Path:
    """Writes a HF folder (config.json, safetensors, tokenizer files) that transformers loads.

    tied_head: for a model with tied embeddings, also write `lm_head.weight` (the embedding again).
      HF checkpoints of tied models leave it out; a vLLM in-place reload needs it to refresh the
      head (see `rollout.vllm_engine`). No effect on an untied model, which always writes its head.
    """
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    np_dtype = _np_dtype(dtype)
    cfg = model.config.to_hf()
    cfg["dtype"] = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[
        np_dtype.name
    ]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = _hf_tensors(model, np_dtype)
    if tied_head and model.config.tie_word_embeddings:
        tensors[TIED_HEAD] = tensors[EMBEDDING]
    shards = _shard(tensors, max_shard_bytes)
    if len(shards) == 1:
        write_safetensors(out / "model.safetensors", shards[0])
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(out / fname, shard)
            for name, item in shard.items():
                weight_map[name] = fname
                total += int(np.prod(item[0], dtype=np.int64)) * np_dtype.itemsize
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if tokenizer_dir is not None:
        for fname in TOKENIZER_FILES:
            src = pathlib.Path(tokenizer_dir) / fname
            if src.exists():
                shutil.copy2(src, out / fname)
    return out


def save_peft_adapter(
    model, out_dir: str | os.PathLike, *, base_model_name_or_path: str, dtype=jnp.float32
) -> pathlib.Path:
    """Writes the LoRA adapters as a PEFT folder (loadable by `peft` and vLLM)."""
    cfg = model.lora_config
    if cfg is None:
        raise ValueError("model has no LoRA adapters (load it with lora=LoraConfig(...))")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    np_dtype = _np_dtype(dtype)
    per_layer = {}
    for path, module in nnx.iter_graph(model):
        if isinstance(module, layers.Dense) and module.lora_a is not None:
            for leaf, hf in (("lora_a", "lora_A"), ("lora_b", "lora_B")):
                stacked = np.asarray(getattr(module, leaf)[...].astype(jnp.float32))
                for i in range(stacked.shape[0]):  # [L, in, r] / [L, r, out]: one per layer
                    name = f"base_model.model.{loading.hf_module(path, i)}.{hf}.weight"
                    per_layer.setdefault(i, {})[name] = stacked[i].T.astype(np_dtype)
    tensors = {name: arr for i in sorted(per_layer) for name, arr in per_layer[i].items()}
    write_safetensors(out / "adapter_model.safetensors", tensors)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model_name_or_path),
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted(cfg.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "layers_to_transform": None,
        "revision": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return out
