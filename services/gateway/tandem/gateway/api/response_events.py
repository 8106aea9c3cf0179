"""The stored stream events of a streamed background response (``background: true, stream: true``), so that a
client that lost the create's stream resumes it through any replica with
``GET /v1/responses/{id}?stream=true&starting_after=N``.

Written by :class:`EventRecorder`, which :mod:`~tandem.gateway.api.background_responses` puts behind the
generating gateway's :class:`~tandem.gateway.api.streaming.StreamedResponse` (it reads the Server-Sent Events that
writer sends, whatever the answer's wire format: plain text, tool calls, ``auto``); read by the create's own
stream (:meth:`EventRecorder.frames`, from this gateway's memory) and by a resume (:meth:`EventLog.read`, from
Redis). Calls Redis only.

* **Layout.** A Redis list per response, ``<prefix>:gw:conv:<tenant>:<response id>:events``, beside the response's
  own record (``…:<response id>``): in the tenant's namespace, with the conversations' TTL after its last
  write, and deleted with the record (an eviction, the TTL's clean-up and ``DELETE`` all go through the
  conversation store's ``evict``, which deletes both). The name cannot be a conversation's: a chat conversation
  id may not start with ``resp_`` and a response id holds no ``:``. Element 0 is :data:`HEADER` (the response
  was created to stream: a resume of one that was not is refused); the event whose ``sequence_number`` is
  ``n`` is element ``n + 1``, stored as its SSE frame without the closing blank line.
* **Byte budget.** The list is item ``events:<response id>`` of the tenant's storage account
  (:mod:`tandem.gateway.storage_quota`), counted as the conversation scripts count turns. Stream events do not
  evict anything: a batch is stored only while the account stays under the tenant's limit with room left for
  the response's answer (``reserve_bytes``, the preparation's estimate), so that the replay buffer never costs
  the tenant a stored conversation nor the response its own answer. Past that, :data:`TRUNCATED` closes the list
  and nothing more is stored; the create's stream goes on from memory, and a resume that reaches the mark ends
  with an ``error`` event (``storage_quota_exceeded``: ``GET`` the response for its result).
* **Stored, then sent.** A batch goes to the create's stream only once Redis took it, so every event a client
  saw can be resumed from (one Redis round trip, under a millisecond in a cluster, against tens of ms between
  tokens; under load the batches grow instead). When Redis fails a write the list stops there, as past the
  budget but without the mark; a resume then ends with the response's final status (below).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis

from tandem.gateway.redis_client import redis_errors
from tandem.gateway.sse import encode_event
from tandem.gateway.storage_quota import ACCOUNT_LUA, ENTRY_OVERHEAD_BYTES, ITEM_OVERHEAD_BYTES, account_key
from tandem.gateway.tenancy.store import tenant_record_key, tenant_salt_guard_lua

logger = logging.getLogger(__name__)

#: Element 0 of every event list: an SSE comment, never sent.
HEADER = ": stream"
#: The last element of a list closed at the tenant's storage limit: an SSE comment, never sent.
TRUNCATED = ": truncated"
#: The event types that end a response's stream.
FINAL_TYPES = frozenset({"response.completed", "response.incomplete", "response.failed", "response.cancelled", "error"})
#: The final event of a stream that ended without one (cancelled, failed before its first token, or its
#: gateway stopped), by the response's status.
FINAL_TYPE_OF_STATUS = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
    "cancelled": "response.cancelled",
}
TRUNCATED_MESSAGE = (
    "The rest of this stream was not kept: it was over this tenant's storage quota. "
    "GET /v1/responses/{id} for the response."
)

#: Appends a batch of events under the tenant's limit (the module docstring). KEYS: the event list, the tenant's
#: account. ARGV: TTL (s), the tenant's limit (bytes), the bytes to leave free for the answer, the account item,
#: the tenant's salt, the tenant's record ('' for no check), then the events. Returns 1 (stored), 0 (over the
#: limit: :data:`TRUNCATED` stored if it fits, nothing else) or -1 (the tenant is gone: nothing stored).
_APPEND = (
    "#!lua\n"
    + tenant_salt_guard_lua(key="ARGV[6]", salt="ARGV[5]", refused="-1")
    + ACCOUNT_LUA
    + f"""local key, account = KEYS[1], KEYS[2]
