"""Checkpoint resolution: local folders as they are, hub ids through the HF cache, clear errors."""

import json

import huggingface_hub.constants
import pytest

from mmr_jax.models import hub

from support import testing


@pytest.fixture
def offline_cache(monkeypatch, tmp_path):
    """An empty HF cache with the hub switched off (the library reads these at import)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    return tmp_path


class TestResolveCheckpoint:
    def test_local_folder_is_returned_as_is(self, tmp_path):
        assert hub.resolve_checkpoint(tmp_path) == tmp_path

    def test_missing_local_path_names_it(self, tmp_path):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            hub.resolve_checkpoint(tmp_path / "nope")

    def test_unreachable_repo_id_says_both_readings(self, offline_cache):
        # Offline, with an empty cache: the hub id can be neither a folder nor fetched.
        with pytest.raises(FileNotFoundError, match="neither a local checkpoint folder nor"):
            hub.resolve_checkpoint("no-such-org/no-such-model")

    def test_cached_repo_id_resolves_offline(self, offline_cache):
        # A snapshot laid out as huggingface_hub caches it resolves without any network.
        commit = "0" * 40
        repo = offline_cache / "models--org--tiny"
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(commit)
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        (snap / "config.json").write_text("{}")
        assert hub.resolve_checkpoint("org/tiny") == snap


def _tokenizer_folder(tmp_path, model_type: str, declared: str, **tokenizer_config):
    """The tests' tiny tokenizer, saved with config.json's `model_type` and tokenizer_config.json's
    `tokenizer_class` set as a checkpoint from the hub may set them."""
    folder = tmp_path / f"{model_type}-{declared}"
    testing.make_tiny_tokenizer(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(tokenizer_class=declared, **tokenizer_config)
    path.write_text(json.dumps(config))
    return folder


_TEXTS = ["12 + 35 = 47", "<|im_start|>user\nhé 💡<|im_end|>", "", "  two  spaces\n\n"]


def _behaviour(tok):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    return dict(
        cls=type(tok),
        ids=[tok.encode(t) for t in _TEXTS],
        decoded=[tok.decode(tok.encode(t)) for t in _TEXTS],
        chat=tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        special=(tok.eos_token_id, tok.pad_token_id, tok.bos_token_id, tok.unk_token_id),
        size=len(tok),
        sides=(tok.padding_side, tok.truncation_side, tok.model_max_length),
    )


class TestLoadTokenizer:
    @pytest.mark.parametrize("declared", ["TokenizersBackend", "PreTrainedTokenizerFast"])
    def test_direct_load_equals_auto_tokenizer(self, tmp_path, declared):
        import transformers

        folder = _tokenizer_folder(tmp_path, "llama", declared)
        assert hub.declares_plain_backend(folder)
        ours = _behaviour(hub.load_tokenizer(folder))
        assert ours == _behaviour(transformers.AutoTokenizer.from_pretrained(folder))
        assert ours["ids"][0]  # the tokenizer encodes: the comparison is not of two empty objects

    @pytest.mark.parametrize(
        "model_type, declared, extra",
        [
            ("llama", "LlamaTokenizer", {}),  # AutoTokenizer's own rules choose the class
            ("qwen2", "Qwen2Tokenizer", {}),
            # AutoTokenizer replaces this declared class with Qwen2Tokenizer, which splits
            # "12 + 35" differently: the case that limits the direct load to Llama folders.
            ("qwen2", "TokenizersBackend", {}),
            ("mistral", "TokenizersBackend", {}),  # a model type with its own backend rules
            ("llama", "TokenizersBackend", {"auto_map": {"AutoTokenizer": ["x.Tok", None]}}),
        ],
    )
    def test_other_folders_go_through_auto_tokenizer(self, tmp_path, model_type, declared, extra):
        assert not hub.declares_plain_backend(
            _tokenizer_folder(tmp_path, model_type, declared, **extra)
        )

    def test_direct_load_does_not_import_torch(self, tmp_path):
        # The reason for the direct load: AutoTokenizer's AutoConfig imports torch (2.3 s a start).
        folder = _tokenizer_folder(tmp_path, "llama", "TokenizersBackend")
        script = (
            "import sys; from mmr_jax.models import hub; tok = hub.load_tokenizer(sys.argv[1]); "
            "print(type(tok).__name__, 'torch' in sys.modules)"
        )
        out = testing.run_in_fresh_jax(script, str(folder), timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["TokenizersBackend", "False"]
