"""`scripts/study.py --report_only` on an archived study: the report regenerates from the records
on another machine and after later code changes (docs/studies.md, "Regenerating the reports")."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_archived_v2_report_regenerates_identically(tmp_path):
    """The stored study names the data folder of the machine it ran on and lacks keys added
    since; the report reads only the runs' metrics, so it must come out byte for byte the same."""
    folder = tmp_path / "study_v2"
    shutil.copytree(REPO / "docs" / "study_v2" / "study", folder)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1"}
    args = ["--config=configs/study_v2.py", f"--config.folder={folder}", "--report_only"]
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "study.py"), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    archived = (REPO / "docs" / "study_v2" / "study" / "report.md").read_text()
    assert (folder / "report.md").read_text() == archived