local ttl_s, limit, reserve, item = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local old = tonumber(redis.call('HGET', account, item) or 0)
local first = 0
if old == 0 then
  first = {ITEM_OVERHEAD_BYTES}
end
local mark = first + #'{TRUNCATED}' + {ENTRY_OVERHEAD_BYTES}
local n = first
for i = 7, #ARGV do
  n = n + #ARGV[i] + {ENTRY_OVERHEAD_BYTES}
end
local total = stored_total(account)
local stored = 1
if total + (n - first) + mark + reserve > limit then
  if total + mark > limit then
    return 0
  end
  redis.call('RPUSH', key, '{TRUNCATED}')
  n, stored = mark, 0
else
  redis.call('RPUSH', key, unpack(ARGV, 7))
end
stored_set(account, item, old + n)
redis.call('EXPIRE', key, ttl_s)
stored_keep(account, ttl_s)
return stored
"""
)


def frame_type(frame: str) -> str:
    """The event type of a stored frame (``event: <type>`` is its first line)."""
    first = frame.split("\n", 1)[0]
    return first.removeprefix("event: ")


def final_frame(response: dict[str, Any], sequence_number: int) -> bytes:
    """The final event of a stream that ended without one, from the response's final record."""
    name = FINAL_TYPE_OF_STATUS.get(response.get("status", ""), "response.failed")
    payload = {"type": name, "sequence_number": sequence_number, "response": response}
    return f"event: {name}\n".encode() + encode_event(payload)


def error_frame(sequence_number: int, message: str, code: str) -> bytes:
    """An ``error`` event (the SDK's ``ResponseErrorEvent``): the stream cannot go on."""
    payload = {"type": "error", "sequence_number": sequence_number, "code": code, "message": message, "param": None}
    return b"event: error\n" + encode_event(payload)


class EventLog:
    """The stored event lists of one gateway's tenants (Redis)."""

    def __init__(self, client: aioredis.Redis, *, key_prefix: str, ttl_s: int) -> None:
        self._redis = client
        self._key_prefix = key_prefix
        self._p = f"{key_prefix}:gw:conv"
        self._ttl_s = ttl_s
        self._append: Any = client.register_script(_APPEND)

    def key(self, tenant_id: str, response_id: str) -> str:
        return f"{self._p}:{tenant_id}:{response_id}:events"

    async def append(
        self,
        tenant_id: str,
        response_id: str,
        frames: list[str],
        *,
        tenant_salt: str,
        limit_bytes: int,
        reserve_bytes: int,
    ) -> bool:
        """Store ``frames`` after the ones before; False when they were over the budget (the list is closed:
        store nothing more). Raises BackendUnavailableError when Redis cannot take them."""
        args: list[str | int] = [
            self._ttl_s,
            limit_bytes,
            reserve_bytes,
            f"events:{response_id}",
            tenant_salt,
            tenant_record_key(self._key_prefix, tenant_id) if tenant_salt else "",
            *frames,
        ]
        keys = [self.key(tenant_id, response_id), account_key(self._key_prefix, tenant_id)]
        with redis_errors("response events write"):
            stored = await self._append(keys=keys, args=args)
        return int(stored) == 1

    async def length(self, tenant_id: str, response_id: str) -> int:
        """The list's length: 0 for a response that was not created to stream (or whose events expired)."""
        with redis_errors("response events read"):
            return int(await self._redis.llen(self.key(tenant_id, response_id)))

    async def read(self, tenant_id: str, response_id: str, first: int) -> list[str]:
        """The stored elements from index ``first`` on."""
        with redis_errors("response events read"):
            raws = await self._redis.lrange(self.key(tenant_id, response_id), first, -1)
        return [raw.decode() if isinstance(raw, bytes) else raw for raw in raws]


