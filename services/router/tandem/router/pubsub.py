"""The ledger's Redis pub/sub on raw connections: a publish is one socket write, a received
message one parse, and neither wakes a task.

Why (2026-12-05, ``benchmarks/router_fleet.py --skip-replicas --skip-fairness``, one replica, 250
schedules/s, every event-loop callback timed): through redis-py's asyncio client the ledger's ~380
publishes a second and their echo on the channel took 3.4 s of the event loop in 33 s, more than
the 7,480 placement decisions themselves (2.65 s). Each publish went through the connection pool,
a ``wait_for`` task around the send (the client's socket timeout) and a reply read under a timeout;
each message received went through ``PubSub.get_message`` and a timeout of its own.

Here (:class:`Publisher`) a publish is a ``transport.write`` of a pre-encoded command on a
connection of its own: no await, no task; the replies are counted as they arrive. Messages
(:class:`Subscription`) are parsed by hiredis inside ``data_received`` and handed to a callback
there and then. Order is the connection's: the messages of one publisher reach every subscriber in
the order :meth:`Publisher.publish` was called.

What a publish that fails costs is the same as before: it is lost, the receivers see a gap in the
sender's sequence numbers and repair from its next snapshot (:mod:`tandem.router.ledger`). A
connection that breaks is reopened in the background; one that Redis stops answering for
``timeout_s`` is closed and reopened; while a connection's unsent bytes exceed
``max_buffered_bytes`` (Redis not reading), publishes are refused rather than queued without
bound.

URLs: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://`` (TLS; ``?ssl_cert_reqs=none``
and ``?ssl_ca_certs=PATH`` as redis-py reads them) and ``unix://PATH``. Pub/sub ignores the
database number.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import hiredis
from redis.connection import SSLConnection, parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

logger = logging.getLogger(__name__)

#: Unsent bytes on a publisher's connection past which a publish is refused (Redis is not reading).
MAX_BUFFERED_BYTES = 8 * 2**20
#: Wait between attempts to reopen a broken connection.
RECONNECT_WAIT_S = 0.5


@dataclass(frozen=True)
class RedisAddress:
    """Where a raw connection goes, from a Redis URL (see the module docstring)."""

    host: str = "127.0.0.1"
    port: int = 6379
    path: str = ""
    tls: ssl.SSLContext | None = None
    username: str | None = None
    password: str | None = None

    @classmethod
    def from_url(cls, url: str) -> RedisAddress:
        options: dict[str, Any] = parse_url(url)  # type: ignore[no-untyped-call]
        tls = None
        if options.get("connection_class") is SSLConnection:
            tls = ssl.create_default_context(cafile=options.get("ssl_ca_certs"))
            if str(options.get("ssl_cert_reqs", "required")).lower() in ("none", "cert_none"):
                tls.check_hostname = False
                tls.verify_mode = ssl.CERT_NONE
        return cls(
            host=options.get("host") or "127.0.0.1",
            port=int(options.get("port") or 6379),
            path=options.get("path") or "",
            tls=tls,
            username=options.get("username"),
            password=options.get("password"),
        )


def encode_command(*parts: bytes) -> bytes:
    """One command in RESP (an array of bulk strings)."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out += (b"$%d\r\n" % len(part), part, b"\r\n")
    return b"".join(out)


