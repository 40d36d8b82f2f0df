"""Tests for mmr_jax.rewards: grading (math-verify), accuracy, format, cosine, registry, score."""

import functools
import math
import threading

import numpy as np
import pytest

from mmr_jax import rewards
from mmr_jax.rewards import functions, grading

GRADER = grading.Grader(workers=0, timeout_s=2)  # in-process: fast, signal timeouts (main thread)


def _status(completion, gold):
    return GRADER.grade([completion], [gold])[0].status


class TestGrading:
    @pytest.mark.parametrize(
        "completion,gold,expected",
        [
            # fractions vs decimals
            (r"so \boxed{0.5}", r"\frac12", "correct"),
            (r"\boxed{\frac{3}{4}}", "0.75", "correct"),
            (r"\boxed{0.33}", r"\frac13", "wrong"),
            # radicals
            (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", "correct"),
            (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", "correct"),
            (r"\boxed{\sqrt{2}}", r"\sqrt{3}", "wrong"),
            # intervals: the bracket matters
            (r"\boxed{(-\infty, 3]}", r"(-\infty,3]", "correct"),
            (r"\boxed{(-\infty, 3)}", r"(-\infty,3]", "wrong"),
            # several boxed answers are read together as one set: hedging earns nothing
            (r"\boxed{2} and \boxed{3}", "2,3", "correct"),
            (r"first \boxed{5} then \boxed{7}", "7", "wrong"),
            # no boxed answer: an anchored answer counts, a bare number does not
            ("The answer is 42.", "42", "correct"),
            (
                r"Therefore, the final answer is: $\boxed{42}$. I hope it is correct",
                "42",
                "correct",
            ),
            ("I think 42", "42", "wrong"),
            ("no answer here", "42", "wrong"),
            # LaTeX units and degrees
            (r"\boxed{10\text{ cm}}", "10", "correct"),
            (r"\boxed{90^\circ}", "90", "correct"),
            (r"\boxed{\$5}", "5", "correct"),
            # text answers
            (r"\boxed{\text{Evelyn}}", r"\text{Evelyn}", "correct"),
            (r"\boxed{Evelyn}", r"\text{Evelyn}", "correct"),
            (r"\boxed{\text{Bob}}", r"\text{Evelyn}", "wrong"),
            # Minerva e-notation golds
            (r"\boxed{4.5\times10^{33}}", "4.5e33", "correct"),
            (r"\boxed{4.5e33}", "4.5e33", "correct"),
            (r"\boxed{4.6\times10^{33}}", "4.5e33", "wrong"),
        ],
    )
    def test_pairs(self, completion, gold, expected):
        assert _status(completion, gold) == expected

    @pytest.mark.parametrize("gold", ["", "   ", r"\text{}", "}{"])
    def test_unparseable_gold_is_invalid_not_correct(self, gold):
        assert _status(r"\boxed{1}", gold) == grading.GOLD_INVALID

    def test_in_process_timeout_is_counted(self):
        g = grading.Grader(workers=0, timeout_s=1).grade([r"\boxed{9^{9^{9^{9^{9}}}}}"], ["1"])
        assert g[0].status == grading.TIMEOUT and not g[0].correct

    def test_worker_pool_kills_a_stuck_row_and_keeps_going(self):
        # hard_timeout_s below math-verify's own timeout: the worker is killed and replaced.
        grader = grading.Grader(workers=1, timeout_s=5, hard_timeout_s=1.0)
        try:
            out = grader.grade([r"\boxed{9^{9^{9^{9^{9}}}}}", r"\boxed{2}"], ["1", "2"])
            assert [g.status for g in out] == [grading.TIMEOUT, grading.CORRECT]
            assert [g.status for g in grader.grade([r"\boxed{3}"], ["3"])] == [grading.CORRECT]
        finally:
            grader.close()

    def test_worker_pool_works_off_the_main_thread(self):
        grader, out = grading.Grader(workers=2, timeout_s=2), []
        try:
            t = threading.Thread(
                target=lambda: out.extend(grader.grade([r"\boxed{0.5}"] * 3, ["1/2", "1", ""]))
            )
            t.start()
            t.join(60)
            assert [g.status for g in out] == ["correct", "wrong", "gold_invalid"]
        finally:
            grader.close()


class TestFormat:
    @pytest.mark.parametrize(
        "text,expected",
        [
            ("<think>add them</think><answer>\\boxed{7}</answer>", 1.0),
            ("<think>\nadd\n</think>\n<answer>\nso \\boxed{7}\n</answer>\n", 1.0),
            ("<think>add</think><answer>7</answer>", 0.0),  # no boxed answer
            ("<think>add</think>\\boxed{7}", 0.0),  # no answer tags
            ("<answer>\\boxed{7}</answer><think>x</think>", 0.0),  # wrong order
            ("Sure! <think>a</think><answer>\\boxed{7}</answer>", 0.0),  # text before
            ("<think>a</think><answer>\\boxed{7}</answer> trailing", 0.0),  # text after
            ("", 0.0),
        ],
    )
    def test_tags(self, text, expected):
        assert functions.format_reward([text])[0] == expected

    @pytest.mark.parametrize(
        "text,expected",
        [
            ("reasoning\n</think>\nThe answer is \\boxed{7}", 1.0),
            ("reasoning</think>\\boxed{7}", 0.0),  # needs the newlines
            ("a\n</think>\nb\n</think>\nc", 0.0),  # twice
            ("no tag", 0.0),
        ],
    )
    def test_r1(self, text, expected):
        assert functions.format_r1([text])[0] == expected
        assert functions.format_reward([text], style="r1")[0] == expected

    def test_unknown_style(self):
        with pytest.raises(ValueError, match="style"):
            functions.format_reward(["x"], style="xml")


class TestCosine:
    @pytest.mark.parametrize(
        "length,correct,expected",
        [
            (0, True, 1.0),
            (500, True, 0.75),  # 0.5 + 0.25 * (1 + cos(pi/2))
            (1000, True, 0.5),
            (250, True, 0.5 + 0.25 * (1 + math.cos(math.pi / 4))),
            (0, False, 0.0),
            (500, False, -0.25),
            (1000, False, -0.5),
            (3000, True, 0.5),  # clamped
            (3000, False, -0.5),
        ],
    )
    def test_clamped_tokens(self, length, correct, expected):
        grades = [grading.Grade(grading.CORRECT if correct else grading.WRONG)]
        r = functions.cosine(["x"], ["1"], lengths=[length], grades=grades, max_len=1000)
        np.testing.assert_allclose(r, [expected], atol=1e-6)

    def test_released_form_counts_characters_and_is_periodic(self):
        correct = [grading.Grade(grading.CORRECT)] * 3
        texts = ["", "a" * 1000, "a" * 2000]  # 2 * max_len characters: back to the top
        r = functions.cosine(texts, ["1"] * 3, lengths=[1, 1, 1], grades=correct,
                             **rewards.RELEASED_COSINE)  # fmt: skip
        np.testing.assert_allclose(r, [1.0, 0.5, 1.0], atol=1e-6)

    def test_grades_itself_without_grades(self):
        r = functions.cosine([r"\boxed{2}", r"\boxed{3}"], ["2", "2"], lengths=[0, 0],
                             grader=GRADER, max_len=10)  # fmt: skip
        np.testing.assert_allclose(r, [1.0, 0.0])


class TestRegistry:
    def test_builtins_registered(self):
        assert {"accuracy", "format", "format_r1", "cosine"} <= set(rewards.REGISTRY)

    def test_make_reward_fn_binds_params(self):
        fn = rewards.make_reward_fn("format", style="r1")
        assert isinstance(fn, functools.partial) and fn(["a\n</think>\nb"], ["1"])[0] == 1.0

    def test_unknown_name(self):
        with pytest.raises(KeyError, match="unknown reward"):
            rewards.make_reward_fn("nope")

    def test_duplicate_registration(self):
        with pytest.raises(ValueError, match="already registered"):
            rewards.register("format")(lambda *a, **k: None)


class TestScore:
    TEXTS = [
        "<think>a</think><answer>\\boxed{4}</answer>",  # well-formed, correct
        "<think>a</think><answer>\\boxed{5}</answer>",  # well-formed, wrong
        "the answer is \\boxed{4}",  # correct, no format
        "\\boxed{4}",  # gold not parseable
    ]
    ANSWERS = ["4", "4", "4", ""]

    def test_weighted_total_and_validity(self):
        s = rewards.score(self.TEXTS, self.ANSWERS, [0, 0, 0, 0],
                          {"format": 1.0, "cosine": 2.0, "accuracy": 0.0},
                          params={"cosine": {"max_len": 100}}, grader=GRADER)  # fmt: skip
        np.testing.assert_allclose(s.per_fn["format"], [1, 1, 0, 0])
        np.testing.assert_allclose(s.per_fn["accuracy"], [1, 0, 1, 0])
        np.testing.assert_allclose(s.per_fn["cosine"], [1, 0, 1, 0])
        np.testing.assert_allclose(s.total, [3, 1, 2, 0])
        np.testing.assert_array_equal(s.valid, [True, True, True, False])
        assert s.counts == {"gold_invalid": 1, "timeouts": 0}
        assert s.total.dtype == np.float32

    def test_validity_without_correctness_rewards(self):
        s = rewards.score(self.TEXTS, self.ANSWERS, [1] * 4, {"format": 1.0}, grader=GRADER)
        np.testing.assert_array_equal(s.valid, [True, True, True, False])

    def test_non_string_completion(self):
        with pytest.raises(TypeError, match="completion 1 is NoneType"):
            rewards.score(["a", None], ["1", "1"], [1, 1], {"format": 1.0}, grader=GRADER)

    def test_nan_reward_raises(self):
        rewards.REGISTRY["_nan_test"] = lambda c, a, *, lengths: np.array([0.0, np.nan])
        try:
            with pytest.raises(ValueError, match="'_nan_test' is not finite at rows \\[1\\]"):
                rewards.score(["a", "b"], ["1", "1"], [1, 1], {"_nan_test": 1.0}, grader=GRADER)
        finally:
            del rewards.REGISTRY["_nan_test"]

    def test_length_mismatch(self):
        with pytest.raises(ValueError, match="2 completions, 1 answers"):
            rewards.score(["a", "b"], ["1"], [1, 1], {"format": 1.0}, grader=GRADER)

    def test_params_for_unweighted_reward(self):
        with pytest.raises(ValueError, match="without a weight"):
            rewards.score(["a"], ["1"], [1], {"format": 1.0}, params={"cosine": {}}, grader=GRADER)


class TestAccuracyNumberOnly:
    # math-verify evaluates a restated question ("3 + 9") to the gold (12): correct by default,
    # not with number_only.
    TEXTS = [
        "The answer is 12.",
        "The answer is 3 + 9, which is the sum.",
        "The answer is 2 + 7 = 12.",
        "So \\boxed{12}",
        "So \\boxed{3+9}",
        "The answer is 12, since 3 + 9 = 12.",
        "The answer is 13.",
    ]

    def test_default_accepts_a_restated_expression(self):
        got = functions.accuracy(self.TEXTS, ["12"] * 7, grader=GRADER)
        assert got[1] == 1.0 and got[4] == 1.0  # the shortcut that number_only closes

    def test_number_only_requires_a_plain_number(self):
        got = functions.accuracy(self.TEXTS, ["12"] * 7, grader=GRADER, number_only=True)
        np.testing.assert_array_equal(got, [1, 0, 0, 1, 0, 1, 0])

    def test_score_passes_the_parameter(self):
        s = rewards.score(
            self.TEXTS[:2], ["12"] * 2, [5, 5], {"accuracy": 1.0},
            params={"accuracy": {"number_only": True}}, grader=GRADER,
        )  # fmt: skip
        np.testing.assert_array_equal(s.total, [1.0, 0.0])


class TestOverlong:
    @pytest.mark.parametrize(
        "length,expected",
        [
            (0, 0.0),
            (80, 0.0),  # L_max - L_cache: the last length without punishment
            (81, -0.05),  # (80 - 81) / 20
            (90, -0.5),
            (99, -0.95),
            (100, -1.0),  # L_max
            (101, -1.0),  # beyond L_max (a longer engine limit)
        ],
    )
    def test_dapo_eq13_hand_worked(self, length, expected):
        r = functions.overlong(["x"], ["1"], lengths=[length], max_len=100, cache_len=20)
        assert r.dtype == np.float32
        np.testing.assert_allclose(r, [expected], atol=1e-7)

    def test_no_cache_is_a_step_at_l_max(self):
        r = functions.overlong(["x"] * 3, None, lengths=[99, 100, 101], max_len=100, cache_len=0)
        np.testing.assert_array_equal(r, [0.0, 0.0, -1.0])

    def test_registered_and_scored_by_name(self):
        assert "overlong" in rewards.REGISTRY
        s = rewards.score(
            ["a", "b"],
            ["1", "1"],
            [10, 95],
            {"overlong": 1.0, "format": 0.0},
            params={"overlong": {"max_len": 100, "cache_len": 20}},
        )
        np.testing.assert_allclose(s.per_fn["overlong"], [0.0, -0.75])

    @pytest.mark.parametrize("kw", [dict(lengths=None), dict(lengths=[1], cache_len=101)])
    def test_bad_input(self, kw):
        with pytest.raises(ValueError):
            functions.overlong(["x"], None, **{"max_len": 100, "cache_len": 20, **kw})
