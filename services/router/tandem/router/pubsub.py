"""The ledger's Redis pub/sub, on redis-py's asyncio client (``redis.asyncio``): one connection
that publishes, one that listens.

Called by :class:`tandem.router.ledger.Ledger` only: :meth:`Publisher.publish` once per ledger
message (no I/O: it queues, a writer task sends), and :func:`subscribe_forever` to keep a
:class:`Subscription` to the channel (``on_message`` runs in the subscription's reader task, for
every message of every replica).

Why the maintained client (issue 39; before it, a client hand-written on ``asyncio.Protocol``
with hiredis). Measured side by side in one run, ``python benchmarks/ledger_pubsub.py --seconds 8
--repeats 3 --rate 250`` (2026-12-06, the 2-core dev host shared with other jobs, load average
~10; medians of 3): a replica publishing 250 messages a second of 300 B and receiving them with
750 more from the other replicas:

==========================  =================  ===========================
per message published       redis.asyncio      hand-written (6a98561)
==========================  =================  ===========================
event-loop CPU              544 us (11.7 %)    333 us (6.7 %)
``publish()`` call p50/p99  4.7 / 11 us        21 / 57 us
to own subscriber p50/p99   0.35 / 8.8 ms      0.13 / 5.9 ms
==========================  =================  ===========================

(CPU includes the benchmark's 1 ms lag timer, the same for both.) The maintained client costs
about 0.05 of a core more at this rate and ~0.2 ms more per hop, well under what the fleet
targets depend on: replicas place ~10 ms apart at the fleet benchmark's 100 requests a second,
so 0.2 ms more lag should leave replica agreement where it was, and the decision's own CPU is
not touched. The hand-written client was built when each publish went through redis-py's pool, a
``wait_for`` around the send and a reply read under a timeout, per message (3.4 s of the event
loop in 33 s at 250 schedules a second, more than the decisions took): here a publish only queues,
and one writer task sends what is queued when it wakes (one command, or one pipeline). The fleet
benchmark's replica part (``benchmarks/router_fleet.py --skip-speed --skip-fairness
--replica-seconds 20``), run back to back on the same host while it was overloaded (load average
12, then 160): ``replica_agreement`` 0.978 with this client, 0.753 with the hand-written one, so
the host's load decided both and neither is a figure; rerun it, and the speed part's arrival p99
against the 1 ms target, on a quiet host.

The writer sends on its client's one connection itself (redis-py's ``Connection.pack_commands``,
``send_packed_command``, ``read_response``: the same packer and hiredis parser), under one
``asyncio.timeout`` for the write and every reply, instead of ``Redis.publish`` and a pipeline,
whose per-command layers (a lock, a retry wrapper, and a task per write for the socket timeout:
``asyncio.wait_for``) cost ~85 us of the loop per message. Measured side by side,
``python benchmarks/ledger_pubsub.py --seconds 6 --repeats 3 --rate 250 --baseline-rev 9b00a3e``
(2026-12-06, the 2-core host shared with four other jobs, load average ~4; three runs): event-loop
CPU per message published (with four received) 606, 637, 565 us against 698, 713, 652 us through
``Redis.publish``; to own subscriber p50 0.27, 0.27, 0.24 ms against 0.34, 0.32, 0.28 ms.

Receiving reads the subscription's connection itself, through redis-py's public
``Connection.read_response(push_request=True)`` (a RESP3 pub/sub message is a push reply; what
``PubSub.parse_response`` calls too), without ``PubSub.get_message``'s layers around it (a health
check, the retry wrapper, a dict per message) and with a push handler of ours (redis-py's default
formats every push reply into a debug log line). Measured side by side,
``python benchmarks/ledger_pubsub.py --seconds 6 --repeats 3 --rate 250 --baseline-rev HEAD``
(2026-12-06, the shared 2-core host, load average 3-6; two runs): event-loop CPU per message
published (with ~4.6 received) 477 and 592 us against 529 and 698 us through ``get_message``; to
own subscriber p50 unchanged (0.29, 0.35 ms against 0.28, 0.36 ms). In a microbenchmark (one
message per wake, 2,000 a second) ``get_message`` took 52 us of CPU per message and this read 26-42
us: most of what is left is the event loop's wake itself, which a client on ``asyncio.Protocol`` (the
hand-written one, 6a98561) skipped by handing each message over from ``data_received``.

No task per publish (2026-12-07): the messages published in one iteration of the event loop go at
its end as one pipeline, from a plain callback (``loop.call_soon``) into the connection's transport,
which writes them to the socket at once; the writer task wakes only to read replies (every
``_REPLY_CHECK_S``) and, when a send left bytes in the transport (the socket's buffer full: Redis not
reading), to drain it under ``timeout_s`` while publishes queue. That reads redis-py's
``Connection._writer`` (the asyncio StreamWriter its own ``send_packed_command`` writes to), the one
private name used here. The fleet benchmark's stall timing (``FLEET_STALLS=1``, 1,000 SIMULATED
workers, 250 schedules a second) had put the writer's wakes, one per publish, at 1.07 s of the
loop's 7.05 s of callbacks in 33 s (78 us each), the largest part after the decisions and the KV
followers. ``python benchmarks/ledger_pubsub.py --seconds 6 --repeats 3 --rate 250 --baseline-rev
HEAD`` (2026-12-07, load ~1.6, one run): 475 against 533 us of loop CPU per message published (with
~4.6 received), loop share 0.104 against 0.118, own-subscriber latency p50 0.14 against 0.17 ms.

Order is the sender's: the queue goes in the order :meth:`Publisher.publish` was called, on one
connection, so a publisher's messages reach every subscriber in order. What a publish that fails costs: it is lost, the
receivers see a gap in the sender's sequence numbers and repair from its next snapshot
(:mod:`tandem.router.ledger`). The writer does not wait for each reply: it sends, and reads the
replies that have arrived meanwhile every ``_REPLY_CHECK_S`` (50 ms; a reply already in the
connection's buffer is read without suspending), so a publish cost one wake of the writer instead
of two (before the callback above). Profiled side by side on an exclusive core (the fleet benchmark's
speed phase, 15 s, ``FLEET_PROFILE=1``, 2026-12-07): the replica's event loop busy 9.74 s against
10.45 s waiting for each reply (and 8.63 s with the hand-written client of ``587d182``);
``python benchmarks/ledger_pubsub.py --seconds 6 --repeats 3 --rate 250 --baseline-rev main``: 645
against 684 us of loop CPU per message published (with ~4.6 received). A connection that breaks, a
reply that is an error, or a send whose reply has not come in ``timeout_s`` (found at the next
check) or a drain that takes longer marks it broken, and every message not yet answered (or queued)
is counted lost; it is reopened by the writer every ``reconnect_wait_s``; publishes
meanwhile are refused, not queued; while the queue holds more than ``max_queued_bytes`` (Redis not
reading), publishes are refused rather than queued without bound. A subscription whose connection
breaks ends (:meth:`Subscription.wait_closed`), and the ledger subscribes again and repairs from
snapshots: redis-py's own retries are off on both connections, so that a break is seen.

Commands sent: PUBLISH; SUBSCRIBE (and UNSUBSCRIBE at close); AUTH and SELECT as the URL says;
nothing else (``lib_name=None``, ``lib_version=None``: no CLIENT SETINFO), which the router's Redis
user allows (:mod:`tandem.common.redis_acl`). URLs are redis-py's (``redis://``, ``rediss://``,
``unix://``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

logger = logging.getLogger(__name__)

#: Queued bytes past which a publish is refused (Redis is not reading).
MAX_QUEUED_BYTES = 8 * 2**20
#: Wait between attempts to reopen a broken connection.
RECONNECT_WAIT_S = 0.5
#: The publisher reads the replies already arrived this often (and when the oldest is due).
_REPLY_CHECK_S = 0.05
#: Longest a close waits for the writer or reader task to end.
_CLOSE_WAIT_S = 1.0


def _client(url: str, timeout_s: float) -> aioredis.Redis:
    """A client whose errors surface (no retry) and that sends no CLIENT SETINFO."""
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        health_check_interval=0,
        retry_on_timeout=False,
        retry=Retry(NoBackoff(), retries=0),
        lib_name=None,
        lib_version=None,
        single_connection_client=True,
    )


@dataclass
class PublisherStats:
    #: Publishes queued, and those Redis acknowledged.
    num_sent: int = 0
    num_answered: int = 0
    #: Publishes refused: no connection, or the queue past ``max_queued_bytes``.
    num_refused: int = 0
    #: Publishes lost after they were queued (an error reply, or the connection broke under them).
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
        max_queued_bytes: int = MAX_QUEUED_BYTES,
        reconnect_wait_s: float = RECONNECT_WAIT_S,
    ) -> None:
        self._url = url
        self._channel = channel
        self._timeout_s = timeout_s
        self._max_queued_bytes = max_queued_bytes
        self._reconnect_wait_s = reconnect_wait_s
        self._client: aioredis.Redis | None = None
        self._connection: Connection | None = None
        self._queue: deque[bytes] = deque()
        self._queued_bytes = 0
        #: (monotonic time sent, number of commands) of the sends whose replies are not read yet.
        self._unanswered: deque[tuple[float, int]] = deque()
        self._replies_read_s = 0.0
        self._wakeup: asyncio.Event | None = None
        self._writer: asyncio.Task[None] | None = None
        # The send of what publish() queued, at the end of this event-loop iteration (_flush).
        self._flush_soon: asyncio.Handle | None = None
        # The last send left bytes in the transport's buffer (the socket's was full): the writer drains.
        self._must_drain = False
        self._connected = False
        self._ever_connected = False
        self._closed = False
        self.stats = PublisherStats()

    @property
    def connected(self) -> bool:
        return self._connected

    async def connect(self) -> None:
        """Open the connection now (raises when Redis cannot be reached or refuses); later breaks
        reconnect by themselves."""
        await self._open()
        self.start()

    def start(self) -> None:
        """Start the writer, which opens the connection in the background, retrying every
        ``reconnect_wait_s`` (no-op while it runs)."""
        if self._closed or (self._writer is not None and not self._writer.done()):
            return
        self._wakeup = asyncio.Event()
        self._writer = asyncio.get_running_loop().create_task(self._write_forever())

    def publish(self, payload: bytes) -> bool:
        """Queue ``payload`` for the channel; False when it was refused (it is lost)."""
        if not self._connected or self._wakeup is None:
            self.stats.num_refused += 1
            self.start()
            return False
        if self._queued_bytes > self._max_queued_bytes:
            self.stats.num_refused += 1
            return False
        self._queue.append(payload)
        self._queued_bytes += len(payload)
        self.stats.num_sent += 1
        if self._flush_soon is None:
            self._flush_soon = asyncio.get_running_loop().call_soon(self._flush)
        return True

    def _flush(self) -> None:
        """Send what is queued as one pipeline, on this iteration of the loop, without a task: the
        command goes into the connection's transport, which writes it to the socket at once. Only
        when the socket's buffer was full (Redis not reading) does the writer task drain it, under
        ``timeout_s``; until then publishes queue, up to ``max_queued_bytes``."""
        self._flush_soon = None
        connection, wakeup = self._connection, self._wakeup
        if not self._queue or not self._connected or self._must_drain or connection is None or wakeup is None:
            return  # (the writer sends the queue once drained)
        # redis-py's Connection keeps its asyncio StreamWriter in ``_writer`` (what its own
        # send_packed_command writes to; 5.x to 7.x): StreamWriter.writelines is synchronous.
        stream = connection._writer
        if stream is None or stream.transport.is_closing():
            self._lose_all(ConnectionError("the connection is closed"))
            return
        batch = list(self._queue)
        self._queue.clear()
        self._queued_bytes = 0
        stream.writelines(connection.pack_commands([(b"PUBLISH", self._channel, payload) for payload in batch]))
        now_s = time.monotonic()
        if not self._unanswered:
            self._replies_read_s = now_s  # the replies' 50 ms start with the first unanswered send
        self._unanswered.append((now_s, len(batch)))
        if stream.transport.get_write_buffer_size() > 0:
            self._must_drain = True
            wakeup.set()
        elif len(self._unanswered) == 1:
            wakeup.set()  # the writer sleeps until these replies are due

    async def _open(self) -> None:
        client = _client(self._url, self._timeout_s)
        try:
            await client.ping()
        except BaseException:
            await client.aclose()
            raise
        if self._closed:
            await client.aclose()
            return
        # The writer sends on the client's one connection itself (see _send): no socket timeout of
        # the connection's own, which would wrap every write in a task (asyncio.wait_for).
        connection = client.connection
        assert connection is not None  # a single-connection client after its first command
        connection.socket_timeout = None
        old, self._client, self._connection = self._client, client, connection
        if old is not None:
            with contextlib.suppress(RedisError, OSError):
                await old.aclose()
        if self._ever_connected:
            self.stats.num_reconnects += 1
        self._ever_connected = self._connected = True

    async def _write_forever(self) -> None:
        assert self._wakeup is not None
        while not self._closed:
            if not self._connected:
                try:
                    await self._open()
                except (RedisError, OSError) as exc:
                    logger.warning("ledger publisher cannot reach Redis: %s", exc)
                    await asyncio.sleep(self._reconnect_wait_s)
                    continue
            if self._unanswered:
                # Wake for the replies at the latest when they are due, even with nothing to send.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, self._replies_due_s() - time.monotonic())):
                        await self._wakeup.wait()
            else:
                await self._wakeup.wait()
            self._wakeup.clear()
            await self._send()

    def _replies_due_s(self) -> float:
        """When the replies are read next: ``_REPLY_CHECK_S`` after the last read, or sooner when the
        oldest unanswered send reaches ``timeout_s``."""
        return min(self._replies_read_s + _REPLY_CHECK_S, self._unanswered[0][0] + self._timeout_s)

    async def _read_replies(self, connection: Connection) -> None:
        """Read the replies already in the connection's buffer (no wait); raise TimeoutError when the
        oldest unanswered send is ``timeout_s`` old."""
        self._replies_read_s = now_s = time.monotonic()
        while self._unanswered:
            reply = await connection.read_response(timeout=0)
            if reply is None:  # nothing buffered yet
                if now_s - self._unanswered[0][0] >= self._timeout_s:
                    raise TimeoutError(f"no reply from Redis in {self._timeout_s} s")
                return
            sent_s, count = self._unanswered[0]
            self.stats.num_answered += 1
            if count == 1:
                self._unanswered.popleft()
            else:
                self._unanswered[0] = (sent_s, count - 1)

    async def _send(self) -> None:
        """The writer's round: drain the transport if a send left bytes in it, send what queued
        meanwhile (or since a reconnect), and read the replies when they are due."""
        connection = self._connection
        if connection is None:
            return
        try:
            if self._must_drain:
                stream = connection._writer
                if stream is None:
                    raise ConnectionError("the connection is closed")
                async with asyncio.timeout(self._timeout_s):
                    await stream.drain()
                self._must_drain = False
            if self._queue:
                self._flush()
            if self._unanswered and time.monotonic() >= self._replies_due_s():
                await self._read_replies(connection)
        except (RedisError, OSError, TimeoutError) as exc:
            self._lose_all(exc)

    def _lose_all(self, exc: BaseException) -> None:
        """The connection broke (or a reply was an error, or late): every message sent and not yet
        answered, and every one queued, is lost; the receivers see a gap and repair from our next
        snapshot. The writer reconnects."""
        lost = sum(count for _, count in self._unanswered) + len(self._queue)
        self._unanswered.clear()
        self._queue.clear()
        self._queued_bytes = 0
        self._must_drain = False
        self.stats.num_error_replies += lost
        self._connected = False
        logger.warning("ledger publish failed (%d messages lost): %s", lost, exc or type(exc).__name__)
        if self._wakeup is not None:
            self._wakeup.set()

    async def aclose(self) -> None:
        self._closed = True
        self._connected = False
        if self._writer is not None:
            self._writer.cancel()
            # (bounded: redis-py can swallow a cancellation that lands inside a command)
            await asyncio.wait((self._writer,), timeout=_CLOSE_WAIT_S)
        if self._client is not None:
            with contextlib.suppress(RedisError, OSError):
                await self._client.aclose()
            self._client = self._connection = None


class Subscription:
    """One connection subscribed to one channel: each message's payload goes to ``on_message`` in
    the subscription's reader task, in the order Redis delivered them."""

    def __init__(self, client: aioredis.Redis, pubsub: PubSub, on_message: Callable[[bytes], None]) -> None:
        self._client = client
        self._pubsub = pubsub
        self._on_message = on_message
        #: ``time.monotonic()`` of the last message received.
        self.heard_s = time.monotonic()
        self._closed = False
        self._reader = asyncio.get_running_loop().create_task(self._read_forever())

    @classmethod
    async def open(
        cls, url: str, channel: str, on_message: Callable[[bytes], None], *, timeout_s: float
    ) -> Subscription:
        """Subscribed once this returns (raises when Redis cannot be reached or refuses)."""
        client = _client(url, timeout_s)
        # (a handler of ours: redis-py's default formats every push reply into a debug log line)
        pubsub = client.pubsub(push_handler_func=_as_received)
        try:
            await pubsub.subscribe(channel)
            deadline_s = time.monotonic() + timeout_s
            while True:  # the confirmation (messages cannot come before it)
                reply: dict[str, Any] | None = await pubsub.get_message(timeout=max(0.0, deadline_s - time.monotonic()))
                if reply is not None and reply["type"] == "subscribe":
                    break
                if time.monotonic() > deadline_s:
                    raise TimeoutError(f"no answer to SUBSCRIBE {channel} in {timeout_s} s")
        except BaseException:
            await pubsub.aclose()  # type: ignore[no-untyped-call]
            await client.aclose()
            raise
        return cls(client, pubsub, on_message)

    async def _read_forever(self) -> None:
        """Read the subscription's connection itself: each message is a RESP3 push reply
        ``[b"message", channel, payload]``, which redis-py's ``Connection.read_response`` returns with
        ``push_request=True`` (what ``PubSub.parse_response`` passes it too), without the layers of
        ``PubSub.get_message`` around it (a health check, the retry wrapper, a dict per message): see
        the module docstring for the figures."""
        on_message = self._on_message
        # (redis-py leaves the attribute unannotated: None until subscribed)
        connection = cast("Connection | None", self._pubsub.connection)
        assert connection is not None  # subscribed
        try:
            while not self._closed:
                reply = await connection.read_response(timeout=math.inf, disconnect_on_error=False, push_request=True)
                self.heard_s = time.monotonic()
                if isinstance(reply, list) and len(reply) == 3 and reply[0] == b"message":
                    try:
                        on_message(reply[2])
                    except Exception:  # a receiver's bug must not end the subscription
                        logger.exception("pub/sub message handler failed")
        except (RedisError, OSError) as exc:
            logger.warning("ledger subscription lost: %s", exc)

    async def wait_closed(self, timeout_s: float) -> bool:
        """Wait until the connection is lost (True) or ``timeout_s`` passed (False)."""
        done, _ = await asyncio.wait((self._reader,), timeout=timeout_s)
        return bool(done)

    async def aclose(self) -> None:
        self._closed = True
        self._reader.cancel()
        # (bounded: redis-py can swallow a cancellation that lands inside a read; closing the
        # connection below ends the read then)
        await asyncio.wait((self._reader,), timeout=_CLOSE_WAIT_S)
        with contextlib.suppress(RedisError, OSError):
            await self._pubsub.aclose()  # type: ignore[no-untyped-call]
            await self._client.aclose()


