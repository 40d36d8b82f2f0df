"""`scripts/train.py --export_hf` with the distributed flags (issue 36, item 9): every process
restores its shards onto the run's mesh and joins the gather, process 0 writes the same HF folder
as one process does (it ended in a bare StopIteration: no global array to find a mesh on). The
console says one line, "exported <path>", on process 0; Orbax's INFO lines go to the log file.
"""

import re

import numpy as np
import pytest
import safetensors.numpy

from support import train_script

pytestmark = pytest.mark.slow
ABSL_INFO = re.compile(r"^I\d{4} ")  # absl's INFO line prefix, e.g. "I1125 01:23:59.53 ..."


def _ok(procs, timeout=900):
    for p in procs:
        p.wait(timeout=timeout)
    for p in procs:
        assert p.returncode == 0, train_script.output(p)[-3000:]


def test_export_on_two_processes_equals_one(tmp_path, tiny_llama_dir):
    cfg = train_script.cluster_config(tiny_llama_dir, steps=1)
    work = tmp_path / "run"
    _ok(train_script.launch(cfg, work, processes=1, devices=2))
    one, two = tmp_path / "hf_one", tmp_path / "hf_two"
    (proc,) = train_script.launch(
        cfg, work, processes=1, devices=2, extra_args=(f"--export_hf={one}",)
    )
    _ok([proc])
    lines = train_script.output(proc).splitlines()
    assert [x for x in lines if ABSL_INFO.match(x) or "orbax" in x.lower()] == [], lines[:20]
    assert [x for x in lines if x.endswith(f" exported {one}")] != [], lines
    assert "_NonBlockingMetadataStore" in (work / "export.log").read_text()  # logged, not shown
    procs = train_script.launch(
        cfg, work, processes=2, devices=1, extra_args=(f"--export_hf={two}",)
    )
    _ok(procs)
    out0, out1 = (train_script.output(p) for p in procs)
    assert "StopIteration" not in out0
    assert f" exported {two}" in out0 and " exported " not in out1  # process 0 alone prints
    a = safetensors.numpy.load_file(one / "model.safetensors")
    b = safetensors.numpy.load_file(two / "model.safetensors")
    assert sorted(a) == sorted(b) and a
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in two.iterdir())
