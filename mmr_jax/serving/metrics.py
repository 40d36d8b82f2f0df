"""The server's Prometheus metrics (`GET /metrics`) and load (`GET /load`), under vLLM's names.

vllm:num_requests_running (gauge: generation requests in flight, which is also /load's
server_load), vllm:prompt_tokens_total and vllm:generation_tokens_total (counters),
vllm:request_success_total (counter, by finished_reason), vllm:e2e_request_latency_seconds
(histogram), each labelled model_name as vLLM's. One registry per server, so servers in one
process do not share counts.
"""

from __future__ import annotations

import threading
import time

import prometheus_client as prom

CONTENT_TYPE = prom.CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, model_name: str):
        self.registry = prom.CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        self.running = prom.Gauge(
            "vllm:num_requests_running",
            "Generation requests in flight.",
            labels,
            registry=self.registry,
        )
        self.prompt_tokens = prom.Counter(
            "vllm:prompt_tokens", "Prompt tokens processed.", labels, registry=self.registry
        )
        self.generation_tokens = prom.Counter(
            "vllm:generation_tokens", "Tokens generated.", labels, registry=self.registry
        )
        self.success = prom.Counter(
            "vllm:request_success",
            "Requests answered, by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.latency = prom.Histogram(
            "vllm:e2e_request_latency_seconds",
            "Time from a request's arrival to its last token.",
            labels,
            registry=self.registry,
        )
        self._load, self._lock = 0, threading.Lock()
        self.running.labels(model_name).set(0)
        # The token counters are exported at 0 from the start, as vLLM's are: a scrape before the
        # first request sees `vllm:generation_tokens_total 0.0`, not a missing series.
        self.prompt_tokens.labels(model_name)
        self.generation_tokens.labels(model_name)

    @property
    def load(self) -> int:
        return self._load

    def started(self):
        """Counts a generation request in flight until the returned `done()` is called (once
        its reply, stream included, has ended; later calls do nothing)."""
        with self._lock:
            self._load += 1
            self.running.labels(self.model_name).set(self._load)
        start, ended = time.perf_counter(), []

        def done():
            with self._lock:
                if ended:
                    return
                ended.append(True)
                self._load -= 1
                self.running.labels(self.model_name).set(self._load)
            self.latency.labels(self.model_name).observe(time.perf_counter() - start)

        return done

    def finished(self, prompt_tokens: int, choices) -> None:
        """Counts a request's tokens and its choices' finish reasons."""
        name = self.model_name
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.generation_tokens.labels(name).inc(sum(len(c.token_ids) for c in choices))
        for c in choices:
            self.success.labels(name, c.finish_reason).inc()

    def exposition(self) -> str:
        return prom.generate_latest(self.registry).decode()
