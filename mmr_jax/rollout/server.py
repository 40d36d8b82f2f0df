"""OpenAI-compatible HTTP server with vLLM's request/response shapes, over any `Backend`.

Routes (those of vLLM 0.33 that the rollout client, weight sync and evaluation use):
  GET  /health, /v1/models
  POST /v1/completions            token-id or text prompts, n, seed, max_tokens, temperature, top_p,
                                  top_k, stop_token_ids, ignore_eos, logprobs, return_token_ids,
                                  return_tokens_as_token_ids; choices prompt-major (index b * n + i)
  POST /collective_rpc            {"method", "args", "kwargs"} -> {"results": [one per worker]}
  POST /reset_prefix_cache        -> {"success": true}
  POST /v1/load_lora_adapter      {"lora_name", "lora_path"}
  POST /v1/unload_lora_adapter    {"lora_name"}
Not supported (HTTP 400): streaming, echo, stop strings, best_of > 1, beam search, and any
sampling control this sampler does not apply when set to a value that would change the output
(repetition/presence/frequency penalties, min_p, logit_bias, min_tokens): a request is answered
as asked or refused, never answered as if a parameter were absent. `logprobs=k` returns the
sampled token's log-prob only (top_logprobs holds that one entry), whatever k.

Stdlib only (`http.server.ThreadingHTTPServer`); the backend serialises generation itself.
Start in-process with `OpenAIServer(backend, port=0).start()`; `.url` gives the bound address.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from mmr_jax.rollout import base

log = logging.getLogger(__name__)


class HTTPError(Exception):
    """An error answered as vLLM does: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


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

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_strings(self, ids: Sequence[int]) -> list[str]: ...

    def adapters(self) -> dict[str, str]: ...

    def load_adapter(self, name: str, path: str) -> None: ...

    def unload_adapter(self, name: str) -> None: ...

    def collective_rpc(self, method: str, args: list, kwargs: dict) -> Any: ...


_UNSUPPORTED = {
    "stream": "streaming",
    "echo": "echo",
    "use_beam_search": "beam search",
    "suffix": "suffix",
    "prompt_embeds": "prompt_embeds",
}

