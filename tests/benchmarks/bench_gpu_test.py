"""`benchmarks/bench_gpu.py`'s model-FLOPs arithmetic (MFU's numerator) and device peaks, in
`benchmarks/gpu_flops.py`."""

import dataclasses
import math

import pytest
from flax import nnx

from mmr_jax.infra import bench_harness
from mmr_jax.models import config as model_config
from mmr_jax.models import loading


def _gpu_flops():
    return bench_harness.load("bench_gpu").gpu_flops  # the module the benchmark runs


TINY = model_config.ModelConfig(
    vocab_size=32,
    hidden_size=8,
    intermediate_size=16,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
)


def test_flops_hand_worked():
    b = _gpu_flops()
    # per layer: q 8x8 + k, v 8x4 each + o 8x8 + gate, up, down 8x16 each = 576 weights;
    # 2 layers + the LM head (8 x 32) = 1408 multiply-adds, 2816 FLOPs per token.
    assert b.forward_flops_per_token(TINY) == 2816
    # one prompt of 3 tokens (1 + 2 + 3 positions) and 2 completions of 2 tokens (4 + 5 each)
    assert b.positions_attended(1, 2, 3, 2) == 6 + 2 * 9
    assert b.step_tokens(1, 2, 3, 2) == 3 + 2 * 2
    # 2 layers x (scores + values: 2 x 2 FLOPs) x 2 heads x 4 dims x 24 positions
    assert b.attention_flops(TINY, 24) == 1536
    forward = 2816 * 7 + 1536
    kw = dict(prompts=1, generations=2, prompt_len=3, completion_len=2)
    assert b.train_flops(TINY, lora=False, **kw) == 3 * forward
    assert b.train_flops(TINY, lora=True, **kw) == 2 * forward


@pytest.mark.parametrize("tied", [False, True])
def test_forward_flops_match_the_models_matmul_weights(tied):
    """2 FLOPs per weight of every matmul the model holds (the embedding table is a lookup;
    a tied head multiplies by it once more), counted from the real model's parameters."""
    cfg = dataclasses.replace(TINY, tie_word_embeddings=tied)
    state = nnx.state(loading.abstract_model(cfg), nnx.Param)
    weights = 0
    for path, var in nnx.to_flat_state(state):
        shape = var.get_value().shape
        if path[-1] == "kernel":
            weights += math.prod(shape)
    if tied:
        weights += cfg.vocab_size * cfg.hidden_size
    assert _gpu_flops().forward_flops_per_token(cfg) == 2 * weights


def test_positions_attended_counts_each_token_once():
    """Against a loop over the tokens: a prompt token sees its prompt up to itself, a
    completion token its prompt and its completion up to itself."""
    prompts, generations, p, t = 3, 4, 5, 7
    expected = 0
    for _ in range(prompts):
        expected += sum(i + 1 for i in range(p))
        for _ in range(generations):
            expected += sum(p + j + 1 for j in range(t))
    assert _gpu_flops().positions_attended(prompts, generations, p, t) == expected


def test_device_peaks():
    b = _gpu_flops()
    assert b.device_peaks("NVIDIA H200") == (989.0, 4.8)
    assert b.device_peaks("NVIDIA H100 80GB HBM3") == (989.0, 3.35)
    assert b.device_peaks("cpu") == (None, None)
