"""Forward+backward tokens/s of our JAX decoder vs transformers (torch), same CPU, same batch.

    python benchmarks/bench_model.py          # tiny random model + SmolLM2-135M if prepared
    python benchmarks/bench_model.py --models tiny --batch 4 --seq 256 --iters 5 --json

Both sides compute the same loss, the sum of per-token log-probs of the batch (log_softmax of the
logits, gathered at the next tokens), and its gradient with respect to every parameter (full
fine-tuning), in fp32. Ours is one jitted function (compile time excluded, reported separately);
torch runs eagerly with all CPU threads. Tokens/s = batch * seq / median step time.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))  # `support`
from mmr_jax.infra import bench_harness as harness

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "checkpoints" / "smollm2-135m-instruct"
TINY = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=4096,
)


def _time(fn, iters: int, warmup: int) -> tuple[float, float]:
    """(first call seconds, median seconds of `iters` timed calls after `warmup - 1` more)."""
    t = harness.timed(fn, steps=iters, warmup=max(warmup - 1, 0))
    return t.first_s, t.median_s


def bench_jax(path, tokens_np, iters, warmup, remat=False):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mmr_jax import models
    from mmr_jax.models import logprobs

    model = models.from_pretrained(path, remat=remat)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jnp.asarray(tokens_np, jnp.int32)
    mask = jnp.ones_like(tokens)

    @jax.jit
    def step(params, rest, tokens, mask):
        def loss(p):
            m = nnx.merge(graphdef, p, rest)
            return logprobs.token_logprobs(m, tokens, mask).sum()

        return jax.value_and_grad(loss)(params)

    def run():
        jax.block_until_ready(step(params, rest, tokens, mask))

    return _time(run, iters, warmup)


def bench_torch(path, tokens_np, iters, warmup):
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()  # dropout is 0 in these configs; train mode as in fine-tuning
    tokens = torch.tensor(tokens_np, dtype=torch.long)

    def run():
        model.zero_grad(set_to_none=True)
        logits = model(tokens).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, 1:, None]).sum()
        logp.backward()

    return _time(run, iters, warmup)


def _model_paths(names, tmp):
    from support import testing

    out = {}
    for name in names:
        if name == "tiny":
            out["tiny (4L, H=256)"] = testing.make_tiny_checkpoint(
                pathlib.Path(tmp) / "tiny", family="llama", tokenizer=False, init_std=0.02, **TINY
            )
        elif name == "smollm2":
            if not (SMOLLM2 / "model.safetensors").exists():
                print(f"skipping smollm2: run scripts/prepare_smollm2.py first ({SMOLLM2})")
                continue
            out["SmolLM2-135M"] = SMOLLM2
    return out


def main(argv=None):
    ap = harness.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--remat", action="store_true", help="our model with per-block remat")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import numpy as np

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in _model_paths(args.models.split(","), tmp).items():
            vocab = json.loads((pathlib.Path(path) / "config.json").read_text())["vocab_size"]
            tokens = np.random.RandomState(0).randint(0, vocab, (args.batch, args.seq))
            n = args.batch * args.seq
            j_first, j_t = bench_jax(path, tokens, args.iters, args.warmup, args.remat)
            t_first, t_t = bench_torch(path, tokens, args.iters, args.warmup)
            rows.append(
                dict(
                    model=name,
                    batch=args.batch,
                    seq=args.seq,
                    jax_tok_s=n / j_t,
                    torch_tok_s=n / t_t,
                    ratio=t_t / j_t,
                    jax_compile_s=j_first - j_t,
                    jax_step_s=j_t,
                    torch_step_s=t_t,
                    threads=os.cpu_count(),
                )
            )
    if args.json:
        print(json.dumps(rows, indent=2))
        return rows
    print(
        f"{'model':18s} {'B x T':>9s} {'jax tok/s':>10s} {'torch tok/s':>12s} {'ratio':>6s} "
        f"{'jax compile s':>13s}"
    )
    for r in rows:
        print(
            f"{r['model']:18s} {r['batch']:>4d}x{r['seq']:<4d} {r['jax_tok_s']:10.0f} "
            f"{r['torch_tok_s']:12.0f} {r['ratio']:6.2f} {r['jax_compile_s']:13.1f}"
        )
    print(
        "ratio = torch step time / jax step time (>1: ours faster); fwd+bwd, fp32, full gradients"
    )
    return rows


if __name__ == "__main__":
    harness.run(main)
