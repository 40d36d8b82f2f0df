"""What `bench_mmr.py` times our MMR kernel against: Algorithm 1 as the paper writes it, the same
rule vectorised in NumPy, a PyTorch port of the released loop, and the kernel with the cosine in
its earlier forms; and the rewards and embeddings they all get (`data`). Each baseline reweights one
group (or one micro-batch, torch)."""

import jax
import numpy as np

from mmr_jax.algorithms import mmr


def data(b, g, d, seed=0):
    """The rewards [B, G] (binary plus noise) and embeddings [B, G, D] every implementation gets."""
    rng = np.random.default_rng(seed)
    r = (rng.random((b, g)) < 0.5).astype(np.float32) + rng.normal(size=(b, g)).astype(np.float32)
    e = rng.normal(size=(b, g, d)).astype(np.float32)
    return r, e


def numpy_plain_loop(r, e, lam=None):
    """Algorithm 1 for one group as the paper writes it: NumPy for the similarity matrix (line 2)
    and each row's max over S (line 5), Python loops where the algorithm loops (lines 6-12)."""
    norm = np.linalg.norm(e, axis=1, keepdims=True)
    u = np.divide(e, norm, out=np.zeros_like(e), where=norm > 0)
    sim = u @ u.T
    if lam is None:
        lam = 1.0 / (1.0 + np.exp(-r.std()))
    out = r.copy()
    selected = [int(np.argmax(r))]
    for _ in range(len(r) - 1):
        rest = [i for i in range(len(r)) if i not in selected]
        best_sim = {i: sim[i, selected].max() for i in rest}
        score = {i: lam * r[i] - (1.0 - lam) * best_sim[i] for i in rest}
        pick = max(rest, key=score.__getitem__)  # the first maximum: lowest index on ties
        selected.append(pick)
        out[pick] = score[pick]
    return out


def numpy_vectorised(r, e, lam=None):
    """Algorithm 1 for one group with NumPy vector ops over candidates and an incremental best
    similarity (O(G^2) instead of O(G^3)); a Python loop over picks only. A stronger baseline
    than the plain loop."""
    norm = np.linalg.norm(e, axis=1, keepdims=True)
    u = np.divide(e, norm, out=np.zeros_like(e), where=norm > 0)
    sim = u @ u.T
    if lam is None:
        lam = 1.0 / (1.0 + np.exp(-r.std()))
    out = r.copy()
    first = int(np.argmax(r))
    picked = np.zeros(len(r), bool)
    picked[first] = True
    best = sim[:, first].copy()
    for _ in range(len(r) - 1):
        score = lam * r - (1.0 - lam) * best
        score[picked] = -np.inf
        i = int(np.argmax(score))
        picked[i] = True
        out[i] = score[i]
        best = np.maximum(best, sim[:, i])
    return out


def torch_released(rewards, embeddings):
    """Own port of the released `diverse_adjust_rewards_fast_sigmoid` (one call per micro-batch)."""
    import torch  # here, not at import: the tests load this script without needing torch

    n = rewards.size(0)
    lam = torch.sigmoid(rewards.std(unbiased=False))
    emb = torch.nn.functional.normalize(embeddings, p=2, dim=1)
    sim = emb @ emb.T
    sim.fill_diagonal_(0.0)
    adjusted = torch.zeros_like(rewards)
    best = torch.zeros(n)
    selected = torch.zeros(n, dtype=torch.bool)
    first = torch.argmax(rewards)
    selected[first] = True
    adjusted[first] = rewards[first]
    for _ in range(n - 1):
        best = torch.maximum(best, sim[:, selected].max(dim=1).values)
        scores = lam * rewards - (1 - lam) * best
        scores[selected] = -1e9
        nxt = torch.argmax(scores)
        selected[nxt] = True
        adjusted[nxt] = scores[nxt]
    return adjusted


def unscaled_cosine(embeddings, *, mask=None):
    """The cosine before the fuzz fixes: no scaling, so extreme rows overflow or underflow."""
    del mask
    return mmr.gram_cosine(embeddings)[0]


def always_scaled_cosine(embeddings, *, mask=None):
    """The fuzz fixes' cosine: every row max-abs scaled on every call."""
    del mask
    return mmr.cosine_similarity_scaled(embeddings)


def kernel_with(cosine):
    """`mmr.mmr_reweight` jitted with `cosine` in place of `mmr.cosine_similarity` (at trace)."""

    def kernel(r, e):
        saved = mmr.cosine_similarity
        mmr.cosine_similarity = cosine
        try:
            return mmr.mmr_reweight(r, e)
        finally:
            mmr.cosine_similarity = saved

    return jax.jit(kernel)
