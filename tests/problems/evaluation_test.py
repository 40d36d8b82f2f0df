"""Tests for problems.evaluation: the pass@k estimator, evaluate() on a fake engine, sweeps."""

import itertools
import json
import math

import numpy as np
import pytest

from mmr_jax.problems import data, evaluation
from mmr_jax.rewards import grading
from mmr_jax.rollout import base

from support import testing


class TestPassAtK:
    @pytest.mark.parametrize(
        "n,c,k,expected",
        [
            (16, 0, 1, 0.0),
            (16, 16, 16, 1.0),
            (16, 4, 1, 0.25),  # pass@1 = c / n
            (4, 2, 2, 1 - 1 / 6),  # 1 - C(2,2)/C(4,2)
            (5, 1, 2, 0.4),  # 1 - C(4,2)/C(5,2) = 1 - 6/10
            (16, 1, 8, 0.5),
            (10, 7, 4, 1.0),  # n - c < k
        ],
    )
    def test_hand_values(self, n, c, k, expected):
        assert evaluation.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)

    @pytest.mark.parametrize("n", [1, 4, 7])
    def test_brute_force_over_all_k_subsets(self, n):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert evaluation.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)

    def test_matches_binomial_formula_at_large_n(self):
        n, c, k = 200, 37, 50
        exact = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert evaluation.pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)

    @pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)])
    def test_invalid(self, n, c, k):
        with pytest.raises(ValueError):
            evaluation.pass_at_k(n, c, k)


