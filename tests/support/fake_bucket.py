"""A fake `gs://` bucket on a local folder, for tests of bucket workdirs (issue 36, item 6).

    with fake_bucket.installed(tmp_path / "gcs"):
        trainer.train(cfg, "gs://bucket/runs/x")   # files land in tmp_path/gcs/bucket/runs/x

Two seams, both public or documented test hooks of the libraries that reach the bucket:
`etils.epath.testing.mock_epath` (every `epath.Path` operation on a `gs://` path is done on the
matching local path: how the run, Orbax's folders and its metadata reach the bucket), and
Orbax's `gcs_utils.get_kvstore_for_gcs` (the TensorStore spec of the array data: a `file`
kvstore on the same local folder instead of TensorStore's `gcs` driver). Local paths pass
through unchanged. Nothing here makes a folder named 'gs:'.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys
from unittest import mock

from etils.epath import testing as epath_testing
from orbax.checkpoint._src.path import gcs_utils

PREFIX = "gs://"


def local(root: pathlib.Path, path) -> str:
    """The local path of `path` under `root` when it is a gs:// path; else `path` as a string."""
    text = os.fspath(path)
    if not text.startswith(PREFIX):
        return text
    return str(root / text[len(PREFIX) :])


def _remote(root: pathlib.Path, text: str) -> str:
    """Back from a local path under `root` to its gs:// path."""
    rel = os.path.relpath(text, root)
    return PREFIX + rel


@contextlib.contextmanager
def installed(root):
    """Redirects gs:// paths of epath and Orbax's TensorStore specs to `root` (created)."""
    root = pathlib.Path(root).absolute()
    root.mkdir(parents=True, exist_ok=True)

    def one(fn, path, *args, **kwargs):
        return fn(local(root, path), *args, **kwargs)

    def two(fn, path, dst, *args, **kwargs):
        return fn(local(root, path), local(root, dst), *args, **kwargs)

    def glob(fn, path):
        remote = os.fspath(path).startswith(PREFIX)
        out = fn(local(root, path))
        return [_remote(root, p) for p in out] if remote else out

    def walk(fn, top, **kwargs):
        remote = os.fspath(top).startswith(PREFIX)
        for folder, dirs, files in fn(local(root, top), **kwargs):
            yield (_remote(root, os.fspath(folder)) if remote else folder), dirs, files

    def kvstore(path: str) -> dict:
        return {"driver": "file", "path": local(root, path)}

    fns = dict.fromkeys(
        ("exists", "isdir", "listdir", "makedirs", "mkdir", "open", "remove", "rmtree", "stat"),
        one,
    )
    fns.update(copy=two, rename=two, replace=two, glob=glob, walk=walk)
    with contextlib.ExitStack() as stack:
        stack.enter_context(epath_testing.mock_epath(**fns))
        stack.enter_context(mock.patch.object(gcs_utils, "get_kvstore_for_gcs", kvstore))
        stack.enter_context(
            mock.patch.object(gcs_utils, "is_hierarchical_namespace_enabled", lambda p: False)
        )
        yield root


def main(argv: list[str]) -> None:
    """`python -m support.fake_bucket ROOT SCRIPT ARGS...`: runs SCRIPT with the fake bucket."""
    import runpy

    root, script, *rest = argv
    sys.argv = [script, *rest]
    with installed(root):
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
