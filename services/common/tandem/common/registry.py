"""The worker registry in Redis.

Workers call :meth:`WorkerRegistry.heartbeat` every ``heartbeat_interval_s``
with their current :class:`WorkerRecord`; the router and the gateway call
:meth:`WorkerRegistry.list_workers`. A record lives ``ttl_s`` past its last
heartbeat, so a worker that dies disappears by itself; a worker that stops
cleanly calls :meth:`WorkerRegistry.unregister`.

Layout: one sorted set ``<prefix>:workers`` (member = worker id, score =
expiry in Unix ms by the worker's clock, informational) and one string
``<prefix>:worker:<id>`` (JSON, with a Redis TTL) per worker. Liveness is the
record key's Redis TTL alone: Redis's clock is the only one that counts, so a
worker and a router whose clocks disagree still see each other. The sorted set
is an index; readers prune members whose record has expired.

**A record is checked where it is read** (:meth:`WorkerRecord.from_json`): its JSON against the
record's types (msgspec; fields this version does not know are skipped), then what the readers put
into metric labels, PromQL selectors and arithmetic (a role of :data:`ROLES`, a worker id and a model
name of :data:`WORKER_ID` / :data:`MODEL_NAME`, counts and sizes not negative, loads finite). Anything
that can write the registry (a worker's Redis user, or an insider with it) could otherwise stop every
reader: one record with a non-ASCII model made every router Schedule fail (Ray's metric tags are
ASCII), one that did not parse failed the whole list's refresh, so the router kept an old list for
good. A record that fails is skipped and logged by its readers (:meth:`WorkerRegistry.list_workers`,
the router's ``tandem.router.worker_view``); the others are served as before.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tandem.common import redis_retry
from tandem.common.errors import BackendUnavailableError

ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
ROLES = (ROLE_PREFILL, ROLE_DECODE)
#: A served model's name (the engine's served_model_name, the gateway's ``model``, a ``model`` metric label
#: and PromQL selector value): ASCII, no quote, backslash or space. The operator's CRD allows the same.
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./:-]{0,127}$")
#: A worker id (``<role>-<hex>`` from the worker; tests and simulated fleets use other plain names).
WORKER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")

logger = logging.getLogger(__name__)


class InvalidWorkerRecordError(ValueError):
    """A registry record that does not parse or breaks a rule of :meth:`WorkerRecord.from_json`."""


@dataclass(frozen=True)
class WorkerLoad:
    """What a worker reports about its engine on each heartbeat."""

    num_running_requests: int = 0
    num_waiting_requests: int = 0
    kv_usage: float = 0.0
    num_held_kv_requests: int = 0
    #: Prompt tokens of the requests the worker is prefilling now (prefill role).
    num_prompt_tokens_in_flight: int = 0
    #: KV tokens its running requests may grow to, prompt plus max_tokens (decode role).
    num_kv_tokens_in_flight: int = 0


@dataclass(frozen=True)
class WorkerRecord:
    """A registered worker: identity, addresses, capacity and load."""

    worker_id: str
    role: str
    model: str
    #: host:port of the tandem.v1.Worker gRPC service.
    address: str
    #: host:port of the KV transfer server (prefill) or "" (decode).
    kv_address: str = ""
    #: ZMQ endpoint of the engine's KV-event publisher, "" when off.
    kv_events_endpoint: str = ""
    #: ZMQ endpoint of the publisher's replay (ROUTER) socket, "" when off.
    kv_events_replay_endpoint: str = ""
    #: How the engine hashes prefix-cache blocks (see tandem.common.block_hash).
    block_hash_algo: str = "sha256"
    block_hash_seed: str = "vllm-none-hash"
    block_size_tokens: int = 0
    num_kv_blocks: int = 0
    max_model_len: int = 0
    started_unix_s: float = 0.0
    #: LoRA adapters the engine can hold at once (vLLM's max_loras); 0: LoRA is off on this worker.
    max_adapters: int = 0
    #: Engine names (tandem.common.adapters) of the adapters loaded now, least recently used first.
    adapters: tuple[str, ...] = ()
    #: Which weights the engine runs (declared, or read from the model folder: tandem.common.kv_fingerprint).
    model_revision: str = ""
    #: The engine's KV-layout fingerprint (tandem.common.kv_fingerprint): the router pairs a prefill worker
    #: only with decode workers of the same one. "" from a worker of an older version: pairs only with "".
    kv_fingerprint: str = ""
    #: The data paths its KV server serves held blocks over: "grpc" always, "shm" with shared memory on
    #: (tandem.worker.kv_connector.shm_transport); a worker of an older version: gRPC only.
    kv_data_paths: tuple[str, ...] = ("grpc",)
    #: With "shm": the host (node name or boot id) and the shared directory's token; a decode worker of the
    #: same two pulls from it through shared memory.
    kv_shm_host_id: str = ""
    kv_shm_dir_token: str = ""
    load: WorkerLoad = field(default_factory=WorkerLoad)

    @property
    def capacity_tokens(self) -> int:
        """KV tokens the engine can hold."""
        return self.block_size_tokens * self.num_kv_blocks

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> WorkerRecord:
        """The record in ``raw``, checked (module docstring); fields this version does not know are skipped
        (a newer worker may send more). Raises :class:`InvalidWorkerRecordError`."""
        try:
            record = _RECORD_DECODER.decode(raw)
        except msgspec.DecodeError as exc:  # (ValidationError derives from it)
            raise InvalidWorkerRecordError(f"worker record does not parse: {exc}") from None
        record.check()
        return record

    def check(self) -> None:
        """Raise :class:`InvalidWorkerRecordError` for what a reader cannot serve (module docstring)."""
        if not WORKER_ID.fullmatch(self.worker_id):
            raise InvalidWorkerRecordError(f"worker id {self.worker_id[:40]!r} does not match {WORKER_ID.pattern}")
        if self.role not in ROLES:
            raise InvalidWorkerRecordError(f"worker {self.worker_id}: role {self.role[:20]!r} is not one of {ROLES}")
        if not MODEL_NAME.fullmatch(self.model):
            raise InvalidWorkerRecordError(
                f"worker {self.worker_id}: model {self.model[:40]!r} does not match {MODEL_NAME.pattern}"
            )
        counts = {name: getattr(self, name) for name in _RECORD_COUNTS}
        counts.update({name: getattr(self.load, name) for name in _LOAD_COUNTS})
        negative = sorted(name for name, value in counts.items() if value < 0)
        if negative:
            raise InvalidWorkerRecordError(f"worker {self.worker_id}: negative {', '.join(negative)}")
        if not (math.isfinite(self.load.kv_usage) and self.load.kv_usage >= 0):
            raise InvalidWorkerRecordError(f"worker {self.worker_id}: kv_usage {self.load.kv_usage} is not a share")


_RECORD_DECODER = msgspec.json.Decoder(WorkerRecord)
_RECORD_COUNTS = tuple(f.name for f in dataclasses.fields(WorkerRecord) if f.type in ("int", int))
_LOAD_COUNTS = tuple(f.name for f in dataclasses.fields(WorkerLoad) if f.type in ("int", int))


#: A reader that skips bad records logs it at most this often (it reads the list every second or so).
REJECT_LOG_INTERVAL_S = 60.0
_reject_logged_s: dict[str, float] = {}


def parse_records(raws: list[bytes], *, source: str) -> list[WorkerRecord]:
    """The records of ``raws`` that pass :meth:`WorkerRecord.from_json`; one that does not is skipped, so
    one bad record never hides the others, and logged (by ``source``, the reader) once a minute."""
    records = []
    for raw in raws:
        try:
            records.append(WorkerRecord.from_json(raw))
        except InvalidWorkerRecordError as exc:
            now_s = time.monotonic()
            if now_s - _reject_logged_s.get(source, -REJECT_LOG_INTERVAL_S) >= REJECT_LOG_INTERVAL_S:
                _reject_logged_s[source] = now_s
                logger.warning("%s: skipping a worker record (logged once a minute): %s", source, exc)
    return records


class WorkerRegistry:
    """Redis-backed registry of live workers. Safe to share across tasks."""

    def __init__(self, redis_url: str, *, key_prefix: str = "tandem", ttl_s: float = 5.0) -> None:
        self._redis: aioredis.Redis = redis_retry.connect(redis_url, timeout_s=2.0)
        self._prefix = key_prefix
        self._ttl_s = ttl_s

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    def _set_key(self) -> str:
        return f"{self._prefix}:workers"

    def _record_key(self, worker_id: str) -> str:
        return f"{self._prefix}:worker:{worker_id}"

    def _removals_key(self) -> str:
        return f"{self._prefix}:workers:removed"

    async def heartbeat(self, record: WorkerRecord) -> None:
        """Register or refresh ``record`` for another ``ttl_s``."""
        # Redis rejects PX 0; a sub-millisecond TTL means "expire at once" anyway.
        ttl_ms = max(1, int(self._ttl_s * 1000))
        expiry_ms = int(time.time() * 1000) + ttl_ms
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(self._record_key(record.worker_id), record.to_json(), px=ttl_ms)
                pipe.zadd(self._set_key(), {record.worker_id: expiry_ms})
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise BackendUnavailableError(f"worker registry unreachable: {exc}") from exc

    async def unregister(self, worker_id: str) -> None:
        """Remove a worker at once (clean shutdown, drain, a dead engine, a supervisor that saw it die),
        and count the removal (:meth:`removals`), so that readers drop it now, not at their next read."""
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(self._record_key(worker_id))
                pipe.zrem(self._set_key(), worker_id)
                pipe.incr(self._removals_key())
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise BackendUnavailableError(f"worker registry unreachable: {exc}") from exc

    async def removals(self) -> int:
        """How many times a worker was unregistered (one small GET): a reader that polls it often can
        refresh its list as soon as it changes, and read the whole list rarely."""
        try:
            raw = await self._redis.get(self._removals_key())
        except (RedisError, OSError) as exc:
            raise BackendUnavailableError(f"worker registry unreachable: {exc}") from exc
        return int(raw or 0)

    async def list_raw_records(self, *, batch_size: int = 0) -> list[bytes]:
        """Every live worker's record as stored (JSON), for readers that parse them themselves.

        ``batch_size`` > 0 reads the records that many per MGET: the reader's event loop then
        parses one small reply at a time (at 1,000 workers one MGET reply took ~4 ms of the loop)."""
        try:
            ids = [i.decode() if isinstance(i, bytes) else str(i)
                   for i in await self._redis.zrange(self._set_key(), 0, -1)]
            keys = [self._record_key(i) for i in ids]
            step = batch_size if batch_size > 0 else max(1, len(keys))
            raws: list[Any] = []
            for start in range(0, len(keys), step):
                raws.extend(await self._redis.mget(keys[start:start + step]))
            # Not filtered by the set's scores: they come from the workers' clocks.
            expired_ids = [i for i, raw in zip(ids, raws, strict=True) if raw is None]
            if expired_ids:
                # A worker that re-registers between MGET and ZREM drops out of the
                # index until its next heartbeat (one interval), never for longer.
                await self._redis.zrem(self._set_key(), *expired_ids)
        except (RedisError, OSError) as exc:
            raise BackendUnavailableError(f"worker registry unreachable: {exc}") from exc
        return [raw if isinstance(raw, bytes) else str(raw).encode() for raw in raws if raw is not None]

    async def list_workers(self, *, role: str | None = None, model: str | None = None) -> list[WorkerRecord]:
        """Live workers, optionally filtered by role and model, sorted by id."""
        records = parse_records(await self.list_raw_records(), source="worker registry")
        return sorted(
            (r for r in records
             if (role is None or r.role == role) and (model is None or r.model == model)),
            key=lambda r: r.worker_id,
        )

    async def aclose(self) -> None:
        await self._redis.aclose()
