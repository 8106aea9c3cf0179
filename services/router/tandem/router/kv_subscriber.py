"""Follows every registered worker's KV-event publisher into the :class:`KVIndex`.

:class:`tandem.router.scheduler.Scheduler` calls :meth:`KVEventSubscriber.sync`
with the registry's worker list whenever it changes; the subscriber follows
each worker that has a ``kv_events_endpoint`` and stops following (and drops
the index entries of) workers that left; each followed worker is a
:class:`tandem.router.kv_follower.Follower`, whose module says how it reads the
worker's live stream and replays and repairs what was lost.

Scale: each subscriber has a ZMQ context of its own with ``MAX_SOCKETS``
raised (the shared default context allows 1,023 sockets, and a router holds
two per worker), created on first use and terminated by :meth:`aclose`.

A worker that restarted registers with a new ``started_unix_s``: its entries
are dropped and followed afresh. Wire format: :mod:`tandem.common.kv_events`.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable
from typing import Any

from tandem.common.registry import WorkerRecord
from tandem.router.kv_follower import Follower, Following, Source, SubscriberStats
from tandem.router.kv_index import KVIndex

__all__ = ["MAX_SOCKETS", "KVEventSubscriber", "SubscriberStats"]

logger = logging.getLogger(__name__)

#: Upper bound on the sockets of one subscriber's ZMQ context (two per followed worker, clipped to
#: libzmq's own limit). ZMQ's default, 1,023, stops a router at ~500 workers with "Too many open
#: files"; raising it costs nothing until sockets exist. Each socket also takes about two file
#: descriptors (its mailbox and its TCP connection), so the process's open-file limit must allow
#: ~4 per worker.
MAX_SOCKETS = 65_536


class KVEventSubscriber:
    def __init__(
        self,
        index: KVIndex,
        *,
        replay_timeout_s: float = 2.0,
        catch_up_interval_s: float = 2.0,
        drop_fraction: float = 0.0,
        drop_seed: int = 0,
    ) -> None:
        """``replay_timeout_s``: the longest silence while waiting for a replay's next message.
        ``catch_up_interval_s``: an idle worker is asked for what it published since the last batch
        applied this long after its last live batch or replay (step 4 in :mod:`tandem.router.kv_follower`).

        ``drop_fraction`` is a fault-injection knob for tests and benchmarks only: that fraction of
        live PUB messages is discarded on receipt, as if the network had lost them (counted in
        ``stats.num_dropped``), so that the repair paths run. The decision takes one draw of
        ``random.Random(drop_seed)`` per live message, in the order they arrive."""
        if not 0.0 <= drop_fraction < 1.0:
            raise ValueError("drop_fraction must be in [0, 1)")
        if catch_up_interval_s <= 0 or replay_timeout_s <= 0:
            raise ValueError("catch_up_interval_s and replay_timeout_s must be positive")
        self._ctx: Any = None  # zmq.Context, created by the first follow
        self._following = Following(
            index, self._context, replay_timeout_s, catch_up_interval_s, drop_fraction, random.Random(drop_seed)
        )
        self._followers: dict[str, Follower] = {}

    @property
    def index(self) -> KVIndex:
        return self._following.index

    @property
    def stats(self) -> SubscriberStats:
        return self._following.stats

    def sync(self, workers: Iterable[WorkerRecord]) -> None:
        """Follow exactly the workers in ``workers`` that publish KV events."""
        wanted = {
            w.worker_id: Source(w.worker_id, w.kv_events_endpoint, w.kv_events_replay_endpoint, w.started_unix_s)
            for w in workers
            if w.kv_events_endpoint
        }
        for worker_id in list(self._followers):
            follower = self._followers[worker_id]
            if wanted.get(worker_id) != follower.source:
                follower.close()
                del self._followers[worker_id]
                self.index.remove_worker(worker_id)
                logger.info("stopped following KV events", extra={"worker_id": worker_id})
        for worker_id, source in wanted.items():
            if worker_id not in self._followers:
                try:
                    self._followers[worker_id] = Follower(self._following, source)
                except Exception:  # e.g. out of sockets: tried again at the next sync
                    logger.exception("cannot follow KV events", extra={"worker_id": worker_id})

    @property
    def num_following(self) -> int:
        """Workers whose publisher this subscriber follows."""
        return len(self._followers)

    async def aclose(self) -> None:
        """Stop following every worker and terminate this subscriber's ZMQ context (a later
        :meth:`sync` starts a new one)."""
        for follower in self._followers.values():
            follower.close()
        self._followers.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def _context(self) -> Any:
        if self._ctx is None:
            import zmq  # the router's own dependency; not needed by the pure index

            ctx = zmq.Context()
            # Before the first socket: libzmq sizes its socket table then.
            ctx.set(zmq.MAX_SOCKETS, min(MAX_SOCKETS, ctx.get(zmq.SOCKET_LIMIT)))
            self._ctx = ctx
        return self._ctx
