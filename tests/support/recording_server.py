"""The project's OpenAI-compatible server (mmr_jax/serving/server.py) over a real tiny model,
recording what it was asked: the stand-in for one vLLM server per host in the multi-process
tests. It proves the protocol and the routing, not vLLM itself.

    with recording_server.serve(tiny_llama_dir) as (backend, url):
        ...  # a run with rollout.url=url
        backend.requests  # [(prompt ids, seed)] of every completion request, in arrival order
        backend.reloads   # weight folders it reloaded
"""

from __future__ import annotations

import contextlib
import threading

from mmr_jax.rollout import padding
from mmr_jax.serving import embedded_backend, server

MODEL_NAME = "tiny"


class RecordingBackend(embedded_backend.EmbeddedBackend):
    """`EmbeddedBackend` that records its completion requests and weight reloads."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.requests, self.reloads = [], []
        self._record = threading.Lock()

    def start(self, prompt_ids, params, **kwargs):
        with self._record:
            self.requests.extend((tuple(int(t) for t in p), params.seed) for p in prompt_ids)
        return super().start(prompt_ids, params, **kwargs)

    def reload_weights(self, weights_path: str) -> dict:
        with self._record:
            self.reloads.append(str(weights_path))
        return super().reload_weights(weights_path)

    def clear(self) -> None:
        with self._record:
            self.requests.clear()
            self.reloads.clear()


@contextlib.contextmanager
def serve(checkpoint_dir):
    """(backend, url) of a server on `checkpoint_dir` under the name `MODEL_NAME`, in a thread."""
    backend = RecordingBackend.from_pretrained(
        checkpoint_dir, model_name=MODEL_NAME, buckets=padding.MinSizes(min_prompts=1)
    )
    with server.OpenAIServer(backend, weights_dir="/") as srv:  # the runs' sync folders
        yield backend, srv.url
