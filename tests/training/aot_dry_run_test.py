"""`scripts/train.py --dry_run --dry_run_target=...`: the run's programs compiled by a real TPU or
GPU compiler on this machine, with no accelerator (issue 52).

The command a user runs, in the compile-only venvs (`.venv-aot-gpu`, `.venv-aot-tpu`, built by
scripts/setup_aot_env.sh; MMR_JAX_AOT_GPU_PYTHON / MMR_JAX_AOT_TPU_PYTHON name other
interpreters): the CPU default's SmolLM2 and a 2-layer Qwen2-shaped model at head dim 128, for
an H100 and a v5e. Each must compile every program, report the target's devices,
and with the attention forms a run there uses: cuDNN on the GPU in bf16, splash on the TPU at the
completions' odd length. A config that cannot fit must exit non-zero naming the program.

Without a venv each test is skipped with the reason, except under CI=true, where it fails: CI
builds both (.ci/run), as tests/rollout/vllm_server_test.py does for the vLLM server's venv.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from mmr_jax.infra import aot_targets

pytestmark = pytest.mark.slow
REPO = pathlib.Path(__file__).resolve().parents[2]
VENVS = {"cuda": ".venv-aot-gpu", "tpu": ".venv-aot-tpu"}


def _python(platform: str) -> str:
    """The compile-only venv's interpreter (skips without it; fails under CI=true)."""
    env = os.environ.get(f"MMR_JAX_AOT_{'GPU' if platform == 'cuda' else 'TPU'}_PYTHON")
    python = pathlib.Path(env) if env else REPO / VENVS[platform] / "bin" / "python"
    if python.exists():
        return str(python)
    why = f"no {python} (bash scripts/setup_aot_env.sh builds {VENVS[platform]})"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must build the compile-only venvs first: {why}")
    pytest.skip(why)


def _dry_run(tmp_path, target: str, config: str, *overrides: str, python=None):
    """(exit status, output, the JSON report or None) of the user's command."""
    platform = aot_targets.parse_target(target).platform
    out = tmp_path / f"{target.replace(':', '_')}.json"
    argv = [python or _python(platform), "scripts/train.py", f"--config={config}", "--dry_run"]
    argv += [f"--dry_run_target={target}", f"--dry_run_json={out}"]
    argv += [f"--config.{o}" for o in overrides]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    report = json.loads(out.read_text()) if out.exists() else None
    return proc.returncode, proc.stdout + proc.stderr, report


