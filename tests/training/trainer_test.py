"""End-to-end training on a tiny random model: variants, resume after SIGKILL, learning, dry run."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest

from mmr_jax import rewards
from mmr_jax.config import checks
from mmr_jax.infra import metrics
from mmr_jax.rewards import grading
from mmr_jax.step import batch_layout, pipeline
from mmr_jax.training import (
    build,
    checkpoint,
    compiled_dry_run,
    hf_export,
    trainer,
    workdir_guard,
)

from support import testing, train_script

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "configs"))
import dapo  # noqa: E402
import dapo_nods  # noqa: E402
import dr_grpo  # noqa: E402
import grpo  # noqa: E402


# Compiled programs are shared by the runs of this module and the subprocesses it starts.
@pytest.fixture(autouse=True, scope="module")
def _xla_cache():
    """XLA's persistent cache for this module's tests and the processes they start."""
    with testing.persistent_xla_cache(min_compile_s=0.5):
        yield


ALGOS = {"grpo": grpo, "dr_grpo": dr_grpo, "dapo": dapo, "dapo_nods": dapo_nods}
TARGET = set("0123456789")


@rewards.register("test_target") if "test_target" not in rewards.REGISTRY else (lambda f: f)
def _target_reward(completions, answers, *, lengths=None):
    """Pays for the share of digit characters: a tiny random model can learn to emit more."""
    del answers, lengths
    return np.array(
        [sum(ch in TARGET for ch in c) / max(len(c), 1) for c in completions], np.float32
    )


def _config(algo, ckpt, *, mmr=False, lora=False, steps=2, **overrides):
    c = testing.smoke_config(ALGOS[algo], ckpt, steps=steps, mmr=mmr, lora=lora, **overrides)
    return checks.from_config_dict(c)


# The fast set trains one variant (20-25 s on 2 cores); each algorithm, MMR on and off, LoRA and
# full (4 runs, 3 min) run under --runslow (issue 40: the fast set's time).
VARIANTS = [("grpo", True, False)]
SLOW_VARIANTS = [
    ("dr_grpo", False, True),
    ("dapo", True, True),
    ("dapo_nods", False, False),
]  # and test_eval_and_export: dapo_nods with MMR and LoRA
ALL = [(a, m, lo) for a in ALGOS for m in (False, True) for lo in (False, True)]
FAST = [*VARIANTS, *SLOW_VARIANTS, ("dapo_nods", True, True)]
# With these three, every pair of factor values (algorithm x MMR, algorithm x LoRA, MMR x LoRA)
# trains together in some run: a pairwise covering array of the 16-run product, 8 runs instead
# of 16 (issue 48). MMR reweights the rewards on the host, LoRA changes which parameters train,
# the algorithm the loss: no code path depends on all three at once.
PAIRWISE = [("grpo", False, True), ("dr_grpo", True, False), ("dapo", False, False)]


def _pairs(variants):
    return {
        (i, a, j, b) for v in variants for i, a in enumerate(v) for j, b in enumerate(v) if i < j
    }


def _check_run(tmp_path, ckpt, algo, mmr, lora, **overrides):
    cfg = _config(algo, ckpt, mmr=mmr, lora=lora, **overrides)
    out = trainer.train(cfg, tmp_path / "run")
    assert np.isfinite(out["loss"]) and np.isfinite(out["grad_norm"]) and out["grad_norm"] > 0
    rows = metrics.read_jsonl(tmp_path / "run" / metrics.METRICS_FILE)
    assert [r["step"] for r in rows] == [1, 2]
    assert ("mmr/lambda_mean" in rows[0]) == mmr
    # The smoke configs pack (every step, whatever the lengths) and drop no arithmetic prompt.
    assert all(r["batch/layout"] == batch_layout.LAYOUTS.index("packed") for r in rows)
    assert all(r["data/prompts_dropped"] == 0 for r in rows)
    initial, final, meta = train_script.params(tmp_path / "run", cfg)
    assert meta["step"] == 2 and meta["data"]["position"] > 0
    # Each step ran at a length at least its own, one the checkpoint records as compiled, so
    # that a resume makes the same choices (shape_reuse).
    assert all(r["batch/packed_len"] >= r["batch/packed_len_needed"] for r in rows)
    assert {r["batch/packed_len"] for r in rows} <= set(meta["packed_lengths"]["compiled"])
    diffs = jax.tree.leaves(
        jax.tree.map(
            lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), initial, final
        )
    )
    assert max(diffs) > 0, "no parameter changed"
    if lora:
        assert all("lora" in str(p[-1]) for p, _ in __import__("flax").nnx.to_flat_state(final))
    return cfg, out


def _eval_overrides(tmp_path):
    bench = tmp_path / "bench"
    bench.mkdir()
    rows = [{"id": str(i), "problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(2)]
    (bench / "tiny.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "eval.every": 2,
        "eval.data_dir": str(bench),
        "eval.benchmarks": ("tiny",),
        "eval.n": 2,
        "eval.max_new_tokens": 8,
        "eval.system_prompt": "",
    }


class TestVariants:
    @pytest.mark.parametrize(
        "algo,mmr,lora",
        [*VARIANTS, *(pytest.param(*v, marks=pytest.mark.slow) for v in SLOW_VARIANTS)],
    )
    def test_two_steps(self, tmp_path, tiny_llama_dir, algo, mmr, lora):
        _check_run(tmp_path, tiny_llama_dir, algo, mmr, lora)

    @pytest.mark.slow
    def test_eval_and_export(self, tmp_path, tiny_llama_dir, monkeypatch):
        # A planted grader: problem 0 (answer "1") right in both samples, problem 1 only in its
        # first. c = (2, 1) of n = 2: pass@1 = (1 + 1/2) / 2 = 0.75, pass@2 = (1 + 1) / 2 = 1.
        class Planted:
            def grade(self, completions, answers):
                return [
                    grading.Grade(grading.CORRECT if a == "1" or i % 2 == 0 else grading.WRONG)
                    for i, a in enumerate(answers)
                ]

        monkeypatch.setattr(grading, "default_grader", Planted)
        cfg, out = _check_run(
            tmp_path, tiny_llama_dir, "dapo_nods", True, True, **_eval_overrides(tmp_path)
        )
        for where in ("tiny", "average"):
            assert out[f"eval/{where}/pass@1"] == 0.75 and out[f"eval/{where}/pass@2"] == 1.0
        path = hf_export.export_hf(cfg, tmp_path / "run", tmp_path / "hf", step=1)
        assert (pathlib.Path(path) / "config.json").exists()
        assert (pathlib.Path(path) / "adapter" / "adapter_config.json").exists()

    def test_variants_cover_every_pair_of_factors(self):
        assert _pairs(FAST + PAIRWISE) == _pairs(ALL)
        assert _pairs(FAST) != _pairs(ALL)  # PAIRWISE adds pairs the others miss

    @pytest.mark.slow
    @pytest.mark.parametrize("algo,mmr,lora", PAIRWISE)
    def test_two_steps_all(self, tmp_path, tiny_llama_dir, algo, mmr, lora):
        _check_run(tmp_path, tiny_llama_dir, algo, mmr, lora)

    @pytest.mark.slow
    def test_dra_batch_scope_and_iterations(self, tmp_path, tiny_qwen2_dir, monkeypatch):
        # The advantages the step gets, against plain loops of DRA-GRPO and of the released
        # MMR rule over the whole batch, each followed by the GRPO group normalisation.
        seen = _capture_advantages(monkeypatch)
        cfg = _config("grpo", tiny_qwen2_dir, **{"reweight.method": "dra", "loss.iterations": 2})
        out = trainer.train(cfg, tmp_path / "run")
        assert out["ratio/min"] < 1.0 < out["ratio/max"]  # pass 1 is 1, pass 2 moves both ways
        for r, emb, adv in seen:
            np.testing.assert_allclose(adv, _grpo(_dra_loop(r, emb)), rtol=1e-4, atol=1e-5)
        seen.clear()
        cfg = _config(
            "grpo", tiny_qwen2_dir, mmr=True, **{"reweight.scope": "batch", "reweight.lam": 0.7}
        )
        trainer.train(cfg, tmp_path / "run2")
        assert len(seen) == 2
        for r, emb, adv in seen:
            want = _mmr_batch_loop(r.reshape(-1), emb.reshape(len(r.reshape(-1)), -1), 0.7)
            np.testing.assert_allclose(adv, _grpo(want.reshape(r.shape)), rtol=1e-4, atol=1e-5)


class TestBatchPolicy:
    @pytest.mark.slow
    def test_over_long_prompts_dropped_counted_and_full_rows_logged(self, tmp_path, tiny_llama_dir):
        # One truncation policy: prompts over batch.max_prompt_len (32) are dropped at load,
        # never cut, and counted in every step's metrics; the full-row layout logs itself.
        rows = [{"problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(6)]
        rows += [{"problem": "What is " + "1 + " * 40 + "1?", "answer": "41"}] * 2
        src = tmp_path / "train.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        cfg = _config(
            "dapo_nods",
            tiny_llama_dir,
            steps=1,
            **{"data.source": str(src), "checkpoint.every": 0, "batch.shared_prompt": False},
        )
        trainer.train(cfg, tmp_path / "run")
        (row,) = metrics.read_jsonl(tmp_path / "run" / metrics.METRICS_FILE)
        assert row["data/prompts_dropped"] == 2
        assert row["batch/layout"] == batch_layout.LAYOUTS.index("full")
        assert row["batch/rows_per_prompt"] == 1


def _capture_advantages(monkeypatch):
    """Records (rewards [B, G], embeddings [B, G, D], advantages [B, G]) of every step."""
    seen, real = [], pipeline.make_batch

    def make_batch(cfg, groups, **kw):
        batch, info = real(cfg, groups, **kw)
        assert groups.valid.all()  # arithmetic answers all parse: no masked completion here
        adv = np.asarray(batch.advantages).reshape(groups.total.shape)
        seen.append((groups.total.astype(np.float64), groups.embeddings.astype(np.float64), adv))
        return batch, info

    monkeypatch.setattr(pipeline, "make_batch", make_batch)
    return seen


def _cosines(emb):
    norm = np.linalg.norm(emb, axis=-1, keepdims=True)
    unit = np.where(norm > 0, emb / np.where(norm > 0, norm, 1.0), 0.0)
    return unit @ unit.T


def _dra_loop(r_BxG, emb_BxGxD):
    out = np.zeros_like(r_BxG)
    for b in range(r_BxG.shape[0]):
        cos = _cosines(emb_BxGxD[b])
        for i in range(r_BxG.shape[1]):
            out[b, i] = r_BxG[b, i] / (1 + sum(cos[i, j] for j in range(len(cos)) if j != i))
    return out


def _mmr_batch_loop(r, emb, lam):
    """Algorithm 1 over one list: argmax r keeps its reward; each later greedy pick gets
    lam * r - (1 - lam) * (max cosine to the picked)."""
    cos, out, picked = _cosines(emb), np.zeros_like(r), [int(np.argmax(r))]
    out[picked[0]] = r[picked[0]]
    while len(picked) < len(r):
        rest = [i for i in range(len(r)) if i not in picked]
        scores = [lam * r[i] - (1 - lam) * max(cos[i, j] for j in picked) for i in rest]
        k = int(np.argmax(scores))
        out[rest[k]] = scores[k]
        picked.append(rest[k])
    return out


def _grpo(r_BxG, eps=1e-4):
    """(r - group mean) / (group std, ddof 1, + eps): the grpo configs' estimator."""
    mean = r_BxG.mean(-1, keepdims=True)
    return (r_BxG - mean) / (r_BxG.std(-1, ddof=1, keepdims=True) + eps)


