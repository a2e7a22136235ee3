"""Refuse request bodies over a size limit with 413, before they are read into memory.

Checks `Content-Length` up front, and counts bytes as they stream for chunked bodies. Pure ASGI; a
request that is not chunked (no body, or one bounded by its `Content-Length`, which the HTTP parser
enforces) passes straight through, without wrapping `receive` and `send` (most requests: each
wrapper cost every request a frame per ASGI message).
"""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import BODY_TOO_LARGE, send_problem


class _TooLarge(BaseException):  # noqa: N818
    """BaseException, so that body parsers' `except Exception` cannot turn it into a 400."""


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _refuse(self, send: Send) -> None:
        await send_problem(send, *BODY_TOO_LARGE, f"request body larger than {self.max_bytes} bytes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunked = False
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    too_big = True
                if too_big:
                    await self._refuse(send)
                    return
            elif name == b"transfer-encoding":
                chunked = True  # HTTP/1.1: the body's length is then unknown (Content-Length ignored)
        if not chunked:
            await self.app(scope, receive, send)
            return
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._refuse(send)


def install(app: Any, max_bytes: int) -> None:
    app.add_middleware(BodySizeLimit, max_bytes=max_bytes)
