"""The training rollout with and without decode-loop compaction, in one process, interleaved.

    python benchmarks/bench_rollout.py                          # configs/cpu_smollm2.py's rollout
    python benchmarks/bench_rollout.py --batches=8 --rounds=3 --json=out.json

The work is the trainer's rollout for the config (default the CPU default: SmolLM2-135M-Instruct,
4 arithmetic prompts x 8 completions, 32 new tokens at most, T = 0.7, EOS on): the config's
prompts in the trainer's order (`problem_sets.load`, `data.PromptIterator`),
--batches batches,
each sampled by `EmbeddedEngine.generate` as the trainer calls it, with the sampler's
compaction on (the default: once at most half of the rows are still decoding they go on
alone, `rollout/sampler.py`) and off (every row stays in the loop until the last one ends).
Both sides draw the same completions (same seeds; a test checks they are equal); this times how
long they take. Every batch is sampled once by each side before the timing (compiles every loop
shape the batches meet), then --rounds rounds each time every batch on both sides, alternating
which goes first. Reported per side: median seconds per batch, and per batch the decode steps,
the loops it ran (rows of each) and the mean and longest completion.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
import time

from absl import flags

_REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))
from mmr_jax.infra import user_errors  # noqa: E402

_CONFIG = flags.DEFINE_string("config", "configs/cpu_smollm2.py", "training config")
_BATCHES = flags.DEFINE_integer("batches", 6, "rollout batches (trainer steps) to time")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "timed rounds over every batch and side")
_JSON = flags.DEFINE_string("json", None, "also write the results to this JSON file")


def main(argv) -> None:
    del argv
    import transformers

    from mmr_jax.config import checks, command_line
    from mmr_jax.infra import compile_cache
    from mmr_jax.models import hub
    from mmr_jax.problems import data
    from mmr_jax.rollout import base
    from mmr_jax.training import build, engines, problem_sets

    compile_cache.enable()
    cfg = checks.from_config_dict(command_line.load_config_file(_CONFIG.value))
    model_dir = hub.resolve_checkpoint(cfg.model.path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    policy = build.load_policy(cfg)
    engine = engines.make_engine(cfg, policy, tokenizer, model_dir, workdir=None)
    prompt_ids, answers, _ = problem_sets.load(cfg, tokenizer)[0]
    it = data.PromptIterator(
        list(zip(prompt_ids, answers, strict=True)), cfg.batch.prompts, cfg.seed
    )
    batches = [[p for p, _ in next(it)] for _ in range(_BATCHES.value)]
    params = [
        base.SamplingParams(
            max_new_tokens=cfg.batch.max_completion_len,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            n=cfg.batch.generations,
            seed=cfg.seed + i,
        )
        for i in range(len(batches))
    ]
    sides = {"compaction": True, "no compaction": False}

    def run(side: str, i: int) -> tuple[float, dict]:
        engine.compact = sides[side]
        t0 = time.perf_counter()
        out = engine.generate(batches[i], params[i])
        seconds = time.perf_counter() - t0
        lengths = out.lengths
        return seconds, {
            "decode_steps": engine.last_loop_stats.decode_steps,
            "loops": list(engine.last_loop_stats.loop_rows),
            "mean_len": float(lengths.mean()),
            "max_len": int(lengths.max()),
        }

    info: dict[int, dict] = {}
    for i in range(len(batches)):  # compile every shape these batches meet, on both sides
        for side in sides:
            info.setdefault(i, {})[side] = run(side, i)[1]
    seconds = {side: [[] for _ in batches] for side in sides}
    for r in range(_ROUNDS.value):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for i in range(len(batches)):
            for side in order:
                seconds[side][i].append(run(side, i)[0])
        print(f"round {r + 1}/{_ROUNDS.value} done", file=sys.stderr)

    per_batch = {s: [statistics.median(x) for x in seconds[s]] for s in sides}
    print(
        f"\n{cfg.name}: {cfg.batch.prompts} prompts x {cfg.batch.generations}, "
        f"<= {cfg.batch.max_completion_len} new tokens, T = {cfg.rollout.temperature}; "
        f"median of {_ROUNDS.value} rounds per batch\n"
    )
    print(
        "| batch | mean / max length | decode steps | loops (rows) "
        "| compaction s | no compaction s | ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for i in range(len(batches)):
        a, b = per_batch["compaction"][i], per_batch["no compaction"][i]
        d = info[i]["compaction"]
        print(
            f"| {i + 1} | {d['mean_len']:.1f} / {d['max_len']} | {d['decode_steps']} | "
            f"{', '.join(map(str, d['loops']))} | {a:.3f} | {b:.3f} | {b / a:.2f}x |"
        )
    total = {s: sum(per_batch[s]) for s in sides}
    print(
        f"| all | | | | {total['compaction']:.3f} | {total['no compaction']:.3f} | "
        f"**{total['no compaction'] / total['compaction']:.2f}x** |"
    )
    if _JSON.value:
        pathlib.Path(_JSON.value).write_text(
            json.dumps({"config": _CONFIG.value, "seconds": seconds, "info": info}, indent=1)
        )


if __name__ == "__main__":
    user_errors.run(main)
