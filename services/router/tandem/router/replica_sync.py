"""What router replicas share through Redis, so that they are active-active.

Every replica runs :meth:`ReplicaSync.sync` every ``interval_s`` (from the
deployment's upkeep loop). One sync, one pipelined round trip:

* writes this replica's budget tokens per worker (total, and the part
  reserved within the last heartbeat or two, which worker reports cannot
  show yet) to
  ``<prefix>:router:replica:<replica_id>`` (a hash with a TTL of a few
  intervals) — a replica that dies stops counting once its key expires;
* reads the other replicas' hashes, so :meth:`others_tokens` gives the
  budget they hold (what :class:`tandem.router.budget.BudgetView` adds);
* records ``request id → owning replica`` for the requests placed since the
  last sync, and takes the releases other replicas forwarded to this one.

A Release that reaches a replica which does not hold the reservation (Serve's
consistent hashing moved the request id after a replica came or went) is
forwarded with :meth:`forward_release` to its owner's release list; when the
owner is gone there is nothing to free (its key expired with it). No request
state lives only in one replica's memory that a retry would need: a Schedule
retried on another replica is placed afresh.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tandem.common import redis_retry

logger = logging.getLogger(__name__)


class ReplicaSync:
    def __init__(
        self,
        redis_url: str,
        *,
        key_prefix: str,
        replica_id: str,
        interval_s: float = 0.25,
        lease_s: float = 600.0,
    ) -> None:
        self._redis: aioredis.Redis = redis_retry.connect(redis_url, timeout_s=1.0)
        self._prefix = f"{key_prefix}:router"
        self.replica_id = replica_id
        self.interval_s = interval_s
        self._ttl_ms = max(1000, int(interval_s * 8 * 1000))
        self._lease_s = lease_s
        self._others: dict[str, int] = {}
        self._others_young: dict[str, int] = {}
        self._pending_owners: list[str] = []
        self.num_live_replicas = 1

    def _replica_key(self, replica_id: str) -> str:
        return f"{self._prefix}:replica:{replica_id}"

    def _owner_key(self, request_id: str) -> str:
        return f"{self._prefix}:owner:{request_id}"

    def _releases_key(self, replica_id: str) -> str:
        return f"{self._prefix}:releases:{replica_id}"

    def others_tokens(self, worker_id: str) -> int:
        return self._others.get(worker_id, 0)

    def others_young_tokens(self, worker_id: str) -> int:
        return self._others_young.get(worker_id, 0)

    def placed(self, request_id: str) -> None:
        """Remember that this replica owns ``request_id`` (written at the next sync)."""
        self._pending_owners.append(request_id)

    async def sync(
        self, tokens_by_worker: Mapping[str, int], young_tokens_by_worker: Mapping[str, int] | None = None
    ) -> list[str]:
        """Publish ours, read theirs; returns request ids whose Release was forwarded to us."""
        young = young_tokens_by_worker or {}
        ours = {w: [n, young.get(w, 0)] for w, n in tokens_by_worker.items()}
        mine = self._replica_key(self.replica_id)
        owners, self._pending_owners = self._pending_owners, []
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.set(mine, json.dumps(ours), px=self._ttl_ms)
                for request_id in owners:
                    pipe.set(self._owner_key(request_id), self.replica_id, ex=max(1, int(self._lease_s)))
                pipe.lrange(self._releases_key(self.replica_id), 0, -1)
                pipe.delete(self._releases_key(self.replica_id))
                results = await pipe.execute()
            forwarded = [r.decode() if isinstance(r, bytes) else str(r) for r in results[1 + len(owners)]]
            keys = [k async for k in self._redis.scan_iter(match=self._replica_key("*"), count=1000)]
            others_keys = [k for k in keys if (k.decode() if isinstance(k, bytes) else k) != mine]
            raws = await self._redis.mget(others_keys) if others_keys else []
        except (RedisError, OSError) as exc:
            self._pending_owners = owners + self._pending_owners
            logger.warning("replica sync failed: %s", exc)
            return []
        others: dict[str, int] = {}
        others_young: dict[str, int] = {}
        for raw in raws:
            if raw is None:
                continue
            try:
                for worker_id, value in json.loads(raw).items():
                    total, recent = (value, 0) if isinstance(value, int) else (int(value[0]), int(value[1]))
                    others[worker_id] = others.get(worker_id, 0) + total
                    others_young[worker_id] = others_young.get(worker_id, 0) + recent
            except (ValueError, AttributeError, TypeError, IndexError):
                continue
        self._others = others
        self._others_young = others_young
        self.num_live_replicas = 1 + sum(1 for r in raws if r is not None)
        return forwarded

    async def forward_release(self, request_id: str) -> bool:
        """Send a Release this replica does not hold to the replica that does; False when none does."""
        try:
            owner = await self._redis.get(self._owner_key(request_id))
            if owner is None:
                return False
            owner_id = owner.decode() if isinstance(owner, bytes) else str(owner)
            if owner_id == self.replica_id:
                return False
            if not await self._redis.exists(self._replica_key(owner_id)):
                return False  # the owner died; its budget went with its key
            await self._redis.rpush(self._releases_key(owner_id), request_id)
            await self._redis.expire(self._releases_key(owner_id), max(1, int(self._lease_s)))
            return True
        except (RedisError, OSError) as exc:
            logger.warning("release forwarding failed: %s", exc)
            return False

    async def leave(self) -> None:
        """Stop counting at once (clean shutdown)."""
        try:
            await self._redis.delete(self._replica_key(self.replica_id))
        except (RedisError, OSError):
            pass

    async def aclose(self) -> None:
        await self._redis.aclose()
