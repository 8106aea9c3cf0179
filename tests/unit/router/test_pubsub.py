"""The ledger's pub/sub connections (redis.asyncio) against the real Redis (127.0.0.1:6379): order,
a broken connection (through a TCP relay the test cuts), a Redis that stops answering, and a
refused AUTH."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from redis.exceptions import AuthenticationError

from tandem.router.pubsub import Publisher, Subscription, subscribe_forever
from tests.kit.redis import acl_users

REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
REDIS_URL = f"redis://{REDIS_HOST}:{REDIS_PORT}/0"


async def until(condition, timeout_s: float = 3.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.005)


class Relay:
    """A TCP relay to Redis that the test can cut (closing every connection) or freeze (it keeps
    accepting and reading, and forwards nothing)."""

    def __init__(self) -> None:
        self.frozen = False
        #: Stop reading what clients send (their sockets' buffers fill up).
        self.stalled = False
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self.port = 0

    async def start(self, port: int = 0) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        redis_reader, redis_writer = await asyncio.open_connection(REDIS_HOST, REDIS_PORT)
        self._writers += [client_writer, redis_writer]

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while not await self._wait_unstalled(reader is client_reader) and (data := await reader.read(65536)):
                    if not self.frozen:
                        writer.write(data)
            writer.close()

        await asyncio.gather(pipe(client_reader, redis_writer), pipe(redis_reader, client_writer))

    async def _wait_unstalled(self, from_client: bool) -> bool:
        while from_client and self.stalled:
            await asyncio.sleep(0.01)
        return False

    async def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()
        await self._server.wait_closed()


@pytest_asyncio.fixture
async def relay() -> AsyncIterator[Relay]:
    relay = Relay()
    await relay.start()
    yield relay
    with contextlib.suppress(Exception):
        await relay.cut()


def channel() -> str:
    return f"tandem-test-pubsub-{uuid.uuid4().hex[:8]}"


async def test_messages_arrive_whole_and_in_the_order_they_were_published() -> None:
    name = channel()
    received: list[bytes] = []
    subscription = await Subscription.open(REDIS_URL, name, received.append, timeout_s=2.0)
    publisher = Publisher(REDIS_URL, name, timeout_s=2.0)
    await publisher.connect()
    # Sizes around the parser's edges: empty, CRLF inside, a payload larger than one socket read.
    payloads = [b"", b"\r\n$3\r\n", bytes(range(256)) * 1024] + [b"m%d" % i for i in range(2000)]
    try:
        for payload in payloads:
            assert publisher.publish(payload)
        await until(lambda: len(received) == len(payloads))
        assert received == payloads
        await until(lambda: publisher.stats.num_answered == publisher.stats.num_sent == len(payloads))
        assert publisher.stats.num_error_replies == publisher.stats.num_refused == 0
    finally:
        await subscription.aclose()
        await publisher.aclose()


async def test_a_cut_connection_refuses_publishes_until_it_reopens_by_itself(relay: Relay) -> None:
    name = channel()
    received: list[bytes] = []
    subscription = await Subscription.open(REDIS_URL, name, received.append, timeout_s=2.0)
    publisher = Publisher(f"redis://127.0.0.1:{relay.port}/0", name, timeout_s=2.0, reconnect_wait_s=0.05)
    await publisher.connect()
    try:
        assert publisher.publish(b"before")
        await until(lambda: received == [b"before"])
        port = relay.port
        await relay.cut()
        publisher.publish(b"lost")  # the break is found by this publish: lost (the ledger repairs gaps)
        await until(lambda: not publisher.connected)
        assert publisher.stats.num_refused + publisher.stats.num_error_replies == 1
        assert not publisher.publish(b"refused")  # nothing to write to: refused, not queued
        await asyncio.sleep(0.2)  # it keeps trying while nothing listens
        assert not publisher.connected
        await relay.start(port)
        await until(lambda: publisher.connected)
        assert publisher.publish(b"after")
        await until(lambda: received == [b"before", b"after"])
        assert publisher.stats.num_reconnects == 1
    finally:
        await subscription.aclose()
        await publisher.aclose()


async def test_a_subscription_learns_that_its_connection_was_cut(relay: Relay) -> None:
    subscription = await Subscription.open(
        f"redis://127.0.0.1:{relay.port}/0", channel(), lambda payload: None, timeout_s=2.0
    )
    assert not await subscription.wait_closed(0.05)
    await relay.cut()
    assert await subscription.wait_closed(2.0)


async def test_subscribe_forever_subscribes_again_after_a_cut(relay: Relay) -> None:
    """The ledger's listener: a cut connection is reopened by itself, ``on_subscribed`` runs each time
    (the ledger then repairs its mirrors from snapshots), and messages flow again."""
    name = channel()
    received: list[bytes] = []
    num_subscribed = [0]
    closed = [False]

    def on_subscribed() -> None:
        num_subscribed[0] += 1

    listener = asyncio.create_task(
        subscribe_forever(
            f"redis://127.0.0.1:{relay.port}/0",
            name,
            received.append,
            on_subscribed=on_subscribed,
            silent_s=5.0,
            timeout_s=1.0,
            closed=lambda: closed[0],
        )
    )
    publisher = Publisher(REDIS_URL, name, timeout_s=2.0)
    await publisher.connect()
    try:
        await until(lambda: num_subscribed[0] == 1)
        assert publisher.publish(b"before")
        await until(lambda: received == [b"before"])
        port = relay.port
        await relay.cut()
        await relay.start(port)
        await until(lambda: num_subscribed[0] == 2, timeout_s=5.0)
        assert publisher.publish(b"after")
        await until(lambda: received == [b"before", b"after"])
    finally:
        closed[0] = True
        listener.cancel()
        await asyncio.wait((listener,), timeout=2.0)
        await publisher.aclose()


async def test_a_redis_that_stops_answering_is_left_after_the_timeout(relay: Relay) -> None:
    publisher = Publisher(f"redis://127.0.0.1:{relay.port}/0", channel(), timeout_s=0.2, reconnect_wait_s=10)
    await publisher.connect()
    try:
        assert publisher.publish(b"answered")
        await until(lambda: publisher.stats.num_answered == 1)
        relay.frozen = True
        assert publisher.publish(b"unanswered")  # written; no answer comes
        await asyncio.sleep(0.3)
        assert not publisher.publish(b"refused")  # unanswered for longer than timeout_s: the connection goes
        await until(lambda: not publisher.connected)
    finally:
        await publisher.aclose()


async def test_a_redis_that_stops_reading_is_left_after_the_timeout_and_publishes_queue_meanwhile(
    relay: Relay,
) -> None:
    """Publishes go into the connection's transport at once; once the socket's buffer is full the
    writer drains it under ``timeout_s``, publishes queue up to ``max_queued_bytes`` meanwhile, and a
    drain that does not end loses them all and leaves the connection."""
    payload = b"\xf0\x9f\x9a\x80 \xe6\x9d\xb1 <|im_start|>" * (2**20 // 24)  # ~1 MiB
    publisher = Publisher(
        f"redis://127.0.0.1:{relay.port}/0", channel(), timeout_s=0.5, reconnect_wait_s=10, max_queued_bytes=4 * 2**20
    )
    await publisher.connect()
    try:
        assert publisher.publish(b"answered")
        await until(lambda: publisher.stats.num_answered == 1)
        relay.stalled = True
        accepted = refused = 0
        for _ in range(64):  # 64 MiB: more than loopback's socket buffers hold
            if publisher.publish(payload):
                accepted += 1
            else:
                refused += 1
            await asyncio.sleep(0)  # one loop iteration: the flush runs
        assert accepted >= 2 and refused >= 1, (accepted, refused)  # queued past max_queued_bytes: refused
        await until(lambda: not publisher.connected, timeout_s=3.0)
        assert publisher.stats.num_error_replies == accepted  # every one not answered is counted lost
        assert not publisher.publish(b"refused")
    finally:
        relay.stalled = False
        await publisher.aclose()


async def test_a_refused_auth_is_a_clear_error() -> None:
    """The router's own Redis user with a wrong password: both connections refuse to open."""
    async with acl_users(REDIS_URL) as users:
        url = users.url("router")
        wrong = url.replace(url[url.index(":", 8) + 1 : url.index("@")], "not-the-password")
        publisher = Publisher(wrong, channel(), timeout_s=2.0)
        with pytest.raises(AuthenticationError):
            await publisher.connect()
        assert not publisher.connected
        await publisher.aclose()
        with pytest.raises(AuthenticationError):
            await Subscription.open(wrong, f"{users.key_prefix}:router:ledger", lambda payload: None, timeout_s=2.0)


