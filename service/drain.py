"""Errors every client can read: the rest of a request body is read before the response goes out.

A response decided before the body was consumed (401 for a missing key, 413 ``too_many_images`` after the
parser stopped, ...) used to go out while the client was still sending; the server then closed the
connection with unread data and the client's TCP stack saw a reset. curl shows the 413 anyway, but
Python's ``urllib`` and ``requests`` report "connection reset" and never see the error. This middleware
reads (and drops) what is left of the body, up to the body-size limit, before the response starts.
A body declared larger than the limit is read up to the limit only: past it the connection may still be
reset, which is the price of not reading unbounded input.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class DrainBody:
    """ASGI middleware (outside ``BodySizeLimit``): drain the unread request body before answering."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = Headers(scope=scope) if scope["type"] == "http" else None
        if headers is None or ("content-length" not in headers and "transfer-encoding" not in headers):
            await self.app(scope, receive, send)  # no body to drain (a GET, a websocket)
            return
        received, done = 0, False

        async def counting() -> Message:
            nonlocal received, done
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                done = not message.get("more_body", False)
            elif message["type"] == "http.disconnect":
                done = True
            return message

        async def draining_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                while not done and received <= self.max_bytes:
                    await counting()
            await send(message)

        await self.app(scope, counting, draining_send)
