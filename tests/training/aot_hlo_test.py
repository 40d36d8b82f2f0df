"""The project's programs as an H100's and a TPU v5e's own compilers build them (compile-only
devices, infra/aot_targets.py), read from their optimized HLO (infra/hlo_stats.py):

- decode in place: one decode step writes the KV cache's new token into the donated cache, with
  no copy of a cache-sized buffer, and XLA aliases the cache to the output;
- the fused kernels: with attention_impl='cudnn' both of the train step's attention calls
  (prompts; completions over [prompt ; own]) are cuDNN fused-attention custom calls, forward and
  backward, at the model's head dim and the step's lengths (T = bucket - 1 is odd: padded to even;
  packed rows with their segments); with 'pallas_tpu' on a TPU, splash's Mosaic kernels (forward,
  dq, dkv) for both calls, at the lengths padded to splash's block;
- the bf16 frozen base: with model.frozen_dtype=bfloat16 under LoRA, every frozen weight is a bf16
  argument of the compiled step, and memory_analysis counts its bytes as such.

Each property is checked by a function that lists what breaks it; each is also run against a
deliberately broken variant (the decode step without donation; attention_impl='xla'; a float32
frozen base) and must find something there, so a check that cannot fail would fail its test.

Models: a 2-layer Qwen2-shaped model at head dim 128 (4 heads, 2 kv heads, q/k/v bias), bf16,
and SmolLM2-135M's shape (configs/cpu_smollm2.py, float32: cuDNN does not apply) for the decode.
Slow; needs the compile-only environments: run inside them,

    .venv-aot-gpu/bin/python -m pytest tests/training/aot_hlo_test.py --runslow -m slow -k "not tpu"
    .venv-aot-tpu/bin/python -m pytest tests/training/aot_hlo_test.py --runslow -m slow -k tpu

(scripts/setup_aot_env.sh builds them); elsewhere each test is skipped naming the venv, and where
MMR_JAX_AOT_PLATFORMS names the platform (CI) a missing plugin fails (tests/support/aot.py).
"""

from __future__ import annotations

import collections
import functools
import json
import math
import pathlib
import re

import numpy as np
import pytest

from mmr_jax.infra import hlo_stats

from support import aot

pytestmark = pytest.mark.slow
cpu_backend_for_aot = aot.cpu_backend_for_aot  # the module's fixture

REPO = pathlib.Path(__file__).resolve().parents[2]
P, T = 48, 64  # max_prompt_len, max_completion_len: completions feed T - 1 = 63 tokens (odd)


def _qwen2_dir(root: pathlib.Path) -> str:
    """config.json of the 1.5B's architecture at 2 layers, hidden 512, 4 heads x 128."""
    hf = json.loads(
        (REPO / "third_party/hf_configs/deepseek_r1_distill_qwen_1_5b.json").read_text()
    )
    hf.update(
        num_hidden_layers=2,
        hidden_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=1024,
        vocab_size=4096,
    )
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(hf))
    return str(root)


@functools.cache
def _config(model: str, *, pack: int = 0, lora: str = "", root: str = "", devices: int = 1):
    """A small real config: 2 prompts x 4 completions, one minibatch, `devices` on the fsdp
    axis."""
    from configs import cpu_smollm2, grpo
    from mmr_jax.config import checks

    if model == "smollm2":
        c = cpu_smollm2.get_config()
    else:
        c = grpo.get_config()
        c.model.path = _qwen2_dir(pathlib.Path(root) / "qwen2_2l")
        c.batch.max_prompt_len, c.batch.max_completion_len = P, T
    c.batch.prompts, c.batch.generations = 2, 4
    c.batch.pack_max_len, c.batch.min_bucket_len = pack, 16
    c.loss.minibatches = 1
    c.mesh.shape = (1, devices, 1)
    if lora:
        c.lora.enabled, c.lora.rank, c.model.frozen_dtype = True, 8, lora
    return checks.from_config_dict(c)


@functools.cache
def _compiled(
    target: str, kind: str, model: str, *, attention="", pack=0, lora="", root="", devices=1
):
    """(optimized HLO module, memory analysis, abstract args, config) of one program for `target`:
    'train', 'decode', or 'decode_undonated' (the broken variant: the same step, no donation)."""
    import jax

    from mmr_jax.infra import aot_targets
    from mmr_jax.training import compiled_dry_run, dry_run_programs

    cfg = _config(model, pack=pack, lora=lora, root=root, devices=devices)
    chips = aot_targets.compile_only_devices(aot_targets.parse_target(target))
    mesh = compiled_dry_run.config_mesh(cfg, devices=chips[:devices])
    if kind == "train":
        fn, args = dry_run_programs.train_step_program(cfg, mesh, attention=attention)
    else:
        fn, args = dry_run_programs.decode_step_program(cfg, mesh)
        if kind == "decode_undonated":
            fn = jax.jit(fn.__wrapped__)
    compiled = fn.lower(*args).compile()
    return hlo_stats.parse(compiled.as_text()), compiled.memory_analysis(), args, cfg


