"""Hugging Face safetensors checkpoints -> `decoder.Decoder`.

The model is built abstractly (`nnx.eval_shape`, no memory), then every parameter is filled from its
tensor, read on its own from a memory-mapped safetensors file (single file or sharded index) and
placed straight into its target dtype and sharding with `jax.make_array_from_callback`, so each
device only touches its own slice and no full host copy of the model is ever made.

Name/layout table (our state path -> HF tensor name; kernels are HF Linear weights transposed):
  embed_tokens/embedding                 model.embed_tokens.weight            [V, E]
  layers/self_attn/{q,k,v,o}_proj/kernel     model.layers.N.self_attn.*.weight   transposed
  layers/self_attn/{q,k,v,o}_proj/bias       model.layers.N.self_attn.*.bias
  layers/mlp/{gate,up,down}_proj/kernel      model.layers.N.mlp.*.weight         transposed
  layers/{input,post_attention}_layernorm/weight     model.layers.N.*.weight
(`layers/...` are stacked: [L, ...], layer N at index N, read one layer slice at a time.)
  norm/weight                            model.norm.weight
  lm_head/kernel                         lm_head.weight (untied only)          transposed
LoRA adapters are not in the checkpoint: lora_a is drawn as in PEFT, lora_b is zero.
"""

from __future__ import annotations

import json
import math
import os
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from mmr_jax.models import config as config_lib
from mmr_jax.models import decoder, hub
from mmr_jax.models import lora as lora_lib
from mmr_jax.models import sharding as sharding_lib

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def is_stacked(path: tuple) -> bool:
    """Whether the parameter at `path` belongs to the stacked layers (leading layer axis)."""
    return str(path[0]) == "layers"


def hf_name(path: tuple, layer: int | None = None) -> tuple[str, bool]:
    """(HF tensor name, transpose?) for one of our parameter paths (of layer `layer` when the
    path is a stacked layer parameter: ('layers', 'self_attn', 'q_proj', 'kernel'), 3 ->
    'model.layers.3.self_attn.q_proj.weight')."""
    parts = [str(p) for p in path]
    if is_stacked(path):
        if layer is None:
            raise ValueError(f"{'/'.join(parts)} is stacked over the layers: give the layer")
        parts.insert(1, str(layer))
    leaf = parts[-1]
    prefix = "" if parts[0] == "lm_head" else "model."
    name = prefix + ".".join(parts[:-1]) + (".bias" if leaf == "bias" else ".weight")
    return name, leaf == "kernel"


def hf_module(path: tuple, layer: int) -> str:
    """The HF module name of a stacked layer module's path, for layer `layer`:
    ('layers', 'self_attn', 'q_proj') -> 'model.layers.3.self_attn.q_proj'."""
    parts = [str(p) for p in path]
    return ".".join(["model", parts[0], str(layer), *parts[1:]])


def _layer_range(idx, num_layers: int) -> range:
    return range(num_layers)[idx[0]]


class SafetensorsFile:
    """Reads single tensors from a safetensors file through a read-only memory map (any dtype)."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        with open(self.path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        self.header, self._base = header, 8 + n
        self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")

    def keys(self):
        return self.header.keys()

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        raw = self._mmap[self._base + start : self._base + end]
        return raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


def open_checkpoint(path: str | os.PathLike) -> dict[str, SafetensorsFile]:
    """{tensor name: file} for `model.safetensors` or a `model.safetensors.index.json` set."""
    path = pathlib.Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {f: SafetensorsFile(path / f) for f in sorted(set(weight_map.values()))}
        return {name: files[f] for name, f in weight_map.items()}
    single = path / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    f = SafetensorsFile(single)
    return {name: f for name in f.keys()}


def abstract_model(
    cfg: config_lib.ModelConfig,
    *,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    lora: lora_lib.LoraConfig | None = None,
    frozen_dtype=None,
) -> decoder.Decoder:
    """The decoder with ShapeDtypeStruct leaves (no memory allocated)."""
    kw = dict(dtype=dtype, param_dtype=param_dtype, lora=lora, frozen_dtype=frozen_dtype)
    return nnx.eval_shape(lambda: decoder.Decoder(cfg, rngs=nnx.Rngs(0), **kw))


def _place(shape, dtype, sharding, read):
    """A jax.Array of `shape`/`dtype` whose device slices come from `read(index)` (host numpy)."""
    if sharding is None:
        return jax.device_put(np.asarray(read((slice(None),) * len(shape)), dtype=dtype))
    return jax.make_array_from_callback(
        shape, sharding, lambda idx: np.asarray(read(idx), dtype=dtype)
    )


def _lora_value(path, shape, dtype, seed):
    """One layer's adapter: lora_b = 0; lora_a [in, r] ~ U(-1/sqrt(in), 1/sqrt(in)) from a seed of
    the run's and the path's (with its layer: 'layers/3/self_attn/q_proj/lora_a')."""
    if path[-1] == "lora_b":
        return np.zeros(shape, dtype)
    bound = 1.0 / math.sqrt(shape[0])
    path_seed = [seed, *(ord(c) for c in "/".join(map(str, path)))]
    return np.random.default_rng(path_seed).uniform(-bound, bound, shape).astype(dtype)


def _lora_init(path, shape, dtype, sharding, seed):
    """The adapter at `path`, drawn on the host (small); stacked paths draw each layer's own."""
    if is_stacked(path):
        value = np.stack(
            [_lora_value((path[0], i, *path[1:]), shape[1:], dtype, seed) for i in range(shape[0])]
        )
    else:
        value = _lora_value(path, shape, dtype, seed)
    return _place(shape, dtype, sharding, lambda idx: value[idx])


