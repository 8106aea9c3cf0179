"""The ledger's typed wire (:mod:`tandem.router.ledger_events`): every event survives a round trip
through a sealed message, the typed wire is the version before's positional tuples byte for byte
(a rolling upgrade reads both ways), and what a replica cannot decode is counted, never raised."""

from __future__ import annotations

import msgspec
import pytest

from tandem.router.ledger import Ledger
from tandem.router.ledger_auth import LedgerAuth
from tandem.router.ledger_events import (
    BlockHashes,
    Codec,
    Dequeued,
    Ended,
    Event,
    ForwardedEnd,
    HandedOff,
    HandOffPlacement,
    Message,
    Queued,
    Reserved,
    Snapshot,
    WaitingRequest,
    WorkerRef,
)
from tests.kit.router import LEDGER_SECRET

NOW_UNIX = 1_700_000_000.5
WAITING = WaitingRequest(
    model="m",
    num_prompt_tokens=300,
    max_tokens=16,
    block_hashes=[BlockHashes(16, "sha256", [11, 12])],
    exclude_worker_ids=["d0"],
    prefill_done_on_worker_id="",
    priority="normal",
    local_prefill_only=True,
)
PLACEMENT = HandOffPlacement(
    worker_ids=["p0", "d0"],
    tokens=[300, 316],
    tenant="t",
    placed_at_unix=NOW_UNIX,
    prefill=WorkerRef("p0", "prefill", "m", "10.0.0.1:1"),
    decode=WorkerRef("d0", "decode", "m", "10.0.0.2:1"),
    lease_s=600.0,
    num_cached_tokens=32,
    num_decode_cached_tokens=0,
    reason="cache_aware",
)
#: Each event, and the tuple the version before published for it.
EVENTS: list[tuple[Event, tuple[object, ...]]] = [
    (
        Reserved("r1", ["p0", "d0"], [300, 316], "t", 268, NOW_UNIX),
        ("+", "r1", ["p0", "d0"], [300, 316], "t", 268, NOW_UNIX),
    ),
    (Ended("r1"), ("-", "r1")),
    (
        Queued("r2", "t", 1, NOW_UNIX, WAITING),
        # The version before ends the payload at local_prefill_only; the trailing adapter ("": the base
        # model, issue 40) is one element more, which the version before ignores (msgspec drops extra
        # trailing elements of an array-like struct).
        ("q", "r2", "t", 1, NOW_UNIX, ["m", 300, 16, [[16, "sha256", [11, 12]]], ["d0"], "", "normal", True, ""]),
    ),
    (Dequeued("r2"), ("d", "r2")),
    (ForwardedEnd("r3", "b"), ("r", "r3", "b")),
    (
        HandedOff("r2", "b", PLACEMENT),
        (
            "p",
            "r2",
            "b",
            [
                ["p0", "d0"],
                [300, 316],
                "t",
                NOW_UNIX,
                ["p0", "prefill", "m", "10.0.0.1:1"],
                ["d0", "decode", "m", "10.0.0.2:1"],
                600.0,
                32,
                0,
                "cache_aware",
            ],
        ),
    ),
]


def make_ledger(name: str = "b") -> Ledger:
    return Ledger(
        "redis://127.0.0.1:6379/0",
        key_prefix="unused",
        replica_id=name,
        secret=LEDGER_SECRET,
        lease_s=60,
        young_s=1,
        wall_clock=lambda: NOW_UNIX,
    )


@pytest.mark.parametrize(("event", "positional"), EVENTS, ids=lambda v: type(v).__name__)
def test_each_event_is_the_version_befores_tuple_on_the_wire(event: Event, positional: tuple[object, ...]) -> None:
    codec = Codec()
    typed = codec.encode(Message("a", 7, [event], NOW_UNIX))
    old = msgspec.msgpack.encode(["a", 7, [positional], NOW_UNIX])
    assert typed == old
    assert codec.decode_message(old).events == [event]


def test_the_version_befores_shorter_payloads_decode_with_their_defaults() -> None:
    """A waiter without a payload (older still) and a payload without local_prefill_only."""
    codec = Codec()
    old = msgspec.msgpack.encode(
        [
            "a",
            0,
            [
                ("q", "r", "t", 0, NOW_UNIX),
                (
                    "q",
                    "s",
                    "t",
                    0,
                    NOW_UNIX,
                    [
                        "m",
                        1,
                        2,
                        [],
                        [],
                        "",
                        "",
                    ],
                ),
            ],
            NOW_UNIX,
        ]
    )
    without, seven = codec.decode_message(old).events
    assert isinstance(without, Queued) and without.payload is None
    assert isinstance(seven, Queued) and seven.payload is not None and seven.payload.local_prefill_only is False
    assert seven.payload.adapter == ""