# Sampling controls the embedded sampler does not apply: accepted only at their neutral value.
_NEUTRAL = {
    "best_of": (None, 1),
    "repetition_penalty": (None, 1, 1.0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "min_p": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "min_tokens": (None, 0),
}


def _seed(body: dict) -> int | None:
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise HTTPError(400, f"seed must be an integer, got {seed!r}", param="seed")
    return seed


def _prompts(body: dict, backend: Backend) -> list[list[int]]:
    prompt = body.get("prompt")
    add_special = bool(body.get("add_special_tokens", True))
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise HTTPError(
            400, "prompt must be a string, a list of strings or token ids", param="prompt"
        )
    if all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append(backend.encode(p, add_special_tokens=add_special))
        elif isinstance(p, list) and all(isinstance(t, int) and t >= 0 for t in p):
            out.append(list(p))
        else:
            raise HTTPError(400, "mixed or invalid prompt list", param="prompt")
        if not out[-1]:
            raise HTTPError(400, "empty prompt", param="prompt")
    return out


def parse_completion_request(
    body: dict, backend: Backend
) -> tuple[list[list[int]], base.SamplingParams]:
    """(prompt ids, SamplingParams) of a /v1/completions body; HTTPError 400 when invalid."""
    for key, what in _UNSUPPORTED.items():
        if body.get(key):
            raise HTTPError(400, f"{what} is not supported by this server", param=key)
    for key, neutral in _NEUTRAL.items():
        if body.get(key) not in neutral:
            raise HTTPError(400, f"{key}={body[key]!r} is not supported by this server", param=key)
    if body.get("stop"):
        raise HTTPError(400, "stop strings are not supported; use stop_token_ids", param="stop")
    prompts = _prompts(body, backend)
    temperature = body.get("temperature")
    top_k = body.get("top_k")
    try:
        params = base.SamplingParams(
            max_new_tokens=int(body.get("max_tokens") or 16),
            temperature=1.0 if temperature is None else float(temperature),
            top_p=float(body.get("top_p") if body.get("top_p") is not None else 1.0),
            top_k=0 if top_k is None or int(top_k) < 0 else int(top_k),
            n=int(body.get("n") or 1),
            stop_token_ids=tuple(body.get("stop_token_ids") or ()),
            seed=_seed(body),
        )
    except (TypeError, ValueError) as e:
        raise HTTPError(400, f"invalid sampling parameters: {e}") from e
    longest = max(len(p) for p in prompts)
    if longest + params.max_new_tokens > backend.max_model_len:
        raise HTTPError(
            400,
            f"This model's maximum context length is {backend.max_model_len} tokens; the request "
            f"has {longest} prompt tokens and max_tokens={params.max_new_tokens}",
            param="max_tokens",
        )
    return prompts, params


def _logprobs_obj(backend, ids, logps, as_ids: bool) -> dict:
    tokens = [f"token_id:{t}" for t in ids] if as_ids else backend.token_strings(ids)
    offsets, pos = [], 0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {
        "text_offset": offsets,
        "token_logprobs": [float(x) for x in logps],
        "tokens": tokens,
        "top_logprobs": [{s: float(x)} for s, x in zip(tokens, logps, strict=True)],
    }


def completion_response(
    body: dict,
    backend: Backend,
    prompts,
    params: base.SamplingParams,
    batch: base.RolloutBatch,
    model: str,
) -> dict:
    """The vLLM /v1/completions reply for `batch` (choices prompt-major)."""
    choices = []
    eos = set(backend.eos_token_ids)
    for b, prompt in enumerate(prompts):
        for i in range(params.n):
            ids = batch.completion_ids(b, i)
            logps = batch.logprobs[b, i, : len(ids)].tolist()
            reason = batch.finish_reasons[b][i]
            stop_reason = None
            text_ids = ids
            if reason == base.FINISH_STOP and ids:
                text_ids = ids[:-1]
                if ids[-1] not in eos:
                    stop_reason = ids[-1]
            choice = {
                "index": len(choices),
                "text": backend.decode(text_ids),
                "logprobs": None,
                "finish_reason": reason,
                "stop_reason": stop_reason,
                "token_ids": ids if body.get("return_token_ids") else None,
                "prompt_logprobs": None,
                "prompt_token_ids": prompt if body.get("return_token_ids") else None,
            }
            if body.get("logprobs") is not None:
                choice["logprobs"] = _logprobs_obj(
                    backend, ids, logps, bool(body.get("return_tokens_as_token_ids"))
                )
            choices.append(choice)
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = int(batch.mask.sum())
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        log.debug("%s %s", self.address_string(), fmt % args)

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

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError as e:
            raise HTTPError(400, f"JSON decode error: {e}") from e
        if not isinstance(body, dict):
            raise HTTPError(400, "request body must be a JSON object")
        return body

    def _dispatch(self, method: str) -> None:
        route = self.path.split("?", 1)[0]
        handler = self.server.app.routes.get((method, route))
        try:
            if handler is None:
                raise HTTPError(404, f"no route {method} {route}")
            body = self._body() if method == "POST" else {}
            status, payload, text = handler(body)
        except HTTPError as e:
            status, text = e.status, None
            payload = {
                "error": {
                    "message": e.message,
                    "type": HTTPStatus(e.status).phrase.replace(" ", "") + "Error",
                    "param": e.param,
                    "code": e.status,
                }
            }
        except Exception as e:
            log.exception("error serving %s %s", method, route)
            status, text = 500, None
            payload = {
                "error": {
                    "message": f"{type(e).__name__}: {e}",
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                }
            }
        self._send(status, payload, text)

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    app: OpenAIServer


class OpenAIServer:
    """The routes above over `backend`, on (host, port); port 0 picks a free port."""

    def __init__(self, backend: Backend, *, host: str = "127.0.0.1", port: int = 0):
        self.backend = backend
        self._http = _HTTPServer((host, port), _Handler)
        self._http.app = self
        self._thread: threading.Thread | None = None
        self.routes = {
            ("GET", "/health"): lambda body: (200, None, None),
            ("GET", "/v1/models"): self._models,
            ("POST", "/v1/completions"): self._completions,
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
        raise HTTPError(404, f"The model `{name}` does not exist.", param="model")

    def _completions(self, body):
        model = self._resolve_model(body.get("model"))
        prompts, params = parse_completion_request(body, self.backend)
        batch = self.backend.generate(
            prompts, params, model=model, ignore_eos=bool(body.get("ignore_eos"))
        )
        return 200, completion_response(body, self.backend, prompts, params, batch, model), None

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
