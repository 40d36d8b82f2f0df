"""Runs a study (variants x seeds, each a normal training run) and writes its report.

    python scripts/study.py --config=configs/study.py
    python scripts/study.py --config=configs/study.py --config.seeds=1,2,3,4 \\
        --config.folder=runs/study_4seeds
    python scripts/study.py --config=configs/study.py --report_only   # from what exists so far
    python scripts/study.py --config=configs/study.py --base_accuracy # untrained model, held out
    python scripts/study.py --config=configs/study.py --report_only --archive=docs/study_cpu
        # the study without checkpoints; `cp -r docs/study_cpu/. runs/study_cpu/` and the first
        # command then resumes it elsewhere, skipping the ended runs

On several hosts, the same command on every host with the distributed flags (docs/multihost.md,
"A study on several hosts"); each run then trains on all of them, its processes a cluster of
their own at the coordinator's port + 1, and `study.folder` must be one folder every host sees:

    python scripts/study.py --config=configs/study.py --coordinator_address=host0:1234 \\
        --num_processes=2 --process_id=0        # and --process_id=1 on the other host

Re-running the same command resumes: finished runs are skipped, an interrupted run resumes from
its latest checkpoint, a study folder of another config is refused with the differences named.
Writes `<folder>/study.json` (every curve and the summary), `report.md` and `curves.png`.
"""

import functools
import json
import os
import pathlib
import sys

from absl import flags, logging
from ml_collections import config_flags

_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(_ROOT / "scripts"))
import plot_run  # noqa: E402

from mmr_jax import distributed  # noqa: E402
from mmr_jax.config import command_line  # noqa: E402
from mmr_jax.infra import compile_cache, console, metrics, run_paths, user_errors  # noqa: E402
from mmr_jax.problems import evaluation  # noqa: E402
from mmr_jax.studies import on_hosts, reporting, run_curves, study  # noqa: E402
from mmr_jax.training import own_process  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Study config (configs/study.py[:pilot]).", lock_config=True
)
_REPORT_ONLY = flags.DEFINE_bool("report_only", False, "Write the report from the runs so far.")
_IN_PROCESS = flags.DEFINE_bool(
    "in_process", False, "Train every run in this process (debugging); default: one process a run."
)
_ARCHIVE = flags.DEFINE_string(
    "archive",
    None,
    "After the report, copy the study without checkpoints to this folder "
    "(study files, ended runs' metrics); copying it back into an empty folder resumes there.",
)
_KEEP = flags.DEFINE_bool(
    "keep_checkpoints",
    False,
    "Keep each ended run's last checkpoint (default: delete it once the run has ended; the "
    "report reads only the runs' metrics).",
)
_BASE = flags.DEFINE_bool(
    "base_accuracy", False, "Evaluate the untrained checkpoint on the held-out set and exit."
)
_PROCESSES = distributed.define_flags()  # several hosts: every run trains on all of them


def write_report(config, specs) -> dict:
    """study.json, report.md and curves.png in the study folder; returns study.json's content."""
    folder = run_paths.as_path(config.folder)  # local, or a bucket (gs://)
    written = run_paths.open_run(config.folder).local  # the folder, or a bucket's staging one
    result = study.collect(config, specs)
    (folder / "study.json").write_text(json.dumps(result, indent=1))
    runs = list(zip(specs, result["runs"], strict=True))
    with_curve = [s for s, r in runs if r["curve"]["steps"]]
    # The bands are over the steps every plotted seed has: a run still going (or diverged) would
    # cut its variant's curve short, so only finished runs are plotted once there are any.
    finished = [s for s, r in runs if r["curve"]["steps"] and r["status"] == "finished"]
    plotted = finished or with_curve
    plot = ""
    if plotted:
        plot_run.plot_bands(
            [run_paths.fetched(folder / s.name / metrics.METRICS_FILE) for s in plotted],
            [s.variant for s in plotted],
            written / "curves.png",
            metrics=(study.EVAL_METRIC, "reward/mean", "completion/length_mean"),
        )
        if run_paths.is_remote(folder):
            (folder / "curves.png").write_bytes((written / "curves.png").read_bytes())
        plot = "curves.png"
    mechanism = {  # how each run learnt and what it cost, from its metrics
        s.name: run_curves.run_mechanism(metrics.read_jsonl(path))
        for s in specs
        if (path := folder / s.name / metrics.METRICS_FILE).exists()
    }
    report = reporting.markdown(
        result["summary"], result["runs"], result["study"], plot=plot, mechanism=mechanism
    )
    (folder / "report.md").write_text(report)
    console.info("wrote %s, report.md, curves.png", folder / "study.json")
    print(report, flush=True)
    return result