async def _as_received(reply: Any) -> Any:
    return reply


async def subscribe_forever(
    url: str,
    channel: str,
    on_message: Callable[[bytes], None],
    *,
    on_subscribed: Callable[[], None],
    silent_s: float,
    timeout_s: float,
    closed: Callable[[], bool],
) -> None:
    """Keep ``channel`` subscribed until cancelled or ``closed()``: subscribe again when the
    connection breaks, cannot be opened (every ``RECONNECT_WAIT_S``), or heard nothing for
    ``silent_s``; ``on_subscribed`` is called each time the subscription is (re)established."""
    while not closed():
        subscription: Subscription | None = None
        try:
            subscription = await Subscription.open(url, channel, on_message, timeout_s=timeout_s)
            on_subscribed()
            while not closed():
                if await subscription.wait_closed(silent_s):
                    logger.warning("ledger subscription lost: Redis closed the connection")
                    await asyncio.sleep(RECONNECT_WAIT_S)
                    break
                if time.monotonic() - subscription.heard_s > silent_s:
                    logger.warning("ledger subscription silent for %.1f s; subscribing again", silent_s)
                    break
        except asyncio.CancelledError:
            raise
        except (RedisError, OSError, TimeoutError) as exc:
            logger.warning("ledger subscription lost: %s", exc)
            await asyncio.sleep(RECONNECT_WAIT_S)
        finally:
            if subscription is not None:
                await subscription.aclose()
