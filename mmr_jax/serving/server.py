"""OpenAI-compatible HTTP server with vLLM's request/response shapes, over any `Backend`.

Routes (parameters, shapes and what is refused: docs/serving.md):
  GET  /health, /ping, /version, /load, /metrics (Prometheus, `metrics`), /v1/models
  POST /v1/completions, /v1/chat/completions, /v1/chat/completions/batch (vLLM's batched chat),
       /invocations (SageMaker's: a chat or completion body), /ping, /reset_prefix_cache
  with `weights_dir` only (off by default, as vLLM's dev-mode and runtime-LoRA routes):
  POST /collective_rpc, /v1/load_lora_adapter, /v1/unload_lora_adapter (`weight_routes`)
Bodies and stream chunks: `openai_format`; request parsing and what is refused: `openai_params`,
`openai_chat_params` (a request is answered as asked or refused with a 400, never answered as if
a parameter were absent); echo and prompt log-probs: `prompt_logprobs` (one forward pass per
prompt). Errors are OpenAI's shape, {"error": {"message", "type", "param", "code"}}.

Limits (`request_limits`): rows, context and body size, each a 400 before anything is generated.
Generation: with the backend's slot engine enabled (`scripts/serve.py` does), `slot_scheduler`
batches continuously: a request joins the running decode at the next step and a finished row
frees its slot; else `batching` decodes the requests waiting together. Streams send tokens
as they are decoded (`openai_stream`); stop strings and clients that leave end their rows
early. Log-probs follow the backend's `logprobs_mode` (default: after temperature, before
top-k/top-p); with k alternatives (k > 0) the server runs one extra forward pass over
prompt + completion for them, under the same hold of the backend as the generation.
HTTP: `http` (Starlette on uvicorn, as vLLM's). In-process: `OpenAIServer(backend, port=0).start()`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

import mmr_jax
from mmr_jax.rollout import base
from mmr_jax.serving import (
    batching,
    http,
    metrics,
    openai_chat_params,
    openai_choices,
    openai_params,
    openai_stream,
    request_limits,
    slot_scheduler,
    token_controls,
    weight_routes,
)
from mmr_jax.serving import openai_format as fmt

log = logging.getLogger(__name__)


class Backend(Protocol):
    """What the server needs from a model host (see `embedded_backend.EmbeddedBackend`)."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def exclusive(self) -> Any:
        """A context manager held while a batch is decoded (no weight changes meanwhile)."""

    def start(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: base.SamplingParams,
        *,
        model: str,
        ignore_eos: bool,
        n_slots: int,
    ) -> Any:
        """A decode in progress, as `sampler.start`'s `Sampling` (or `batching.Finished`
        over a whole batch): advance(steps), progress(), cancel(rows), finished."""

    def top_logprobs(
        self,
        sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
        k: int,
        *,
        temperature: float,
        model: str,
    ) -> list[tuple[np.ndarray, np.ndarray]]: ...

    def chat_prompt(self, messages: list[dict]) -> list[int]: ...

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_strings(self, ids: Sequence[int]) -> list[str]: ...

    def adapters(self) -> dict[str, str]: ...

    def load_adapter(self, name: str, path: str) -> None: ...

    def unload_adapter(self, name: str) -> None: ...

    def collective_rpc(self, method: str, args: list, kwargs: dict) -> Any: ...


