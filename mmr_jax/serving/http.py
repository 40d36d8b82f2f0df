"""The HTTP side of `server.OpenAIServer`: requests read whole and bounded, the key checked,
replies and server-sent-event streams written (stdlib `http.server`, HTTP/1.1 keep-alive).

Every request's body is read before it is answered, whatever the route or the error, so the
next request on a kept-alive connection (the `openai` client reuses them) starts where it should;
a body that cannot be read that way (Content-Length missing with chunked transfer encoding,
invalid, negative, repeated with different values, over `max_body_bytes`, or shorter than it
says) is answered 400 and the connection closed. With an API key, every route but /health needs
`Authorization: Bearer <key>` (401 otherwise), as vLLM's `--api-key`. As vLLM's: a POST body
whose Content-Type is not application/json is a 400 (none given: read as JSON), a route asked
with the wrong method a 405, and a client that resets its connection is logged, not a traceback.
"""

from __future__ import annotations

import hmac
import json
import logging
import select
import socket
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from mmr_jax.serving import openai_format as fmt

log = logging.getLogger(__name__)

HTTPError = fmt.HTTPError
OPEN_ROUTES = ("/health", "/ping", "/version", "/metrics", "/load")  # no API key, as vLLM's
NO_BODY_ROUTES = ("/ping",)  # POST routes that take no JSON body
READ_TIMEOUT_S = 300  # a connection idle (or stalled mid-request) this long is closed


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


class Handler(BaseHTTPRequestHandler):
    server: HTTPServer
    protocol_version = "HTTP/1.1"
    timeout = READ_TIMEOUT_S

    def log_message(self, fmt_, *args):
        log.debug("%s %s", self.address_string(), fmt_ % args)

    def handle(self):
        try:
            super().handle()
        except (ConnectionResetError, BrokenPipeError, TimeoutError) as e:
            log.info("connection from %s ended: %s", self.address_string(), type(e).__name__)
            self.close_connection = True

    def _send(self, status: int, payload: Any = None, text: str | None = None, headers=()) -> None:
        data = b"" if payload is None else json.dumps(payload).encode()
        ctype = "application/json"
        if text is not None:
            data, ctype = text.encode(), "text/plain; charset=utf-8"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _send_stream(self, stream: Stream) -> None:
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
        finally:
            stream.events.close()
            stream.on_close()

    def client_gone(self) -> bool:
        """Whether the client closed its side (checked while a reply is generated)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _refuse_body(self, message: str) -> None:
        self.close_connection = True
        raise HTTPError(400, message, code="invalid_request_body")

    def _read_body(self) -> bytes:
        """The body, read in full, or a 400 (the connection then closes: it cannot be reused)."""
        if self.headers.get("Transfer-Encoding"):
            self._refuse_body("chunked request bodies are not supported: send Content-Length")
        values = set(self.headers.get_all("Content-Length") or [])
        if not values:
            return b""
        if len(values) > 1:
            self._refuse_body("conflicting Content-Length headers")
        (value,) = values
        if not value.strip().isdigit():
            self._refuse_body(f"invalid Content-Length {value[:32]!r}")
        size, limit = int(value), self.server.app.limits.max_body_bytes
        if size > limit:
            self.close_connection = True
            raise HTTPError(
                400,
                f"request body of {size} bytes exceeds this server's {limit} (--max_body_bytes)",
                code="request_too_large",
            )
        try:
            raw = self.rfile.read(size)
        except (TimeoutError, OSError):
            raw = b""
        if len(raw) != size:
            self._refuse_body("request body shorter than its Content-Length")
        return raw

    def _authorize(self, route: str) -> None:
        key = self.server.app.api_key
        if key is None or route in OPEN_ROUTES:
            return
        given = self.headers.get("Authorization") or ""
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise HTTPError(
                401, "Unauthorized: a valid API key is required", code="invalid_api_key"
            )

    def _check_json_type(self) -> None:
        """A body sent as anything but JSON is refused, as vLLM's `validate_json_request`."""
        ctype = self.headers.get("Content-Type")
        if ctype is not None and ctype.split(";", 1)[0].strip().lower() != "application/json":
            raise HTTPError(
                400,
                f"Unsupported Media Type {ctype[:64]!r}: only 'application/json' is allowed",
                code="unsupported_media_type",
            )

    @staticmethod
    def _json(raw: bytes) -> dict:
        try:
            body = json.loads(raw or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise HTTPError(
                400, f"We could not parse the JSON body of your request: {e}", code="invalid_json"
            ) from e
        if not isinstance(body, dict):
            raise HTTPError(400, "request body must be a JSON object", code="invalid_json")
        return body

    def _dispatch(self, method: str) -> None:
        route = self.path.split("?", 1)[0]
        headers = ()
        try:
            raw = self._read_body()
            self._authorize(route)
            routes = self.server.app.routes
            handler = routes.get((method, route))
            if handler is None:
                allowed = sorted(m for m, r in routes if r == route)
                if allowed:
                    headers = (("Allow", ", ".join(allowed)),)
                    raise HTTPError(405, f"Method Not Allowed ({method} {route})")
                raise HTTPError(404, f"Invalid URL ({method} {route})")
            body = {}
            if method == "POST" and route not in NO_BODY_ROUTES:
                self._check_json_type()
                body = self._json(raw)
            status, payload, text = handler(body, self)
        except HTTPError as e:
            status, payload, text = e.status, e.payload(), None
        except Exception as e:
            log.exception("error serving %s %s", method, route)
            status, text = 500, None
            payload = fmt.error_payload(
                f"{type(e).__name__}: {e}", kind="server_error", param=None, code=None
            )
        if isinstance(payload, Stream):
            self._send_stream(payload)
            return
        try:
            self._send(status, payload, text, headers)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_DELETE(self):
        self._dispatch("DELETE")


class HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    # socketserver's listen backlog is 5: 16 clients connecting at once had connections refused.
    request_queue_size = 1024
    app: Any  # the `server.OpenAIServer`
