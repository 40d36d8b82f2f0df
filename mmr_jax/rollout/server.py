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
  POST /collective_rpc            {"method", "args", "kwargs"} -> {"results": [one per worker]}
  POST /reset_prefix_cache        -> {"success": true}
  POST /v1/load_lora_adapter      {"lora_name", "lora_path"}
  POST /v1/unload_lora_adapter    {"lora_name"}
Bodies and stream chunks: `openai_format`; request parsing and what is refused: `openai_params`
(echo, best_of > 1, beam search, tools, and any sampling control this sampler does not apply when
set to a value that would change the output are HTTP 400: a request is answered as asked or
refused, never answered as if a parameter were absent). Errors are OpenAI's shape,
{"error": {"message", "type", "param", "code"}}: unknown model 404 `model_not_found`, a prompt
over the context 400 `context_length_exceeded`, malformed JSON or bad parameters 400.

Streaming (`stream=true`) sends server-sent events after the whole batch is generated: the
sampler's decode loop runs on the device under one jit, so tokens are not seen as they are made.
Stop strings are applied to the finished text (the sampler still runs to a stop token or
max_tokens). Log-probs follow `base`'s convention (after temperature, before top-k/top-p); with k
alternatives (k > 0) the server runs one extra forward pass over prompt + completion for them.

Stdlib only (`http.server.ThreadingHTTPServer`); the backend serialises generation itself.
Start in-process with `OpenAIServer(backend, port=0).start()`; `.url` gives the bound address.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

import numpy as np

from mmr_jax.rollout import base, openai_choices, openai_params
from mmr_jax.rollout import openai_format as fmt

log = logging.getLogger(__name__)

HTTPError = fmt.HTTPError
parse_completion_request = openai_params.parse_completion_request


class Backend(Protocol):
    """What the server needs from a model host (see `serve_backend.EmbeddedBackend`)."""

    model_name: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: base.SamplingParams,
        *,
        model: str,
        ignore_eos: bool,
    ) -> base.RolloutBatch: ...

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


class _Stream:
    """A route's reply sent as server-sent events (already encoded)."""

    def __init__(self, events: Iterable[bytes]):
        self.events = events


