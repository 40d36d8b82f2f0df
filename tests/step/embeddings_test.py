"""Tests for mmr_jax.step.embeddings: the offline MiniLM encoder, the hashing encoder, errors."""

import os

import numpy as np
import pytest

from mmr_jax.step import embeddings

SIMILAR = ["The cat sits on the mat.", "A cat is sitting on a mat."]
UNRELATED = "Quarterly revenue rose five percent on strong bond sales."


@pytest.fixture(scope="module")
def minilm():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return embeddings.make_encoder("all-MiniLM-L6-v2", max_length=128, batch_size=2)


class TestSentenceTransformerEncoder:
    def test_similar_pair_beats_unrelated_pair(self, minilm):
        e = minilm.encode([*SIMILAR, UNRELATED])
        assert e.shape == (3, 384) and e.dtype == np.float32
        assert e[0] @ e[1] > e[0] @ e[2] + 0.3

    def test_unit_norm_and_batching_invariance(self, minilm):
        texts = [*SIMILAR, UNRELATED, "x", "\\boxed{4}"]
        e = minilm.encode(texts)
        np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)
        np.testing.assert_allclose(e[3:], minilm.encode(texts[3:]), atol=1e-5)

    def test_empty_list(self, minilm):
        assert minilm.encode([]).shape == (0, 384)

    def test_non_string(self, minilm):
        with pytest.raises(TypeError, match="text 1 is int"):
            minilm.encode(["a", 3])

    def test_model_not_available_offline(self, monkeypatch):
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        with pytest.raises(RuntimeError, match="could not be loaded.*HF_HUB_OFFLINE"):
            embeddings.make_encoder("nonexistent-org/nonexistent-model-xyz")

    def test_minilm_resolves_to_the_package_folder(self):
        path = embeddings.resolve_model("sentence-transformers/all-MiniLM-L6-v2")
        assert os.path.isfile(os.path.join(path, "model.safetensors"))


class TestHashingEncoder:
    def test_deterministic_normalised_and_similarity_ordered(self):
        enc = embeddings.make_encoder("hashing")
        e = enc.encode([*SIMILAR, UNRELATED, ""])
        assert e.shape == (4, enc.dim) and e.dtype == np.float32
        np.testing.assert_allclose(np.linalg.norm(e[:3], axis=1), 1.0, atol=1e-6)
        np.testing.assert_array_equal(e[3], 0.0)  # empty text: zero row
        assert e[0] @ e[1] > e[0] @ e[2]
        np.testing.assert_array_equal(
            e, embeddings.HashingEncoder().encode([*SIMILAR, UNRELATED, ""])
        )

    def test_identical_texts_have_cosine_one(self):
        e = embeddings.HashingEncoder(dim=64).encode(["same text here", "same text here"])
        assert e[0] @ e[1] == pytest.approx(1.0, abs=1e-6)
