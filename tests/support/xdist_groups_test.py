"""`--dist loadgroup` keeps an `xdist_group` on one worker, as .ci/run and several slow modules
rely on: one vLLM server for `vllm_server`'s tests, one compile of the dry-run flips, the
cluster tests never beside each other.

pytest 9.2 moved node IDs to a structured form, and pytest-xdist 3.8's loadgroup still renames
`_nodeid`, so the groups silently stopped grouping (pytest-xdist issue #1386): each worker built
its own session fixture (two vLLM servers, the dry-run flips compiled twice). This runs a real
`pytest -n 2 --dist loadgroup` on a throwaway module and fails if a group is split again.
"""

import os
import subprocess
import sys
import textwrap

_MODULE = textwrap.dedent(
    """
    import os
    import pytest

    pytestmark = pytest.mark.xdist_group("one_worker")

    @pytest.mark.parametrize("i", range(6))
    def test_grouped(i):
        with open(os.environ["WORKERS_FILE"], "a") as f:
            f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
    """
)


def test_an_xdist_group_runs_on_one_worker(tmp_path):
    (tmp_path / "test_grouped.py").write_text(_MODULE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    workers = tmp_path / "workers.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["WORKERS_FILE"] = str(workers)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider"]
        + ["-q", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ran_on = workers.read_text().split()
    assert len(ran_on) == 6 and len(set(ran_on)) == 1, ran_on
