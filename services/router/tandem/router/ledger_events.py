"""The router ledger's wire: what replicas publish on the ledger channel and write as snapshots, as
typed messages (``msgspec.Struct``), msgpack encoded. No logic here.

Written by :class:`tandem.router.ledger.Ledger` (it seals each message and snapshot with
:mod:`tandem.router.ledger_auth`) and read back by it and :mod:`tandem.router.ledger_mirror`; the
two payloads a waiting request and a hand-off carry (:class:`WaitingRequest`,
:class:`HandOffPlacement`) are filled and read by :mod:`tandem.router.handoff` for the scheduler.

A :class:`Message` is ``[replica_id, seq, events, sent_at_unix]``; its events are a tagged union
(:data:`Event`), each an array whose first element is its tag: ``"+"`` :class:`Reserved`, ``"-"``
:class:`Ended`, ``"q"`` :class:`Queued`, ``"d"`` :class:`Dequeued`, ``"r"``
:class:`ForwardedEnd`, ``"p"`` :class:`HandedOff`. A :class:`Snapshot` is a map (its keys are
the names below). Arrays rather than maps for the messages: no field names on the wire, and the
channel carries one message per event-loop iteration that placed something, to every replica.

**Rolling upgrade.** These are the positional tuples of the version before (issue 39), given types:
the same tags, fields in the same order, an array per struct, so the two versions read each other's
messages and snapshots, with one exception: the version before wrote a hand-off without a prefill
worker (a local prefill) as ``[]`` where this one writes nil. Such a hand-off from an old replica
does not decode here; nor does anything else a replica cannot read (a newer event, a wrong type).
The receiver decodes a message whole or not at all: one that does not decode is dropped and
counted (``tandem_router_ledger_rejected_total{reason="malformed"}``), never raised; the sender's
mirror then sees a gap in its seqs and is rebuilt from its next snapshot, so what is lost is the
message's requests of the moment (its forwarded Releases and hand-offs, which snapshots do not
carry): the placer's hand-off expires (``handoff_timeout_s``) and frees its budget, the waiter
waits on in its own replica's queue. A snapshot that does not decode leaves its mirror waiting for
the next one.
"""

from __future__ import annotations

from typing import TypeAlias

import msgspec


class WorkerRef(msgspec.Struct, frozen=True, array_like=True):
    """A worker as a hand-off names it (a receiver that knows the worker uses its own record)."""

    worker_id: str
    role: str
    model: str
    address: str


class BlockHashes(msgspec.Struct, frozen=True, array_like=True):
    """A prompt's block hashes for one engine hashing configuration."""

    block_size: int
    algo: str
    hashes: list[int]


class WaitingRequest(msgspec.Struct, frozen=True, array_like=True):
    """What another replica needs to place a request waiting in its replica's queue (the payload of
    :class:`Queued`): sizes, exclusions and block hashes. Its id and tenant are the event's."""

    model: str
    num_prompt_tokens: int
    max_tokens: int
    block_hashes: list[BlockHashes]
    exclude_worker_ids: list[str]
    prefill_done_on_worker_id: str
    priority: str
    #: Absent from the version before local prefills' replacements.
    local_prefill_only: bool = False
    #: The request's LoRA adapter (engine name), "" for the base model; absent from the versions before
    #: adapters (issue 40), which read such a waiter as a base-model request.
    adapter: str = ""


class HandOffPlacement(msgspec.Struct, frozen=True, array_like=True):
    """A placement one replica made and reserved for another replica's waiter (the payload of
    :class:`HandedOff`): the reservation it holds and the decision the waiter's Schedule returns."""

    worker_ids: list[str]
    #: Tokens reserved on each of ``worker_ids``, in the same order.
    tokens: list[int]
    tenant: str
    placed_at_unix: float
    #: None: a local prefill.
    prefill: WorkerRef | None
    decode: WorkerRef
    lease_s: float
    num_cached_tokens: int
    num_decode_cached_tokens: int
    reason: str


class Reserved(msgspec.Struct, frozen=True, array_like=True, tag="+"):
    """The sender reserved budget on workers for a request."""

    request_id: str
    worker_ids: list[str]
    #: Tokens reserved on each of ``worker_ids``, in the same order.
    tokens: list[int]
    tenant: str
    #: Prompt tokens the placement makes a worker compute (the tenant's fair-share cost).
    num_uncached_tokens: int
    reserved_at_unix: float


class Ended(msgspec.Struct, frozen=True, array_like=True, tag="-"):
    """The sender ended its reservation of a request (its budget is free again)."""

    request_id: str


class Queued(msgspec.Struct, frozen=True, array_like=True, tag="q"):
    """A request waits for budget in the sender's queue."""

    request_id: str
    tenant: str
    #: Index into the priority classes (0 = highest).
    priority_index: int
    enqueued_at_unix: float
    #: None: not sent (a replica of an older version); the request cannot be placed elsewhere.
    payload: WaitingRequest | None = None


class Dequeued(msgspec.Struct, frozen=True, array_like=True, tag="d"):
    """The request left the sender's queue (placed, timed out or cancelled)."""

    request_id: str


class ForwardedEnd(msgspec.Struct, frozen=True, array_like=True, tag="r"):
    """A Release that reached the sender for a request ``owner_replica_id`` holds."""

    request_id: str
    owner_replica_id: str


class HandedOff(msgspec.Struct, frozen=True, array_like=True, tag="p"):
    """The sender placed a request waiting in ``target_replica_id``'s queue (and reserved it in the
    same message)."""

    request_id: str
    target_replica_id: str
    placement: HandOffPlacement


Event: TypeAlias = Reserved | Ended | Queued | Dequeued | ForwardedEnd | HandedOff


class Message(msgspec.Struct, frozen=True, array_like=True):
    """One publish on the ledger channel: the sender's changes of one event-loop iteration."""

    replica_id: str
    #: Numbered from 0 by each sender, one more per message: a receiver that sees a gap repairs.
    seq: int
    events: list[Event]
    sent_at_unix: float


class Snapshot(msgspec.Struct, frozen=True):
    """A replica's whole state as of its message ``seq``, written every snapshot round."""

    replica_id: str = msgspec.field(name="replica")
    seq: int
    sent_at_unix: float = msgspec.field(name="at")
    reservations: list[Reserved] = msgspec.field(default_factory=list)
    waiters: list[Queued] = msgspec.field(default_factory=list)
    #: (service in uncached prompt tokens, as of a wall-clock time) per tenant.
    served: dict[str, tuple[float, float]] = msgspec.field(default_factory=dict)
    #: (recent tokens, as of a wall-clock time) per worker, released reservations included (absent
    #: from older senders).
    recent: dict[str, tuple[float, float]] = msgspec.field(default_factory=dict)


class Codec:
    """Encodes and decodes messages and snapshots (decoding raises ``msgspec.DecodeError``, and
    ``msgspec.ValidationError`` for a wrong type)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._message_decoder = msgspec.msgpack.Decoder(Message)
        self._snapshot_decoder = msgspec.msgpack.Decoder(Snapshot)

    def encode(self, value: Message | Snapshot) -> bytes:
        return self._encoder.encode(value)

    def decode_message(self, body: bytes) -> Message:
        return self._message_decoder.decode(body)

    def decode_snapshot(self, body: bytes) -> Snapshot:
        return self._snapshot_decoder.decode(body)