@pytest.fixture(scope="module")
def compile_for(cpu_backend_for_aot, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("aot_hlo"))

    def get(target, kind, model="qwen2", fresh=False, **kw):
        """`fresh`: compiled again, not the cached program (a test that patches the code)."""
        aot.require_plugin("cuda" if target.startswith("h") else "tpu")
        return (_compiled.__wrapped__ if fresh else _compiled)(target, kind, model, root=root, **kw)

    return get


# ----- the checks: each returns what breaks its property (empty: holds) -------------------------


def cache_copies(module: hlo_stats.Module, cache) -> list[str]:
    """Ops that write a buffer holding a layer's cache or more: an array whose dims include the
    dims of one layer's K (or V) cache (an in-place update counts only its new token)."""
    k = cache.k.shape  # [layers, rows, kv heads, head dim, slots]
    layer = collections.Counter(k[1:])
    found = []
    for w in hlo_stats.writes(module):
        if w.bytes < math.prod(k[1:]) * np.dtype(cache.k.dtype).itemsize:
            continue
        for _, dims in hlo_stats.arrays(w.instruction.shape):
            if not layer - collections.Counter(dims):
                found.append(f"{w.kind} {w.instruction.name} {w.instruction.shape} x{w.count}")
                break
    return found


def missing_attention_kernels(module, *, target_re, want) -> list[str]:
    """`want`: {label: (kernel name regex, the query operand's dims)}; the labels with no custom
    call (target matching `target_re`) of that name with an operand of those dims (cuDNN's
    query is its first operand, splash's its fourth, after the mask tables)."""
    calls = hlo_stats.custom_calls(module, target_re)
    missing = []
    for label, (name_re, dims) in want.items():
        if not any(
            re.search(name_re, c.target + " " + c.name)
            and any(d == dims for shape in c.operand_shapes for _, d in hlo_stats.arrays(shape))
            for c in calls
        ):
            missing.append(label)
    return missing


def even(n: int) -> int:
    return n + n % 2


def _cudnn_want(cfg, layout):
    """The cuDNN forward and backward calls of both attentions, by q operand [rows, T', N, D]
    (cuDNN's training kernels with a mask take even lengths: `attention_impl._even_lengths`)."""
    from mmr_jax.training import dry_run_programs

    rows, length = cfg.rows_per_step, T - 1
    if layout == "packed":  # k completions a row of L tokens
        k, length = dry_run_programs.packed_shape(cfg)
        rows //= k
    prompts, completions = (cfg.batch.prompts, P, 4, 128), (rows, even(length), 4, 128)
    fwd, bwd = r"fmhaScaleBiasSoftmax\b(?!Backward)", r"fmhaScaleBiasSoftmaxBackward"
    return {
        "prompts forward": (fwd, prompts),
        "prompts backward": (bwd, prompts),
        "completions forward": (fwd, completions),
        "completions backward": (bwd, completions),
    }


# ----- GPU: H100 --------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["qwen2", "smollm2"])
def test_decode_donates_its_cache(compile_for, model):
    _, memory, args, _ = compile_for("h100:1", "decode", model)
    own_cache = args[6]
    cache_bytes = sum(x.size * np.dtype(x.dtype).itemsize for x in (own_cache.k, own_cache.v))
    assert memory.alias_size_in_bytes >= cache_bytes


@pytest.mark.xfail(
    strict=True,
    reason="XLA:GPU copies the K caches each decode step: the stacked [layers, rows, K, D, slots] "
    "K cache is transposed whole to [.., slots, D] on entry (wrapped_transpose, prompt and own "
    "cache), then each layer's slice of it copied by the scan (dynamic-slice); the update itself "
    "is in place (docs/performance.md, 'What the GPU compiler shows')",
)
@pytest.mark.parametrize("model", ["qwen2", "smollm2"])
def test_decode_reads_the_cache_without_copying_it(compile_for, model):
    module, _, args, _ = compile_for("h100:1", "decode", model)
    assert cache_copies(module, args[6]) == []


def test_decode_check_finds_the_copy_without_donation(compile_for):
    module, memory, args, _ = compile_for("h100:1", "decode_undonated", "qwen2")
    assert cache_copies(module, args[6]), "the undonated step must copy its cache"
    assert memory.alias_size_in_bytes == 0


@pytest.mark.parametrize("pack", [0, 128])
def test_cudnn_runs_both_attention_calls(compile_for, pack):
    """Shared prompt (completions T = 63, padded to 64; keys 48 + 63 = 111, padded to 112) and
    packed rows (two completions a row, a bucket of 128: keys 48 + 128)."""
    module, _, _, cfg = compile_for("h100:1", "train", attention="cudnn", pack=pack)
    want = _cudnn_want(cfg, "packed" if pack else "shared")
    assert missing_attention_kernels(module, target_re=r"cudnn", want=want) == []