class _Connection(asyncio.Protocol):
    """One RESP connection: replies go to the futures of the handshake's commands first, in order,
    then to ``on_reply``."""

    def __init__(self, on_reply: Callable[[Any], None]) -> None:
        self._reader = hiredis.Reader()
        self._on_reply = on_reply
        self._handshake: deque[asyncio.Future[Any]] = deque()
        self.transport: asyncio.Transport | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        #: ``time.monotonic()`` of the last bytes received.
        self.heard_s = time.monotonic()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # No isinstance check: uvloop's transports (Ray Serve runs the router on uvloop) have the
        # interface of asyncio.Transport without deriving from it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.heard_s = time.monotonic()
        self._reader.feed(data)
        while (reply := self._reader.gets()) is not False:
            if self._handshake:
                future = self._handshake.popleft()
                if not future.done():
                    future.set_result(reply)
                continue
            try:
                self._on_reply(reply)
            except Exception:  # a receiver's bug must not close the connection under the others
                logger.exception("pub/sub reply handler failed")

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        for future in self._handshake:
            if not future.done():
                future.set_exception(RedisConnectionError(f"connection lost: {exc}"))
        self._handshake.clear()
        if not self.closed.done():
            self.closed.set_result(None)

    async def call(self, *parts: bytes) -> Any:
        """Send a command of the handshake and wait for its reply (an error reply raises)."""
        assert self.transport is not None
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._handshake.append(future)
        self.transport.write(encode_command(*parts))
        reply = await future
        if isinstance(reply, hiredis.ReplyError):
            raise ResponseError(str(reply))
        return reply

    def close(self) -> None:
        transport, self.transport = self.transport, None  # nothing more is written to it from now
        if transport is not None:
            transport.abort()


async def _open(address: RedisAddress, on_reply: Callable[[Any], None], timeout_s: float) -> _Connection:
    """A connection to ``address``, authenticated; raises ``OSError``, ``TimeoutError`` or
    :class:`redis.exceptions.RedisError`."""
    loop = asyncio.get_running_loop()

    async def connect() -> _Connection:
        factory = lambda: _Connection(on_reply)  # noqa: E731
        if address.path:
            _, connection = await loop.create_unix_connection(factory, address.path)
        else:
            _, connection = await loop.create_connection(factory, address.host, address.port, ssl=address.tls)
        if connection.transport is None:  # connection_made did not run, or the peer left at once
            raise RedisConnectionError("connection closed as it opened")
        try:
            if address.password is not None:
                auth = (address.username.encode(),) if address.username else ()
                await connection.call(b"AUTH", *auth, address.password.encode())
        except BaseException:
            connection.close()
            raise
        return connection

    return await asyncio.wait_for(connect(), timeout_s)


@dataclass
class PublisherStats:
    #: Publishes written to the connection, and the replies received for them.
    num_sent: int = 0
    num_answered: int = 0
    #: Publishes refused: no connection, or its unsent bytes past ``max_buffered_bytes``.
    num_refused: int = 0
    #: Error replies (each publish answered with one was lost).
    num_error_replies: int = 0
    #: Connections opened after the first one.
    num_reconnects: int = 0