def _qwen2_head_dim_128(tmp_path) -> str:
    """A checkpoint folder holding only a 2-layer Qwen2 config.json at head dim 128 (the dry
    run reads the architecture, no weights)."""
    from support import testing

    config = testing.tiny_hf_config(
        "qwen2",
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    folder = tmp_path / "qwen2_hd128"
    config.save_pretrained(folder)
    return str(folder)


def _compiled(report) -> dict[str, dict]:
    return {r["name"]: r for r in report["rows"]}


def _check_all_compiled(code, text, report, target):
    assert code == 0, text[-4000:]
    t = aot_targets.parse_target(target)
    assert report["devices"] == t.devices and report["target"] == t.name
    assert report["failures"] == []
    names = list(_compiled(report))
    assert any(n.startswith("train step") for n in names), names
    assert {"sampler prefill", "sampler decode loop"} <= set(names)
    for row in report["rows"]:
        if row["required"]:
            assert row["error"] is None and row["fits"], row
            assert 0 < row["total_bytes"] <= report["memory_bytes"], row


def test_cpu_default_compiles_for_an_h100(tmp_path):
    # (On a TPU the CPU default compiles in the does-not-fit test below, at a larger batch.)
    code, text, report = _dry_run(tmp_path, "h100:1", "configs/cpu_smollm2.py")
    _check_all_compiled(code, text, report, "h100:1")
    # fp32 (the CPU default's dtype): cuDNN takes no fp32, so 'auto' is 'unfused', as at a
    # run's start-up, and the report says so.
    assert report["attention"] == [["unfused", "auto: cuDNN takes no float32"]]


def test_qwen2_head_dim_128_on_an_h100_compiles_cudnn_and_its_fallback(tmp_path):
    ckpt = _qwen2_head_dim_128(tmp_path)
    code, text, report = _dry_run(
        tmp_path, "h100:1", "configs/grpo.py:smoke", f"model.path={ckpt}", "model.dtype=bfloat16"
    )
    _check_all_compiled(code, text, report, "h100:1")
    rows = _compiled(report)
    # 'auto' in bf16: a run probes cuDNN first and falls back to 'xla'; both are compiled.
    assert "train step (remat none, attention cudnn)" in rows, list(rows)
    assert "train step (remat none, attention xla)" in rows, list(rows)


def test_qwen2_head_dim_128_on_a_tpu_compiles_splash(tmp_path):
    # Splash attention (pallas_tpu) through Mosaic, at the completions' length T = 31: not a
    # multiple of its blocks (the fix of issue 52: padded to them). No packing: splash takes no
    # per-row segments, so 'auto' is splash here, by the start-up rule
    # (`attention_impl.auto_off_gpu`). On several chips splash runs under shard_map (the HLO
    # tests compile it for v5e:2x2).
    ckpt = _qwen2_head_dim_128(tmp_path)
    overrides = [f"model.path={ckpt}", "model.dtype=bfloat16"]
    overrides += ["batch.pack_max_len=0", "batch.max_completion_len=31"]
    code, text, report = _dry_run(tmp_path, "v5e:1x1", "configs/grpo.py:smoke", *overrides)
    _check_all_compiled(code, text, report, "v5e:1x1")
    assert report["attention"] == [["pallas_tpu", "auto on a TPU: splash"]]
    assert "train step (remat none, attention pallas_tpu)" in _compiled(report)


def test_a_config_that_does_not_fit_exits_naming_the_program(tmp_path):
    # SmolLM2 in fp32 with 512 completions of 4096 tokens in one pass and no remat: the train
    # step's activations are far beyond one v5e chip's 16 GiB.
    overrides = ["batch.prompts=32", "batch.generations=16", "batch.max_completion_len=4096"]
    overrides += ["batch.pack_max_len=0", "loss.minibatches=1", "model.remat=none"]
    overrides += ["model.attention_impl=unfused"]  # the score matrices: far beyond the chip
    code, text, report = _dry_run(tmp_path, "v5e:1x1", "configs/cpu_smollm2.py", *overrides)
    assert code != 0
    name = "train step (remat none, attention unfused)"
    assert f"{name} does not" in text and "v5e:1x1" in text, text[-3000:]
    train = _compiled(report)[name]
    # libtpu itself refuses a program over the chip's HBM ("Ran out of memory on HBM": 115 GiB
    # of temporaries here), so on a TPU it does not compile; a compiler that builds it anyway
    # would give a total over the 16 GiB.
    if train["error"] is None:
        assert not train["fits"] and train["total_bytes"] > report["memory_bytes"] == 16 * 2**30
    else:
        assert "memory" in train["error"].lower(), train["error"]
    # The sampler's decode loop is compiled for the TPU too and reported on its own: at 512 rows
    # of 4096 tokens its cache is also over the HBM, which libtpu says the same way.
    decode = _compiled(report)["sampler decode loop"]
    assert decode["error"] is None or "memory" in decode["error"].lower(), decode["error"]


def test_without_the_plugin_the_error_names_the_setup_script(tmp_path):
    # The plain venv (this interpreter, when it has no CUDA plugin): one line saying what to run.
    if _has_cuda_plugin():
        pytest.skip("this interpreter has the CUDA plugin")
    code, text, _ = _dry_run(tmp_path, "h100:1", "configs/cpu_smollm2.py", python=sys.executable)
    assert code != 0
    assert "scripts/setup_aot_env.sh" in text and ".venv-aot-gpu" in text


def _has_cuda_plugin() -> bool:
    from support import aot

    return aot.has_plugin("cuda")
