"""training.method_line: the console's method line names what the config trains."""

import pathlib

import pytest

from mmr_jax.config import checks, command_line
from mmr_jax.training import method_line

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


def _line(name, arg="smoke", **keys):
    c = command_line.load_config_file(f"{CONFIGS / name}.py:{arg}")
    return method_line.method_line(checks.from_config_dict(command_line.set_keys(c, keys)))


class TestMethodLine:
    def test_cispo_rloo_mmr_reads_as_such(self):
        line = _line("cispo", **{"advantage.estimator": "rloo", "reweight.method": "mmr"})
        assert line.startswith("reweighting MMR (group scope, adaptive lambda, minilm)"), line
        assert "advantages RLOO" in line and "objective CISPO, token ratio, clip [0, 5]" in line
        assert "loss token_mean" in line and "2 pass(es) x 1 update(s) per batch" in line

    def test_plain_grpo_names_no_option(self):
        line = _line("grpo")
        assert line == (
            "reweighting none | advantages GRPO (r - mean) / std | objective clipped surrogate, "
            "token ratio, clip [0.8, 1.2] | loss seq_mean_token_mean | KL k3 beta 0.04"
        )

    @pytest.mark.parametrize(
        "name,keys,part",
        [
            ("grpo", {"reweight.method": "dra"}, "reweighting DRA (minilm)"),
            ("grpo", {"reweight.method": "mmr", "reweight.scope": "batch", "reweight.lam": 0.5},
             "reweighting MMR (batch scope, lambda 0.5, minilm)"),
            ("dr_grpo", {}, "advantages Dr.GRPO r - mean"),
            ("dapo", {}, "DAPO dynamic sampling on accuracy (<= 4 rounds)"),
            ("gspo", {}, "objective clipped surrogate, sequence (GSPO) ratio"),
            ("grpo", {"loss.entropy_coef": 0.001, "loss.entropy_target": 0.3},
             "entropy bonus 0.001, adaptive to 0.3 nats"),
            ("grpo", {"loss.top_entropy_quantile": 0.2}, "top 0.2 entropy tokens"),
            ("grpo", {"loss.dual_clip_c": 3.0}, "dual clip c 3"),
            ("grpo", {"loss.tis_cap": 2.0}, "mismatch token_truncate cap 2"),
            ("grpo", {"rollout.off_policy_lag": 1, "loss.tis_cap": 2.0}, "off-policy lag 1"),
            ("grpo", {"advantage.estimator": "batch_std"}, "(r - group mean) / batch std"),
        ],
    )  # fmt: skip
    def test_each_option_named(self, name, keys, part):
        assert part in _line(name, **keys)

    def test_lora_named_for_the_7b(self):
        assert "LoRA r 8" in _line("grpo", "7b,smoke")