class Publisher:
    """Publishes to one channel on a connection of its own; see the module docstring."""

    def __init__(
        self,
        url: str,
        channel: str,
        *,
        timeout_s: float,
        max_buffered_bytes: int = MAX_BUFFERED_BYTES,
        reconnect_wait_s: float = RECONNECT_WAIT_S,
    ) -> None:
        self._address = RedisAddress.from_url(url)
        channel_bytes = channel.encode()
        #: Everything of a PUBLISH command up to the payload's length.
        self._head = b"*3\r\n$7\r\nPUBLISH\r\n$%d\r\n%s\r\n" % (len(channel_bytes), channel_bytes)
        self._timeout_s = timeout_s
        self._max_buffered_bytes = max_buffered_bytes
        self._reconnect_wait_s = reconnect_wait_s
        self._connection: _Connection | None = None
        self._connecting: asyncio.Task[None] | None = None
        #: ``time.monotonic()`` since when the oldest publish still unanswered has waited at most.
        self._waiting_since_s = 0.0
        self._closed = False
        self.stats = PublisherStats()

    @property
    def connected(self) -> bool:
        return self._connection is not None and self._connection.transport is not None

    async def connect(self) -> None:
        """Open the connection now (raises when Redis cannot be reached); later breaks reconnect
        by themselves."""
        await self._open()

    def start(self) -> None:
        """Open the connection in the background, retrying every ``reconnect_wait_s`` until it opens
        (no-op while connected or connecting)."""
        if self._closed or self.connected or (self._connecting is not None and not self._connecting.done()):
            return
        self._connecting = asyncio.get_running_loop().create_task(self._reconnect_forever())

    def publish(self, payload: bytes) -> bool:
        """Send ``payload`` on the channel; False when it was not sent (it is lost)."""
        connection = self._connection
        transport = None if connection is None else connection.transport
        if connection is None or transport is None:
            self.stats.num_refused += 1
            self.start()
            return False
        unanswered = self.stats.num_sent - self.stats.num_answered
        if unanswered and time.monotonic() - max(self._waiting_since_s, connection.heard_s) > self._timeout_s:
            logger.warning("ledger publisher: Redis has not answered for %.1f s; reconnecting", self._timeout_s)
            connection.close()
            self.stats.num_refused += 1
            return False
        if transport.get_write_buffer_size() > self._max_buffered_bytes:
            self.stats.num_refused += 1
            return False
        if not unanswered:
            self._waiting_since_s = time.monotonic()
        transport.write(b"%s$%d\r\n%s\r\n" % (self._head, len(payload), payload))
        self.stats.num_sent += 1
        return True

    def _on_reply(self, reply: Any) -> None:
        self.stats.num_answered += 1
        if isinstance(reply, hiredis.ReplyError):
            self.stats.num_error_replies += 1
            logger.warning("ledger publish refused by Redis: %s", reply)

    async def _open(self) -> None:
        connection = await _open(self._address, self._on_reply, self._timeout_s)
        if self._closed:
            connection.close()
            return
        if self._connection is not None:
            self.stats.num_reconnects += 1
        # Replies to the old connection's publishes will never come: they are lost (gaps, repaired).
        self.stats.num_answered = self.stats.num_sent
        self._connection = connection

    async def _reconnect_forever(self) -> None:
        while not self._closed and not self.connected:
            try:
                await self._open()
            except (OSError, TimeoutError, RedisConnectionError, ResponseError) as exc:
                logger.warning("ledger publisher cannot reach Redis: %s", exc)
            if not self.connected:  # failed, or lost as soon as it opened: never a tight loop
                await asyncio.sleep(self._reconnect_wait_s)

    async def aclose(self) -> None:
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._connecting
        if self._connection is not None:
            self._connection.close()
            self._connection = None


class Subscription:
    """One connection subscribed to one channel: each message's payload goes to ``on_message`` as
    it is parsed, inside the connection's ``data_received``."""

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection

    @classmethod
    async def open(
        cls, url: str, channel: str, on_message: Callable[[bytes], None], *, timeout_s: float
    ) -> Subscription:
        """Subscribed once this returns (raises when Redis cannot be reached or refuses)."""

        def on_reply(reply: Any) -> None:
            # (b"message", channel, payload); the others are (un)subscribe confirmations
            if type(reply) is list and len(reply) == 3 and reply[0] == b"message":
                on_message(reply[2])

        connection = await _open(RedisAddress.from_url(url), on_reply, timeout_s)
        try:
            confirmation = await asyncio.wait_for(connection.call(b"SUBSCRIBE", channel.encode()), timeout_s)
        except BaseException:
            connection.close()
            raise
        if not (isinstance(confirmation, list) and confirmation and confirmation[0] == b"subscribe"):
            connection.close()
            raise ResponseError(f"unexpected answer to SUBSCRIBE: {confirmation!r}")
        return cls(connection)

    @property
    def heard_s(self) -> float:
        """``time.monotonic()`` of the last bytes received."""
        return self._connection.heard_s

    async def wait_closed(self, timeout_s: float) -> bool:
        """Wait until the connection is lost (True) or ``timeout_s`` passed (False)."""
        done, _ = await asyncio.wait((self._connection.closed,), timeout=timeout_s)
        return bool(done)

    def close(self) -> None:
        self._connection.close()
