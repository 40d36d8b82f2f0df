"""Builds the data folder (eval/ benchmarks, train/gsm8k) from public Hugging Face datasets.

    python scripts/prepare_data.py              # into $MMR_JAX_SHARED_DATA or ../shared/data
    python scripts/prepare_data.py --out=/data/mmr --files=eval/math500.jsonl,eval/aime24.jsonl
    python scripts/prepare_data.py --from_dir=/media/shared/data --out=../shared/data   # offline

Each file is converted by `problems.data_sources` (the offline folder's field mapping) and written
atomically, one progress line per file. `--from_dir` copies an offline folder's files instead,
after checking each loads with the expected number of records. See docs/data.md.
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

from absl import app, flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from mmr_jax.infra import user_errors
from mmr_jax.problems import data, data_sources

_REPO = pathlib.Path(__file__).resolve().parents[1]
_OUT = flags.DEFINE_string(
    "out",
    os.environ.get(data.DATA_ENV) or str(_REPO.parent / "shared" / "data"),
    "Data folder to write (eval/ and train/ under it).",
)
_FILES = flags.DEFINE_list(
    "files", None, "Files to build, relative to the folder (default: all the hub can build)."
)
_FROM_DIR = flags.DEFINE_string(
    "from_dir", None, "Copy these files from an offline data folder instead of the hub."
)


def main(argv):
    del argv
    out = pathlib.Path(_OUT.value)
    names = list(data_sources.expected_rows() if _FROM_DIR.value else data_sources.SOURCES)
    files = _FILES.value or names
    unknown = sorted(set(files) - set(names))
    if unknown:
        raise app.UsageError(f"unknown files {unknown}; known: {names}")
    if _FROM_DIR.value:  # its loading of local files: one line per file is ours, no bars
        import datasets

        datasets.disable_progress_bars()
    for i, path in enumerate(files, 1):
        t0 = time.monotonic()
        if _FROM_DIR.value:
            src = pathlib.Path(_FROM_DIR.value) / path
            count = data_sources.check_folder(_FROM_DIR.value, [path])[path]
            if src.resolve() != (out / path).resolve():
                data_sources.copy_file(src, out / path)
            origin = str(src)
        else:
            source = data_sources.SOURCES[path]
            print(f"[{i}/{len(files)}] {path} <- {source.hub} ...", flush=True)
            try:
                rows = data_sources.load_hub_rows(source)
            except ConnectionError as e:
                raise user_errors.UserError(
                    f"{e}; without the hub, copy an offline data folder: --from_dir=<folder>"
                ) from e
            records = data_sources.build(path, rows)
            data_sources.write_jsonl(records, out / path)
            count, origin = len(records), source.hub
        print(
            f"[{i}/{len(files)}] {out / path}: {count} records from {origin} "
            f"({time.monotonic() - t0:.1f} s)",
            flush=True,
        )
    if not _FROM_DIR.value:
        print(f"not on the hub (copy them with --from_dir): {', '.join(data_sources.OFFLINE_ONLY)}")


if __name__ == "__main__":
    user_errors.run(main)
