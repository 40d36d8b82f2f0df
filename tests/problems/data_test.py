"""Tests for problems.data: loading and schema checks, prompts, PromptIterator, arithmetic; the
data folder's helpers (missing data named, `testing.require_shared_data`, the frozen tiny BPE)."""

import json
import re

import pytest

from mmr_jax.problems import data

from support import testing

EVAL_FILES = {"math500": 500, "aime24": 30, "amc23": 40, "minerva_math": 272, "olympiadbench": 675}


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return testing.make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


class TestLoadProblems:
    @pytest.mark.parametrize("name,rows", EVAL_FILES.items())
    def test_eval_files(self, name, rows):
        root = testing.require_shared_data(f"eval/{name}.jsonl")
        problems = data.load_problems(root / "eval" / f"{name}.jsonl")
        assert len(problems) == rows
        assert all(p.problem.strip() and p.answer.strip() and p.id for p in problems)
        assert len({p.id for p in problems}) == rows

    def test_custom_fields_and_numeric_answer(self, tmp_path):
        path = _write_jsonl(tmp_path / "q.jsonl", [{"question": "1+1?", "gt": 2}])
        (p,) = data.load_problems(path, problem_field="question", answer_field="gt")
        assert p == data.Problem(id="0", problem="1+1?", answer="2")

    @pytest.mark.parametrize(
        "rows,message",
        [
            ([{"problem": "a", "answer": "1"}, {"problem": "b"}],
             r"bad\.jsonl: row 1: missing field 'answer'"),
            ([{"problem": "a", "answer": "1"}, {"problem": "b", "answer": "  "}],
             r"bad\.jsonl: row 1: field 'answer' is empty"),
            ([{"answer": "1"}], r"bad\.jsonl: row 0: missing field 'problem'"),
        ],
    )  # fmt: skip
    def test_malformed_rows(self, tmp_path, rows, message):
        path = _write_jsonl(tmp_path / "bad.jsonl", rows)
        with pytest.raises(ValueError, match=message):
            data.load_problems(path)

    def test_parquet(self, tmp_path):
        import datasets

        path = str(tmp_path / "p.parquet")
        datasets.Dataset.from_list([{"id": "x", "problem": "q", "answer": "3"}]).to_parquet(path)
        assert data.load_problems(path) == [data.Problem("x", "q", "3")]

    def test_missing_file(self, tmp_path):
        with pytest.raises(FileNotFoundError, match="nope.jsonl"):
            data.load_problems(tmp_path / "nope.jsonl")

    def test_missing_data_file_says_how_to_get_it(self, tmp_path):
        path = tmp_path / "data" / "eval" / "math500.jsonl"
        with pytest.raises(data.DataNotFoundError) as e:
            data.load_problems(path)
        message = str(e.value)
        assert f"{path} does not exist" in message
        assert f"python scripts/prepare_data.py --out={tmp_path / 'data'}`" in message
        assert "../shared/data" in message and "$MMR_JAX_SHARED_DATA" in message

    def test_trainer_data_paths_name_missing_data(self, tmp_path, tokenizer):
        """The trainer's problems (`data.source`) and benchmarks (`eval.data_dir`)."""
        from configs import base
        from mmr_jax.config import checks
        from mmr_jax.training import problem_sets

        c = base.get_config()
        c.data.source = str(tmp_path / "d" / "train" / "gsm8k_train.jsonl")
        c.eval.source, c.eval.data_dir = "benchmarks", str(tmp_path / "d" / "eval")
        cfg = checks.from_config_dict(c)
        with pytest.raises(data.DataNotFoundError, match=re.escape(f"--out={tmp_path / 'd'}`")):
            problem_sets.load_prompts(cfg, tokenizer, {})  # benchmarks: nothing held out
        with pytest.raises(data.DataNotFoundError, match=r"d.eval does not exist"):
            problem_sets.eval_problems(cfg)


class TestRequireSharedData:
    def test_present(self, tmp_path, monkeypatch):
        (tmp_path / "eval").mkdir()
        (tmp_path / "eval" / "a.jsonl").write_text("")
        monkeypatch.setenv("MMR_JAX_SHARED_DATA", str(tmp_path))
        assert testing.require_shared_data("eval/a.jsonl") == tmp_path

    @pytest.mark.parametrize("ci", ["", "true"])
    def test_missing_skips_or_fails_under_ci(self, tmp_path, monkeypatch, ci):
        (tmp_path / "eval").mkdir()
        monkeypatch.setenv("MMR_JAX_SHARED_DATA", str(tmp_path))
        monkeypatch.setenv("CI", ci)
        outcome = pytest.fail.Exception if ci else pytest.skip.Exception
        with pytest.raises(outcome) as e:
            testing.require_shared_data("eval/a.jsonl")
        line = str(e.value)
        assert "\n" not in line and f"{tmp_path / 'eval' / 'a.jsonl'} does not exist" in line
        assert f"prepare_data.py --out={tmp_path}`" in line

    def test_no_folder_names_the_folder(self, tmp_path, monkeypatch):
        monkeypatch.setenv("MMR_JAX_SHARED_DATA", str(tmp_path / "none"))
        monkeypatch.delenv("CI", raising=False)
        with pytest.raises(pytest.skip.Exception, match="none.eval does not exist"):
            testing.require_shared_data()


