"""The engines `bench_sampler.py` times, each one call that generates exactly `new_tokens` per
completion (EOS off): our embedded JAX sampler (`warm_jax` compiles a call's bucket, `bench_jax`
times one), transformers' `generate` (`bench_hf`) and a real vLLM server through our
`VllmEngine` (`start_vllm`, `bench_vllm`, and `bench_sync`: its weight sync); the prompts all get
(`prompt_ids`: chat-templated GSM8K problems from ../shared/data, or built-in text).
"""

from __future__ import annotations

import json
import pathlib
import time

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
    from mmr_jax.rollout import padding, sampler

    buckets = padding.MinSizes(min_new_tokens=new_tokens)  # max_new_tokens is traced, not static
    t0 = time.perf_counter()
    sampler.sample(model, prompts, _jax_params(1, temperature, n, 0), buckets=buckets, mesh=mesh)
    return time.perf_counter() - t0


def bench_jax(model, prompts, n, new_tokens, temperature, mesh=None, seed=1) -> float:
    """Seconds for one call that generates exactly `new_tokens` per completion (after warm_jax)."""
    from mmr_jax.rollout import padding, sampler

    buckets = padding.MinSizes(min_new_tokens=new_tokens)
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
    """Why vLLM cannot serve `path` here (no server venv, a head_dim its CPU attention does not
    take), or None."""
    from mmr_jax.rollout import vllm_launch

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
