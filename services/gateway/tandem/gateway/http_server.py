"""The gateway's HTTP/1.1 connection protocol: uvicorn's httptools protocol plus
the limits uvicorn does not have.

Called by uvicorn, which builds one instance per connection from the class that
:func:`guarded_protocol` returns (``uvicorn.Config(http=...)`` in
:mod:`tandem.gateway.__main__`); calls uvicorn and httptools. Everything here
happens before a request reaches Starlette:

* **slow heads** (slow-loris): a request head must be complete
  ``header_timeout_s`` after its first byte, or after the connection opened;
  else 408 and the connection is closed (silently if it never sent a byte). An
  idle keep-alive connection is uvicorn's business (``keep_alive_timeout_s``);
* **slow bodies**: a body must be complete ``body_timeout_s`` after its head;
  else 408 (the handler sees a disconnect) and the connection is closed;
* **big heads**: httptools buffers a head of any size, so heads over
  ``max_header_bytes`` or with more than ``max_num_headers`` fields get 431;
* **too many connections**: each request on a connection beyond
  ``max_connections`` gets 503 ``too_many_connections`` (uvicorn's own
  ``limit_concurrency`` answers in plain text);
* **kernel buffers**: ``send_buffer_bytes``, when set, fixes each connection's
  send buffer, so that a client that stops reading is noticed by the stream's
  own bound (see :mod:`tandem.gateway.api.generation`) rather than after the
  kernel has absorbed MiBs;
* a request httptools cannot parse gets 400 in the OpenAI shape, not uvicorn's
  plain text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from tandem.gateway.api.errors import ApiError
from tandem.gateway.settings import HttpSettings

logger = logging.getLogger(__name__)

_CLOSE = {"Connection": "close"}


class _HeadRejectedError(Exception):
    """Raised inside an httptools callback to stop the parser; the error to answer with is on the protocol."""


class GuardedHttpProtocol(HttpToolsProtocol):
    """One client connection. The limits are a class attribute: uvicorn builds instances itself."""

    limits: ClassVar[HttpSettings] = HttpSettings()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: True while the bytes that arrive belong to a request head (or to the gap before one).
        self._awaiting_head = True
        #: Raw bytes received since the current head began; bounds what httptools buffers for a head
        #: that never completes.
        self._num_head_bytes_received = 0
        #: Size of the current head as parsed (URL and header fields), and its number of fields.
        self._num_head_bytes = 0
        self._num_headers = 0
        self._rejection: ApiError | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None

    # -- connection events -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.limits.send_buffer_bytes is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.limits.send_buffer_bytes)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        if self._awaiting_head:
            self._arm_head_timer()
            self._num_head_bytes_received += len(data)
        super().data_received(data)
        if (
            self._awaiting_head
            and self._num_head_bytes_received > self.limits.max_header_bytes
            and not self.transport.is_closing()
        ):
            self._reject_head(self._head_too_large())

    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this when httptools fails, which is also how a callback below stops the parser.
        error = self._rejection or ApiError(400, "Invalid HTTP request.", code="invalid_http_request", headers=_CLOSE)
        self._reject_head(error)

    # -- parser callbacks (httptools) --------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._num_head_bytes = 0
        self._num_headers = 0

    def on_url(self, url: bytes) -> None:
        self._count_head_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._num_headers += 1
        if self._num_headers > self.limits.max_num_headers:
            self._stop_parser(
                ApiError(
                    431,
                    f"The request has more than {self.limits.max_num_headers} header fields.",
                    code="too_many_headers",
                    headers=_CLOSE,
                )
            )
        self._count_head_bytes(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._awaiting_head = False
        self._cancel_head_timer()
        if len(self.connections) > self.limits.max_connections:
            logger.warning("too many connections", extra={"num_connections": len(self.connections)})
            app, self.app = self.app, _too_many_connections
            try:
                super().on_headers_complete()
            finally:
                self.app = app
        else:
            super().on_headers_complete()
        self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._cancel_body_timer()
        self._awaiting_head = True
        self._num_head_bytes_received = 0

    # -- limits ------------------------------------------------------------------------------------

    def _count_head_bytes(self, num_bytes: int) -> None:
        self._num_head_bytes += num_bytes
        if self._num_head_bytes > self.limits.max_header_bytes:
            self._stop_parser(self._head_too_large())

    def _head_too_large(self) -> ApiError:
        return ApiError(
            431,
            f"The request head (request line and headers) is larger than {self.limits.max_header_bytes} bytes.",
            code="request_header_too_large",
            headers=_CLOSE,
        )

    def _stop_parser(self, error: ApiError) -> None:
        self._rejection = error
        raise _HeadRejectedError(error.message)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._awaiting_head or self.transport.is_closing():
            return
        busy = self.cycle is not None and not self.cycle.response_complete
        if self._num_head_bytes_received == 0 or busy:
            # Nothing to answer (a connection that never spoke), or a response is still being written.
            logger.info("connection closed: request head timed out", extra={"client": _address(self.client)})
            self.transport.close()
            return
        self._reject_head(
            ApiError(
                408,
                f"The request head was not complete within {self.limits.header_timeout_s} s.",
                code="request_timeout",
                headers=_CLOSE,
            )
        )

    def _body_timed_out(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if cycle is None or not cycle.more_body or self.transport.is_closing():
            return
        logger.info("request body timed out", extra={"client": _address(self.client)})
        if cycle.response_started:
            self.transport.close()
            return
        # The handler is still reading: from now on it sees a disconnect and its writes go nowhere.
        cycle.disconnected = True
        cycle.message_event.set()
        error = ApiError(
            408,
            f"The request body was not complete within {self.limits.body_timeout_s} s.",
            code="request_timeout",
            headers=_CLOSE,
        )
        self._write_error(error)

    def _reject_head(self, error: ApiError) -> None:
        logger.info(
            "request refused before its head was read",
            extra={"status": error.status_code, "code": error.code, "client": _address(self.client)},
        )
        self._write_error(error)

    def _write_error(self, error: ApiError) -> None:
        """Answer with ``error`` and close; only when no response is in progress on this connection."""
        self._cancel_timers()
        if self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete:
            self.transport.close()
            return
        body = json.dumps(error.body()).encode()
        headers = [
            *self.server_state.default_headers,
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in error.headers.items()),
        ]
        head = STATUS_LINE[error.status_code] + b"".join(name + b": " + value + b"\r\n" for name, value in headers)
        self.transport.write(head + b"\r\n" + body)
        self.transport.close()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _cancel_timers(self) -> None:
        self._cancel_head_timer()
        self._cancel_body_timer()


async def _too_many_connections(scope: Any, receive: Any, send: Any) -> None:
    error = ApiError(
        503,
        "The server has too many open connections; retry shortly.",
        type="server_error",
        code="too_many_connections",
        headers={"Retry-After": "1", **_CLOSE},
    )
    await error.response()(scope, receive, send)


def _address(client: tuple[str, int] | None) -> str | None:
    return None if client is None else f"{client[0]}:{client[1]}"


def guarded_protocol(settings: HttpSettings) -> type[GuardedHttpProtocol]:
    """The protocol class to pass as ``uvicorn.Config(http=...)``, bound to ``settings``."""

    class BoundGuardedHttpProtocol(GuardedHttpProtocol):
        limits = settings

    return BoundGuardedHttpProtocol
