"""Trains a policy with GRPO / Dr.GRPO / DAPO, optionally with MMR or DRA reweighting.

    python scripts/train.py --config=configs/grpo_7b.py --workdir=runs/mmr_grpo_7b \\
        --config.reweight.method=mmr
    python scripts/train.py --config=configs/cpu_smollm2.py --workdir=runs/cpu_smollm2
    python scripts/train.py --config=configs/dapo.py:8b --dry_run
    .venv-aot-gpu/bin/python scripts/train.py --config=configs/grpo_7b.py --dry_run \
        --dry_run_target=h100:1     # compiled for an H100 without one (scripts/setup_aot_env.sh)
    python scripts/train.py --config=configs/grpo.py:1.5b --workdir=runs/x --export_hf=runs/x/hf

Several processes (hosts) train as one program on one global mesh (docs/multihost.md):

    python scripts/train.py ... --coordinator_address=HOST0:1234 --num_processes=2 --process_id=I
    python scripts/train.py ... --distributed=auto     # TPU pod slices, SLURM: JAX finds them

Re-running the same command resumes from the workdir's latest checkpoint. The console shows a
header, a line per step, checkpoints, evaluations and warnings; every log (Orbax, JAX, ...) goes to
<workdir>/train.log, and `--verbosity=0` shows them on the console too. `--export_hf` shows one
line, "exported <path>" (its logs: <workdir>/export.log). `--workdir` may be a
bucket, `gs://bucket/runs/x` (with `pip install 'mmr_jax[gcs]'`; docs/multihost.md, "Workdirs on
a bucket").
"""

