"""Tests of mmr_jax/models/random_init.py and `model.init=random` through scripts/train.py."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from mmr_jax.config import checks, schema
from mmr_jax.infra import metrics
from mmr_jax.models import config as model_config
from mmr_jax.models import random_init
from mmr_jax.problems import data
from mmr_jax.training import build, checkpoint

jax.config.update("jax_numpy_rank_promotion", "raise")
REPO = pathlib.Path(__file__).resolve().parents[2]


class TestByteTokenizer:
    @pytest.mark.parametrize("vocab", [260, 512, 49152, 151936])
    def test_exact_vocab_size_and_every_id_decodes(self, vocab):
        tok = random_init.byte_tokenizer(vocab)
        assert len(tok) == vocab
        assert isinstance(tok.decode([vocab - 1, 0, vocab // 2]), str)
        assert tok.convert_ids_to_tokens(2) == "<|im_end|>" == tok.eos_token
        assert tok.eos_token_id == 2 and tok.pad_token_id == 3

    def test_text_round_trips_and_chat_template_uses_special_tokens(self):
        tok = random_init.byte_tokenizer(1024)
        text = "What is 12 + 35? Let me think. \\boxed{47} é ü"
        assert tok.decode(tok.encode(text)) == text
        ids = data.build_prompt(tok, "2+2?", "")  # as the trainer builds its prompts
        assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1  # im_start x2, im_end x1
        assert tok.decode(ids) == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"

    def test_too_small_vocab_is_a_named_error(self):
        with pytest.raises(ValueError, match="vocab_size >= 260"):
            random_init.byte_tokenizer(100)


def _grpo_config(arg: str, **overrides) -> schema.TrainConfig:
    sys.path.insert(0, str(REPO))
    from configs import grpo

    c = grpo.get_config(arg)
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(c, section), name, value)
    return checks.from_config_dict(c)


class TestRandomPolicy:
    def test_1_5b_shapes_from_upstream_config_without_allocating(self):
        cfg = _grpo_config("1.5b", **{"model.init": "random"})
        hf = json.loads(
            (REPO / "third_party/hf_configs/deepseek_r1_distill_qwen_1_5b.json").read_text()
        )
        params = jax.eval_shape(lambda: build.load_policy(cfg).params)
        flat = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(params)}
        h, i, layers = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
        kv = hf["num_key_value_heads"] * h // hf["num_attention_heads"]
        assert flat["embed_tokens/embedding"].shape == (hf["vocab_size"], h)
        assert flat["layers/self_attn/q_proj/kernel"].shape == (layers, h, h)
        assert flat["layers/self_attn/k_proj/kernel"].shape == (layers, h, kv)
        assert flat["layers/self_attn/v_proj/bias"].shape == (layers, kv)  # Qwen2's q/k/v bias
        assert flat["layers/mlp/down_proj/kernel"].shape == (layers, i, h)
        assert ("lm_head/kernel" in flat) == (not hf["tie_word_embeddings"])
        assert all(v.dtype == np.float32 for v in flat.values())  # fp32 master weights
        total = sum(math.prod(v.shape) for v in flat.values())
        assert 1.7e9 < total < 1.8e9, total  # 1.78B with the untied head

    def test_tokenizer_has_the_architecture_vocab(self):
        cfg = _grpo_config("1.5b", **{"model.init": "random"})
        assert len(random_init.byte_tokenizer_of(cfg.model.path)) == 151936

    def test_weights_drawn_with_the_decoder_init_and_seed(self):
        mcfg = model_config.ModelConfig(
            vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=8,
        )  # fmt: skip
        kw = dict(dtype=np.float32, param_dtype=np.float32)
        a = random_init.random_model(mcfg, seed=1, **kw)
        b = random_init.random_model(mcfg, seed=1, **kw)
        c = random_init.random_model(mcfg, seed=2, **kw)
        wa = np.asarray(a.layers.mlp.up_proj.kernel[...])
        np.testing.assert_array_equal(wa, np.asarray(b.layers.mlp.up_proj.kernel[...]))
        assert not np.array_equal(wa, np.asarray(c.layers.mlp.up_proj.kernel[...]))
        assert abs(wa.std() - 0.02) < 0.003  # normal(0.02), as transformers' initializer_range
        np.testing.assert_array_equal(np.asarray(a.norm.weight[...]), np.ones(32, np.float32))
        assert a.deterministic  # eval mode

    def test_random_with_vllm_is_a_config_error(self):
        with pytest.raises(schema.ConfigError, match="rollout.engine='embedded'"):
            _grpo_config("smoke", **{"model.init": "random", "rollout.engine": "vllm"})


@pytest.mark.slow
def test_train_script_runs_steps_on_random_weights(tmp_path):
    """scripts/train.py with model.init=random on a config.json alone: no weights, no tokenizer
    files. The run metadata and the console say the weights are random; the loss is finite."""
    arch = tmp_path / "arch"
    arch.mkdir()
    (arch / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen2",
                "vocab_size": 400,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 256,
                "rms_norm_eps": 1e-6,
                "rope_theta": 10000.0,
                "tie_word_embeddings": True,
                "hidden_act": "silu",
            }
        )  # fmt: skip
    )
    workdir = tmp_path / "run"
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "train.py"),
        f"--config={REPO / 'configs' / 'grpo.py'}:smoke",
        f"--workdir={workdir}",
        f"--config.model.path={arch}",
        "--config.model.init=random",
        "--config.total_steps=2",
        "--config.data.source=arithmetic",
        "--config.data.system_prompt=",
        "--config.reweight.method=none",
        "--config.batch.max_prompt_len=48",
        "--config.batch.max_completion_len=8",
        "--config.checkpoint.every=0",
        "--config.checkpoint.at_end=False",  # as benchmarks/rl_step.py runs it: nothing saved
        "--config.eval.every=0",
        "--config.logging.samples=0",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "RANDOM WEIGHTS" in out
    run = json.loads((workdir / "run.json").read_text())
    assert run["config"]["model"]["init"] == "random"
    # 'auto' resolved once at start-up (no GPU here: the unfused form), in run.json and header
    assert run["resolved"]["attention_impl"]["implementation"] == "unfused", run
    assert "| attention unfused |" in out
    ckpts = workdir / checkpoint.CKPT_DIR
    assert not ckpts.exists() or not any(ckpts.iterdir()), list(ckpts.iterdir())
    rows = metrics.read_jsonl(workdir / metrics.METRICS_FILE)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in rows), rows