def _read_stacked(path, shape, tensors, used, missing):
    """A reader of the stacked parameter at `path` from its L per-layer HF tensors, or None.

    The reader stacks only the layers and the slice each device asks for: the checkpoint is read
    through its memory map, so no full copy of the stacked parameter is made on the host.
    """
    sources = []
    for i in range(shape[0]):
        name, transpose = hf_name(path, i)
        if name not in tensors:
            missing.append(name)
            continue
        used.add(name)
        src = tensors[name].get(name)
        sources.append(src.T if transpose else src)
    if len(sources) < shape[0]:
        return None
    for i, src in enumerate(sources):
        if tuple(src.shape) != shape[1:]:
            raise ValueError(
                f"tensor {hf_name(path, i)[0]}: checkpoint shape {src.shape} (after layout) != "
                f"model {shape[1:]}"
            )
    return lambda idx: np.stack([sources[i][idx[1:]] for i in _layer_range(idx, shape[0])])


def _fill(path, var, tensors, used, missing, mesh, seed):
    """The concrete value for the abstract variable at `path` (None if its tensor is missing)."""
    shape, dtype = tuple(var.get_value().shape), var.get_value().dtype
    sharding = None if mesh is None else sharding_lib.named_sharding(path, shape, mesh)
    if isinstance(var, nnx.RngKey):  # LoRA dropout stream
        return jax.random.key(seed)
    if isinstance(var, nnx.RngCount):
        return jnp.zeros(shape, dtype)
    if isinstance(var, nnx.LoRAParam):
        return _lora_init(path, shape, dtype, sharding, seed)
    if is_stacked(path):
        read = _read_stacked(path, shape, tensors, used, missing)
        return None if read is None else _place(shape, dtype, sharding, read)
    name, transpose = hf_name(path)
    if name not in tensors:
        missing.append(name)
        return None
    used.add(name)
    src = tensors[name].get(name)
    src = src.T if transpose else src
    if tuple(src.shape) != shape:
        raise ValueError(
            f"tensor {name}: checkpoint shape {src.shape} (after layout) != model {shape}"
        )
    return _place(shape, dtype, sharding, lambda idx: src[idx])


def _layer_count(tensors) -> int:
    """How many decoder layers the checkpoint holds (1 + the highest model.layers.N)."""
    found = [int(n.split(".")[2]) for n in tensors if n.startswith("model.layers.")]
    return 1 + max(found, default=-1)


def load_weights(model_abstract: decoder.Decoder, path, *, mesh=None, rngs=None) -> decoder.Decoder:
    """Fills an abstract decoder from the checkpoint at `path`; errors list missing/unexpected."""
    tensors = open_checkpoint(path)
    graphdef, state = nnx.split(model_abstract)
    seed = int(jax.random.randint((rngs or nnx.Rngs(0)).params(), (), 0, 2**31 - 1))
    used, missing, flat = set(), [], []
    for p, var in nnx.to_flat_state(state):
        value = _fill(p, var, tensors, used, missing, mesh, seed)
        flat.append((p, var.replace(value) if value is not None else var))
    unexpected = [
        n
        for n in tensors
        if n not in used
        and not n.endswith(_IGNORED_SUFFIXES)
        and not (n == "lm_head.weight" and model_abstract.config.tie_word_embeddings)
    ]
    layers_here = _layer_count(tensors)
    if layers_here != model_abstract.config.num_layers:
        raise ValueError(
            f"checkpoint {path} has {layers_here} decoder layers, the model config "
            f"{model_abstract.config.num_layers} (num_hidden_layers): they must match"
        )
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match the model: missing tensors {sorted(missing)}; "
            f"unexpected tensors {sorted(unexpected)}"
        )
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    model.eval()
    return model


def from_pretrained(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    mesh: jax.sharding.Mesh | None = None,
    lora: lora_lib.LoraConfig | None = None,
    rngs: nnx.Rngs | None = None,
    remat: str | bool = "none",
    frozen_dtype=None,
    attention_impl: str = "xla",
) -> decoder.Decoder:
    """Loads a HF checkpoint (config.json + safetensors) as a `Decoder` in eval mode.

    Args:
      path: the checkpoint folder, or a hub repo id ('Qwen/Qwen2.5-1.5B'), fetched once.
      dtype: compute dtype; param_dtype: storage dtype of the weights (fp32 master weights).
      mesh: place each parameter with its partition rule on this mesh (default: one device).
      lora: add adapters (B = 0, so the model starts equal to the base).
      rngs: randomness for lora_a (its `params` stream).
      remat: the remat policy of the scanned layer (`config.REMAT_POLICIES`).
      frozen_dtype: with `lora`, the storage dtype of the frozen base (`decoder.Decoder`).
      attention_impl: the training forwards' attention backend (`config.ATTENTION_IMPLS`).
    """
    path = hub.resolve_checkpoint(path)
    cfg = config_lib.ModelConfig.from_hf(path, remat=remat, attention_impl=attention_impl)
    abstract = abstract_model(
        cfg, dtype=dtype, param_dtype=param_dtype, lora=lora, frozen_dtype=frozen_dtype
    )
    return load_weights(abstract, path, mesh=mesh, rngs=rngs)
