"""The ASGI gate in front of the API: what a request must pass before the app reads it.

In order: 503 with ``Retry-After`` once the server drains (SIGTERM), 401 without the API key
(``/health``, ``/metrics``, ``/version`` stay open), 413 for a body over ``max_body`` bytes
(from ``Content-Length`` before reading a byte, else counted while reading). The gate counts
the requests it lets through until their responses end: the drain waits for them.
"""

from __future__ import annotations

import math
import time

from starlette.responses import JSONResponse

from jaxkv.server.protocol import error_body

OPEN_PATHS = ("/health", "/metrics", "/version")
DEFAULT_MAX_BODY = 4 * 2**20


def error_response(status: int, message: str, kind: str, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    """An error in OpenAI's schema (``protocol.error_body``)."""
    return JSONResponse(error_body(message, kind, status, param), status_code=status,
                        headers=headers)


class Gate:
    """ASGI middleware: drain, API key and body size (module docstring).

    Args:
      app: the ASGI app behind the gate.
      api_key: the bearer token the API routes require (None: open).
      max_body: the largest request body accepted, in bytes.

    Attributes:
      drain_deadline: ``time.monotonic()`` at which the drain ends (None: not draining).
      in_flight: requests let through whose responses have not ended.
    """

    def __init__(self, app, api_key: str | None = None, max_body: int = DEFAULT_MAX_BODY):
        self.app = app
        self.api_key = api_key
        self.max_body = max_body
        self.drain_deadline: float | None = None
        self.in_flight = 0

    def start_draining(self, timeout: float) -> None:
        self.drain_deadline = time.monotonic() + timeout

    @property
    def draining(self) -> bool:
        return self.drain_deadline is not None

    def drain_left(self) -> float:
        """Seconds until the drain ends."""
        return self.drain_deadline - time.monotonic()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._refusal(scope)
        if refusal is None:
            body = await _read_body(receive, self.max_body)
            if body is None:
                refusal = _too_large(f"the request body exceeds this server's limit of "
                                     f"{self.max_body} bytes (--max-request-bytes)")
        if refusal is not None:
            return await refusal(scope, receive, send)
        self.in_flight += 1
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.in_flight -= 1

    def _refusal(self, scope) -> JSONResponse | None:
        """The answer to a request refused before its body is read, or None."""
        if self.draining:
            retry = str(max(1, math.ceil(self.drain_left())))
            return error_response(503, "the server is shutting down", "ServiceUnavailableError",
                                  headers={"Retry-After": retry})
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"] not in OPEN_PATHS and \
                headers.get(b"authorization") != f"Bearer {self.api_key}".encode():
            return error_response(401, "invalid or missing API key", "AuthenticationError")
        size = int(headers.get(b"content-length", 0))
        if size > self.max_body:
            return _too_large(f"the request body is {size} bytes, over this server's limit of "
                              f"{self.max_body} bytes (--max-request-bytes)")
        return None


def _too_large(message: str) -> JSONResponse:
    return error_response(413, message, "RequestTooLargeError")


async def _read_body(receive, limit: int) -> dict | None:
    """The request's body as one ``http.request`` message (a disconnect as itself), or None as
    soon as it exceeds ``limit`` bytes (uvicorn discards the rest after the response)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return message
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            return None
        if not message.get("more_body", False):
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}


def _replay(first: dict, receive):
    """``receive`` that returns ``first`` once, then what ``receive`` returns."""
    pending = [first]

    async def replayed():
        return pending.pop() if pending else await receive()
    return replayed
