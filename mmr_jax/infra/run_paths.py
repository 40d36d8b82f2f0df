"""Where a run's files go: a local folder, or a bucket (`gs://...`) through `etils.epath`.

Every run path (checkpoints, run.json, metrics, logs, exports) is an `epath.Path`: a local path
is an ordinary file, a `gs://bucket/x` path is an object in the bucket (epath's fsspec backend,
which needs `gcsfs`: `pip install 'mmr_jax[gcs]'`), and Orbax takes either natively.

Object stores cannot append. The files a run appends to (metrics.jsonl, train.log, TensorBoard
events) are written, for a bucket workdir, to a local staging folder and copied whole to the
workdir (`RunDir.mirror`): before each checkpoint is written, every `MIRROR_EVERY_S` seconds,
and when the run ends, its error path included (and at interpreter exit). A killed process
loses what it wrote after the last copy; a resume truncates metrics to its checkpoint anyway.
A resume reads them back from the workdir. What a local process must read (a vLLM server's
weight-sync folder and log) stays in the staging folder (`RunDir.local`). A local workdir is
used in place, exactly as before: no staging, appends go straight to its files.
"""

from __future__ import annotations

import atexit
import os
import pathlib
import re
import sys
import tempfile
import threading

from absl import logging
from etils import epath

from mmr_jax.infra import user_errors

# Schemes a workdir may have, and the package epath needs for each. Orbax writes arrays to
# gs:// (TensorStore's own GCS driver) and to local paths only, so other schemes are refused.
SCHEMES = {"gs": "gcsfs"}
INSTALL = "pip install 'mmr_jax[gcs]'"
MIRROR_EVERY_S = 60.0  # a bucket workdir's appended files are copied to it this often
STAGING_ENV = "MMR_JAX_STAGING_DIR"  # parent of staging folders (default: the system temp dir)


class WorkdirSchemeError(user_errors.UserError, ValueError):
    """A run path is a URL this program cannot write (an unknown scheme, or a missing package)."""


class NotAFolderError(user_errors.UserError, NotADirectoryError):
    """A local run path that is a file, or lies under one."""


def scheme(path) -> str | None:
    """'gs' for 'gs://b/x'; None for a local path."""
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", os.fspath(path))
    return m.group(1).lower() if m else None


def is_remote(path) -> bool:
    return scheme(path) is not None


def check(path, what: str = "--workdir") -> None:
    """Raises `WorkdirSchemeError` for a URL that the run cannot write: a scheme other than
    gs://, or gs:// without the package epath reads it with (named in the message); and
    `NotAFolderError` for a local path that is a file or lies under one (nothing is created)."""
    name = scheme(path)
    if name is None:
        _check_local(os.fspath(path), what)
        return
    text = os.fspath(path)
    if name not in SCHEMES:
        raise WorkdirSchemeError(
            f"{what}={text!r}: {name}:// is not supported; the run's checkpoints are written by "
            "Orbax, which writes gs:// buckets and local (or mounted) paths only. Use a gs:// "
            "path, or mount the storage and give the mounted path."
        )
    try:
        epath.Path(text).exists()
    except ImportError as e:
        raise WorkdirSchemeError(
            f"{what}={text!r}: reading {name}:// needs the package {SCHEMES[name]} ({INSTALL}): {e}"
        ) from e


def _check_local(text: str, what: str) -> None:
    path = pathlib.Path(text).expanduser().absolute()
    for folder in (path, *path.parents):  # the nearest one that exists must be a folder
        if folder.exists():
            if not folder.is_dir():
                where = "is a file" if folder == path else f"lies under {folder}, a file"
                raise NotAFolderError(
                    f"{what}={text!r} {where}, not a folder; give a path under a folder"
                )
            return