class FakeEngine:
    """A RolloutEngine answering each prompt with scripted texts (one per sample), in order."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.calls = tokenizer, script, []

    def generate(self, prompt_ids, params):
        self.calls.append(params)
        toks, lps, reasons = [], [], []
        for ids in prompt_ids:
            question = self.tokenizer.decode(ids).split("user\n")[-1].split("<|im_end|>")[0]
            texts = self.script[question]
            assert len(texts) == params.n
            comp = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
            comp = [c + list(params.stop_token_ids) for c in comp]
            toks.append(comp)
            lps.append([[0.0] * len(c) for c in comp])
            reasons.append(["stop"] * params.n)
        return base.batch_from_lists(toks, lps, reasons, pad_id=3)

    def sync_weights(self, model, *, version):
        del model, version


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return testing.make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _problems():
    return {
        "easy": [data.Problem("e1", "What is 1+1?", "2"), data.Problem("e2", "What is 2+2?", "4")],
        "hard": [data.Problem("h1", "What is 3*3?", "9")],
    }


# 4 samples each: e1 3/4 correct, e2 1/4, h1 0/4 (one with an unboxed wrong answer).
SCRIPT = {
    "What is 1+1?": ["\\boxed{2}", "so \\boxed{2}", "\\boxed{3}", "The answer is 2."],
    "What is 2+2?": ["\\boxed{5}", "\\boxed{4}", "no idea", "\\boxed{22}"],
    "What is 3*3?": ["\\boxed{6}", "\\boxed{33}", "nine", "\\boxed{8}"],
}


class TestEvaluate:
    def test_pass_at_k_by_hand(self, tokenizer):
        engine = FakeEngine(tokenizer, SCRIPT)
        result = evaluation.evaluate(
            engine, tokenizer, _problems(), n=4, max_new_tokens=32, ks=(1, 2, 4, 8),
            prompt_batch_size=1, grader=grading.Grader(workers=0), keep_completions=True,
        )  # fmt: skip
        easy = result.per_benchmark["easy"]
        # pass@1: (3/4 + 1/4) / 2; pass@2: e1 1 - C(1,2)/C(4,2) = 1, e2 1 - C(3,2)/C(4,2) = 1/2
        assert easy["pass@1"] == pytest.approx(0.5)
        assert easy["pass@2"] == pytest.approx(0.75)
        assert easy["pass@4"] == pytest.approx(1.0)
        assert "pass@8" not in easy  # k > n left out
        assert result.per_benchmark["hard"]["pass@4"] == 0.0
        assert result.average["pass@1"] == pytest.approx(0.25)  # unweighted over benchmarks
        rec = {r["id"]: r for r in result.records}
        assert rec["e1"]["correct"] == [True, True, False, True]
        assert rec["e1"]["benchmark"] == "easy" and rec["e1"]["completions"][0] == "\\boxed{2}"
        # the sampler got the protocol's settings, EOS as the stop token, and distinct seeds
        p = engine.calls[0]
        assert (p.n, p.temperature, p.top_p, p.stop_token_ids) == (4, 0.6, 0.95, (2,))
        assert len({c.seed for c in engine.calls}) == 3
        table = evaluation.format_table(result)
        assert "average" in table and "50.00" in table

    def test_json_and_run_sweep_with_plot(self, tokenizer, tmp_path):
        run = tmp_path / "run"
        for step in (10, 20, 30):
            (run / f"step_{step}").mkdir(parents=True)
            (run / f"step_{step}" / "config.json").write_text("{}")
        (run / "step_40").mkdir()  # no config.json: not an export
        correct_by_step = {"step_10": 1, "step_20": 3, "step_30": 3}

        def evaluate_checkpoint(step, path):
            assert path.endswith(f"step_{step}")
            c = correct_by_step[path.rsplit("/", 1)[-1]]
            script = {q: ["\\boxed{2}"] * c + ["\\boxed{0}"] * (4 - c) for q in SCRIPT}
            problems = {"b": [data.Problem("p", "What is 1+1?", "2")]}
            engine, grader = FakeEngine(tokenizer, script), grading.Grader(workers=0)
            return evaluation.evaluate(
                engine, tokenizer, problems, n=4, max_new_tokens=8, grader=grader
            )

        found = evaluation.find_checkpoints(run)
        results, peak = evaluation.evaluate_run(found, evaluate_checkpoint)
        assert [s for s, _ in results] == [10, 20, 30] and peak == 20  # ties: earliest step
        evaluation.plot_curve(results, tmp_path / "curve.png")
        assert (tmp_path / "curve.png").stat().st_size > 1000
        evaluation.write_json(results[0][1], tmp_path / "out" / "eval.json", step=10)
        saved = json.loads((tmp_path / "out" / "eval.json").read_text())
        assert saved["metadata"] == {"step": 10} and saved["records"][0]["pass@1"] == 0.25

    def test_number_only(self, tokenizer):
        # math-verify evaluates "3+9" to 12, so restating the question passes without number_only
        script = {"What is 3+9?": ["The answer is 3+9.", "The answer is 12.", "\\boxed{12}",
                                   "\\boxed{3+9}"]}  # fmt: skip
        problems = {"b": [data.Problem("p", "What is 3+9?", "12")]}
        kw = dict(n=4, max_new_tokens=8, grader=grading.Grader(workers=0))
        loose = evaluation.evaluate(FakeEngine(tokenizer, script), tokenizer, problems, **kw)
        strict = evaluation.evaluate(
            FakeEngine(tokenizer, script), tokenizer, problems, number_only=True, **kw
        )
        assert loose.records[0]["correct"] == [True] * 4
        assert strict.records[0]["correct"] == [False, True, True, False]
        assert strict.average["pass@1"] == 0.5

    def test_load_benchmarks(self):
        root = testing.require_shared_data("eval/aime24.jsonl", "eval/amc23.jsonl")
        problems = evaluation.load_benchmarks(root / "eval", ("aime24", "amc23"), max_problems=3)
        assert {k: len(v) for k, v in problems.items()} == {"aime24": 3, "amc23": 3}

    def test_load_benchmarks_names_missing_data(self, tmp_path):
        with pytest.raises(data.DataNotFoundError) as e:
            evaluation.load_benchmarks(tmp_path / "data" / "eval", ("aime24",))
        assert f"{tmp_path / 'data' / 'eval'} does not exist" in str(e.value)
        assert f"prepare_data.py --out={tmp_path / 'data'}`" in str(e.value)
        (tmp_path / "data" / "eval").mkdir(parents=True)
        with pytest.raises(data.DataNotFoundError, match=r"eval.aime24\.jsonl does not exist"):
            evaluation.load_benchmarks(tmp_path / "data" / "eval", ("aime24",))

    @pytest.mark.parametrize(
        "max_problems",
        [pytest.param(0, marks=pytest.mark.slow, id="all"), pytest.param(40, id="40")],
    )
    def test_gold_answers_of_the_benchmarks_parse(self, max_problems):
        files = [f"eval/{b}.jsonl" for b in evaluation.BENCHMARKS]
        eval_dir = testing.require_shared_data(*files) / "eval"
        problems = evaluation.load_benchmarks(eval_dir, max_problems=max_problems)
        golds = sorted({p.answer for ps in problems.values() for p in ps})
        grades = grading.Grader(workers=0).grade([""] * len(golds), golds)
        assert [a for a, g in zip(golds, grades, strict=True) if not g.gold_valid] == []
        assert np.mean([g.status == grading.WRONG for g in grades]) == 1.0


class TestEndToEnd:
    def test_script_names_missing_data(self, tmp_path):
        """No benchmark folder: evaluate.py exits 1 with the line saying how to get the data."""
        import pathlib
        import subprocess
        import sys

        root = pathlib.Path(__file__).resolve().parents[2]
        missing = tmp_path / "data" / "eval"
        (tmp_path / "ckpt").mkdir()  # a folder: the checkpoint is checked first
        cmd = [
            sys.executable, str(root / "scripts" / "evaluate.py"),
            f"--config={root / 'configs' / 'eval.py'}", f"--config.data_dir={missing}",
            f"--config.checkpoint={tmp_path / 'ckpt'}", f"--config.output_dir={tmp_path / 'out'}",
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 1, proc.stderr[-3000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert last == f"FATAL: benchmark folder: {data.missing_data_message(missing)}"
        assert f"prepare_data.py --out={tmp_path / 'data'}`" in last

    def test_script_on_a_tiny_model_and_five_problems(self, tmp_path):
        """scripts/evaluate.py through the real embedded sampler; records graded again here."""
        import pathlib
        import subprocess
        import sys

        eval_dir = testing.require_shared_data("eval/math500.jsonl") / "eval"
        # MATH-500 prompts run to ~800 tokens with the tiny 512-token vocabulary.
        ckpt = testing.make_tiny_checkpoint(tmp_path / "ckpt", max_position_embeddings=2048)
        root = pathlib.Path(__file__).resolve().parents[2]
        out = tmp_path / "eval"
        cmd = [
            sys.executable, str(root / "scripts" / "evaluate.py"),
            f"--config={root / 'configs' / 'eval.py'}",
            f"--config.checkpoint={ckpt}", f"--config.output_dir={out}",
            "--config.benchmarks=('math500',)", "--config.max_problems=5", "--config.n=2",
            "--config.ks=(1,2)", "--config.max_new_tokens=8", "--config.grader_workers=0",
            "--config.keep_completions=True", f"--config.data_dir={eval_dir}",
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        [path] = list(out.glob("*.json"))
        result = json.loads(path.read_text())
        records = result["records"]
        problems = evaluation.load_benchmarks(eval_dir, ["math500"], max_problems=5)["math500"]
        gold = {p.id: p.answer for p in problems}
        assert sorted(r["id"] for r in records) == sorted(gold)
        for r in records:  # every completion graded again, one by one, outside evaluate()
            assert len(r["completions"]) == 2
            regraded = [grading.grade_one(c, gold[r["id"]]).correct for c in r["completions"]]
            assert r["correct"] == regraded
        expect = np.mean([evaluation.pass_at_k(2, sum(r["correct"]), 1) for r in records])
        assert result["per_benchmark"]["math500"]["pass@1"] == pytest.approx(expect)