class EventRecorder:
    """One streamed background response's events: read from the SSE bytes its writer sends (:meth:`feed`),
    stored in batches by :meth:`run` (a task of the generation's), and kept in memory for the create's own
    stream (:meth:`frames`)."""

    def __init__(
        self,
        log: EventLog,
        tenant_id: str,
        response_id: str,
        *,
        tenant_salt: str,
        limit_bytes: int,
        reserve_bytes: int,
    ) -> None:
        self._log = log
        self._tenant_id = tenant_id
        self._response_id = response_id
        self._tenant_salt = tenant_salt
        self._limit_bytes = limit_bytes
        self._reserve_bytes = reserve_bytes
        self._unparsed = b""
        self._pending: list[str] = []
        self._wake = asyncio.Event()
        #: The events stored so far (or past the point where storing stopped), in order: the create's stream.
        self.published: list[str] = []
        #: Set (and replaced) at each publication, for the readers of :meth:`frames`.
        self._news = asyncio.Event()
        self._closing = False
        #: Set once every event was published and the response's record is final (:meth:`close`).
        self.closed = False
        self._storing = True

    async def store_header(self) -> None:
        """Element 0 (:data:`HEADER`), before the create answers. Raises BackendUnavailableError."""
        await self._store([HEADER])

    async def _store(self, frames: list[str]) -> None:
        if not await self._log.append(
            self._tenant_id,
            self._response_id,
            frames,
            tenant_salt=self._tenant_salt,
            limit_bytes=self._limit_bytes,
            reserve_bytes=self._reserve_bytes,
        ):
            self._storing = False
            logger.warning(
                "response events over the tenant's storage quota: no more stored",
                extra={"request_id": self._response_id, "num_events": len(self.published)},
            )

    def feed(self, chunk: bytes) -> None:
        """SSE bytes from the stream writer: whole events are queued for :meth:`run` (heartbeats dropped)."""
        self._unparsed += chunk
        *frames, self._unparsed = self._unparsed.split(b"\n\n")
        events = [f.strip(b"\n").decode() for f in frames if f.strip(b"\n")]
        if events:
            self._pending.extend(events)
            self._wake.set()

    async def run(self) -> None:
        """Store what is pending, then publish it, until :meth:`close`."""
        while not self.closed:
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending, []
            closing = self._closing
            if batch and self._storing:
                try:
                    await self._store(batch)
                except Exception as exc:  # Redis down: the create's stream goes on; resumes end at the gap
                    self._storing = False
                    logger.warning("response events not stored: %s", exc, extra={"request_id": self._response_id})
            self.published.extend(batch)
            self.closed = closing and not self._pending
            news, self._news = self._news, asyncio.Event()
            news.set()

    def stream_error(self) -> dict[str, str] | None:
        """The ``error`` of the stream's last event when it is ``response.failed`` (an error after the stream
        began, which the record must say too), else None."""
        events = self.published + self._pending
        if not events or frame_type(events[-1]) != "response.failed":
            return None
        data = events[-1].split("\ndata: ", 1)[-1]
        error = json.loads(data)["response"].get("error") or {}
        return {"code": str(error.get("code", "server_error")), "message": str(error.get("message", ""))}

    def close(self) -> None:
        """The generation ended and the record is final: :meth:`run` stores what is left and stops."""
        self._closing = True
        self._wake.set()

    async def frames(self, timeout_s: float) -> AsyncIterator[str | None]:
        """The published events from the first, as they come, until :attr:`closed`; None after ``timeout_s``
        without one (for a heartbeat)."""
        sent = 0
        while True:
            if len(self.published) == sent and not self.closed:
                try:
                    await asyncio.wait_for(self._news.wait(), timeout_s)
                except TimeoutError:
                    yield None
                continue
            batch = self.published[sent:]
            sent += len(batch)
            for frame in batch:
                yield frame
            if self.closed and sent == len(self.published):
                return


def is_final(frame: str) -> bool:
    return frame_type(frame) in FINAL_TYPES
