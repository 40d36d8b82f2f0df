"""Config files: every variant loads, converts to typed config, and rejects bad keys."""

import ast
import dataclasses
import json
import pathlib
import sys
from unittest import mock

import pytest
from absl import flags
from ml_collections import config_flags

from mmr_jax.algorithms import advantages
from mmr_jax.config import checks, command_line, schema
from mmr_jax.step import train_step
from mmr_jax.training import workdir_guard

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
RUNS = pathlib.Path(__file__).resolve().parents[1] / "support" / "runs"  # run.json of older trees
VARIANTS = [
    "grpo",
    "dr_grpo",
    "dapo",
    "dapo_nods",
    "grpo_7b",
    "cpu_smollm2",
    "base",
    "gspo",
    "cispo",
]


def _load(name, arg=None, overrides=()):
    fv = flags.FlagValues()
    spec = str(CONFIGS / f"{name}.py") + (f":{arg}" if arg else "")
    config_flags.DEFINE_config_file("config", spec, flag_values=fv, lock_config=True)
    argv = ["prog", f"--config={spec}", *overrides]
    with mock.patch.object(sys, "argv", argv):  # config_flags reads overrides from sys.argv
        fv(argv)
    return fv.config


class TestVariants:
    @pytest.mark.parametrize("name", VARIANTS)
    @pytest.mark.parametrize("arg", [None, "1.5b", "7b", "8b", "smoke", "8b,smoke"])
    def test_loads_and_converts(self, name, arg):
        cfg = checks.from_config_dict(_load(name, arg))
        assert dataclasses.is_dataclass(cfg) and cfg.rows_per_step > 0
        if arg and "smoke" in arg:
            assert cfg.total_steps <= 4 and cfg.batch.max_completion_len <= 64

    @pytest.mark.parametrize("size,lora", [("1.5b", False), ("7b", True), ("8b", True)])
    def test_model_sizes(self, size, lora):
        cfg = checks.from_config_dict(_load("grpo", size))
        assert cfg.lora.enabled == lora
        assert cfg.lora.rank == 64 and cfg.lora.alpha == 128 and cfg.lora.dropout == 0.05
        # the LoRA sizes keep their frozen base in the compute dtype (what fits one H100)
        assert cfg.model.frozen_dtype == ("bfloat16" if lora else "")

    @pytest.mark.parametrize("name", ["base", "grpo", "dr_grpo", "dapo", "dapo_nods", "gspo"])
    def test_lora_sizes_store_the_frozen_base_in_the_compute_dtype(self, name):
        for arg, want in (("7b", "bfloat16"), ("8b", "bfloat16"), ("8b,smoke", "float32")):
            cfg = checks.from_config_dict(_load(name, arg))
            assert cfg.model.frozen_dtype == want == cfg.model.dtype, (name, arg)
        assert checks.from_config_dict(_load(name, "1.5b")).model.frozen_dtype == ""
        assert checks.from_config_dict(_load("grpo_7b")).model.frozen_dtype == "bfloat16"
        assert checks.from_config_dict(_load("grpo_7b", "smoke")).model.frozen_dtype == "float32"

    def test_paper_shared_hyperparameters(self):
        cfg = checks.from_config_dict(_load("grpo"))
        assert (cfg.optim.lr, cfg.optim.min_lr_ratio, cfg.optim.warmup_ratio) == (1e-6, 0.1, 0.1)
        assert cfg.optim.grad_clip == 1.0 and cfg.seed == 2025 and cfg.total_steps == 500
        assert cfg.rows_per_step == 48 and cfg.batch.generations == 6
        assert (cfg.batch.max_prompt_len, cfg.batch.max_completion_len) == (512, 3584)
        assert cfg.rollout.temperature == 0.7 and cfg.checkpoint.every == 50
        assert cfg.loss.beta == 0.04 and dict(cfg.rewards.weights) == {
            "accuracy": 0.0,
            "format": 1.0,
            "cosine": 2.0,
        }

    def test_dapo(self):
        cfg = checks.from_config_dict(_load("dapo"))
        assert (cfg.loss.eps_low, cfg.loss.eps_high, cfg.loss.beta) == (0.2, 0.28, 0.0)
        assert cfg.dynamic_sampling.enabled and cfg.dynamic_sampling.filter_reward == "accuracy"
        assert cfg.dynamic_sampling.max_generation_batches == 10 and cfg.total_steps == 200
        assert cfg.rewards.weights["accuracy"] == 1.0 and cfg.rewards.weights["cosine"] == 1.0
        nods = checks.from_config_dict(_load("dapo_nods"))
        assert not nods.dynamic_sampling.enabled and nods.loss.eps_high == 0.28

    def test_dr_grpo(self):
        cfg = checks.from_config_dict(_load("dr_grpo"))
        assert cfg.advantage.estimator == "dr_grpo"
        assert cfg.loss.aggregation == "seq_mean_token_sum_norm"

    def test_gspo(self):
        # The paper's v2 settings (TRL paper index): sequence ratio, clip 3e-4 / 4e-4, no KL.
        cfg = checks.from_config_dict(_load("gspo"))
        assert cfg.loss.importance_sampling_level == "sequence"
        assert (cfg.loss.eps_low, cfg.loss.eps_high, cfg.loss.beta) == (3e-4, 4e-4, 0.0)
        assert cfg.loss.aggregation == "seq_mean_token_mean" and cfg.loss.iterations == 2
        step = train_step.StepConfig.from_config(cfg)  # reaches the train step
        assert step.loss.importance_sampling_level == "sequence" and step.loss.eps_high == 4e-4
        with_mmr = _load("gspo", "8b,smoke", ["--config.reweight.method=mmr"])
        typed = checks.from_config_dict(with_mmr)
        assert typed.reweight.method == "mmr" and typed.loss.importance_sampling_level == "sequence"
        assert typed.total_steps <= 4 and typed.lora.enabled
        token = _load("gspo", None, ["--config.loss.importance_sampling_level=sequence_token"])
        assert checks.from_config_dict(token).loss.importance_sampling_level == ("sequence_token")

    def test_cispo(self):
        # MiniMax-M1's objective, no lower bound, cap 1 + 4 = 5 (TRL / ScaleRL), no KL.
        cfg = checks.from_config_dict(_load("cispo"))
        assert cfg.loss.objective == "cispo" and cfg.loss.importance_sampling_level == "token"
        assert (cfg.loss.eps_low, cfg.loss.eps_high, cfg.loss.beta) == (1.0, 4.0, 0.0)
        assert cfg.loss.aggregation == "token_mean" and cfg.loss.iterations == 2
        step = train_step.StepConfig.from_config(cfg)  # reaches the train step
        assert step.loss.objective == "cispo" and step.loss.eps_high == 4.0
        typed = checks.from_config_dict(
            _load("cispo", "8b,smoke", ["--config.reweight.method=mmr"])
        )
        assert typed.reweight.method == "mmr" and typed.loss.objective == "cispo"

    def test_new_options_reach_the_step(self):
        over = [
            "--config.loss.dual_clip_c=3.0",
            "--config.loss.entropy_coef=0.001",
            "--config.loss.top_entropy_quantile=0.2",
            "--config.advantage.estimator=rloo",
            "--config.reweight.method=mmr",
        ]
        cfg = checks.from_config_dict(_load("dapo", None, over))
        step = train_step.StepConfig.from_config(cfg)
        assert (step.loss.objective, step.loss.dual_clip_c) == ("ppo_clip", 3.0)
        assert (step.loss.entropy_coef, step.loss.top_entropy_quantile) == (0.001, 0.2)
        assert cfg.advantage.estimator == "rloo" and cfg.reweight.method == "mmr"
        base = train_step.StepConfig.from_config(checks.from_config_dict(_load("grpo")))
        assert (base.loss.objective, base.loss.dual_clip_c, base.loss.entropy_coef) == (
            "ppo_clip",
            0.0,
            0.0,
        )
        assert base.loss.top_entropy_quantile == 1.0

    def test_tis_modes_reach_the_step(self):
        over = ["--config.loss.tis_cap=3.0", "--config.loss.tis_mode=sequence_mask"]
        cfg = checks.from_config_dict(
            _load("grpo", None, [*over, "--config.loss.tis_mask_low=0.5"])
        )
        step = train_step.StepConfig.from_config(cfg)
        assert (step.loss.tis_cap, step.loss.tis_mode, step.loss.tis_mask_low) == (
            3.0,
            "sequence_mask",
            0.5,
        )

    def test_a_registered_estimator_is_a_valid_choice_with_no_config_edit(self):
        # The choices are the registries themselves: a name added to `advantages.ESTIMATORS` (as a
        # user's own estimator would be) passes the check, and fails again once removed.
        cfg = checks.from_config_dict(_load("grpo"))
        mine = dataclasses.replace(cfg.advantage, estimator="my_estimator")
        bad = dataclasses.replace(cfg, advantage=mine)
        with pytest.raises(schema.ConfigError, match="'grpo'.*'rloo'"):
            checks.validate(bad)
        advantages.register("my_estimator")(advantages.ESTIMATORS["grpo"])
        try:
            assert checks.validate(bad) is bad
        finally:
            del advantages.ESTIMATORS["my_estimator"]
        with pytest.raises(schema.ConfigError, match="my_estimator"):
            checks.validate(bad)

    def test_overrides(self):
        cfg = _load("grpo_7b", None, ["--config.reweight.method=mmr", "--config.reweight.lam=0.7"])
        typed = checks.from_config_dict(cfg)
        assert typed.reweight.method == "mmr" and typed.reweight.lam == 0.7 and typed.lora.enabled
        assert checks.from_config_dict(_load("grpo")).reweight.lam is None


