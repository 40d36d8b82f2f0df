"""Stop ids: the tokenizer's EOS plus every EOS of the generation config, for a local folder and
for a hub id alike, and the embedded engine built from either stops on all of them.
(The vLLM engine's request: vllm_client_test.py; against a real vLLM: vllm_server_test.py.)"""

import json
import types

import pytest

from mmr_jax.rollout import base, embedded, sampler, stops

from support import testing

TOKENIZER_EOS = 2  # <|im_end|> in the tiny tokenizer; 0 is <|endoftext|>
PROMPT = [5, 17, 33, 9, 100]


def _second_eos(model, max_new_tokens=8) -> tuple[int, int]:
    """(t, k): the greedy completion's token t at position k >= 1 that comes first there and is
    not the tokenizer's EOS, so stopping on t ends the completion after k + 1 tokens."""
    params = base.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    toks = sampler.sample(model, [PROMPT], params).tokens[0, 0].tolist()
    assert TOKENIZER_EOS not in toks, "the random model ends on EOS: pick another prompt"
    k = next(k for k in range(1, len(toks)) if toks[k] not in toks[:k])
    return toks[k], k


class TestStopTokenIds:
    def test_union_of_tokenizer_and_generation_config(self, tiny_llama_dir, tmp_path):
        snap = testing.as_hub_snapshot(tiny_llama_dir, tmp_path, eos_token_ids=[0, 7])
        assert stops.stop_token_ids(snap) == (0, 2, 7)

    def test_single_generation_eos_other_than_the_tokenizers(self, tiny_llama_dir, tmp_path):
        snap = testing.as_hub_snapshot(tiny_llama_dir, tmp_path)
        (snap / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
        assert stops.stop_token_ids(snap) == (0, 2)

    def test_without_generation_config_the_model_configs_eos_counts(self, tiny_llama_dir, tmp_path):
        snap = testing.as_hub_snapshot(tiny_llama_dir, tmp_path)
        (snap / "generation_config.json").unlink()
        config = json.loads((snap / "config.json").read_text())
        (snap / "config.json").write_text(json.dumps({**config, "eos_token_id": [0, 2]}))
        assert stops.stop_token_ids(snap) == (0, 2)

    def test_hub_id_resolves_like_its_folder(self, tiny_llama_dir, tmp_path, monkeypatch):
        testing.offline_hub(monkeypatch, tmp_path)
        snap = testing.as_hub_snapshot(tiny_llama_dir, tmp_path, "org/tiny", eos_token_ids=[0, 2])
        assert stops.stop_token_ids("org/tiny") == stops.stop_token_ids(snap) == (0, 2)

    def test_a_loaded_tokenizer_is_used_as_given(self, tiny_llama_dir, tmp_path):
        snap = testing.as_hub_snapshot(tiny_llama_dir, tmp_path, eos_token_ids=[2])
        assert stops.stop_token_ids(snap, types.SimpleNamespace(eos_token_id=9)) == (2, 9)


class TestEmbeddedEngineStops:
    @pytest.fixture
    def hub_ckpt(self, llama, tiny_llama_dir, tmp_path, monkeypatch):
        """'org/tiny' (offline cache): the tiny Llama whose generation config adds a second EOS
        that its greedy completion of PROMPT reaches at position k; returns k."""
        t, k = _second_eos(llama)
        testing.offline_hub(monkeypatch, tmp_path)
        testing.as_hub_snapshot(tiny_llama_dir, tmp_path, "org/tiny", eos_token_ids=[2, t])
        return t, k

    def test_hub_id_engine_stops_on_the_second_eos(self, hub_ckpt):
        t, k = hub_ckpt
        engine = embedded.EmbeddedEngine.from_pretrained("org/tiny")
        assert engine.stop_token_ids == tuple(sorted({TOKENIZER_EOS, t}))
        batch = engine.generate([PROMPT], base.SamplingParams(max_new_tokens=8, temperature=0.0))
        assert batch.mask[0, 0].sum() == k + 1 and batch.tokens[0, 0, k] == t
        assert batch.finish_reasons[0][0] == base.FINISH_STOP

    def test_trainer_engine_of_a_hub_id_stops_on_both(self, llama, hub_ckpt, tmp_path):
        """engines.make_engine (the trainer's) on the folder of `model.path` = a hub id (as the
        run's builder resolves it once): tokenizer EOS + t."""
        import importlib.util

        import transformers

        from mmr_jax.config import checks
        from mmr_jax.models import hub
        from mmr_jax.training import engines

        t, _ = hub_ckpt
        spec = importlib.util.spec_from_file_location(
            "base_config", testing.REPO / "configs/base.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        c = module.get_config()
        c.model.path = "org/tiny"
        cfg = checks.from_config_dict(c)
        model_dir = hub.resolve_checkpoint("org/tiny")
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        policy = types.SimpleNamespace(model=lambda: llama)
        engine = engines.make_engine(cfg, policy, tokenizer, model_dir, tmp_path / "run")
        assert engine.stop_token_ids == tuple(sorted({TOKENIZER_EOS, t}))