class OpenAIServer:
    """The routes above over `backend`, on (host, port); port 0 picks a free port.

    Args:
      default_max_tokens: a chat request's limit when it sets none (None: the context's room).
      limits: what one request may ask (`request_limits.Limits`).
      api_key: the key clients must send as `Authorization: Bearer <key>` (None: no key).
      weights_dir: turns the weight-reload and adapter routes on, for paths inside this folder
        (None: those routes answer 404).
      chunk_steps: decode steps between the batcher's hand-overs (stream chunks, early ends).
      gather_s: how long the batcher waits, once a request arrives, for others to join it.
      force_include_usage: every stream carries the usage in every chunk (vLLM's
        --enable-force-include-usage).
    """

    def __init__(
        self,
        backend: Backend,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        default_max_tokens: int | None = None,
        limits: request_limits.Limits | None = None,
        api_key: str | None = None,
        weights_dir: str | os.PathLike | None = None,
        chunk_steps: int = 8,
        gather_s: float = 0.02,
        force_include_usage: bool = False,
    ):
        self.backend, self.default_max_tokens = backend, default_max_tokens
        self.limits, self.api_key = limits or request_limits.Limits(), api_key or None
        self.force_include_usage = force_include_usage
        self.weights_dir = None if weights_dir is None else os.path.realpath(weights_dir)
        self.batcher = slot_scheduler.batcher_for(
            backend, self.limits, chunk_steps=chunk_steps, gather_s=gather_s
        )
        self._thread: threading.Thread | None = None
        self.metrics = metrics.Metrics(backend.model_name)
        ok = lambda body, conn: (200, None, None)
        self.routes = {
            ("GET", "/health"): ok,
            ("GET", "/ping"): ok,
            ("POST", "/ping"): ok,
            ("GET", "/version"): lambda body, conn: (200, {"version": mmr_jax.__version__}, None),
            ("GET", "/load"): lambda body, conn: (200, {"server_load": self.metrics.load}, None),
            ("GET", "/metrics"): lambda body, conn: (200, None, self.metrics.exposition()),
            ("GET", "/v1/models"): self._models,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/chat/completions/batch"): self._batch_chat,
            ("POST", "/invocations"): self._invocations,
            ("POST", "/reset_prefix_cache"): lambda body, conn: (200, {"success": True}, None),
        }
        if self.weights_dir is not None:
            self.routes.update(weight_routes.WeightRoutes(backend, self.weights_dir).routes())
        self._http = http.HTTP(
            self.routes,
            host=host,
            port=port,
            api_key=self.api_key,
            max_body_bytes=self.limits.max_body_bytes,
        )

    @property
    def url(self) -> str:
        host, port = self._http.address
        return f"http://{host}:{port}"

    def start(self) -> OpenAIServer:
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._http.serve_forever()

    def stop_serving(self) -> None:
        """Makes `serve_forever` return (safe from a signal handler: it does not wait)."""
        self._http.stop()

    def shutdown(self) -> None:
        self._http.stop()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._http.close()
        self.batcher.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.shutdown()

    # ---- routes ----------------------------------------------------------------------------------

    def _models(self, body, conn):
        now = int(time.time())
        b = self.backend

        def card(name, root, parent):
            return {
                "id": name,
                "object": "model",
                "created": now,
                "owned_by": "vllm",
                "root": root,
                "parent": parent,
                "max_model_len": b.max_model_len,
                "permission": [],
            }

        data = [card(b.model_name, b.model_name, None)]
        data += [card(name, path, b.model_name) for name, path in b.adapters().items()]
        return 200, {"object": "list", "data": data}, None

    def _resolve_model(self, name: Any) -> str:
        b = self.backend
        if name is not None and not isinstance(name, str):
            raise fmt.HTTPError(400, f"model must be a string, got {name!r}"[:200], param="model")
        if name is None or name == b.model_name or name in b.adapters():
            return name or b.model_name
        raise fmt.HTTPError(
            404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
        )

    def _reply(self, request: openai_params.Request, model: str, conn, *, chat: bool, body):
        """The reply of a parsed request: a JSON body, or a stream as tokens are decoded."""
        request_limits.check(request, self.limits)
        if self.force_include_usage and request.stream:  # vLLM's --enable-force-include-usage
            request = dataclasses.replace(request, include_usage=True, continuous_usage=True)
        if request.controls != token_controls.NONE and not self.batcher.takes_controls:
            raise fmt.HTTPError(400, "logit_bias, allowed_token_ids and min_tokens need the "
                            "continuous batch (scripts/serve.py enables it)")  # fmt: skip
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        token_ids = bool(body.get("return_token_ids"))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        meta = {
            "created": int(time.time()),
            "model": model,
            "prompt_tokens": sum(len(p) for p in request.prompts),
            "logprobs": request.logprobs is not None,
        }
        done = self.metrics.started()
        try:
            info = openai_choices.prompt_info(self.backend, request, model, as_ids=as_ids)
            if not request.generate:  # echo with max_tokens 0: the prompt alone
                choices = openai_choices.build_choices(
                    self.backend, request, None, None, as_ids=as_ids, prompt_info=info
                )
                if request.stream:
                    chunks = fmt.completion_chunks(
                        choices, rid=rid, **meta, include_usage=request.include_usage
                    )
                    return 200, http.sse(chunks, on_close=done), None
                done()
                reply = fmt.completion_response(choices, rid=rid, token_ids=token_ids, **meta)
                return 200, reply, None
            job = self.batcher.submit(batching.Job(request, model))
        except BaseException:
            done()
            raise
        if request.stream:
            kind = "chat.completion.chunk" if chat else "text_completion"
            head = {"id": rid, "object": kind, "created": meta["created"], "model": model}
            chunks = openai_stream.stream(
                self.backend, job, conn.client_gone, head=head, chat=chat, as_ids=as_ids,
                prompt_info=info, token_ids=token_ids,
                on_finish=lambda outs: self.metrics.finished(meta["prompt_tokens"], outs),
            )  # fmt: skip

            def close():
                job.cancel()
                done()

            return 200, http.sse(chunks, on_close=close), None
        try:
            choices = openai_stream.collect(
                self.backend, job, conn.client_gone, as_ids=as_ids, prompt_info=info
            )
        except ConnectionAbortedError:
            conn.close_connection = True
            return 499, None, None
        finally:
            done()
        self.metrics.finished(meta["prompt_tokens"], choices)
        if chat:
            return 200, fmt.chat_response(choices, rid=rid, token_ids=token_ids, **meta), None
        return 200, fmt.completion_response(choices, rid=rid, token_ids=token_ids, **meta), None

    def _completions(self, body, conn):
        model = self._resolve_model(body.get("model"))
        request = openai_params.parse_completion_request(body, self.backend)
        return self._reply(request, model, conn, chat=False, body=body)

    def _chat(self, body, conn):
        model = self._resolve_model(body.get("model"))
        request = openai_chat_params.parse_chat_request(
            body, self.backend, default_max_tokens=self.default_max_tokens
        )
        return self._reply(request, model, conn, chat=True, body=body)

    def _batch_chat(self, body, conn):
        """vLLM's /v1/chat/completions/batch: `messages` a list of conversations, one choice
        each (index i), not streamed, n = 1."""
        conversations = body.get("messages")
        if not isinstance(conversations, list) or not conversations:
            raise fmt.HTTPError(
                400, "messages must be a non-empty list of conversations", param="messages"
            )
        reuse = body.get("kv_transfer_params")
        if isinstance(reuse, dict) and reuse.get("prompt_token_ids") is not None:
            raise fmt.HTTPError(
                400,
                "Batch chat completions do not support `kv_transfer_params['prompt_token_ids']`: "
                "one pre-tokenized prompt cannot serve several conversations.",
                param="kv_transfer_params.prompt_token_ids",
            )
        if body.get("stream") or (body.get("n") or 1) != 1:
            raise fmt.HTTPError(400, "batch chat completions take neither stream nor n > 1")
        if len(conversations) > self.limits.max_num_seqs:
            raise fmt.HTTPError(
                400, f"at most {self.limits.max_num_seqs} conversations", param="messages"
            )
        with concurrent.futures.ThreadPoolExecutor(len(conversations)) as pool:  # one batch
            answers = list(
                pool.map(lambda m: self._chat({**body, "messages": m}, conn), conversations)
            )
        replies = []
        for status, reply, _ in answers:
            if status != 200:
                return status, reply, None
            replies.append(reply)
        choices = [{**r["choices"][0], "index": i} for i, r in enumerate(replies)]
        usage = fmt.usage(
            sum(r["usage"]["prompt_tokens"] for r in replies),
            sum(r["usage"]["completion_tokens"] for r in replies),
        )
        return 200, {**replies[0], "choices": choices, "usage": usage}, None

    def _invocations(self, body, conn):
        """vLLM's (SageMaker's) POST /invocations: a chat body (messages) or a completion body
        (prompt), answered by that route."""
        if "messages" in body:
            return self._chat(body, conn)
        if "prompt" in body:
            return self._completions(body, conn)
        raise fmt.HTTPError(
            400,
            "Cannot find suitable handler for request. Expected one of: "
            "ChatCompletionRequest, CompletionRequest",
        )
