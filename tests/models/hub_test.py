"""Checkpoint resolution: local folders as they are, hub ids through the HF cache, clear errors."""

import huggingface_hub.constants
import pytest

from mmr_jax.models import hub


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