MISMATCH_KEYS = {
    "mismatch/logp_abs_mean",
    "mismatch/logp_abs_max",
    "mismatch/ratio_mean",
    "mismatch/ratio_std",
    "mismatch/ratio_min",
    "mismatch/ratio_max",
}


def _capture_batches(monkeypatch):
    """Records every (engine log-probs, loss mask) the trainer sends to the step, as numpy."""
    seen, real = [], pipeline.make_batch

    def make_batch(cfg, groups, **kw):
        batch, info = real(cfg, groups, **kw)
        seen.append((np.asarray(batch.sampler_logps), np.asarray(batch.completion_mask)))
        return batch, info

    monkeypatch.setattr(pipeline, "make_batch", make_batch)
    return seen


def _plant_engine_offset(monkeypatch, offset, cut_first=None):
    """The embedded engine reports log-prob + `offset` (a scalar, or [B] per prompt) per token;
    `cut_first` cuts prompt 0's completions to that many tokens (another token count)."""
    from mmr_jax.rollout import embedded

    real = embedded.EmbeddedEngine.generate

    def generate(self, prompt_ids, params):
        out = real(self, prompt_ids, params)
        if cut_first is not None:
            out.mask[0, :, cut_first:] = False
            out.tokens[0, :, cut_first:] = self.pad_id
        off = np.broadcast_to(np.asarray(offset, np.float32), (len(prompt_ids),))[:, None, None]
        out.logprobs = np.where(out.mask, out.logprobs + off, 0.0).astype(np.float32)
        return out

    monkeypatch.setattr(embedded.EmbeddedEngine, "generate", generate)