class TestBadInput:
    def test_unknown_key_fails_in_flags(self):
        with pytest.raises(Exception, match="lam"):  # ml_collections: 'Did you mean "lam"'
            _load("grpo", None, ["--config.reweight.lamda=0.5"])

    @pytest.mark.parametrize("key", ["reweight.lamda", "reweightt.lam", "loss.beta.x"])
    def test_check_override_keys(self, key):
        argv = ["prog", f"--config={CONFIGS / 'grpo.py'}:smoke", f"--config.{key}=1"]
        with pytest.raises(command_line.UnknownKeyError, match="valid keys"):
            command_line.check_override_keys(argv)
        command_line.check_override_keys([*argv[:2], "--config.reweight.lam=0.5"])

    def test_a_renamed_key_names_its_new_name(self):
        argv = ["prog", f"--config={CONFIGS / 'grpo.py'}:smoke", "--config.mesh.layout=flat"]
        with pytest.raises(command_line.UnknownKeyError) as e:
            command_line.check_argv(argv)
        assert "unknown config key 'mesh.layout'" in str(e.value) and "\n" not in str(e.value)
        assert str(e.value).endswith("(mesh.layout is now mesh.over_hosts)")
        command_line.check_argv([*argv[:2], "--config.mesh.over_hosts=flat"])
        c = command_line.load_config_file(f"{CONFIGS / 'grpo.py'}:smoke")
        with pytest.raises(command_line.UnknownKeyError, match="is now mesh.over_hosts"):
            command_line.set_keys(c, {"mesh.layout": "flat"})  # scripts' --set, load_config
        flat = command_line.set_keys(c, {"mesh.over_hosts": "flat"})
        assert checks.from_config_dict(flat).mesh.over_hosts == "flat"

    @pytest.mark.parametrize("raw", ["+,-", "+ -"])
    def test_a_tuple_absl_cannot_parse_names_the_quoted_form(self, raw):
        argv = [
            "prog",
            f"--config={CONFIGS / 'cpu_smollm2.py'}",
            f"--config.data.arithmetic_ops={raw}",
        ]
        with pytest.raises(command_line.ConfigValueError) as e:
            command_line.check_argv(argv)
        assert "data.arithmetic_ops takes a tuple" in str(e.value)
        assert str(e.value).endswith("""e.g. --config.data.arithmetic_ops="('+',)\"""")
        for fine in ("+", "('+', '-')", "'+','-'"):  # the shell's words absl parses
            command_line.check_argv([*argv[:2], f"--config.data.arithmetic_ops={fine}"])

    def test_unknown_key_in_dict(self):
        cfg = _load("grpo").to_dict()
        cfg["loss"]["bogus"] = 1
        with pytest.raises(schema.ConfigError, match=r"unknown keys \['bogus'\].*valid keys"):
            checks.from_config_dict(cfg)  # a UserError (one FATAL line) and still a ValueError

    def test_set_keys_names_the_valid_keys_of_a_missing_section(self):
        c = _load("grpo")
        with pytest.raises(command_line.UnknownKeyError) as e:
            command_line.set_keys(c, {"loss.kll.beta": 0.1})
        assert str(e.value).startswith("unknown config key 'loss.kll.beta': 'loss' has no key")
        assert "'kl_estimator'" in str(e.value) and isinstance(e.value, KeyError)
        command_line.set_keys(c, {"loss.beta": 0.5})  # a key that exists is set
        assert c.loss.beta == 0.5

    def test_an_assignment_without_equals_is_a_config_value_error(self):
        with pytest.raises(command_line.ConfigValueError, match="expected name=value"):
            command_line.parse_assignments(["batch.prompts"])

    def test_bad_arg(self):
        with pytest.raises(Exception, match="unknown config argument"):
            _load("grpo", "70b")

    @pytest.mark.parametrize(
        "override,match",
        [
            (("advantage", "estimator", "ppo"), "advantage.estimator"),
            (("reweight", "scope", "global"), "reweight.scope"),
            (("reweight", "lam", 1.5), "reweight.lam"),
            (("loss", "minibatches", 5), "minibatches"),
            (("loss", "tis_cap", -1.0), "loss.tis_cap"),
            (("loss", "tis_cap", 0.9), r"loss.tis_cap=0.9 must be 0 \(off\) or finite and >= 1"),
            # Issue 36 item 9: NaN passed every comparison and silently turned TIS off.
            (("loss", "tis_cap", float("nan")), "loss.tis_cap=nan must be 0"),
            (("loss", "tis_cap", float("inf")), "loss.tis_cap=inf must be 0"),
            (("loss", "tis_mode", "token_clip"), "loss.tis_mode='token_clip'; expected one of"),
            (("loss", "tis_mode", "sequence_mask"), "needs loss.tis_cap >= 1"),
            (("loss", "tis_mask_low", float("nan")), r"tis_mask_low=nan must lie in \[0, 1\)"),
            (("loss", "tis_mask_low", 1.0), r"tis_mask_low=1.0 must lie in \[0, 1\)"),
            (("loss", "tis_mask_low", 0.5), "needs a '_mask' loss.tis_mode"),
            (("loss", "importance_sampling_level", "seq"), "importance_sampling_level='seq'"),
            (("loss", "objective", "ppo"), "loss.objective='ppo'; expected one of"),
            (("loss", "dual_clip_c", 1.0), r"dual_clip_c=1.0 must be 0 \(off\) or finite and > 1"),
            (("loss", "dual_clip_c", float("nan")), "dual_clip_c=nan"),
            (("loss", "entropy_coef", -0.1), "entropy_coef=-0.1 must be finite and >= 0"),
            (("loss", "entropy_coef", float("nan")), "entropy_coef=nan"),
            (
                ("loss", "top_entropy_quantile", 0.0),
                r"top_entropy_quantile=0.0 must lie in \(0, 1\]",
            ),
            (("loss", "top_entropy_quantile", 1.5), "top_entropy_quantile=1.5"),
            (("batch", "pack_max_len", 3582), "pack_max_len=3582 must be 0 .* at least"),
            (("batch", "pack_max_len", -1), "pack_max_len"),
            (("model", "attention_impl", "pallas_tpu"), "takes no packed completions"),
            (("loss", "updates_per_batch", 3), "updates_per_batch=3 must be >= 1 and divide"),
            (("loss", "updates_per_batch", 0), "updates_per_batch=0 must be >= 1"),
            (("loss", "entropy_target", -0.1), "entropy_target=-0.1 must be >= 0"),
            (("loss", "entropy_coef", float("nan")), "entropy_coef=nan"),
            (("rewards", "overlong_cache_len", 4000), r"overlong_cache_len=4000 must lie in"),
            (("rewards", "overlong_max_len", -1), "overlong_max_len=-1"),
            # Issue 55: an operator outside + - * ended in eval's SyntaxError at data loading.
            (("data", "arithmetic_ops", ("x",)), r"data.arithmetic_ops=\('x',\); expected"),
            (("data", "arithmetic_ops", ("+", "/")), r"among \('\+', '-', '\*'\), e.g. --config"),
            (("data", "arithmetic_ops", ()), r"data.arithmetic_ops=\(\)"),
        ],
    )
    def test_invalid_values(self, override, match):
        cfg = _load("grpo").to_dict()
        section, key, value = override
        cfg[section][key] = value
        with pytest.raises(schema.ConfigError, match=match):
            checks.from_config_dict(cfg)

    def test_edge_values_accepted(self):
        cfg = _load("grpo").to_dict()
        cfg["loss"]["tis_cap"] = 1.0
        cfg["batch"]["pack_max_len"] = cfg["batch"]["max_completion_len"] - 1
        checks.from_config_dict(cfg)
        cfg["batch"]["pack_max_len"] = 0  # no packing
        checks.from_config_dict(cfg)
        cfg["model"]["attention_impl"] = "pallas_tpu"  # splash, unpacked
        checks.from_config_dict(cfg)

    def test_off_policy_runs_on_one_process_only(self):
        cfg = checks.from_config_dict(_load("grpo", None, ["--config.rollout.off_policy_lag=1"]))
        checks.check_processes(cfg, 1)
        with pytest.raises(schema.ConfigError, match="one process only .*has 2"):
            checks.check_processes(cfg, 2)
        on_policy = checks.from_config_dict(_load("grpo"))
        checks.check_processes(on_policy, 2)

    def test_no_key_is_defined_twice(self):
        # A second assignment of a key (base.py) or a second field of one name (a dataclass body)
        # silently wins over the first; two merged branches once each added loss.entropy_coef.
        base = ast.parse((CONFIGS / "base.py").read_text())
        func = next(n for n in base.body if getattr(n, "name", "") == "get_config")
        keys = [
            ast.unparse(t)
            for n in ast.walk(func)
            if isinstance(n, ast.Assign)
            for t in n.targets
            if ast.unparse(t).startswith("c.")
        ]
        assert len(keys) > 100 and sorted(k for k in set(keys) if keys.count(k) > 1) == []
        types = ast.parse(pathlib.Path(schema.__file__).read_text())
        for cls in (n for n in types.body if isinstance(n, ast.ClassDef)):
            names = [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)]
            assert sorted(k for k in set(names) if names.count(k) > 1) == [], cls.name

    def test_each_default_is_written_once_in_the_base_config(self):
        # The typed config holds no default: a second one would be a twin that a run built
        # without the base (tests, scripts) silently gets instead. configs/base.py's are the ones.
        for name, section in checks._SECTIONS.items():
            for f in dataclasses.fields(section):
                assert f.default is dataclasses.MISSING, f"{name}.{f.name} = {f.default!r}"
                assert f.default_factory is dataclasses.MISSING, f"{name}.{f.name}"
        with pytest.raises(ValueError, match=r"'loss': unknown keys \[\], missing keys \['beta'\]"):
            stored = _load("grpo").to_dict()
            del stored["loss"]["beta"]
            checks.from_config_dict(stored)  # a config, unlike a stored run, names every key

    def test_a_stored_run_takes_keys_added_since_at_their_base_default(self):
        stored = _load("grpo", "smoke").to_dict()
        del stored["loss"]["dual_clip_c"], stored["loss"]["top_entropy_quantile"]
        del stored["rewards"]["overlong_max_len"]
        stored["rewards"]["weights"] = {"accuracy": 1.0}  # one key, not merged with the base's
        today = command_line.stored_config(stored)
        assert (today["loss"]["dual_clip_c"], today["loss"]["top_entropy_quantile"]) == (0.0, 1.0)
        assert today["rewards"]["overlong_max_len"] == 0
        assert today["rewards"]["weights"] == {"accuracy": 1.0}
        assert today["batch"] == stored["batch"]  # the stored values, not the base's
        assert checks.from_config_dict(today).loss.dual_clip_c == 0.0

    @pytest.mark.parametrize(
        "loss",
        [
            dict(entropy_target=0.2, entropy_coef=0.02),  # start above entropy_coef_max 0.01
            dict(entropy_target=0.2, entropy_coef_step=0.0),
            dict(entropy_target=0.2, entropy_coef_min=-0.01),
        ],
    )
    def test_adaptive_entropy_refused_by_name(self, loss):
        cfg = _load("grpo").to_dict()
        cfg["loss"].update(loss)
        with pytest.raises(schema.ConfigError, match="adaptive entropy"):
            checks.from_config_dict(cfg)

    def test_dapo_full_adds_only_the_overlong_punishment(self):
        paper = _load("dapo", "7b").to_dict()
        full = _load("dapo", "7b,full").to_dict()
        assert full["rewards"]["weights"] == {**paper["rewards"]["weights"], "overlong": 1.0}
        full["rewards"]["weights"] = paper["rewards"]["weights"]
        full["name"] = paper["name"]
        assert full == paper
        checks.from_config_dict(_load("dapo", "smoke,full"))

    @pytest.mark.parametrize("lag,tis_cap,lines", [(1, 0.0, 1), (1, 2.0, 0), (0, 0.0, 0)])
    def test_stale_uncorrected_samples_advised(self, lag, tis_cap, lines):
        cfg = _load("grpo").to_dict()
        cfg["rollout"]["off_policy_lag"], cfg["loss"]["tis_cap"] = lag, tis_cap
        out = checks.advisories(checks.from_config_dict(cfg))
        assert len(out) == lines
        assert all("off_policy_lag=1 with loss.tis_cap=0" in line for line in out)

    @pytest.mark.parametrize(
        "overrides,match",
        [
            ({"importance_sampling_level": "sequence"}, "'cispo' .* does not combine with"),
            ({"dual_clip_c": 3.0}, "caps the 'ppo_clip' surrogate only"),
            ({"eps_low": 1.5}, r"needs 0 <= loss.eps_low <= 1"),
        ],
    )
    def test_cispo_refuses(self, overrides, match):
        cfg = _load("cispo").to_dict()
        cfg["loss"].update(overrides)
        with pytest.raises(schema.ConfigError, match=match):
            checks.from_config_dict(cfg)

    def test_reweighting_is_one_choice(self):
        for method in ("none", "mmr", "dra"):
            cfg = _load("grpo", None, [f"--config.reweight.method={method}"])
            assert checks.from_config_dict(cfg).reweight.method == method
        with pytest.raises(schema.ConfigError, match="reweight.method='both'"):
            checks.from_config_dict(_load("grpo", None, ["--config.reweight.method=both"]))
        over = ["--config.reweight.method=dra", "--config.reweight.lam=0.5"]
        with pytest.raises(schema.ConfigError, match="lam is MMR's"):
            checks.from_config_dict(_load("grpo", None, over))

    def test_the_run_json_of_the_commit_before_resumes_under_todays_keys(self, tmp_path):
        # run.json of configs/cpu_smollm2.py for 3 steps, written by commit bfa45cc (the one
        # before reweight.method) for scripts/step_fingerprint.py's before figures.
        fixture = RUNS / "bfa45cc_cpu_smollm2_run.json"
        (tmp_path / workdir_guard.RUN_FILE).write_text(fixture.read_text())
        (tmp_path / "checkpoints" / "3").mkdir(parents=True)  # a run with a checkpoint is bound
        over = [
            "--config.total_steps=3",
            "--config.checkpoint.every=1000",
            "--config.checkpoint.at_end=False",
            "--config.logging.samples=0",
        ]
        today = checks.from_config_dict(_load("cpu_smollm2", None, over))
        assert today.reweight.method == "mmr"
        workdir_guard.prepare_workdir(tmp_path, today.to_dict())  # the same run: no mismatch
        (tmp_path / workdir_guard.RUN_FILE).write_text(fixture.read_text())
        dra = _load("cpu_smollm2", None, [*over, "--config.reweight.method=dra"])
        with pytest.raises(workdir_guard.RunMismatchError, match="reweight.method: 'mmr' -> 'dra'"):
            workdir_guard.prepare_workdir(tmp_path, checks.from_config_dict(dra).to_dict())

    def test_a_workdir_of_the_commit_before_issue_53_resumes(self, tmp_path):
        # run.json of `scripts/train.py --config=configs/cpu_smollm2.py:smoke
        # --config.total_steps=1 --config.checkpoint.every=1 --config.eval.at_start=False`, written
        # by commit bb73ad9 (mesh.layout; defaults also in the typed config), eval.data_dir made
        # relative. That workdir, checkpoint and all, resumed on this tree for a second step.
        from mmr_jax.training import hf_export

        fixture = RUNS / "bb73ad9_cpu_smollm2_run.json"
        (tmp_path / workdir_guard.RUN_FILE).write_text(fixture.read_text())
        (tmp_path / "checkpoints" / "1").mkdir(parents=True)  # a run with a checkpoint is bound
        over = ["--config.checkpoint.every=1", "--config.eval.at_start=False"]
        today = checks.from_config_dict(
            _load("cpu_smollm2", "smoke", [*over, "--config.total_steps=2"])
        )
        workdir_guard.prepare_workdir(tmp_path, today.to_dict())  # the same run: it resumes
        stored = hf_export.run_config(tmp_path)  # what restores its checkpoints
        assert stored.mesh.over_hosts == "hybrid" and stored.total_steps == 1
        assert dataclasses.replace(stored, total_steps=2, eval=today.eval) == today
        dual = _load("cpu_smollm2", "smoke", [*over, "--config.loss.dual_clip_c=3.0"])
        with pytest.raises(workdir_guard.RunMismatchError, match="loss.dual_clip_c: 0.0 -> 3.0"):
            workdir_guard.prepare_workdir(tmp_path, checks.from_config_dict(dual).to_dict())

    def test_a_run_stored_with_mesh_layout_resumes_under_mesh_over_hosts(self, tmp_path):
        # mesh.layout is mesh.over_hosts since issue 53; bfa45cc's run.json names the old key.
        fixture = RUNS / "bfa45cc_cpu_smollm2_run.json"
        stored = json.loads(fixture.read_text())["config"]
        assert stored["mesh"] == {"layout": "hybrid", "shape": [1, -1, 1]}
        assert (
            checks.from_config_dict(command_line.stored_config(stored)).mesh.over_hosts == "hybrid"
        )
        assert stored["mesh"] == {"layout": "hybrid", "shape": [1, -1, 1]}  # not modified
        stored["mesh"]["layout"] = "flat"  # a run laid flat refuses a hybrid resume, and says so
        (tmp_path / workdir_guard.RUN_FILE).write_text(json.dumps({"config": stored}))
        (tmp_path / "checkpoints" / "3").mkdir(parents=True)
        hybrid = checks.from_config_dict(
            command_line.stored_config(
                {**stored, "mesh": {"layout": "hybrid", "shape": [1, -1, 1]}}
            )
        )
        with pytest.raises(
            workdir_guard.RunMismatchError, match="mesh.over_hosts: 'flat' -> 'hybrid'"
        ):
            workdir_guard.prepare_workdir(tmp_path, hybrid.to_dict())
        flat = dataclasses.replace(hybrid, mesh=dataclasses.replace(hybrid.mesh, over_hosts="flat"))
        workdir_guard.prepare_workdir(tmp_path, flat.to_dict())  # the same run: it resumes

    @pytest.mark.parametrize(
        "old,want",
        [
            ({"enabled": True, "scope": "batch", "lam": 0.7}, ("mmr", "batch", 0.7)),
            ({"enabled": False, "scope": "group", "lam": None}, ("none", "group", None)),
        ],
    )
    def test_configs_stored_before_the_reweight_section_map_to_it(self, old, want):
        stored = _load("grpo").to_dict()
        stored.pop("reweight")
        stored["mmr"] = {**old, "uniform_group_guard": True, "embedding_model": "hashing"}
        stored["mmr"].update(embedding_max_length=512, embedding_batch_size=64)
        stored["dra"] = {"enabled": False}
        rw = checks.from_config_dict(stored).reweight
        assert (rw.method, rw.scope, rw.lam) == want
        assert rw.uniform_group_guard and rw.embedding_model == "hashing"
        stored["dra"] = {"enabled": True}
        stored["mmr"].update(enabled=False, lam=None)
        assert checks.from_config_dict(stored).reweight.method == "dra"
