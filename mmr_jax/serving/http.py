"""The HTTP side of `server.OpenAIServer` on Starlette and uvicorn, vLLM's server stack: routes,
bodies read bounded, the API key checked, replies and server-sent-event streams written.

uvicorn speaks HTTP/1.1 (Content-Length and chunked bodies, keep-alive, a malformed request a
400 that closes the connection) and Starlette routes (a route asked with the wrong method is a
405 with `Allow`, as vLLM's; an unknown one a 404), both answered in OpenAI's error shape. The
route handlers block (they wait for the batcher), so each runs in a worker thread; a task
meanwhile listens for the client leaving, which the handler sees as `Connection.client_gone()`
(it cancels the generation). A body over `max_body_bytes` (declared or as sent), or one that
stalls for `READ_TIMEOUT_S`, is a 400 that closes the connection. With an API key, every route
but the open ones needs `Authorization: Bearer <key>` (401 otherwise), as vLLM's `--api-key`.
As vLLM's: a POST body whose Content-Type is not application/json is a 400 (none given: read as
JSON), and a client that resets its connection is not a traceback.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as RoutingError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from mmr_jax.serving import openai_format as fmt

log = logging.getLogger(__name__)

HTTPError = fmt.HTTPError
OPEN_ROUTES = ("/health", "/ping", "/version", "/metrics", "/load")  # no API key, as vLLM's
NO_BODY_ROUTES = ("/ping",)  # POST routes that take no JSON body
READ_TIMEOUT_S = 300  # a body stalled this long is refused; an idle kept-alive connection closed
# A handler holds its worker thread while its request is in flight (one per request, as the
# thread-per-connection server before): anyio's default of 40 would queue requests the batcher
# could have taken.
WORKER_THREADS = 1024
Handler = Callable[[dict, "Connection"], tuple[int, Any, "str | None"]]


class Stream:
    """A route's reply sent as server-sent events (already encoded); `on_close()` runs when the
    stream ends, finished or not (a client that left: it cancels the generation)."""

    def __init__(self, events: Iterator[bytes], on_close=lambda: None):
        self.events, self.on_close = events, on_close


def sse(chunks: Iterator[dict], on_close=lambda: None) -> Stream:
    def events():
        try:
            for chunk in chunks:
                yield fmt.sse(chunk)
        except ConnectionAbortedError:
            return
        except Exception as e:  # after the 200: the error goes in the stream, as vLLM's
            log.exception("error while streaming")
            payload = fmt.error_payload(
                f"{type(e).__name__}: {e}", kind="server_error", param=None, code=None
            )
            yield fmt.sse(payload)
        yield fmt.SSE_DONE

    return Stream(events(), on_close)


class Connection:
    """What a route handler sees of its client: whether it left (set by the listening task),
    and whether the connection is to close after the reply."""

    def __init__(self):
        self.gone = threading.Event()
        self.close_connection = False

    def client_gone(self) -> bool:
        return self.gone.is_set()


def _json_response(status: int, payload: Any, *, close: bool = False, headers=None) -> Response:
    headers = {**(headers or {}), **({"Connection": "close"} if close else {})}
    data = b"" if payload is None else json.dumps(payload).encode()
    return Response(data, status, headers=headers, media_type="application/json")


def _check_json_type(headers: Headers) -> None:
    """A body sent as anything but JSON is refused, as vLLM's `validate_json_request`."""
    ctype = headers.get("content-type")
    if ctype is not None and ctype.split(";", 1)[0].strip().lower() != "application/json":
        raise HTTPError(
            400,
            f"Unsupported Media Type {ctype[:64]!r}: only 'application/json' is allowed",
            code="unsupported_media_type",
        )


def _parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise HTTPError(
            400, f"We could not parse the JSON body of your request: {e}", code="invalid_json"
        ) from e
    if not isinstance(body, dict):
        raise HTTPError(400, "request body must be a JSON object", code="invalid_json")
    return body


async def _read_body(request: Request, limit: int, conn: Connection) -> bytes:
    """The body, or a 400 that closes the connection (over `limit`, or stalled)."""

    def too_large(size: int | str):
        conn.close_connection = True
        return HTTPError(
            400,
            f"request body of {size} bytes exceeds this server's {limit} (--max_body_bytes)",
            code="request_too_large",
        )

    declared = request.headers.get("content-length")  # uvicorn checked it is one number
    if declared is not None and int(declared) > limit:
        raise too_large(int(declared))
    parts, size = [], 0
    try:
        with anyio.fail_after(READ_TIMEOUT_S):
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise too_large(f"more than {limit}")
                parts.append(part)
    except TimeoutError:
        conn.close_connection = True
        raise HTTPError(
            400, "request body stalled before its end", code="invalid_request_body"
        ) from None
    return b"".join(parts)


