"""LoRA dropout against GSPO's clip band: how far a training forward with adapter dropout moves
the policy ratio from 1 when the old log-probs are dropout-free (issue 47).

    python benchmarks/lora_dropout_ratio.py --json=lora_dropout_ratio.json   # CPU, ~2 min

On SmolLM2-135M with the paper's 7B/8B adapters (r 64, alpha 128 on q/k/v/o/gate/up/down), GSM8K
problems as prompts and their reference solutions as completions, each adapter's B set to
N(0, scale^2) (fresh adapters have B = 0, where dropout changes nothing): per scale, how far the
adapters move the policy from the base (mean |log pi - log pi_base| per token), and the log-ratio
d = log pi_dropout - log pi_clean the train step's second update would see at unchanged weights
(`minibatch.minibatch_loss` against `Batch.old_logps`): its std over tokens, the std over
sequences of the sequence mean (GSPO's log-ratio), and the share outside each clip band
(GRPO's token ratio in [0.8, 1.2], GSPO's sequence ratio in [1 - 3e-4, 1 + 4e-4]). Dropout 0 is
the training-mode forward without masks (d ~ 1e-7: fp32 rounding). Prints a table, writes --json.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from mmr_jax.infra import bench_harness, user_errors  # noqa: E402
from mmr_jax.models import loading  # noqa: E402
from mmr_jax.models import lora as lora_lib  # noqa: E402
from mmr_jax.problems import data  # noqa: E402
from mmr_jax.step import minibatch  # noqa: E402

GSPO_BAND = (1 - 3e-4, 1 + 4e-4)
GRPO_BAND = (0.8, 1.2)


def _rows(tokenizer, path: str, n: int, t: int):
    """Full rows [n, P + t]: problem (left-padded) then solution (right-padded, cut at t)."""
    lines = [json.loads(x) for x in open(path)][:n]
    prompts = [tokenizer(x["problem"])["input_ids"] for x in lines]
    comps = [tokenizer(" " + x["solution"])["input_ids"][:t] for x in lines]
    p = max(map(len, prompts))
    tokens = np.zeros((n, p + t), np.int32)
    attn = np.zeros((n, p + t), bool)
    for i, (a, b) in enumerate(zip(prompts, comps, strict=True)):
        tokens[i, p - len(a) : p] = a
        tokens[i, p : p + len(b)] = b
        attn[i, p - len(a) : p + len(b)] = True
    return jnp.asarray(tokens), jnp.asarray(attn), jnp.asarray(attn[:, p:])


def _policy(model_path: str, dropout: float, scale: float):
    lora = lora_lib.LoraConfig(rank=64, alpha=128.0, dropout=dropout)
    model = loading.from_pretrained(model_path, lora=lora, rngs=nnx.Rngs(0))
    for i, (name, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))):
        if name[-1] == "lora_b":
            var.set_value(scale * jax.random.normal(jax.random.key(i), var.get_value().shape))
    return lora_lib.split_policy(model)


def measure(model_path, tokens, attn, comp, *, dropout, scale, keys, temperature=0.7):
    policy = _policy(model_path, dropout, scale)
    t = comp.shape[1]
    kw = dict(num_completion=t, temperature=temperature)
    clean_kw = dict(graphdef=policy.eval_graphdef, **kw)
    args = (policy.params, policy.frozen, policy.rest, tokens, attn)
    clean = minibatch.logprobs_fn(*args, **clean_kw)
    base = minibatch.logprobs_fn(*args, disable_lora=True, **clean_kw)
    m = np.asarray(comp)
    drift = float(np.abs(np.asarray(clean - base))[m].mean())
    tok, seq = [], []
    for k in range(keys):  # the train step's forward: dropout drawn from its key
        rest = minibatch.with_dropout_key(policy.rest, jax.random.key_data(jax.random.key(k)))
        model = nnx.merge(policy.graphdef, policy.params, policy.frozen, rest)
        noisy = minibatch.completion_logprobs(model, tokens, attn, **kw)
        d = np.asarray(noisy - clean, np.float64)
        tok.append(d[m])
        seq.append((d * m).sum(-1) / m.sum(-1))
    tok, seq = np.concatenate(tok), np.concatenate(seq)
    r_tok, r_seq = np.exp(tok), np.exp(seq)
    return {
        "dropout": dropout,
        "b_scale": scale,
        "drift_abs_logp": drift,
        "token_logratio_std": float(tok.std()),
        "seq_logratio_std": float(seq.std()),
        "grpo_token_outside_frac": float(np.mean((r_tok < GRPO_BAND[0]) | (r_tok > GRPO_BAND[1]))),
        "gspo_seq_outside_frac": float(np.mean((r_seq < GSPO_BAND[0]) | (r_seq > GSPO_BAND[1]))),
        "tokens_per_seq": float(m.sum(-1).mean()),
    }


def main():
    ap = bench_harness.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(REPO / "checkpoints" / "smollm2-135m-instruct"))
    shared = os.environ.get(data.DATA_ENV, str(REPO.parent / "shared" / "data"))
    ap.add_argument("--data", default=os.path.join(shared, "train", "gsm8k_train.jsonl"))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128, help="completion tokens per row (cut)")
    ap.add_argument("--scales", default="0.0003,0.001,0.003", help="std of the adapters' B")
    ap.add_argument("--keys", type=int, default=2, help="dropout draws per setting")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if not (pathlib.Path(a.model) / "config.json").is_file():  # one line, not a traceback
        raise user_errors.UserError(f"--model={a.model}: no checkpoint there (config.json)")
    if not pathlib.Path(a.data).is_file():
        raise data.DataNotFoundError(f"--data: {data.missing_data_message(a.data)}")
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(a.model)
    tokens, attn, comp = _rows(tok, a.data, a.rows, a.tokens)
    out = []
    for scale in map(float, a.scales.split(",")):
        for dropout in (0.05, 0.0):
            out.append(
                measure(a.model, tokens, attn, comp, dropout=dropout, scale=scale, keys=a.keys)
            )
            r = out[-1]
            print(
                f"B std {scale:<7g} dropout {dropout:<5g} drift {r['drift_abs_logp']:.2e} | "
                f"token d std {r['token_logratio_std']:.2e}, outside [0.8,1.2] "
                f"{r['grpo_token_outside_frac']:.3f} | seq d std {r['seq_logratio_std']:.2e}, "
                f"outside GSPO band {r['gspo_seq_outside_frac']:.3f}",
                flush=True,
            )
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({"args": vars(a), "results": out}, indent=1))


if __name__ == "__main__":
    bench_harness.run(main)