class TestTinyTokenizer:
    def test_needs_no_data_folder(self, tmp_path, monkeypatch):
        monkeypatch.setenv("MMR_JAX_SHARED_DATA", str(tmp_path / "none"))
        tok = testing.make_tiny_tokenizer(tmp_path / "tok")
        assert len(tok) == 512
        assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == testing.SPECIAL_TOKENS
        assert tok.decode(tok("What is 12 + 35?")["input_ids"]) == "What is 12 + 35?"

    def test_frozen_bpe_is_the_one_trained_on_the_data(self):
        import tokenizers

        root = testing.require_shared_data("train/gsm8k_train.jsonl")
        trained = testing.train_tiny_bpe(testing.tokenizer_corpus(root))
        frozen = tokenizers.Tokenizer.from_file(str(testing.TINY_BPE))
        assert trained.get_vocab() == frozen.get_vocab()
        assert json.loads(trained.to_str()) == json.loads(frozen.to_str())


class TestBuildPrompt:
    def test_chat_template_with_system_prompt(self, tokenizer):
        ids = data.build_prompt(tokenizer, data.Problem("0", "What is 2+2?", "4"), "Be brief.")
        text = tokenizer.decode(ids)
        assert text == (
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
            "<|im_start|>assistant\n"
        )

    def test_no_system_prompt(self, tokenizer):
        text = tokenizer.decode(data.build_prompt(tokenizer, "hi", None))
        assert text.startswith("<|im_start|>user\nhi")

    def test_long_prompts_dropped_and_counted(self, tokenizer):
        problems = [data.Problem("a", "1+1?", "2"), data.Problem("b", "word " * 200, "1")]
        prompts, kept, dropped = data.build_prompts(
            tokenizer, problems, "Be brief.", max_prompt_length=60
        )
        assert [p.id for p in kept] == ["a"] and dropped == 1 and len(prompts) == 1
        assert len(prompts[0]) <= 60

    def test_paper_prompts(self):
        assert "<think> reasoning process here </think>" in data.TRAIN_SYSTEM_PROMPT
        assert "Therefore, the final answer is:" in data.EVAL_SYSTEM_PROMPT


class TestPromptIterator:
    def test_each_epoch_is_a_permutation_and_epochs_differ(self):
        it = data.PromptIterator(list(range(10)), batch_size=5, seed=3)
        e0 = next(it) + next(it)
        e1 = next(it) + next(it)
        assert sorted(e0) == sorted(e1) == list(range(10)) and e0 != e1

    def test_batches_continue_across_epochs(self):
        it = data.PromptIterator(list(range(5)), batch_size=3, seed=0)
        b = [next(it) for _ in range(5)]  # 15 items = 3 epochs
        flat = [x for bb in b for x in bb]
        assert all(sorted(flat[i : i + 5]) == list(range(5)) for i in (0, 5, 10))

    def test_restore_reproduces_the_order(self):
        it = data.PromptIterator(list(range(7)), batch_size=3, seed=11)
        for _ in range(4):
            next(it)
        state = json.loads(json.dumps(it.state()))
        expected = [next(it) for _ in range(6)]
        fresh = data.PromptIterator(list(range(7)), batch_size=3, seed=11)
        fresh.restore(state)
        assert [next(fresh) for _ in range(6)] == expected

    def test_same_seed_same_order_other_seed_differs(self):
        a = [next(data.PromptIterator(list(range(20)), 20, seed=1))]
        b = [next(data.PromptIterator(list(range(20)), 20, seed=1))]
        c = [next(data.PromptIterator(list(range(20)), 20, seed=2))]
        assert a == b != c

    def test_restore_rejects_other_data(self):
        state = data.PromptIterator(list(range(4)), 2, seed=0).state()
        with pytest.raises(ValueError, match="4 items"):
            data.PromptIterator(list(range(5)), 2, seed=0).restore(state)


class TestArithmeticProblems:
    def test_deterministic_and_correct(self):
        a = data.arithmetic_problems(50, seed=7)
        assert a == data.arithmetic_problems(50, seed=7) != data.arithmetic_problems(50, seed=8)
        for p in a:
            expr = p.problem.removeprefix("What is ").removesuffix("?")
            assert str(eval(expr)) == p.answer  # digits and + - * only

    def test_answers_grade_correct(self):
        from mmr_jax.rewards import grading

        problems = data.arithmetic_problems(5, seed=0, num_terms=3)
        grades = grading.Grader(workers=0).grade(
            [f"\\boxed{{{p.answer}}}" for p in problems], [p.answer for p in problems]
        )
        assert all(g.correct for g in grades)


class TestSystemPrompts:
    def test_eval_prompt_is_the_formatted_lighteval_text(self):
        # The model must see `$\boxed{ANSWER}$`, not the template source's `\\boxed{{ANSWER}}`.
        assert "the final answer is: $\\boxed{ANSWER}$. I hope" in data.EVAL_SYSTEM_PROMPT
        assert "{{" not in data.EVAL_SYSTEM_PROMPT and "\\\\" not in data.EVAL_SYSTEM_PROMPT

    def test_configs_carry_the_library_prompts(self):
        import importlib.util
        import pathlib

        path = pathlib.Path(__file__).resolve().parents[2] / "configs" / "eval.py"
        spec = importlib.util.spec_from_file_location("eval_config", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert module.get_config().system_prompt == data.EVAL_SYSTEM_PROMPT