def test_publish_and_subscribe_on_uvloop() -> None:
    """Ray Serve runs the router's replicas on uvloop (whose transports once failed the hand-written
    client's isinstance check, for every connection, in a tight loop)."""
    import uvloop

    async def scenario() -> tuple[list[bytes], bool]:
        name = channel()
        received: list[bytes] = []
        subscription = await Subscription.open(REDIS_URL, name, received.append, timeout_s=2.0)
        publisher = Publisher(REDIS_URL, name, timeout_s=2.0)
        await publisher.connect()
        try:
            for i in range(100):
                assert publisher.publish(b"u%d" % i)
            await until(lambda: len(received) == 100)
            return received, publisher.connected
        finally:
            await subscription.aclose()
            await publisher.aclose()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        received, connected = runner.run(scenario())
    assert received == [b"u%d" % i for i in range(100)] and connected


async def test_a_connection_refused_is_retried_at_the_reconnect_wait_not_in_a_tight_loop() -> None:
    publisher = Publisher("redis://127.0.0.1:1/0", channel(), timeout_s=0.5, reconnect_wait_s=0.2)
    attempts = 0
    real_open = publisher._open

    async def counted_open() -> None:
        nonlocal attempts
        attempts += 1
        await real_open()

    publisher._open = counted_open  # type: ignore[method-assign]
    assert not publisher.publish(b"x")  # nothing listens on port 1: refused, a reconnect starts
    await asyncio.sleep(0.5)
    await publisher.aclose()
    assert 1 <= attempts <= 4