def test_the_version_before_reads_a_payload_with_an_adapter_and_ignores_it() -> None:
    class WaitingBefore(msgspec.Struct, frozen=True, array_like=True):
        model: str
        num_prompt_tokens: int
        max_tokens: int
        block_hashes: list[BlockHashes]
        exclude_worker_ids: list[str]
        prefill_done_on_worker_id: str
        priority: str
        local_prefill_only: bool = False

    with_adapter = msgspec.structs.replace(WAITING, adapter="support-bot@3")
    before = msgspec.msgpack.decode(msgspec.msgpack.encode(with_adapter), type=WaitingBefore)
    assert before.local_prefill_only is True and before.model == "m"
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(with_adapter), type=WaitingRequest) == with_adapter


def test_a_snapshot_round_trips_and_keeps_its_keys() -> None:
    codec = Codec()
    snapshot = Snapshot(
        replica_id="a",
        seq=3,
        sent_at_unix=NOW_UNIX,
        reservations=[Reserved("r1", ["p0"], [40], "t", 40, NOW_UNIX)],
        waiters=[Queued("r2", "t", 0, NOW_UNIX, None)],
        served={"t": (40.0, NOW_UNIX)},
        recent={"p0": (40.0, NOW_UNIX)},
    )
    body = codec.encode(snapshot)
    assert codec.decode_snapshot(body) == snapshot
    assert set(msgspec.msgpack.decode(body)) == {"replica", "seq", "at", "reservations", "waiters", "served", "recent"}


async def test_every_event_reaches_the_receiver_typed() -> None:
    """A's events, sealed and published as the ledger does, applied by B: its mirror, its forwarded
    Releases and its hand-offs carry the typed payloads."""
    a, b = make_ledger("a"), make_ledger("b")
    published: list[bytes] = []

    def publish(payload: bytes) -> bool:
        published.append(payload)
        return True

    a._publisher.publish = publish  # type: ignore[method-assign]  # the real encoding, no Redis
    try:
        b.apply_snapshot("a", LedgerAuth(LEDGER_SECRET).seal_snapshot(Codec().encode(Snapshot("a", -1, NOW_UNIX))))
        a._outbox = [Reserved("r1", ["p0"], [40], "t", 40, NOW_UNIX), Queued("r2", "t", 0, NOW_UNIX, WAITING)]
        a._flush()
        a._outbox = [ForwardedEnd("r9", "b"), HandedOff("r8", "b", PLACEMENT)]
        a._flush()
        for payload in published:
            b.receive(payload)
        assert b.others_tokens("p0") == 40
        assert [(w.request_id, w.payload) for w in b.remote_waiters()] == [("r2", WAITING)]
        assert b.take_forwarded() == ["r9"]
        handoffs = b.take_handoffs()
        assert [(h.request_id, h.placer_id, h.placement) for h in handoffs] == [("r8", "a", PLACEMENT)]
        assert b.stats.rejected == {}
    finally:
        await a.aclose()
        await b.aclose()


@pytest.mark.parametrize(
    "events",
    [
        # the version before's hand-off of a local prefill: no prefill worker was [] (now nil)
        [("p", "r", "b", [["d0"], [10], "t", NOW_UNIX, [], ["d0", "decode", "m", "h:1"], 600.0, 0, 0, "x"])],
        [("z", "r")],  # an event this version does not know
        [("+", "r", ["p0"], ["forty"], "t", 40, NOW_UNIX)],  # a wrong type
        [("-",)],  # too short
        "not a list",
    ],
    ids=["old_local_prefill_handoff", "unknown_tag", "wrong_type", "too_short", "no_events"],
)
async def test_a_message_that_does_not_decode_is_counted_malformed_and_changes_nothing(events: object) -> None:
    ledger = make_ledger()
    auth = LedgerAuth(LEDGER_SECRET)
    try:
        ledger.receive(auth.seal_message(msgspec.msgpack.encode(["a", 0, events, NOW_UNIX])))
        ledger.receive(auth.seal_message(msgspec.msgpack.encode(["a", 0, [("r", "x", "b")], NOW_UNIX])))
        assert ledger.stats.rejected == {"malformed": 1}
        # The sender's next message is heard (the one that did not decode left no trace).
        assert ledger.take_forwarded() == ["x"] and ledger.take_handoffs() == []
    finally:
        await ledger.aclose()