import os
import pathlib
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from mmr_jax import distributed
from mmr_jax.config import checks, command_line
from mmr_jax.infra import compile_cache, console, run_paths, user_errors
from mmr_jax.models import hub
from mmr_jax.training import checkpoint, compiled_dry_run, hf_export, trainer

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file (configs/*.py[:arg]).", lock_config=True
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run folder (local, or gs://bucket/path): checkpoints, metrics, TensorBoard."
)
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Build everything abstractly, print sizes, exit.")
_DRY_RUN_DEVICES = flags.DEFINE_integer(
    "dry_run_devices",
    0,
    "With --dry_run: also lower and compile the train and decode steps for the config's mesh on "
    "this many virtual CPU devices and print XLA's per-device memory (training/compiled_dry_run).",
)
_DRY_RUN_REMAT = flags.DEFINE_list(
    "dry_run_remat",
    [],
    "With --dry_run_devices or --dry_run_target: the remat policies to compile the train step "
    "for ('all' for every one; default: the config's).",
)
_DRY_RUN_TARGET = flags.DEFINE_string(
    "dry_run_target",
    None,
    "With --dry_run: compile every program a run compiles for this accelerator, with its own "
    "compiler and no device (h100:8, h200:1, v5e:2x4, v5p:2x2x2, v6e:2x4, v5p:4x4x4, ...; "
    "training/aot_dry_run), print per-device memory against the device's and exit non-zero "
    "naming a program that does not compile or fit. Needs .venv-aot-gpu or .venv-aot-tpu "
    "(scripts/setup_aot_env.sh).",
)
_DRY_RUN_JSON = flags.DEFINE_string(
    "dry_run_json", None, "With --dry_run_target: also write the figures here as JSON."
)
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Delete a run of another config in --workdir.")
_EXPORT_HF = flags.DEFINE_string(
    "export_hf", None, "Export a checkpoint of --workdir here and exit."
)
_EXPORT_STEP = flags.DEFINE_integer("export_step", None, "Step to export (default: latest).")
_PROCESSES = distributed.define_flags()


def _remat_policies():
    from mmr_jax.models import config as model_config

    policies = _DRY_RUN_REMAT.value
    if policies == ["all"]:
        policies = list(model_config.REMAT_POLICIES)
    for name in policies:
        model_config.remat_policy_name(name)  # a named error before anything compiles
    return policies or None


def _compiled_dry_run(cfg):
    result = compiled_dry_run.run(cfg, policies=_remat_policies())
    print(compiled_dry_run.format_table(result), flush=True)


def _target_dry_run(cfg, target):
    import json

    from mmr_jax.infra import aot_targets
    from mmr_jax.training import aot_dry_run

    try:
        result = aot_dry_run.run(cfg, target, policies=_remat_policies())
    except aot_targets.AotEnvironmentMissing as e:
        sys.exit(f"FATAL: {e}")
    print(aot_dry_run.format_report(result), flush=True)
    if _DRY_RUN_JSON.value:
        with open(_DRY_RUN_JSON.value, "w") as f:
            json.dump(aot_dry_run.to_json(result), f, indent=1)
    problems = aot_dry_run.failures(result)
    if problems:
        sys.exit("FATAL: " + "; ".join(problems))


def main(argv):
    del argv
    target = None
    if _DRY_RUN.value and _DRY_RUN_TARGET.value:  # a named error, then JAX kept on the CPU
        from mmr_jax.infra import aot_targets

        try:
            target = aot_targets.parse_target(_DRY_RUN_TARGET.value)
        except aot_targets.UnknownTarget as e:
            raise app.UsageError(str(e)) from None
        aot_targets.prepare_jax()
    if _DRY_RUN.value and _DRY_RUN_DEVICES.value:  # before JAX starts its backends
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", _DRY_RUN_DEVICES.value)
    distributed.start(_PROCESSES)  # before any other JAX operation
    cfg = checks.from_config_dict(_CONFIG.value)
    if _DRY_RUN.value:
        user_errors.show_info()  # the dry run's report is its INFO lines; there is no log file
        compiled_dry_run.dry_run(cfg)
        if _DRY_RUN_DEVICES.value:
            _compiled_dry_run(cfg)
        if target is not None:
            _target_dry_run(cfg, target)
        return
    if not _WORKDIR.value:
        raise app.UsageError("--workdir is required (except with --dry_run)")
    primary = distributed.is_primary()
    suffix = "" if primary else f".process{jax.process_index()}"
    if _EXPORT_HF.value:
        run_paths.check(_WORKDIR.value)  # nothing is written in a workdir that cannot export
        run_paths.check(_EXPORT_HF.value, "--export_hf")
        checkpoint.require_checkpoint(_WORKDIR.value, _EXPORT_STEP.value)
        log_file = os.path.join(_WORKDIR.value, f"export{suffix}.log")

        def export():
            console.setup(log_file, stdout=primary)  # Orbax's INFO lines go to the file
            path = hf_export.export_hf(
                cfg, _WORKDIR.value, _EXPORT_HF.value, step=_EXPORT_STEP.value
            )
            console.info("exported %s", path)

        _run(export, log_file=log_file)
        return
    log_file = os.path.join(_WORKDIR.value, f"train{suffix}.log")

    def train():
        run_paths.check(_WORKDIR.value)  # a named error for a scheme the run cannot write
        console.setup(log_file, stdout=primary)  # process 0 alone prints (a bucket: staged)
        logging.info("config %s -> %s", cfg.name, _WORKDIR.value)
        logging.info("XLA compilation cache: %s", compile_cache.enable())
        trainer.train(cfg, _WORKDIR.value, overwrite=_OVERWRITE.value)

    _run(train, log_file=log_file)


def _run(fn, *, log_file: str) -> None:
    """Runs `fn`; an error ends the process with a named message. With several processes every
    error leaves at once, skipping JAX's exit barrier (which would hold this process while its
    peers wait for it in a collective): the peers stop with `PeerLostError` (docs/multihost.md)."""
    try:
        fn()
    except Exception as e:
        code, message = _error_exit(e, log_file)
        if jax.process_count() > 1:
            if code == distributed.failures.EXIT_FAILED:
                distributed.announce(e)  # when the trainer did not (an error before it)
                logging.exception("process %d failed", jax.process_index())
            distributed.exit_now(code, f"{message} (process {jax.process_index()})")
        if message is None:
            raise
        sys.exit(message)


def _error_exit(e: Exception, log_file: str) -> tuple[int, str | None]:
    """(exit code, message) of an error; a None message: an unexpected error, its traceback
    shown (one process) or logged (several)."""
    if isinstance(e, distributed.PeerLostError):
        return distributed.failures.EXIT_PEER_LOST, f"ERROR: PeerLostError: {e}"
    if isinstance(e, distributed.DistributedError):
        return 1, f"ERROR: {type(e).__name__}: {e}"
    weights = isinstance(e, hub.CheckpointNotFoundError)
    if weights and not isinstance(e, hub.CheckpointNotBuiltError):  # say the ways forward
        return 1, user_errors.report(e, then=_without_weights())
    if isinstance(e, user_errors.UserError):
        return 1, user_errors.report(e)
    if isinstance(e, checkpoint.WorkdirWriteError):
        return 1, f"ERROR: {e}"
    if isinstance(e, OSError) and e.errno in checkpoint.WRITE_ERRNOS:
        return 1, f"ERROR: {checkpoint.write_error(e, log_file, 'the log file')}"
    if jax.process_count() > 1:
        return distributed.failures.EXIT_FAILED, f"ERROR: {type(e).__name__}: {e}"
    return 1, None


def _without_weights() -> str:
    spec = flags.FLAGS["config"].config_filename  # configs/x.py[:arg] as given
    path, _, arg = spec.partition(":")
    smoke = f"{path}:{','.join(filter(None, [arg, 'smoke']))}" if "smoke" not in arg else spec
    return (
        "Without those weights: give them with --config.model.path=<HF folder or hub id>, run "
        f"the CPU variant --config={smoke}, check the config with --dry_run, or train random "
        "weights of the architecture with --config.model.init=random"
    )


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    user_errors.run(main, argv_checks=(command_line.check_argv,))