def test_cudnn_check_finds_xla_attention(compile_for):
    module, _, _, cfg = compile_for("h100:1", "train", attention="xla", pack=128)
    want = _cudnn_want(cfg, "packed")
    assert missing_attention_kernels(module, target_re=r"cudnn", want=want) == list(want)


def frozen_not_in(module, dtype: str) -> list[str]:
    """ENTRY parameters of the frozen base's weights (`frozen` in their name, projection kernels
    and the embedding: what `model.frozen_dtype` stores; norms and biases stay in param_dtype)
    whose type is not `dtype`; ['none'] when there are none at all."""
    params = [
        i
        for i in module.computations[module.entry]
        if i.opcode == "parameter"
        and "frozen" in i.name
        and ("kernel" in i.name or "embedding" in i.name)
    ]
    wrong = [f"{i.name}: {i.shape}" for i in params if hlo_stats.arrays(i.shape)[0][0] != dtype]
    return wrong if params else ["none"]


def test_lora_frozen_base_is_bf16_in_the_compiled_step(compile_for):
    module, memory, args, _ = compile_for("h100:1", "train", attention="cudnn", lora="bfloat16")
    assert frozen_not_in(module, "bf16") == []
    # XLA's argument bytes are the abstract arguments' (frozen weights at 2 bytes each), less
    # the few scalars jit leaves out because the step does not read them (12 bytes here)
    want = sum(_nbytes(x) for x in _leaves(args))
    assert want - 64 <= memory.argument_size_in_bytes <= want


def test_frozen_check_finds_a_float32_base(compile_for):
    _, mem16, args, _ = compile_for("h100:1", "train", attention="cudnn", lora="bfloat16")
    f32, mem32, _, _ = compile_for("h100:1", "train", attention="cudnn", lora="float32")
    assert frozen_not_in(f32, "bf16") != []
    frozen = sum(x.size for x in _leaves(args[2]) if np.dtype(x.dtype).itemsize == 2)
    assert mem32.argument_size_in_bytes - mem16.argument_size_in_bytes == 2 * frozen


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def _nbytes(x) -> int:
    """Bytes of an abstract array (a PRNG key: its key data's)."""
    import jax

    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.eval_shape(jax.random.key_data, x)
    return x.size * np.dtype(x.dtype).itemsize


# ----- TPU: v5e ---------------------------------------------------------------------------------


def _splash_want(cfg, devices=1):
    """Splash's three kernels for both attentions, by one device's q operand [rows, K, G, T', D]:
    lengths padded to splash's block of 128 (prompts 48 -> 128, completions 63 -> 128); on
    `devices` chips of the fsdp axis each runs its share of the rows (the 2 prompts padded to
    split evenly: `attention_impl.splash_layout`; a chip's one row is a q of [K, G, T', D], the
    compiler drops the unit dim)."""

    def q(rows):
        return (rows, 2, 2, 128, 128) if rows > 1 else (2, 2, 128, 128)

    prompts, completions = q(-(-cfg.batch.prompts // devices)), q(cfg.rows_per_step // devices)
    want = {}
    for kernel in ("fwd", "dq", "dkv"):
        want[f"prompts {kernel}"] = (rf"splash_mqa_{kernel}", prompts)
        want[f"completions {kernel}"] = (rf"splash_mqa_{kernel}", completions)
    return want


def test_tpu_splash_kernels_in_the_train_step(compile_for):
    """Through libtpu's Mosaic compiler (not Pallas' interpreter): the train step at odd lengths,
    which splash took only at multiples of its block before the padding."""
    module, _, _, cfg = compile_for("v5e:1x1", "train", attention="pallas_tpu")
    want = _splash_want(cfg)
    assert missing_attention_kernels(module, target_re=r"tpu_custom_call", want=want) == []


def test_tpu_splash_check_finds_xla_attention(compile_for):
    module, _, _, cfg = compile_for("v5e:1x1", "train", attention="xla")
    want = _splash_want(cfg)
    assert missing_attention_kernels(module, target_re=r"tpu_custom_call", want=want) == list(want)


def test_tpu_splash_on_four_chips(compile_for):
    """On a mesh of 4 chips (fsdp) the train step compiles with splash's kernels under
    `shard_map`, each chip's call at its own rows."""
    module, _, _, cfg = compile_for("v5e:2x2", "train", attention="pallas_tpu", devices=4)
    want = _splash_want(cfg, devices=4)
    assert missing_attention_kernels(module, target_re=r"tpu_custom_call", want=want) == []


def test_tpu_splash_without_shard_map_does_not_compile_on_four_chips(compile_for, monkeypatch):
    """The broken variant: the same step traced with no mesh (`sharding.tracing_under` a no-op)
    calls splash unsplit, which XLA cannot partition; so the test above holds by the shard_map."""
    import contextlib

    from mmr_jax.models import sharding

    monkeypatch.setattr(sharding, "tracing_under", lambda mesh: contextlib.nullcontext())
    with pytest.raises(Exception, match="Mosaic kernels cannot be automatically partitioned"):
        compile_for("v5e:2x2", "train", attention="pallas_tpu", devices=4, fresh=True)