def _check_for_report(folder, now: dict) -> None:
    """A report reads the runs' metrics, not their training configs: training keys the code has
    changed since the study ran (defaults added or renamed) and the data folder's path are
    logged, not refused; the study's own keys, the run grid, steps and evaluation must still
    match."""
    path = run_paths.as_path(folder) / study.STUDY_FILE
    if not path.exists():
        study.check_folder(folder, now)
        return
    diff = study.differences(json.loads(path.read_text()), study.plain(now))
    report_keys = (".total_steps", ".eval.", ".seed:", ".name:")
    where = ".eval.data_dir:"  # the data folder's path on the machine the study ran: not a setting
    if any(
        not d.startswith("runs.") or (any(k in d for k in report_keys) and where not in d)
        for d in diff
    ):
        study.check_folder(folder, now)  # refuses, naming the differences
    if diff:
        console.info("report of the stored study; training keys changed since: %s", diff)


def _hosts() -> distributed.Options:
    """The distributed flags, checked (a named error and exit on bad ones)."""
    try:
        opts = distributed.options_from_flags(**{k: v.value for k, v in _PROCESSES.items()})
        on_hosts.check_options(opts, in_process=_IN_PROCESS.value)
    except (ValueError, distributed.DistributedError) as e:
        sys.exit(f"ERROR: {type(e).__name__}: {e}")
    return opts


def main(argv):
    del argv
    config = _CONFIG.value
    run_paths.check(config.folder, "--config.folder")  # a bucket (gs://) or a local folder
    opts = _hosts()
    process = opts.process_id or 0
    training = not (_BASE.value or _REPORT_ONLY.value)
    if process and not training:
        print(f"process {process}: --report_only and --base_accuracy run on process 0 alone")
        return
    # Progress and the runs' step lines on stdout; Orbax, absl and JAX INFO to <study>/study.log
    # (on several hosts process 0's; the others log to study.process<I>.log and print nothing).
    name = f"study.process{process}.log" if process else "study.log"
    log_file = console.setup(os.path.join(config.folder, name), stdout=not process)
    hosts = training and opts.mode == "explicit"
    if hosts:
        try:
            on_hosts.start(opts)
        except distributed.DistributedError as e:  # e.g. no coordinator within the timeout
            sys.exit(f"ERROR: {type(e).__name__}: {e}")
        console.info("study process %d of %d", process, opts.num_processes)
    logging.info("XLA compilation cache: %s", compile_cache.enable())
    specs = study.plan(config)
    if not hosts:
        _one_process(config, specs, log_file)
        return
    on_hosts.run(
        config,
        opts,
        report=functools.partial(_report, config, specs),
        log_file=log_file,
        verbose=console.verbosity_given(),
        drop_checkpoints=not _KEEP.value,
    )


def _report(config, specs) -> None:
    write_report(config, specs)
    if _ARCHIVE.value:
        kept = study.archive(config.folder, _ARCHIVE.value)
        console.info("archived %s (ended runs: %s) -> %s", config.folder, kept, _ARCHIVE.value)


def _one_process(config, specs, log_file) -> None:
    if _BASE.value:
        cfg = specs[0].cfg
        result = study.base_accuracy(cfg)
        print(evaluation.format_table(result), flush=True)
        lengths = {b: m["mean_length"] for b, m in result.per_benchmark.items()}
        print(
            "mean completion length (tokens): "
            + ", ".join(f"{b} {v:.2f}" for b, v in lengths.items())
        )
        # Archived beside the study: the candidate table of a plan is read from these files.
        name = "base_accuracy_" + cfg.data.source.replace(":", "_").replace("/", "_") + ".json"
        out = os.path.join(config.folder, name)
        local = run_paths.open_run(config.folder).local / name  # a bucket's: uploaded below
        evaluation.write_json(
            result,
            local,
            model=cfg.model.path,
            data_source=cfg.data.source,
            n=cfg.eval.n,
            seed=cfg.seed,
            temperature=cfg.eval.temperature,
            top_p=cfg.eval.top_p,
        )
        if run_paths.is_remote(out):
            run_paths.as_path(out).write_bytes(local.read_bytes())
        console.info("wrote %s", out)
        return
    if not _REPORT_ONLY.value:
        # Each run in its own process: nothing one run compiled outlives it (memory stays flat).
        in_child = functools.partial(
            own_process.train_in_child, log_file=log_file, verbose=console.verbosity_given()
        )
        study.run_study(
            config,
            train_fn=None if _IN_PROCESS.value else in_child,
            drop_checkpoints=not _KEEP.value,
        )
    else:
        _check_for_report(config.folder, study.resolved(config, specs))
    _report(config, specs)


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    user_errors.run(main, argv_checks=(command_line.check_argv,))