async def _listen_for_disconnect(receive, gone: threading.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


class _Endpoint:
    """One path's handlers by method, as an ASGI app: the body read and parsed, the handler run
    in a worker thread while a task listens for the client leaving, the reply sent."""

    def __init__(self, http: HTTP, path: str, handlers: dict[str, Handler]):
        self.http, self.path, self.handlers = http, path, handlers

    async def __call__(self, scope, receive, send) -> None:
        request, conn = Request(scope, receive), Connection()
        method = "GET" if scope["method"] == "HEAD" else scope["method"]
        try:
            raw = await _read_body(request, self.http.max_body_bytes, conn)
            body = {}
            if method == "POST" and self.path not in NO_BODY_ROUTES:
                _check_json_type(request.headers)
                body = _parse_json(raw)
        except HTTPError as e:
            await _json_response(e.status, e.payload(), close=conn.close_connection)(
                scope, receive, send
            )
            return
        except ClientDisconnect:
            return
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(_listen_for_disconnect, receive, conn.gone)
            reply = await self.http.in_thread(self._answer, self.handlers[method], body, conn)
            if isinstance(reply, Stream):
                await self._stream(reply, send)
            else:
                await reply(scope, receive, send)
            tasks.cancel_scope.cancel()

    def _answer(self, handler: Handler, body: dict, conn: Connection) -> Response | Stream:
        try:
            status, payload, text = handler(body, conn)
        except HTTPError as e:
            status, payload, text = e.status, e.payload(), None
        except Exception as e:
            log.exception("error serving %s", self.path)
            status, text = 500, None
            payload = fmt.error_payload(
                f"{type(e).__name__}: {e}", kind="server_error", param=None, code=None
            )
        if isinstance(payload, Stream):
            return payload
        if text is not None:
            return Response(text, status, media_type="text/plain; charset=utf-8")
        return _json_response(status, payload, close=conn.close_connection)

    async def _stream(self, stream: Stream, send) -> None:
        """Server-sent events, one body message (an HTTP/1.1 chunk) per event."""
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
        ]
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            while (event := await self.http.in_thread(next, stream.events, None)) is not None:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        except OSError:
            log.info("client left during a stream")
        finally:
            with anyio.CancelScope(shield=True):
                await self.http.in_thread(lambda: (stream.events.close(), stream.on_close()))


async def _routing_error(request: Request, exc: RoutingError) -> Response:
    """Starlette's 404 and 405 in OpenAI's error shape (405 with its `Allow` header)."""
    what = f"({request.method} {request.url.path})"
    message = f"Method Not Allowed {what}" if exc.status_code == 405 else f"Invalid URL {what}"
    payload = HTTPError(exc.status_code, message).payload()
    return _json_response(exc.status_code, payload, headers=exc.headers)


class _RequireKey:
    """vLLM's `--api-key`: every route but `OPEN_ROUTES` needs `Authorization: Bearer <key>`."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_ROUTES:
            given = Headers(scope=scope).get("authorization", "").encode()
            if not hmac.compare_digest(given, self.expected):
                message = "Unauthorized: a valid API key is required"
                payload = HTTPError(401, message, code="invalid_api_key").payload()
                await _json_response(401, payload)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class HTTP:
    """`routes` ({(method, path): handler}) served on (host, port) by uvicorn; port 0 picks a
    free port (bound here, so `address` is known before `serve_forever`)."""

    def __init__(self, routes: dict[tuple[str, str], Handler], *, host: str, port: int,
                 api_key: str | None, max_body_bytes: int):  # fmt: skip
        self.max_body_bytes = max_body_bytes
        by_path: dict[str, dict[str, Handler]] = {}
        for (method, path), handler in routes.items():
            by_path.setdefault(path, {})[method] = handler
        app = Starlette(
            routes=[Route(p, _Endpoint(self, p, h), methods=list(h)) for p, h in by_path.items()],
            exception_handlers={RoutingError: _routing_error},
        )
        asgi = app if api_key is None else _RequireKey(app, api_key)
        self.socket = socket.create_server((host, port), backlog=1024)
        config = uvicorn.Config(
            asgi,
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_keep_alive=READ_TIMEOUT_S,
            timeout_graceful_shutdown=5,  # open streams are not waited for longer on shutdown
            backlog=1024,
        )
        self.server = uvicorn.Server(config)
        self._limiter: anyio.CapacityLimiter | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self.socket.getsockname()[:2]

    async def in_thread(self, fn, *args):
        if self._limiter is None:  # made on the server's event loop
            self._limiter = anyio.CapacityLimiter(WORKER_THREADS)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    def serve_forever(self) -> None:
        """Serves until `stop()`; in the main thread, SIGINT and SIGTERM also stop it."""
        self.server.run(sockets=[self.socket])

    def stop(self) -> None:
        """Makes `serve_forever` return (safe from a signal handler: it does not wait)."""
        self.server.should_exit = True

    def close(self) -> None:
        self.socket.close()
