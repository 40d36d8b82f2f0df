"""OpenAI-compatible HTTP server with vLLM's request/response shapes, over any `Backend`.

Routes:
  GET  /health, /v1/models
  POST /v1/completions            token-id or text prompts, n, seed, max_tokens, temperature, top_p,
                                  top_k, stop, stop_token_ids, ignore_eos, logprobs (0-20),
                                  stream (+ stream_options.include_usage), return_token_ids,
                                  return_tokens_as_token_ids; choices prompt-major (index b * n + i)
  POST /v1/chat/completions       messages (text) through the tokenizer's chat template with the
                                  generation prompt; n, seed, max_tokens / max_completion_tokens,
                                  temperature, top_p, top_k, stop, logprobs + top_logprobs (0-20),
                                  stream (+ stream_options.include_usage)
  POST /reset_prefix_cache        -> {"success": true}
  with `weights_dir` only (off by default, as vLLM's dev-mode and runtime-LoRA routes; the paths
  they take must lie inside `weights_dir`):
  POST /collective_rpc            {"method", "args", "kwargs"} -> {"results": [one per worker]}
  POST /v1/load_lora_adapter      {"lora_name", "lora_path"}
  POST /v1/unload_lora_adapter    {"lora_name"}
Bodies and stream chunks: `openai_format`; request parsing and what is refused: `openai_params`
(echo, best_of > 1, beam search, tools, and any sampling control this sampler does not apply when
set to a value that would change the output are HTTP 400: a request is answered as asked or
refused, never answered as if a parameter were absent). Errors are OpenAI's shape,
{"error": {"message", "type", "param", "code"}}: unknown model 404 `model_not_found`, a prompt
over the context 400 `context_length_exceeded`, malformed JSON or bad parameters 400.

Limits (`serve_limits`): rows, context and body size, each a 400 before anything is generated.
Generation: with the backend's slot engine enabled (`scripts/serve.py` does), `slot_scheduler`
batches continuously: a request joins the running decode at the next step and a finished row
frees its slot; else `serve_batcher` decodes the requests waiting together. Streams send tokens
as they are decoded (`openai_stream`); stop strings and clients that leave end their rows
early. Log-probs follow the backend's `logprobs_mode` (default: after temperature, before
top-k/top-p); with k alternatives (k > 0) the server runs one extra forward pass over
prompt + completion for them, under the same hold of the backend as the generation.
HTTP: `serve_http` (bodies always read or the connection closed; the optional API key).

Stdlib only (`http.server.ThreadingHTTPServer`).
Start in-process with `OpenAIServer(backend, port=0).start()`; `.url` gives the bound address.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from mmr_jax.rollout import base, vllm_engine
from mmr_jax.serving import openai_format as fmt
from mmr_jax.serving import (
    openai_params,
    openai_stream,
    serve_batcher,
    serve_http,
    serve_limits,
    slot_scheduler,
)

log = logging.getLogger(__name__)

HTTPError = fmt.HTTPError
Finished = serve_batcher.Finished
parse_completion_request = openai_params.parse_completion_request


class Backend(Protocol):
    """What the server needs from a model host (see `serve_backend.EmbeddedBackend`)."""

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
        """A decode in progress, as `sampler.start`'s `Sampling` (or `serve_batcher.Finished`
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
      limits: what one request may ask (`serve_limits.Limits`).
      api_key: the key clients must send as `Authorization: Bearer <key>` (None: no key).
      weights_dir: turns the weight-reload and adapter routes on, for paths inside this folder
        (None: those routes answer 404).
      chunk_steps: decode steps between the batcher's hand-overs (stream chunks, early ends).
      gather_s: how long the batcher waits, once a request arrives, for others to join it.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        default_max_tokens: int | None = None,
        limits: serve_limits.Limits | None = None,
        api_key: str | None = None,
        weights_dir: str | os.PathLike | None = None,
        chunk_steps: int = 8,
        gather_s: float = 0.02,
    ):
        self.backend, self.default_max_tokens = backend, default_max_tokens
        self.limits, self.api_key = limits or serve_limits.Limits(), api_key or None
        self.weights_dir = None if weights_dir is None else os.path.realpath(weights_dir)
        self.batcher = slot_scheduler.batcher_for(
            backend, self.limits, chunk_steps=chunk_steps, gather_s=gather_s
        )
        self._http = serve_http.HTTPServer((host, port), serve_http.Handler)
        self._http.app = self
        self._thread: threading.Thread | None = None
        self.routes = {
            ("GET", "/health"): lambda body, conn: (200, None, None),
            ("GET", "/v1/models"): self._models,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/reset_prefix_cache"): lambda body, conn: (200, {"success": True}, None),
        }
        if self.weights_dir is not None:
            self.routes[("POST", "/collective_rpc")] = self._collective_rpc
            self.routes[("POST", "/v1/load_lora_adapter")] = self._load_lora
            self.routes[("POST", "/v1/unload_lora_adapter")] = self._unload_lora

    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> OpenAIServer:
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._http.serve_forever()

    def shutdown(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self.batcher.close()
        if self._thread is not None:
            self._thread.join(timeout=5)

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
            raise HTTPError(400, f"model must be a string, got {name!r}"[:200], param="model")
        if name is None or name == b.model_name or name in b.adapters():
            return name or b.model_name
        raise HTTPError(
            404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
        )

    def _reply(self, request: openai_params.Request, model: str, conn, *, chat: bool, body):
        """The reply of a parsed request: a JSON body, or a stream as tokens are decoded."""
        serve_limits.check(request, self.limits)
        job = self.batcher.submit(serve_batcher.Job(request, model))
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        meta = {
            "created": int(time.time()),
            "model": model,
            "prompt_tokens": sum(len(p) for p in request.prompts),
            "logprobs": request.logprobs is not None,
        }
        if request.stream:
            kind = "chat.completion.chunk" if chat else "text_completion"
            head = {"id": rid, "object": kind, "created": meta["created"], "model": model}
            chunks = openai_stream.stream(
                self.backend,
                job,
                conn.client_gone,
                head=head,
                chat=chat,
                as_ids=as_ids,
                include_usage=request.include_usage,
            )
            return 200, serve_http.sse(chunks, on_close=job.cancel), None
        try:
            choices = openai_stream.collect(self.backend, job, conn.client_gone, as_ids=as_ids)
        except ConnectionAbortedError:
            conn.close_connection = True
            return 499, None, None
        if chat:
            return 200, fmt.chat_response(choices, rid=rid, **meta), None
        token_ids = bool(body.get("return_token_ids"))
        return 200, fmt.completion_response(choices, rid=rid, token_ids=token_ids, **meta), None

    def _completions(self, body, conn):
        model = self._resolve_model(body.get("model"))
        request = openai_params.parse_completion_request(body, self.backend)
        return self._reply(request, model, conn, chat=False, body=body)

    def _chat(self, body, conn):
        model = self._resolve_model(body.get("model"))
        request = openai_params.parse_chat_request(
            body, self.backend, default_max_tokens=self.default_max_tokens
        )
        return self._reply(request, model, conn, chat=True, body=body)

    # ---- weight routes (with `weights_dir` only) -------------------------------------------------

    def _inside(self, path: Any, param: str) -> str:
        """`path` if it lies inside `weights_dir` (symlinks resolved), else a 400 that says
        nothing about whether it exists."""
        if not isinstance(path, str) or not path:
            raise HTTPError(400, f"{param} must be a path", param=param)
        real = os.path.realpath(path)
        if os.path.commonpath([real, self.weights_dir]) != self.weights_dir:
            raise HTTPError(
                400, f"{param} must lie inside the folder this server loads from", param=param
            )
        return path

    def _load(self, what: str, path: str, param: str, load) -> Any:
        """`load()`, with any failure a 400 that names the path but not the cause (logged)."""
        try:
            return load()
        except Exception:
            log.exception("loading %s from %s failed", what, path)
            raise HTTPError(
                400, f"could not load {what} from {path!r} (see the server log)", param=param
            ) from None

    def _collective_rpc(self, body, conn):
        method, args, kwargs = body.get("method"), body.get("args") or [], body.get("kwargs") or {}
        if not method:
            raise HTTPError(400, "Missing 'method' in request body")
        if method != vllm_engine.RELOAD_METHOD:
            raise HTTPError(400, f"unknown collective_rpc method {str(method)[:64]!r}")
        if not isinstance(args, list) or not isinstance(kwargs, dict) or len(args) > 1:
            raise HTTPError(400, "args must be a list of at most one path, kwargs an object")
        if set(kwargs) - {"weights_path"} or (args and kwargs):
            raise HTTPError(400, "reload takes one argument, weights_path")
        path = self._inside(args[0] if args else kwargs.get("weights_path"), "weights_path")
        result = self._load(
            "weights",
            path,
            "weights_path",
            lambda: self.backend.collective_rpc(method, [], {"weights_path": path}),
        )
        return 200, {"results": [result]}, None

    def _load_lora(self, body, conn):
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path or not isinstance(name, str):
            raise HTTPError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.backend.adapters():
            raise HTTPError(400, f"The lora adapter '{name}' has already been loaded.")
        path = self._inside(path, "lora_path")
        self._load(
            "a LoRA adapter", path, "lora_path", lambda: self.backend.load_adapter(name, path)
        )
        return 200, None, f"Success: LoRA adapter '{name}' added successfully."

    def _unload_lora(self, body, conn):
        name = body.get("lora_name")
        if not isinstance(name, str) or name not in self.backend.adapters():
            raise HTTPError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name")
        self.backend.unload_adapter(name)
        return 200, None, f"Success: LoRA adapter '{name}' removed successfully."