class TestMismatch:
    def test_embedded_fp32_engine_matches_trainer(self, tmp_path, tiny_llama_dir, monkeypatch):
        seen = _capture_batches(monkeypatch)
        cfg = _config("dapo_nods", tiny_llama_dir, steps=2, **{"checkpoint.every": 0})
        assert cfg.model.dtype == "float32" and not cfg.lora.enabled
        trainer.train(cfg, tmp_path / "run")
        rows = metrics.read_jsonl(tmp_path / "run" / metrics.METRICS_FILE)
        assert len(rows) == 2 and len(seen) == 2
        for row, (logps, mask) in zip(rows, seen, strict=True):
            assert MISMATCH_KEYS <= set(row) and "tis/clipped_frac" not in row
            # The sampler test's fp32 tolerance per token (sampler_test: 2e-5 + 1e-5 |logp|).
            bound = 2e-5 + 1e-5 * float(np.abs(logps[mask]).max())
            assert 0.0 <= row["mismatch/logp_abs_mean"] <= row["mismatch/logp_abs_max"] <= bound
            assert 1 - 1.01 * bound <= row["mismatch/ratio_min"] <= row["mismatch/ratio_mean"]
            assert row["mismatch/ratio_mean"] <= row["mismatch/ratio_max"] <= 1 + 1.01 * bound
            assert row["mismatch/ratio_std"] <= bound

    @pytest.mark.slow
    def test_vllm_engine_over_http(self, tmp_path, tiny_llama_dir, monkeypatch):
        # The project's OpenAI-compatible server stands in for vLLM: the engine's log-probs come
        # back over HTTP. Step 2 samples after a weight sync, so a small mismatch there also
        # shows the server generated with the updated weights (lr 1e-3 moves them far more).
        from mmr_jax.serving import embedded_backend, server

        seen = _capture_batches(monkeypatch)
        backend = embedded_backend.EmbeddedBackend.from_pretrained(
            tiny_llama_dir, model_name="tiny"
        )
        with server.OpenAIServer(backend, weights_dir=tmp_path) as srv:
            cfg = _config(
                "dapo_nods",
                tiny_llama_dir,
                steps=2,
                **{
                    "checkpoint.every": 0,
                    "rollout.engine": "vllm",
                    "rollout.url": srv.url,
                    "rollout.model_name": "tiny",
                },
            )
            trainer.train(cfg, tmp_path / "run")
        rows = metrics.read_jsonl(tmp_path / "run" / metrics.METRICS_FILE)
        assert len(rows) == 2 and len(seen) == 2
        for row, (logps, mask) in zip(rows, seen, strict=True):
            assert MISMATCH_KEYS <= set(row)
            bound = 2e-5 + 1e-5 * float(np.abs(logps[mask]).max())
            assert row["mismatch/logp_abs_max"] <= bound

    @pytest.mark.slow
    def test_planted_offset_shows_exactly_and_tis_scales_the_gradient(
        self, tmp_path, tiny_llama_dir, monkeypatch
    ):
        # The engine claims log-prob - 0.1: trainer - engine = 0.1 (+ the fp32 noise bounded
        # above), so |diff| = 0.1, r = exp(0.1) = 1.105 on every token. With cap 2 the TIS
        # weight is r everywhere: the whole gradient is scaled by exp(0.1) against no TIS; with
        # cap 1.05 every token is capped, the gradient scaled by 1.05.
        _plant_engine_offset(monkeypatch, -0.1)
        out = {}
        for cap in (0.0, 2.0, 1.05):
            cfg = _config(
                "dapo_nods", tiny_llama_dir, steps=1, **{"checkpoint.every": 0, "loss.tis_cap": cap}
            )
            trainer.train(cfg, tmp_path / f"run{cap}")
            (out[cap],) = metrics.read_jsonl(tmp_path / f"run{cap}" / metrics.METRICS_FILE)
        for row in out.values():
            np.testing.assert_allclose(row["mismatch/logp_abs_mean"], 0.1, atol=1e-5)
            np.testing.assert_allclose(row["mismatch/logp_abs_max"], 0.1, atol=1e-5)
            for k in ("ratio_mean", "ratio_min", "ratio_max"):
                np.testing.assert_allclose(row[f"mismatch/{k}"], np.exp(0.1), atol=1e-5)
        assert "tis/clipped_frac" not in out[0.0]
        assert out[2.0]["tis/clipped_frac"] == 0.0 and out[1.05]["tis/clipped_frac"] == 1.0
        np.testing.assert_allclose(
            out[2.0]["grad_norm"] / out[0.0]["grad_norm"], np.exp(0.1), rtol=1e-4
        )
        np.testing.assert_allclose(out[1.05]["grad_norm"] / out[0.0]["grad_norm"], 1.05, rtol=1e-4)

    def test_reduced_exactly_over_minibatches(self, tmp_path, tiny_llama_dir, monkeypatch):
        # Prompt 0's completions get +0.1 and are cut to 5 tokens, prompt 1's get +0.3; with
        # 2 prompts x 4 and 2 minibatches each minibatch holds one prompt's rows. The batch
        # metrics must be the token statistics of the whole batch, computed here with numpy.
        seen = _capture_batches(monkeypatch)
        _plant_engine_offset(monkeypatch, [0.1, 0.3], cut_first=5)
        cfg = _config("dapo_nods", tiny_llama_dir, steps=1, **{"checkpoint.every": 0})
        assert (cfg.batch.prompts, cfg.batch.generations, cfg.loss.minibatches) == (2, 4, 2)
        trainer.train(cfg, tmp_path / "run")
        (row,) = metrics.read_jsonl(tmp_path / "run" / metrics.METRICS_FILE)
        ((logps, mask),) = seen
        off = np.repeat([0.1, 0.3], 4)[:, None] * np.ones_like(logps)
        counts = mask.sum(1)
        assert counts[:4].sum() != counts[4:].sum()  # unequal minibatches: a plain mean differs
        d, r = off[mask], np.exp(-off[mask])
        atol = 2e-5 + 1e-5 * float(np.abs(logps[mask]).max())  # the fp32 noise, test above
        want = {
            "logp_abs_mean": d.mean(),
            "logp_abs_max": 0.3,
            "ratio_mean": r.mean(),
            "ratio_std": r.std(),
            "ratio_min": np.exp(-0.3),
            "ratio_max": np.exp(-0.1),
        }
        for k, v in want.items():
            np.testing.assert_allclose(row[f"mismatch/{k}"], v, atol=atol, err_msg=k)

    def test_non_finite_engine_logprob_is_a_named_error(
        self, tmp_path, tiny_llama_dir, monkeypatch
    ):
        _plant_engine_offset(monkeypatch, np.nan)
        cfg = _config("dapo_nods", tiny_llama_dir, steps=1, **{"checkpoint.every": 0})
        with pytest.raises(
            pipeline.EngineLogprobError, match="embedded engine returned .* non-fin"
        ):
            trainer.train(cfg, tmp_path / "run")


