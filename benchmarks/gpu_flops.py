"""The arithmetic behind `bench_gpu.py`'s MFU and bandwidth columns: model FLOPs of a train step
(`train_flops`, from `forward_flops_per_token`, `attention_flops`, `step_tokens` and
`positions_attended`) and the devices' dense bf16 peaks and memory bandwidths (`device_peaks`).

Model FLOPs count the matmuls and causal attention, forward 2 FLOPs per multiply-add, the backward
twice the forward for a full fine-tune and once for LoRA (activation gradients only; the adapters'
own FLOPs are left out), and no remat recomputation: MFU in PaLM's sense.
"""

from __future__ import annotations

# Dense bf16 peak TFLOP/s and memory bandwidth TB/s (NVIDIA's data sheets, SXM parts).
DEVICE_PEAKS = {
    "H100": (989.0, 3.35),
    "H200": (989.0, 4.8),
    "A100": (312.0, 2.0),
}


def device_peaks(device_kind: str) -> tuple[float | None, float | None]:
    """(bf16 TFLOP/s, TB/s) of a device kind ('NVIDIA H200' -> H200's); (None, None) if unknown."""
    for name, peaks in DEVICE_PEAKS.items():
        if name in device_kind.upper():
            return peaks
    return None, None


def forward_flops_per_token(mcfg) -> int:
    """Matmul FLOPs of one token's forward pass through every layer and the LM head."""
    d, hd = mcfg.hidden_size, mcfg.head_dim
    q, kv = mcfg.num_heads * hd, mcfg.num_kv_heads * hd
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * mcfg.intermediate_size
    return 2 * (mcfg.num_layers * per_layer + d * mcfg.vocab_size)


def attention_flops(mcfg, positions_attended: int) -> int:
    """Forward FLOPs of scores and values (2 matmuls) over `positions_attended` summed over
    the tokens of a step (causal: token i attends to i + 1 positions)."""
    return mcfg.num_layers * 4 * mcfg.num_heads * mcfg.head_dim * positions_attended


def step_tokens(prompts: int, generations: int, prompt_len: int, completion_len: int) -> int:
    """Tokens a shared-prompt step computes: each prompt once, every completion token."""
    return prompts * prompt_len + prompts * generations * completion_len


def positions_attended(prompts: int, generations: int, prompt_len: int, completion_len: int):
    """Sum over a step's tokens of the positions each attends to (causal, prompts shared)."""
    p, t = prompt_len, completion_len
    per_prompt = p * (p + 1) // 2
    per_completion = t * p + t * (t + 1) // 2
    return prompts * (per_prompt + generations * per_completion)


def train_flops(mcfg, *, lora: bool, prompts, generations, prompt_len, completion_len) -> int:
    """Model FLOPs of one train step (one optimiser pass over the batch): forward, and a
    backward of 2x the forward (full) or 1x (LoRA: activation gradients only)."""
    tokens = step_tokens(prompts, generations, prompt_len, completion_len)
    attended = positions_attended(prompts, generations, prompt_len, completion_len)
    forward = forward_flops_per_token(mcfg) * tokens + attention_flops(mcfg, attended)
    return forward * (2 if lora else 3)