def _sse(chunks: Iterable[dict]) -> _Stream:
    def events():
        for chunk in chunks:
            yield fmt.sse(chunk)
        yield fmt.SSE_DONE

    return _Stream(events())


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt_, *args):
        log.debug("%s %s", self.address_string(), fmt_ % args)

    def _send(self, status: int, payload: Any = None, text: str | None = None) -> None:
        data = b"" if payload is None else json.dumps(payload).encode()
        ctype = "application/json"
        if text is not None:
            data, ctype = text.encode(), "text/plain; charset=utf-8"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_stream(self, stream: _Stream) -> None:
        """Server-sent events in HTTP/1.1 chunked transfer encoding, one chunk per event."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for event in stream.events:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            log.info("client left during a stream")
            self.close_connection = True

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        try:
            body = json.loads(raw or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HTTPError(
                400, f"We could not parse the JSON body of your request: {e}", code="invalid_json"
            ) from e
        if not isinstance(body, dict):
            raise HTTPError(400, "request body must be a JSON object", code="invalid_json")
        return body

    def _dispatch(self, method: str) -> None:
        route = self.path.split("?", 1)[0]
        handler = self.server.app.routes.get((method, route))
        try:
            if handler is None:
                raise HTTPError(404, f"Invalid URL ({method} {route})")
            body = self._body() if method == "POST" else {}
            status, payload, text = handler(body)
        except HTTPError as e:
            status, payload, text = e.status, e.payload(), None
        except Exception as e:
            log.exception("error serving %s %s", method, route)
            status, text = 500, None
            payload = fmt.error_payload(
                f"{type(e).__name__}: {e}", kind="server_error", param=None, code=None
            )
        if isinstance(payload, _Stream):
            self._send_stream(payload)
        else:
            self._send(status, payload, text)

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    app: OpenAIServer


class OpenAIServer:
    """The routes above over `backend`, on (host, port); port 0 picks a free port.
    `default_max_tokens`: a chat request's limit when it sets none (None: the context's room)."""

    def __init__(
        self,
        backend: Backend,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        default_max_tokens: int | None = None,
    ):
        self.backend, self.default_max_tokens = backend, default_max_tokens
        self._http = _HTTPServer((host, port), _Handler)
        self._http.app = self
        self._thread: threading.Thread | None = None
        self.routes = {
            ("GET", "/health"): lambda body: (200, None, None),
            ("GET", "/v1/models"): self._models,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/collective_rpc"): self._collective_rpc,
            ("POST", "/reset_prefix_cache"): lambda body: (200, {"success": True}, None),
            ("POST", "/v1/load_lora_adapter"): self._load_lora,
            ("POST", "/v1/unload_lora_adapter"): self._unload_lora,
        }

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
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.shutdown()

    # ---- routes ----------------------------------------------------------------------------------

    def _models(self, body):
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

    def _resolve_model(self, name: str | None) -> str:
        b = self.backend
        if name is None or name == b.model_name or name in b.adapters():
            return name or b.model_name
        raise HTTPError(
            404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
        )

    def _generate(self, request: openai_params.Request, model: str, *, as_ids: bool = False):
        """(choices, the reply's common fields) of `request`, generated in full."""
        batch = self.backend.generate(
            request.prompts, request.params, model=model, ignore_eos=request.ignore_eos
        )
        tops = None
        if request.logprobs:
            n = request.params.n
            sequences = [
                (request.prompts[r // n], batch.completion_ids(r // n, r % n))
                for r in range(len(request.prompts) * n)
            ]
            temperature = request.params.temperature or 1.0  # greedy: untempered, as the sampler
            tops = self.backend.top_logprobs(
                sequences, request.logprobs, temperature=temperature, model=model
            )
        choices = openai_choices.build_choices(self.backend, request, batch, tops, as_ids=as_ids)
        meta = {
            "created": int(time.time()),
            "model": model,
            "prompt_tokens": sum(len(p) for p in request.prompts),
            "logprobs": request.logprobs is not None,
        }
        return choices, meta

    def _completions(self, body):
        model = self._resolve_model(body.get("model"))
        request = openai_params.parse_completion_request(body, self.backend)
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        choices, meta = self._generate(request, model, as_ids=as_ids)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if request.stream:
            chunks = fmt.completion_chunks(
                choices, rid=rid, include_usage=request.include_usage, **meta
            )
            return 200, _sse(chunks), None
        token_ids = bool(body.get("return_token_ids"))
        return 200, fmt.completion_response(choices, rid=rid, token_ids=token_ids, **meta), None

    def _chat(self, body):
        model = self._resolve_model(body.get("model"))
        request = openai_params.parse_chat_request(
            body, self.backend, default_max_tokens=self.default_max_tokens
        )
        choices, meta = self._generate(request, model)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if request.stream:
            chunks = fmt.chat_chunks(choices, rid=rid, include_usage=request.include_usage, **meta)
            return 200, _sse(chunks), None
        return 200, fmt.chat_response(choices, rid=rid, **meta), None

    def _collective_rpc(self, body):
        method = body.get("method")
        if not method:
            raise HTTPError(400, "Missing 'method' in request body")
        result = self.backend.collective_rpc(
            method, body.get("args") or [], body.get("kwargs") or {}
        )
        return 200, {"results": [result]}, None

    def _load_lora(self, body):
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            raise HTTPError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.backend.adapters():
            raise HTTPError(400, f"The lora adapter '{name}' has already been loaded.")
        self.backend.load_adapter(name, path)
        return 200, None, f"Success: LoRA adapter '{name}' added successfully."

    def _unload_lora(self, body):
        name = body.get("lora_name")
        if name not in self.backend.adapters():
            raise HTTPError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name")
        self.backend.unload_adapter(name)
        return 200, None, f"Success: LoRA adapter '{name}' removed successfully."
