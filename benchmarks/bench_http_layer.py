"""The HTTP layer's own cost: `server.OpenAIServer` over a backend without a model, so that only
routing, body parsing and the reply are timed.

    python benchmarks/bench_http_layer.py                   # this tree
    python benchmarks/bench_http_layer.py --repo=<another checkout> --label=before

Every client (one `requests.Session` each: keep-alive, as the `openai` client) alternates
GET /v1/models (200) and a POST /v1/completions that the parameter checks refuse (400 with
temperature -1: the body read and parsed, nothing generated). Prints per concurrency level the
requests per second and the p50 / p95 latency. Run two checkouts one after the other in one
command to compare them (docs/serving.md).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import sys
import time

import requests

REFUSED = json.dumps({"model": "m", "prompt": [1, 2], "temperature": -1}).encode()


class ModelFree:
    """What the routes timed here ask of a backend (`server.Backend`), without a model."""

    model_name, max_model_len, vocab_size, eos_token_ids = "m", 2048, 100, (0,)

    def adapters(self):
        return {}

    def slot_engine(self):
        return None


def client(url: str, requests_sent: int) -> list[float]:
    session, latencies = requests.Session(), []
    for i in range(requests_sent):
        start = time.perf_counter()
        if i % 2:
            r = session.get(f"{url}/v1/models", timeout=60)
            assert r.status_code == 200, r.text
        else:
            headers = {"Content-Type": "application/json"}
            r = session.post(f"{url}/v1/completions", data=REFUSED, headers=headers, timeout=60)
            assert r.status_code == 400, r.text
        latencies.append(time.perf_counter() - start)
    return latencies


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", default=str(pathlib.Path(__file__).resolve().parents[1]))
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--requests", type=int, default=200, help="per client")
    args = ap.parse_args()
    sys.path.insert(0, args.repo)
    from mmr_jax.serving import server

    srv = server.OpenAIServer(ModelFree()).start()
    try:
        client(srv.url, 20)  # connections and first-call costs out of the timings
        for clients in (1, 16):
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                runs = pool.map(client, [srv.url] * clients, [args.requests] * clients)
                latencies = sorted(t for run in runs for t in run)
            wall = time.perf_counter() - start
            p50, p95 = (1000 * latencies[int(len(latencies) * q)] for q in (0.5, 0.95))
            print(f"{args.label}: clients={clients} requests={len(latencies)} "
                  f"req/s={len(latencies) / wall:.0f} p50_ms={p50:.2f} p95_ms={p95:.2f}",
                  flush=True)  # fmt: skip
    finally:
        srv.shutdown()


if __name__ == "__main__":
    main()
