"""Trains a policy with GRPO / Dr.GRPO / DAPO, optionally with MMR or DRA reweighting.

    python scripts/train.py --config=configs/grpo_7b.py --workdir=runs/mmr_grpo_7b \\
        --config.mmr.enabled=True
    python scripts/train.py --config=configs/cpu_smollm2.py --workdir=runs/cpu_smollm2
    python scripts/train.py --config=configs/dapo.py:8b --dry_run
    python scripts/train.py --config=configs/grpo.py:1.5b --workdir=runs/x --export_hf=runs/x/hf

Re-running the same command resumes from the workdir's latest checkpoint. The console shows a
header, a line per step, checkpoints, evaluations and warnings; every log (Orbax, JAX, ...) goes to
<workdir>/train.log, and `--verbosity=0` shows them on the console too.
"""

import os
import pathlib
import sys

from absl import app, flags, logging
from ml_collections import config_flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from mmr_jax import build, checkpoint, compile_cache, config_types, console, trainer

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file (configs/*.py[:arg]).", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run folder: checkpoints, metrics, TensorBoard.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Build everything abstractly, print sizes, exit.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Delete a run of another config in --workdir.")
_EXPORT_HF = flags.DEFINE_string(
    "export_hf", None, "Export a checkpoint of --workdir here and exit."
)
_EXPORT_STEP = flags.DEFINE_integer("export_step", None, "Step to export (default: latest).")


def _parse_flags(argv):
    try:
        config_types.check_override_keys(argv)
    except (KeyError, FileNotFoundError) as e:
        sys.exit(f"FATAL: {e}")
    return flags.FLAGS(argv)


def main(argv):
    del argv
    cfg = config_types.from_config_dict(_CONFIG.value)
    if _DRY_RUN.value:
        build.dry_run(cfg)
        return
    if not _WORKDIR.value:
        raise app.UsageError("--workdir is required (except with --dry_run)")
    if _EXPORT_HF.value:
        trainer.export_hf(cfg, _WORKDIR.value, _EXPORT_HF.value, step=_EXPORT_STEP.value)
        return
    log_file = os.path.join(_WORKDIR.value, "train.log")
    try:
        console.setup(log_file)
        logging.info("config %s -> %s", cfg.name, _WORKDIR.value)
        logging.info("XLA compilation cache: %s", compile_cache.enable())
        trainer.train(cfg, _WORKDIR.value, overwrite=_OVERWRITE.value)
    except OSError as e:
        if isinstance(e, checkpoint.WorkdirWriteError):
            sys.exit(f"ERROR: {e}")
        if e.errno in checkpoint.WRITE_ERRNOS:
            sys.exit(f"ERROR: {checkpoint.write_error(e, log_file, 'the log file')}")
        raise


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    app.run(main, flags_parser=_parse_flags)