def as_path(path, *, absolute: bool = False) -> epath.Path:
    """`path` as an `epath.Path` (a local one made absolute when `absolute`, as Orbax wants)."""
    if is_remote(path):
        return epath.Path(os.fspath(path).rstrip("/"))
    return epath.Path(os.path.abspath(path) if absolute else os.fspath(path))


def upload_tree(src, dst) -> None:
    """Copies the local folder `src` to `dst` (any epath path), file by file."""
    src, dst = pathlib.Path(src), epath.Path(dst)
    for folder, _, files in os.walk(src):
        rel = os.path.relpath(folder, src)
        target = dst if rel == "." else dst / rel
        target.mkdir(parents=True, exist_ok=True)
        for name in sorted(files):
            (target / name).write_bytes((pathlib.Path(folder) / name).read_bytes())


def download_tree(src, dst) -> pathlib.Path:
    """Copies the folder `src` (any epath path) to the local folder `dst`, file by file."""
    src, dst = epath.Path(src), pathlib.Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_dir():
            download_tree(p, dst / p.name)
        else:
            (dst / p.name).write_bytes(p.read_bytes())
    return dst


def tree_size(path) -> int:
    """Bytes of the files under the folder `path` (any epath path)."""
    path = epath.Path(path)
    return sum(tree_size(p) if p.is_dir() else p.stat().length for p in path.iterdir())


def fetched(path) -> str:
    """`path` (a file or folder) on the local disk: itself when local, else a downloaded copy
    (in a new temporary folder, under `STAGING_ENV` when set)."""
    if not is_remote(path):
        return os.fspath(path)
    src = as_path(path)
    local = _temporary("mmr_jax_fetch_") / src.name
    logging.info("downloading %s to %s", path, local)
    if src.is_dir():
        return str(download_tree(src, local))
    local.write_bytes(src.read_bytes())
    return str(local)


def _temporary(prefix: str) -> pathlib.Path:
    """A new local folder under `STAGING_ENV` (default: the system's temporary folder)."""
    parent = os.environ.get(STAGING_ENV) or None
    if parent:
        os.makedirs(parent, exist_ok=True)
    return pathlib.Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


def shadow_steps(run_dir, marker: str = "config.json") -> str:
    """A local stand-in for a bucket's run folder: its `step_N` folders that hold `marker`,
    each with only that file (a local `run_dir` is returned as it is). `fill_step` fetches the
    rest of one when it is needed, so the steps are never all on the disk at once."""
    if not is_remote(run_dir):
        return os.fspath(run_dir)
    local = _temporary("mmr_jax_steps_")
    for step in as_path(run_dir).iterdir():
        if re.fullmatch(r"step_\d+", step.name) and (step / marker).exists():
            (local / step.name).mkdir()
            (local / step.name / marker).write_bytes((step / marker).read_bytes())
    return str(local)


def fill_step(local_step, run_dir) -> str:
    """Downloads the step folder of bucket `run_dir` that `local_step` (of `shadow_steps`)
    stands for; a local `run_dir`: nothing to do."""
    if is_remote(run_dir):
        download_tree(as_path(run_dir) / os.path.basename(local_step), local_step)
    return os.fspath(local_step)


