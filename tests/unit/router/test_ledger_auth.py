"""The ledger's messages and snapshots are authenticated and its mirrors bounded
(:mod:`tandem.router.ledger_auth`, :mod:`tandem.router.ledger`): forged messages and snapshots on the
real Redis (127.0.0.1:6379, a private key prefix) change nothing, a replayed genuine message is
dropped, a flood of replica ids makes at most ``max_replicas`` mirrors, and every drop is counted."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from tandem.router.deployment import build_app
from tandem.router.ledger import DEFAULT_MAX_REPLICAS, Ledger
from tandem.router.ledger_auth import TAG_BYTES, LedgerAuth, LedgerSecretError, check_secret_file, read_secret
from tandem.router.metrics import NullRouterMetrics
from tandem.router.reservations import ReservationTable
from tandem.router.settings import RouterConfig, TandemRouterSettings
from tests.kit.redis import delete_prefix
from tests.kit.router import LEDGER_SECRET

REDIS_URL = "redis://127.0.0.1:6379/0"


class RejectCounts(NullRouterMetrics):
    def __init__(self) -> None:
        self.rejected: dict[str, int] = {}

    def count_ledger_rejected(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1


async def until(condition: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.005)


def reserve(ledger: Ledger, request_id: str, tokens: int = 40) -> None:
    table = ReservationTable(lease_s=60, young_s=1)
    ledger.reserved(table.reserve(request_id, ("p0",), {"p0": tokens}, tenant="t"), tokens)


def message(replica_id: str, seq: int, events: list[tuple[object, ...]], *, sent_at_unix: float | None = None) -> bytes:
    """A message body as the ledger encodes it (no tag)."""
    return msgspec.msgpack.encode([replica_id, seq, events, time.time() if sent_at_unix is None else sent_at_unix])


@pytest_asyncio.fixture
async def redis_prefix() -> AsyncIterator[str]:
    key_prefix = f"tandem-test-ledger-auth-{uuid.uuid4().hex[:8]}"
    yield key_prefix
    client = aioredis.Redis.from_url(REDIS_URL)
    await delete_prefix(client, key_prefix)
    await client.aclose()


def make_ledger(key_prefix: str, name: str, **kwargs: object) -> Ledger:
    options: dict[str, object] = {"secret": LEDGER_SECRET, "lease_s": 60, "young_s": 5.0, "ttl_s": 30.0}
    options.update(kwargs)
    return Ledger(REDIS_URL, key_prefix=key_prefix, replica_id=name, **options)  # type: ignore[arg-type]


async def test_forged_messages_on_the_real_channel_change_no_reservation(redis_prefix: str) -> None:
    """Right shape, no tag or a wrong one: the release of A's reservation, a forwarded Release of B's
    own request and a reservation by an invented replica are all dropped and counted. Then A's
    genuine release goes through (the channel works)."""
    metrics = RejectCounts()
    # A ticks once at start, then not for 30 s: its seq stays where the test can forge the next one.
    ledger_a = make_ledger(redis_prefix, "a", snapshot_interval_s=30.0)
    ledger_b = make_ledger(redis_prefix, "b", snapshot_interval_s=0.05, metrics=metrics)
    root = aioredis.Redis.from_url(REDIS_URL)
    channel = f"{redis_prefix}:router:ledger"
    try:
        ledger_a.start()
        ledger_b.start()
        await until(lambda: ledger_b.num_live_replicas == 2)
        reserve(ledger_a, "req-a")
        await until(lambda: ledger_b.others_tokens("p0") == 40)
        next_seq = ledger_a._seq + 1
        release_a = [("-", "req-a")]
        forward_to_b = [("r", "req-b", "b")]
        fake_reserve = [("+", "req-x", ["p0"], [500], "t", 500, time.time())]
        forged = [
            # the old wire, no tag at all
            msgspec.msgpack.encode(["a", next_seq, release_a]),
            msgspec.msgpack.encode(["a", next_seq, forward_to_b]),
            # the new wire with a tag made without the secret
            message("a", next_seq, release_a) + bytes(TAG_BYTES),
            message("a", next_seq, forward_to_b) + bytes(TAG_BYTES),
            message("x", 0, fake_reserve) + bytes(TAG_BYTES),
            # signed with another secret
            LedgerAuth(b"not-the-shared-secret-0000").seal_message(message("a", next_seq, release_a)),
        ]
        for payload in forged:
            assert await root.publish(channel, payload) >= 1  # b (and a) listen
        await until(lambda: ledger_b.stats.rejected.get("bad_mac", 0) == len(forged))
        assert ledger_b.others_tokens("p0") == 40
        assert ledger_b.take_forwarded() == []
        assert set(ledger_b._mirrors) == {"a"}
        assert metrics.rejected == {"bad_mac": len(forged)}

        ledger_a.reservation_ended(ledger_b._mirrors["a"].table.get("req-a"))  # type: ignore[arg-type]
        await until(lambda: ledger_b.others_tokens("p0") == 0)
    finally:
        await ledger_a.aclose()
        await ledger_b.aclose()
        await root.aclose()


async def test_a_replayed_genuine_message_is_dropped(redis_prefix: str) -> None:
    """A forwarded Release acts at once on the replica it names, whatever the state of the sender's
    mirror: recorded off the channel and published again, it would release that replica's request
    a second time (a retried request placed there again). The seq guard drops it."""
    ledger_a = make_ledger(redis_prefix, "a", snapshot_interval_s=0.05)
    ledger_b = make_ledger(redis_prefix, "b", snapshot_interval_s=0.05)
    root = aioredis.Redis.from_url(REDIS_URL)
    recorder = root.pubsub()
    channel = f"{redis_prefix}:router:ledger"
    try:
        await recorder.subscribe(channel)
        ledger_a.start()
        ledger_b.start()
        await until(lambda: ledger_a.num_live_replicas == 2 and ledger_b.num_live_replicas == 2)
        ledger_a.forward_end_to("b", "req-b")
        await until(lambda: ledger_b.others._forwarded == ["req-b"])
        assert ledger_b.take_forwarded() == ["req-b"]
        recorded = None
        deadline = time.monotonic() + 3.0
        while recorded is None:
            assert time.monotonic() < deadline, "the forwarded Release was not seen on the channel"
            item = await recorder.get_message(ignore_subscribe_messages=True, timeout=0.1)
            if item is not None and b"req-b" in item["data"]:
                recorded = item["data"]
        await root.publish(channel, recorded)
        await until(lambda: ledger_b.stats.rejected.get("replayed", 0) == 1)
        await asyncio.sleep(0.05)
        assert ledger_b.take_forwarded() == []
    finally:
        await recorder.aclose()
        await ledger_a.aclose()
        await ledger_b.aclose()
        await root.aclose()


async def test_a_forged_snapshot_makes_no_mirror(redis_prefix: str) -> None:
    """Snapshots live in Redis keys: an invented replica listed as alive with an untagged snapshot
    holding a reservation is not mirrored; a tagged one is."""
    ledger_b = make_ledger(redis_prefix, "b", snapshot_interval_s=0.05)
    root = aioredis.Redis.from_url(REDIS_URL)
    reservation = ("+", "req-x", ["p0"], [500], "t", 500, time.time())
    body = msgspec.msgpack.encode(
        {"replica": "x", "seq": 0, "at": time.time(), "reservations": [reservation], "waiters": []}
    )
    try:
        await root.set(f"{redis_prefix}:router:alive:x", b"1", px=30_000)
        await root.zadd(f"{redis_prefix}:router:replicas", {"x": 0})
        await root.set(f"{redis_prefix}:router:ledger:x", body + bytes(TAG_BYTES), px=30_000)
        ledger_b.start()
        await until(lambda: ledger_b.stats.rejected.get("bad_mac", 0) >= 2)
        assert "x" not in ledger_b._mirrors and ledger_b.others_tokens("p0") == 0
        # Another replica's genuine snapshot copied under x's key is not x's.
        other = msgspec.msgpack.encode({"replica": "y", "seq": 0, "at": time.time(), "reservations": [reservation]})
        await root.set(f"{redis_prefix}:router:ledger:x", LedgerAuth(LEDGER_SECRET).seal_snapshot(other), px=30_000)
        await until(lambda: ledger_b.stats.rejected.get("malformed", 0) >= 1)
        assert "x" not in ledger_b._mirrors and ledger_b.others_tokens("p0") == 0

        await root.set(f"{redis_prefix}:router:ledger:x", LedgerAuth(LEDGER_SECRET).seal_snapshot(body), px=30_000)
        await until(lambda: ledger_b.others_tokens("p0") == 500)
    finally:
        await ledger_b.aclose()
        await root.aclose()


async def test_ten_thousand_replica_ids_make_at_most_max_replicas_mirrors(redis_prefix: str) -> None:
    """Without the secret they make none; with it (a compromised replica) at most ``max_replicas``,
    the rest dropped and counted; mirrors silent for a lease go, and a new replica is mirrored again."""
    now_s = [1000.0]
    ledger = make_ledger(redis_prefix, "b", clock=lambda: now_s[0])
    auth = LedgerAuth(LEDGER_SECRET)
    reservation = [("+", "req", ["p0"], [10], "t", 10, time.time())]
    try:
        for i in range(10_000):
            ledger.receive(message(f"fake-{i}", 0, reservation) + bytes(TAG_BYTES))
        assert not ledger._mirrors and ledger.stats.rejected == {"bad_mac": 10_000}
        for i in range(10_000):
            ledger.receive(auth.seal_message(message(f"fake-{i}", 0, reservation)))
        assert len(ledger._mirrors) == DEFAULT_MAX_REPLICAS
        assert ledger.stats.rejected["too_many_replicas"] == 10_000 - DEFAULT_MAX_REPLICAS
        ledger.receive(auth.seal_message(message("real", 0, reservation)))
        assert "real" not in ledger._mirrors

        now_s[0] += 61  # a lease (60 s) of silence
        await ledger.tick()
        assert not ledger._mirrors
        ledger.receive(auth.seal_message(message("real", 0, reservation)))
        assert set(ledger._mirrors) == {"real"}
    finally:
        await ledger.aclose()


async def test_stale_and_replayed_messages_are_dropped_without_redis() -> None:
    wall = [1_000_000.0]
    ledger = make_ledger("unused", "b", wall_clock=lambda: wall[0], max_message_age_s=30.0)
    auth = LedgerAuth(LEDGER_SECRET)
    try:
        forward = [("r", "req-b", "b")]
        ledger.receive(auth.seal_message(message("a", 5, forward, sent_at_unix=wall[0] - 31)))
        ledger.receive(auth.seal_message(message("a", 5, forward, sent_at_unix=wall[0] + 31)))
        assert ledger.stats.rejected == {"stale": 2} and ledger.take_forwarded() == []
        genuine = auth.seal_message(message("a", 5, forward, sent_at_unix=wall[0] - 1))
        ledger.receive(genuine)
        assert ledger.take_forwarded() == ["req-b"]
        ledger.receive(genuine)
        ledger.receive(auth.seal_message(message("a", 4, forward, sent_at_unix=wall[0])))
        assert ledger.take_forwarded() == [] and ledger.stats.rejected["replayed"] == 2
        ledger.receive(auth.seal_message(message("a", 6, forward, sent_at_unix=wall[0])))
        assert ledger.take_forwarded() == ["req-b"]
    finally:
        await ledger.aclose()


def test_the_tag_covers_every_byte_and_keeps_messages_and_snapshots_apart() -> None:
    auth = LedgerAuth(LEDGER_SECRET)
    body = message("a", 1, [("-", "req")])
    sealed = auth.seal_message(body)
    assert auth.open_message(sealed) == body
    for i in range(len(sealed)):
        flipped = bytearray(sealed)
        flipped[i] ^= 0x01
        assert auth.open_message(bytes(flipped)) is None
    assert auth.open_message(body) is None and auth.open_message(b"") is None
    assert auth.open_snapshot(sealed) is None  # a message does not pass for a snapshot
    assert auth.open_message(auth.seal_snapshot(body)) is None
    with pytest.raises(LedgerSecretError):
        LedgerAuth(b"short")


def test_the_secret_comes_from_a_file_and_several_replicas_refuse_to_start_without_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "secret"
    path.write_bytes(LEDGER_SECRET + b"\n")
    monkeypatch.setenv("TANDEM_ROUTER_LEDGER__SECRET_FILE", str(path))
    settings = TandemRouterSettings()
    assert settings.ledger.secret_file == path
    assert read_secret(path) == LEDGER_SECRET
    assert settings.router_config().ledger.secret_file == path  # the path travels, the secret does not
    assert LEDGER_SECRET.decode() not in str(settings.router_config().model_dump(mode="json"))
    check_secret_file(path, num_replicas=4)
    check_secret_file(None, num_replicas=1)
    with pytest.raises(LedgerSecretError, match="TANDEM_ROUTER_LEDGER__SECRET_FILE"):
        check_secret_file(None, num_replicas=2)
    with pytest.raises(LedgerSecretError, match="secret_file"):
        build_app(RouterConfig(), num_replicas=2)
    path.write_bytes(b"too short\n")
    with pytest.raises(LedgerSecretError, match="at least 16"):
        check_secret_file(path, num_replicas=1)