class TestLearning:
    def test_target_token_reward_rises(self, tmp_path, tiny_llama_dir):
        # Fixed in advance: mean reward of the last 4 steps beats the first 4 by at least 0.05
        # (the reward is the share of '7' characters; random text starts near 0.01).
        cfg = _config(
            "dapo_nods",
            tiny_llama_dir,
            steps=16,
            **{
                "optim.lr": 3e-3,
                "batch.generations": 8,
                "batch.prompts": 4,
                "loss.minibatches": 2,
                "checkpoint.every": 0,
                "reweight.embedding_model": "hashing",
            },
        )
        trainer.train(cfg, tmp_path / "run")
        r = [
            row["reward/mean"]
            for row in metrics.read_jsonl(tmp_path / "run" / metrics.METRICS_FILE)
        ]
        assert len(r) == 16
        assert np.mean(r[-4:]) > np.mean(r[:4]) + 0.05, r


class TestResume:
    @pytest.mark.slow
    def test_sigkill_then_resume_matches(self, tmp_path, tiny_llama_dir):
        steps = 5
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        ref = tmp_path / "ref"
        subprocess.run(
            train_script.train_cmd(ref, tiny_llama_dir, steps),
            check=True,
            env=env,
            capture_output=True,
        )
        run = tmp_path / "run"
        proc = subprocess.Popen(
            train_script.train_cmd(run, tiny_llama_dir, steps),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 300
        while not (run / checkpoint.CKPT_DIR / "2").exists() and time.time() < deadline:
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        done = checkpoint.Checkpointer(run / checkpoint.CKPT_DIR, keep=None)
        killed_at = done.latest_step()
        done.close()
        assert killed_at is not None and killed_at < steps
        res = subprocess.run(
            train_script.train_cmd(run, tiny_llama_dir, steps),
            env=env,
            capture_output=True,
            text=True,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        assert f"workdir {run} | resuming from step {killed_at}" in res.stdout
        cfg = checks.from_config_dict(
            json.loads((run / workdir_guard.RUN_FILE).read_text())["config"]
        )
        _, a, meta_a = train_script.params(ref, cfg)
        _, b, meta_b = train_script.params(run, cfg)
        assert meta_a == meta_b  # same step and data-iterator position
        jax.tree.map(
            lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6), a, b
        )
        rows_a = metrics.read_jsonl(ref / metrics.METRICS_FILE)
        rows_b = metrics.read_jsonl(run / metrics.METRICS_FILE)
        assert [r["step"] for r in rows_b] == list(range(1, steps + 1))
        for x, y in zip(rows_a, rows_b, strict=True):  # same data order and samples
            assert x["reward/mean"] == pytest.approx(y["reward/mean"], abs=1e-6)
            assert x["completion/length_mean"] == y["completion/length_mean"]

    @pytest.mark.slow
    @pytest.mark.parametrize(
        "commit",
        [
            # The last commit before mmr_jax/ was regrouped into role subpackages (issue 48).
            "6dd19a4596be57b112beaab249fe3fd9336b16fd",
            # The last commit before reweight.method replaced mmr.enabled / dra.enabled (issue 53):
            # its run.json stores the mmr and dra sections, which map to reweight.
            "bfa45ccbb2fce0293d764dd0483296c8c3c0cf8a",
        ],
    )
    def test_a_run_written_by_an_older_commit_resumes(self, tmp_path, tiny_llama_dir, commit):
        old = tmp_path / "old_tree"
        old.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(train_script.REPO), "archive", commit],
            capture_output=True,
        )
        assert archive.returncode == 0, (
            f"this test needs the project's git history (commit {commit}): "
            + archive.stderr.decode()[-500:]
        )
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
        run = tmp_path / "run"
        # The old tree first on the path, so its own mmr_jax (flat layout) writes the run.
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(old))
        first = subprocess.run(
            train_script.train_cmd(run, tiny_llama_dir, 2, repo=old),
            env=env,
            cwd=old,
            capture_output=True,
            text=True,
        )
        assert first.returncode == 0, first.stderr[-3000:]
        stored = workdir_guard.read_run_config(run)
        assert stored["mmr"]["enabled"] and "reweight" not in stored  # the old keys wrote it
        env["PYTHONPATH"] = str(train_script.REPO)
        res = subprocess.run(
            train_script.train_cmd(run, tiny_llama_dir, 3),
            env=env,
            capture_output=True,
            text=True,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        assert f"workdir {run} | resuming from step 2" in res.stdout
        rows = metrics.read_jsonl(run / metrics.METRICS_FILE)
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert np.isfinite(rows[-1]["reward/mean"]) and "mmr/lambda_mean" in rows[-1]


class TestDryRun:
    @pytest.mark.parametrize(
        "size,total,trainable",
        [
            ("1.5b", 1_777_088_000, 1_777_088_000),
            ("7b", 7_615_616_512 + 161_480_704, 161_480_704),
            ("8b", 8_030_261_248 + 167_772_160, 167_772_160),
        ],
    )
    def test_param_counts(self, size, total, trainable):
        out = compiled_dry_run.dry_run(checks.from_config_dict(grpo.get_config(size)))
        assert (out["params_total"], out["trainable"]) == (total, trainable)

    @pytest.mark.parametrize(
        "shape,over_hosts,want",
        [
            ((1, -1, 1), "hybrid", (2, 4, 1)),  # hosts along data, fsdp within one host
            ((1, -1, 1), "flat", (1, 8, 1)),  # every device along fsdp, as asked
            ((-1, 2, 1), "hybrid", (4, 2, 1)),  # -1 on data: the remaining devices
            ((1, 16, 1), "hybrid", (1, 16, 1)),  # written in full: as written, fit or not
        ],
    )
    def test_mesh_of_two_hosts(self, shape, over_hosts, want):
        """On 2 hosts x 4 devices the dry run's mesh is the one the run builds (sharding's
        device_grid), not -1 filled from all 8 devices as one flat block."""
        c = grpo.get_config("1.5b")
        c.mesh.shape, c.mesh.over_hosts = shape, over_hosts
        cfg = checks.from_config_dict(c)
        sizes = compiled_dry_run.dry_run_mesh_sizes(cfg, hosts=2, devices_per_host=4)
        assert sizes == dict(zip(("data", "fsdp", "tensor"), want, strict=True))

    def test_mesh_the_run_would_refuse(self):
        c = grpo.get_config("1.5b")
        c.mesh.shape = (3, -1, 1)  # data 3 does not split over 2 hosts
        with pytest.raises(build.sharding.MeshShapeError, match="do not divide"):
            compiled_dry_run.dry_run_mesh_sizes(
                checks.from_config_dict(c), hosts=2, devices_per_host=4
            )

    @pytest.mark.parametrize(
        "slices, mesh",
        [
            (None, {"data": 2, "fsdp": 4, "tensor": 1}),  # GPU nodes: hosts along data
            ([0] * 8, {"data": 1, "fsdp": 8, "tensor": 1}),  # one TPU slice over both hosts: ICI
            ([0] * 4 + [1] * 4, {"data": 2, "fsdp": 4, "tensor": 1}),  # two slices: data on DCN
        ],
    )
    def test_dry_run_lays_the_mesh_over_the_hosts(self, monkeypatch, tiny_llama_dir, slices, mesh):
        """`dry_run` on what reads as 2 processes x 4 devices reports (and sizes its per-device
        memory for) the mesh the run builds of the default shape (1, -1, 1): data across hosts,
        or across TPU slices where the devices carry a `slice_index`."""
        import types

        cfg = _config("grpo", tiny_llama_dir)
        assert tuple(cfg.mesh.shape) == (1, -1, 1) and cfg.mesh.over_hosts == "hybrid"
        one = compiled_dry_run.dry_run(cfg)
        fake = [types.SimpleNamespace(id=i, process_index=i // 4) for i in range(8)]
        for d, s in zip(fake, slices or [], strict=False):
            d.slice_index, d.platform = s, "tpu"
        monkeypatch.setattr(jax, "devices", lambda: fake)
        monkeypatch.setattr(jax, "device_count", lambda: 8)
        eight = compiled_dry_run.dry_run(cfg)
        assert one["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1}  # this process's 1 device
        assert eight["mesh"] == mesh
        assert eight["param_gib_per_device"] < one["param_gib_per_device"]
        sharding = build.sharding  # the run's grid: make_mesh's default hosts are the granules
        grid = sharding.device_grid((1, -1, 1), fake, [sharding.granule(d) for d in fake])
        assert dict(zip(sharding.AXES, grid.shape, strict=True)) == mesh

    @pytest.mark.slow
    def test_script_on_two_processes_reports_the_hybrid_mesh(self):
        """scripts/train.py --dry_run on a real cluster of 2 processes x 2 CPU devices: both
        report the default (1, -1, 1) as (2, 2, 1), hosts along data (9 s on 2 cores)."""
        from support import multihost

        port = multihost.free_port()
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
        script, config = REPO / "scripts" / "train.py", REPO / "configs" / "grpo_7b.py"
        cmds = [
            [sys.executable, str(script), f"--config={config}", "--dry_run",
             f"--coordinator_address=localhost:{port}", "--num_processes=2", f"--process_id={i}"]
            for i in range(2)
        ]  # fmt: skip
        for code, out, _ in multihost.outputs(multihost.start_all(cmds, env)):
            assert code == 0, out[-3000:]
            assert " mesh 2x2x1 " in out and "161,480,704 trainable" in out, out[-3000:]

    def test_script_prints_counts(self):
        res = subprocess.run(
            [
                sys.executable,
                str(REPO / "scripts" / "train.py"),
                f"--config={REPO / 'configs' / 'grpo_7b.py'}",
                "--dry_run",
            ],
            capture_output=True,
            text=True,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
        )
        assert res.returncode == 0, res.stderr[-2000:]
        assert "161,480,704 trainable" in res.stderr


class TestBadInput:
    def test_unknown_key_lists_valid_keys(self, tmp_path):
        res = subprocess.run(
            [
                sys.executable,
                str(REPO / "scripts" / "train.py"),
                f"--config={REPO / 'configs' / 'grpo.py'}:smoke",
                f"--workdir={tmp_path}",
                "--config.reweight.lamda=0.5",
            ],
            capture_output=True,
            text=True,
        )
        assert res.returncode != 0
        assert "valid keys" in res.stderr and "'scope'" in res.stderr and "lamda" in res.stderr

    def test_dataset_without_fields(self, tmp_path, tiny_llama_dir):
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
        cfg = _config("grpo", tiny_llama_dir, **{"data.source": str(path)})
        with pytest.raises(ValueError, match="problem"):
            trainer.train(cfg, tmp_path / "run")

    def test_workdir_of_another_config(self, tmp_path, tiny_llama_dir):
        workdir_guard.claim(tmp_path / "run", _config("grpo", tiny_llama_dir).to_dict())
        (tmp_path / "run" / checkpoint.CKPT_DIR / "1").mkdir(parents=True)  # it saved a step
        with pytest.raises(workdir_guard.RunMismatchError, match="loss.beta"):
            trainer.train(_config("dapo", tiny_llama_dir), tmp_path / "run")

    def test_non_finite_loss_stops_and_keeps_checkpoint(
        self, tmp_path, tiny_llama_dir, monkeypatch
    ):
        cfg = _config("grpo", tiny_llama_dir, steps=3)
        real = trainer.train_step.jit_train_step

        def poisoned(**kw):
            fn = real(**kw)

            def step(state, batch, *a):
                state, m = fn(state, batch, *a)
                return state, dict(
                    m, loss=m["loss"] * np.nan if int(state.step) == 2 else m["loss"]
                )

            return step

        monkeypatch.setattr(trainer.train_step, "jit_train_step", poisoned)
        with pytest.raises(
            trainer.NonFiniteLossError, match="step 2.*last good checkpoint \\(step 1\\)"
        ):
            trainer.train(cfg, tmp_path / "run")
        ck = checkpoint.Checkpointer(tmp_path / "run" / checkpoint.CKPT_DIR, keep=None)
        assert ck.all_steps() == [1]
        ck.close()


class TestCompilation:
    def test_train_step_traced_once_per_shape(self, tmp_path, tiny_llama_dir, monkeypatch):
        traces, shapes = [], []
        real = trainer.train_step.train_step
        real_step = trainer.train_step.jit_train_step

        def counted(*args, **kwargs):
            traces.append(1)  # runs only while jax traces the step
            return real(*args, **kwargs)

        def recording(**kwargs):
            fn = real_step(**kwargs)

            def call(state, batch, *rest):
                packed = None if batch.packed is None else batch.packed.inputs.shape
                shapes.append((batch.prompt_tokens.shape, batch.tokens.shape, packed))
                return fn(state, batch, *rest)

            return call

        monkeypatch.setattr(trainer.train_step, "train_step", counted)
        monkeypatch.setattr(trainer.train_step, "jit_train_step", recording)
        cfg = _config("dapo_nods", tiny_llama_dir, steps=4, **{"checkpoint.every": 0})
        # shapes: the batch's (prompt, completion, packed row) length buckets
        assert cfg.batch.shared_prompt and cfg.batch.pack_max_len > 0
        trainer.train(cfg, tmp_path / "run")
        assert len(shapes) == 4 and all(packed for *_, packed in shapes)
        assert len(traces) == len(set(shapes))  # one compilation per bucket triple, no more


class TestHeader:
    @pytest.mark.parametrize("tis_cap,warned", [(0.0, True), (2.0, False)])
    def test_stale_uncorrected_samples_warned_at_start(self, tmp_path, caplog, tis_cap, warned):
        c = grpo.get_config("smoke")
        c.rollout.off_policy_lag, c.loss.tis_cap = 1, tis_cap
        run = types.SimpleNamespace(  # what the header reads of a `build.Run`
            cfg=checks.from_config_dict(c),
            workdir=str(tmp_path),
            resume_step=None,
            policy=types.SimpleNamespace(attention=None),
            mesh=types.SimpleNamespace(shape={"data": 1, "fsdp": 1, "tensor": 1}),
        )
        with caplog.at_level("WARNING"):
            trainer.print_header(run)
        lines = [r.getMessage() for r in caplog.records if "off_policy_lag=1" in r.getMessage()]
        assert len(lines) == (1 if warned else 0), lines


class TestLoopOptions:
    def test_two_steps_with_the_issue_47_loop_options(self, tmp_path, tiny_llama_dir):
        # Two updates per batch under LoRA (dropout off in the step), DAPO's overlong punishment
        # and an adaptive entropy coefficient that rises (entropy below the target 100): 0 at
        # step 1, 0.005 at step 2, as logged.
        overrides = {
            "loss.updates_per_batch": 2,
            "loss.entropy_target": 100.0,
            "rewards.weights": {"test_target": 1.0, "format": 0.0, "overlong": 1.0},
        }
        _check_run(tmp_path, tiny_llama_dir, "dapo", False, True, **overrides)
        rows = metrics.read_jsonl(tmp_path / "run" / metrics.METRICS_FILE)
        np.testing.assert_allclose([r["entropy_coef"] for r in rows], [0.0, 0.005], atol=1e-9)
        assert all("reward/overlong/mean" in r for r in rows)

    def test_truncated_completions_leave_the_loss(self, tmp_path, tiny_llama_dir):
        # The tiny random model rarely stops before max_completion_len: a step whose every
        # completion was cut trains on no token with the option, on all of them without it
        # (step 1 samples the same completions in both runs).
        first = {}
        for mask in (True, False):
            opts = {"loss.mask_truncated_completions": mask, "total_steps": 1}
            cfg = _config("dapo_nods", tiny_llama_dir, **opts)  # no DAPO filter: all train
            trainer.train(cfg, tmp_path / f"run_{mask}")
            first[mask] = metrics.read_jsonl(tmp_path / f"run_{mask}" / metrics.METRICS_FILE)[0]
        on, off = first[True], first[False]
        assert on["completion/truncated_frac"] == off["completion/truncated_frac"]
        assert (on["tokens"] == 0) == (on["completion/truncated_frac"] == 1.0), on
        assert off["tokens"] == off["throughput/tokens"] > on["tokens"]
