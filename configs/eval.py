"""Evaluation: pass@k on the five benchmarks (MMR-GRPO protocol: n=16, T=0.6, top-p 0.95).

    python scripts/evaluate.py --config=configs/eval.py --config.checkpoint=runs/x/step_150
    python scripts/evaluate.py --config=configs/eval.py --config.run_dir=runs/x   # every step
    python scripts/evaluate.py --config=configs/eval.py:run --config.run_dir=runs/cpu_smollm2
    python scripts/evaluate.py --config=configs/eval.py:smoke \\
        --config.checkpoint=checkpoints/smollm2-135m-instruct

A run's checkpoints: its step_N HF exports when it wrote them, else its Orbax checkpoints (each
exported to a temporary folder with the run's own config, run.json).
`:run` evaluates on the run's own evaluation problems and settings (the `eval` block of its
config: the CPU default's held-out arithmetic) and adds its initial weights as step 0.
`:smoke` keeps 2 problems per benchmark, 4 samples and 64 new tokens (a CPU minute).
"""

import os

import ml_collections

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SHARED = os.environ.get(
    "MMR_JAX_SHARED_DATA", os.path.join(os.path.dirname(_REPO), "shared", "data")
)
BENCHMARKS = ("math500", "aime24", "amc23", "minerva_math", "olympiadbench")
# The paper's evaluation system prompt; the same text as problems.data.EVAL_SYSTEM_PROMPT (configs
# do not import the library).
EVAL_SYSTEM_PROMPT = (
    "Solve the following math problem efficiently and clearly.  The last line of your response "
    "should be of the following format: 'Therefore, the final answer is: $\\boxed{ANSWER}$. "
    "I hope it is correct' (without quotes) where ANSWER is just the final number or expression "
    "that solves the problem. Think step by step before answering.\n"
)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.checkpoint = ""  # HF checkpoint folder to evaluate (exclusive with run_dir)
    c.run_dir = ""  # run folder: evaluate each checkpoint (step_N/ exports, else Orbax), the peak
    c.step = 0  # with run_dir: only this step's checkpoint (0 = every one)
    c.with_base = False  # with run_dir: also the run's initial weights (model.path), as step 0
    # 'benchmarks' (the files below, with the sampling below) | 'run' (the run's own eval block:
    # problems, n, temperature, top_p, tokens, system prompt, number_only; needs run_dir)
    c.source = "benchmarks"
    c.output_dir = ""  # where JSON / PNG go ('' = the checkpoint or run folder, under eval/)
    c.data_dir = os.path.join(_SHARED, "eval")  # folder of <benchmark>.jsonl
    c.benchmarks = BENCHMARKS  # benchmark names (files in data_dir)
    c.max_problems = 0  # problems per benchmark (0 = all)
    c.n = 16  # samples per problem
    c.ks = (1, 2, 4, 8, 16)  # pass@k reported (k <= n)
    c.temperature = 0.6  # sampling temperature
    c.top_p = 0.95  # nucleus sampling
    c.max_new_tokens = 3584  # completion length
    c.seed = 0  # sampling seed
    c.system_prompt = EVAL_SYSTEM_PROMPT  # system prompt ('' = none)
    c.prompt_batch_size = 32  # prompts per engine call
    c.engine = "embedded"  # rollout engine: 'embedded' | 'vllm'
    # Embedded engine on CPU: one JAX device per core (0 = all cores, 1 = a single device), the
    # prompts of each call split over them. SmolLM2-135M, 32 prompts x 4: 2.57x transformers on
    # 2 devices against 2.50x on one (benchmarks/bench_sampler.py, 2026-11-24; docs/performance.md,
    # "Measured speed").
    c.cpu_devices = 0
    c.url = "http://localhost:8000"  # vLLM / OpenAI-compatible server (engine 'vllm')
    c.grader_workers = 2  # math-verify worker processes (0 = in-process)
    c.grader_timeout_s = 5  # math-verify timeout per parse / comparison (seconds)
    c.keep_completions = False  # store completion texts in the JSON records
    if arg == "run":
        c.source, c.with_base = "run", True
    elif arg == "smoke":
        c.max_problems, c.n, c.ks, c.max_new_tokens = 2, 4, (1, 2, 4), 64
    elif arg:
        raise ValueError(f"unknown config argument {arg!r}; expected 'run' or 'smoke'")
    return c