class RunDir:
    """A run's folder and the local folder its appended files are written in.

    Args:
      workdir: local path or gs:// URL.
      every_s: with a bucket workdir, copy the appended files to it this often (0: only when
        `mirror` is called and at the end).
    """

    def __init__(self, workdir, *, every_s: float = MIRROR_EVERY_S):
        check(workdir)
        self.path = as_path(workdir, absolute=True)
        self.remote = is_remote(workdir)
        if self.remote:
            self.local = _temporary("mmr_jax_run_")
            logging.info("workdir %s: appended files staged in %s", self.path, self.local)
        else:
            self.local = pathlib.Path(os.fspath(self.path))
        self.every_s = every_s
        self._files: dict[str, pathlib.Path] = {}  # name in the workdir -> local file or folder
        self._copied: dict[str, tuple[int, int]] = {}  # local file -> (size, mtime) last copied
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def appended(self, name: str) -> pathlib.Path:
        """The local file that `name` (a file of the workdir) is appended to. With a bucket, its
        current content is fetched first and the file is mirrored from then on."""
        local = self.local / name
        if not self.remote:
            return local
        with self._lock:
            if name not in self._files:
                local.parent.mkdir(parents=True, exist_ok=True)
                remote = self.path / name
                if remote.exists():
                    local.write_bytes(remote.read_bytes())
                    self._copied[str(local)] = _signature(local)
                else:
                    local.unlink(missing_ok=True)
                self._files[name] = local
            self._start()
        return local

    def appended_dir(self, name: str) -> pathlib.Path:
        """A local folder whose files are mirrored to `name` in the workdir (new files only are
        written there, e.g. TensorBoard's event files: nothing is fetched)."""
        local = self.local / name
        if self.remote:
            with self._lock:
                local.mkdir(parents=True, exist_ok=True)
                self._files[name] = local
                self._start()
        return local

    def mirror(self) -> None:
        """Copies the appended files that changed since their last copy to the workdir."""
        if not self.remote:
            return
        with self._lock:
            for name, local in list(self._files.items()):
                files = (
                    sorted(p for p in local.rglob("*") if p.is_file())
                    if local.is_dir()
                    else [local]
                )
                for f in files:
                    sig = _signature(f)
                    if sig is None or self._copied.get(str(f)) == sig:
                        continue
                    rel = name if f == local else f"{name}/{f.relative_to(local).as_posix()}"
                    dst = self.path / rel
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    dst.write_bytes(f.read_bytes())  # one object, written whole
                    self._copied[str(f)] = sig

    def publish(self) -> None:
        """Copies every file of the staging folder to the bucket (outputs written whole, e.g.
        evaluate.py's JSON and plots), then as `close`. A local workdir: nothing to do."""
        self.close()
        if self.remote:
            upload_tree(self.local, self.path)

    def _start(self) -> None:
        if self.every_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="workdir-mirror", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.mirror()
            except Exception as e:  # a bucket that does not answer: tried again next time
                logging.warning("copying the run's logs to %s failed: %s", self.path, e)

    def close(self) -> None:
        """Stops the periodic copy and copies a last time (later writes: at interpreter exit)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.mirror()


def _signature(path: pathlib.Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_size, st.st_mtime_ns


_OPEN: dict[str, RunDir] = {}  # key(workdir) -> its RunDir in this process
_ALL: list[RunDir] = []  # every bucket RunDir made, mirrored a last time at exit


def _key(workdir) -> str:
    return str(as_path(workdir, absolute=True))


def open_run(workdir) -> RunDir:
    """This process's `RunDir` of `workdir` (the script and the trainer share it)."""
    key = _key(workdir)
    if key not in _OPEN:
        _OPEN[key] = RunDir(workdir)
        if _OPEN[key].remote:
            _ALL.append(_OPEN[key])
    return _OPEN[key]


def mirror(workdir) -> None:
    """`RunDir.mirror` of `workdir`, when this process opened it."""
    run = _OPEN.get(_key(workdir))
    if run is not None:
        run.mirror()


def close(workdir) -> None:
    """`RunDir.close` of `workdir` and forgets it (a later `open_run` fetches the files again)."""
    run = _OPEN.pop(_key(workdir), None)
    if run is None:
        return
    failing = sys.exc_info()[1] is not None  # called while an error is on its way: keep that one
    try:
        run.close()
    except Exception as e:
        if not failing:
            raise
        logging.warning("copying the run's logs to %s failed: %s", run.path, e)


@atexit.register
def _mirror_at_exit() -> None:
    for run in _ALL:
        try:
            run.mirror()
        except Exception as e:  # the interpreter is going away: say what was not copied
            logging.warning("copying the run's logs to %s at exit failed: %s", run.path, e)
