"""Abstract builds of the paper's models: parameter counts match the formula and known totals."""

from __future__ import annotations

import pathlib

import pytest

from mmr_jax.models import config as config_lib
from mmr_jax.models import dry_run
from mmr_jax.models import lora as lora_lib

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "third_party" / "hf_configs"
# Published totals (safetensors metadata of the HF repos): 1.78B, 7.62B, 8.03B, 135M.
KNOWN = {
    "deepseek_r1_distill_qwen_1_5b": 1_777_088_000,
    "deepseek_r1_distill_qwen_7b": 7_615_616_512,
    "deepseek_r1_distill_llama_8b": 8_030_261_248,
    "smollm2_135m_instruct": 134_515_008,
}


def _cfg(name):
    return config_lib.ModelConfig.from_hf(CONFIGS / f"{name}.json")


@pytest.mark.parametrize("name", list(KNOWN))
def test_formula_matches_known_total(name):
    assert dry_run.formula_param_count(_cfg(name)) == KNOWN[name]


def test_llama8b_config_fields():
    cfg = _cfg("deepseek_r1_distill_llama_8b")
    assert cfg.rope_scaling_dict["factor"] == 8.0 and cfg.rope_theta == 500000.0
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (32, 8, 128)


@pytest.mark.parametrize("name", ["deepseek_r1_distill_qwen_7b", "smollm2_135m_instruct"])
def test_abstract_counts_and_memory(name):
    cfg = _cfg(name)
    lora = lora_lib.LoraConfig()
    full = dry_run.summarize(cfg, mesh=dry_run.MeshShape(1, 8, 1))
    with_lora = dry_run.summarize(cfg, mesh=dry_run.MeshShape(1, 8, 1), lora=lora)
    assert full["params"] == full["formula_params"] == KNOWN[name]
    assert with_lora["params"] == KNOWN[name]
    assert (
        with_lora["trainable"] == with_lora["lora_params"] == dry_run.formula_lora_count(cfg, lora)
    )
    # fp32 full fine-tuning: params + grads + Adam mu, nu = 16 bytes per parameter, split ~8 ways.
    assert full["total_gib_per_device"] == pytest.approx(16 * KNOWN[name] / 8 / 2**30, rel=0.02)
    assert with_lora["grad_gib_per_device"] < full["grad_gib_per_device"]
