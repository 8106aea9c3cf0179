"""Router metrics seam.

:class:`tandem.router.scheduler.Scheduler` reports through :class:`RouterMetrics`;
the Serve deployment passes :class:`RayRouterMetrics` (Ray's metrics API,
exported by Ray's Prometheus endpoint with deployment/replica tags), unit
tests pass :class:`NullRouterMetrics` or a recorder.

Per model: the series the operator's per-model autoscaling reads (the pools' budget and requests in
flight, the queue by the pool it waits for, the tokens in flight per worker) carry a ``model`` tag,
the served model name of the pool or the request (never an adapter, a tenant or a request: models are
few, and the label's values stay as few). So do the placements, the queue waits and the Schedule
latencies, whose outcomes (``no_capacity``) an operator wants per model; a Schedule for a model no
live worker serves is tagged ``model=""``, so what a caller names cannot add label values.
"""

from __future__ import annotations

from typing import Protocol

#: Upper bounds of the schedule-latency histogram, in seconds.
SCHEDULE_SECONDS_BOUNDARIES = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0]
#: Upper bounds of the admission-queue wait histogram, in seconds.
QUEUE_WAIT_SECONDS_BOUNDARIES = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
#: ``path`` tag values of ``tandem_router_placements_total``.
PATH_DISAGGREGATED = "disaggregated"
PATH_LOCAL_PREFILL = "local_prefill"


class RouterMetrics(Protocol):
    def observe_schedule(self, duration_s: float, *, outcome: str, model: str) -> None:
        """One Schedule for ``model`` ("" when no live worker serves it) took ``duration_s`` (queue
        wait included); outcome is ``ok`` or an error code."""
        ...

    def set_in_flight(self, worker_id: str, model: str, num_requests: int) -> None:
        """This replica now has ``num_requests`` reserved on ``worker_id`` (a worker of ``model``)."""
        ...

    def set_tokens_in_flight(self, worker_id: str, role: str, model: str, num_tokens: int) -> None:
        """Budget tokens this replica holds on ``worker_id``: uncached prompt tokens on a prefill
        worker, prompt plus max_tokens on a decode worker (two gauges: neither pool's load counts
        as the other's)."""
        ...

    def set_queue_depth(self, priority: str, depth: int) -> None:
        """Requests of ``priority`` waiting for budget in this replica."""
        ...

    def set_pool(self, role: str, model: str, budget_used_fraction: float, num_in_flight: int) -> None:
        """The pool ``role`` of ``model`` as this replica sees it: the average over its workers of the budget in use
        (every replica's reservations, as the admission check counts them; 0..1), and the requests
        this replica has placed on it."""
        ...

    def set_queued(self, waiting_for: str, model: str, num_requests: int, num_uncached_tokens: int) -> None:
        """Requests for ``model`` waiting in this replica's queue for ``waiting_for``'s budget (prefill
        or decode), and their prompt tokens no worker holds."""
        ...

    def set_pending_demand(self, role: str, model: str, num_refused: int) -> None:
        """Requests for ``model`` this replica refused within the pending-demand window because no
        worker of ``role`` serves it (the pool is at zero; tandem.router.pending_demand)."""
        ...

    def observe_queue_wait(self, duration_s: float, *, outcome: str, model: str) -> None:
        """A request for ``model`` left the admission queue: ``admitted``, ``timeout`` or ``error``."""
        ...

    def count_placement(self, *, local_prefill: bool, model: str) -> None:
        """A request was placed: on a decode worker alone (``local_prefill``) or on a (prefill, decode) pair."""
        ...

    def count_prefill_tokens(self, num_tokens: int, *, model: str) -> None:
        """A placement handed ``num_tokens`` uncached prompt tokens to a prefill worker (the prefill pool's
        throughput in tokens/s: a saturated pool places at its capacity, whatever arrives)."""
        ...

    def count_prefill_arrival(self, num_tokens: int, *, model: str) -> None:
        """A Schedule headed for the prefill pool arrived with ``num_tokens`` uncached prompt tokens (estimated
        before placement), counted once at its first admission attempt, placed at once or queued
        (:meth:`tandem.router.placement.Placer.arrived`): the prefill pool's demand in tokens/s, which
        placements cannot show once the pool is saturated."""
        ...

    def count_unpaired(self, *, model: str) -> None:
        """A local prefill was placed because no prefill worker shares the decode worker's KV fingerprint
        (tandem.router.pairing)."""
        ...

    def count_burst(self, *, model: str) -> None:
        """A long prompt was placed as a local prefill because its prefill worker was backed up
        (tandem.router.burst)."""
        ...

    def count_handoff(self, outcome: str) -> None:
        """A placement for another replica's waiter: ``placed`` here, ``adopted`` or ``refused`` by the
        waiter's replica, ``expired`` unanswered (see tandem.router.ledger, hand-offs)."""
        ...

    def count_ledger_rejected(self, reason: str) -> None:
        """A ledger message or snapshot was dropped: ``bad_mac``, ``malformed``, ``stale``, ``replayed``
        or ``too_many_replicas`` (see tandem.router.ledger_auth)."""
        ...


class NullRouterMetrics:
    def observe_schedule(self, duration_s: float, *, outcome: str, model: str) -> None:
        pass

    def count_prefill_tokens(self, num_tokens: int, *, model: str) -> None:
        pass

    def count_prefill_arrival(self, num_tokens: int, *, model: str) -> None:
        pass

    def set_in_flight(self, worker_id: str, model: str, num_requests: int) -> None:
        pass

    def set_tokens_in_flight(self, worker_id: str, role: str, model: str, num_tokens: int) -> None:
        pass

    def set_queue_depth(self, priority: str, depth: int) -> None:
        pass

    def set_pool(self, role: str, model: str, budget_used_fraction: float, num_in_flight: int) -> None:
        pass

    def set_queued(self, waiting_for: str, model: str, num_requests: int, num_uncached_tokens: int) -> None:
        pass

    def set_pending_demand(self, role: str, model: str, num_refused: int) -> None:
        pass

    def observe_queue_wait(self, duration_s: float, *, outcome: str, model: str) -> None:
        pass

    def count_placement(self, *, local_prefill: bool, model: str) -> None:
        pass

    def count_unpaired(self, *, model: str) -> None:
        pass

    def count_burst(self, *, model: str) -> None:
        pass

    def count_handoff(self, outcome: str) -> None:
        pass

    def count_ledger_rejected(self, reason: str) -> None:
        pass


class RayRouterMetrics:
    """``tandem_router_*`` metrics through :mod:`ray.serve.metrics`. Construct inside a Serve replica."""

    def __init__(self) -> None:
        from ray.serve import metrics as serve_metrics  # heavy; only inside the replica

        self._schedule_seconds = serve_metrics.Histogram(
            "tandem_router_schedule_seconds",
            description="Time to answer one Schedule inside the router replica, queue wait included.",
            boundaries=SCHEDULE_SECONDS_BOUNDARIES,
            tag_keys=("outcome", "model"),
        )
        self._in_flight = serve_metrics.Gauge(
            "tandem_router_in_flight_requests",
            description="Requests this router replica has reserved on a worker and not yet released.",
            tag_keys=("worker_id", "model"),
        )
        self._tokens_in_flight = {
            "prefill": serve_metrics.Gauge(
                "tandem_router_prefill_tokens_in_flight",
                description="Uncached prompt tokens this replica has placed on each prefill worker that it still "
                "computes, as the prefill budget counts them (the prefill pool's backlog; a finished prefill "
                "leaves it before its request's Release).",
                tag_keys=("worker_id", "model"),
            ),
            "decode": serve_metrics.Gauge(
                "tandem_router_decode_tokens_in_flight",
                description="Prompt plus max_tokens this replica has placed on each decode worker and not yet "
                "released (KV the decode pool must hold).",
                tag_keys=("worker_id", "model"),
            ),
        }
        self._queue_depth = serve_metrics.Gauge(
            "tandem_router_queue_depth",
            description="Requests waiting in this replica's admission queue for token budget.",
            tag_keys=("priority",),
        )
        self._pool_budget_used = serve_metrics.Gauge(
            "tandem_router_pool_budget_used_fraction",
            description="Average over the pool's workers of the token budget in use (0..1), all router "
            "replicas' reservations counted, as the admission check counts them.",
            tag_keys=("role", "model"),
        )
        self._pool_in_flight = serve_metrics.Gauge(
            "tandem_router_pool_in_flight_requests",
            description="Requests this router replica has placed on the pool's workers and not yet released.",
            tag_keys=("role", "model"),
        )
        self._queued_requests = serve_metrics.Gauge(
            "tandem_router_queued_requests",
            description="Requests waiting in this replica's admission queue, by the pool whose budget they "
            "wait for (prefill or decode).",
            tag_keys=("waiting_for", "model"),
        )
        self._queued_tokens = serve_metrics.Gauge(
            "tandem_router_queued_uncached_tokens",
            description="Prompt tokens no worker holds, of the requests waiting in this replica's admission "
            "queue, by the pool whose budget they wait for.",
            tag_keys=("waiting_for", "model"),
        )
        self._pending_demand = serve_metrics.Gauge(
            "tandem_router_pending_demand",
            description="Requests this replica refused within the pending-demand window because no worker of "
            "the pool (role) serves their model: the pool is at zero and the autoscaler should start it.",
            tag_keys=("role", "model"),
        )
        self._queue_wait = serve_metrics.Histogram(
            "tandem_router_queue_wait_seconds",
            description="Time requests spent in the admission queue.",
            boundaries=QUEUE_WAIT_SECONDS_BOUNDARIES,
            tag_keys=("outcome", "model"),
        )
        self._placements = serve_metrics.Counter(
            "tandem_router_placements",  # exported as ray_tandem_router_placements_total
            description="Requests placed, by path: disaggregated (a prefill worker, then a decode worker) or "
            "local_prefill (the decode worker alone, when little of the prompt is uncached there).",
            tag_keys=("path", "model"),
        )
        self._prefill_tokens = serve_metrics.Counter(
            "tandem_router_prefill_uncached_tokens",  # exported as ray_tandem_router_prefill_uncached_tokens_total
            description="Uncached prompt tokens placed on prefill workers (what they must compute; local "
            "prefills on a decode worker not counted): the prefill pool's throughput in tokens/s, at most its "
            "capacity (its demand is tandem_router_prefill_arrived_uncached_tokens).",
            tag_keys=("model",),
        )
        self._prefill_arrivals = serve_metrics.Counter(
            "tandem_router_prefill_arrived_uncached_tokens",  # exported with ray_ and _total
            description="Uncached prompt tokens of the requests headed for prefill workers, counted once when "
            "each arrives, placed at once or queued (timed out in the queue too; a burst run on a decode "
            "worker too): the prefill pool's demand in tokens/s, beyond what a saturated pool can place.",
            tag_keys=("model",),
        )
        self._unpaired = serve_metrics.Counter(
            "tandem_router_unpaired_local_prefills",  # exported as ray_tandem_router_unpaired_local_prefills_total
            description="Local prefills placed because no prefill worker shares a KV-layout fingerprint with the "
            "decode workers that had budget (a rollout between revisions; lasting: prefill and decode differ).",
            tag_keys=("model",),
        )
        self._bursts = serve_metrics.Counter(
            "tandem_router_burst_local_prefills",  # exported as ray_tandem_router_burst_local_prefills_total
            description="Local prefills placed because the prefill worker was backed up: the decode worker "
            "computes a long prompt itself (tandem.router.burst's formula); also counted as local_prefill in "
            "tandem_router_placements.",
            tag_keys=("model",),
        )
        self._handoffs = serve_metrics.Counter(
            "tandem_router_handoffs",  # exported as ray_tandem_router_handoffs_total
            description="Placements made for another replica's waiting request, by outcome: placed (here), "
            "adopted or refused (by the waiter's replica), expired (unanswered).",
            tag_keys=("outcome",),
        )
        self._ledger_rejected = serve_metrics.Counter(
            "tandem_router_ledger_rejected",  # exported as ray_tandem_router_ledger_rejected_total
            description="Ledger messages and snapshots this replica dropped, by reason: bad_mac (missing or "
            "wrong tag), malformed, stale, replayed, too_many_replicas (the mirrors' bound).",
            tag_keys=("reason",),
        )

    def observe_schedule(self, duration_s: float, *, outcome: str, model: str) -> None:
        self._schedule_seconds.observe(duration_s, tags={"outcome": outcome, "model": model})

    def set_in_flight(self, worker_id: str, model: str, num_requests: int) -> None:
        self._in_flight.set(num_requests, tags={"worker_id": worker_id, "model": model})

    def set_tokens_in_flight(self, worker_id: str, role: str, model: str, num_tokens: int) -> None:
        self._tokens_in_flight[role].set(num_tokens, tags={"worker_id": worker_id, "model": model})

    def set_queue_depth(self, priority: str, depth: int) -> None:
        self._queue_depth.set(depth, tags={"priority": priority})

    def set_pool(self, role: str, model: str, budget_used_fraction: float, num_in_flight: int) -> None:
        tags = {"role": role, "model": model}
        self._pool_budget_used.set(budget_used_fraction, tags=tags)
        self._pool_in_flight.set(num_in_flight, tags=tags)

    def set_queued(self, waiting_for: str, model: str, num_requests: int, num_uncached_tokens: int) -> None:
        tags = {"waiting_for": waiting_for, "model": model}
        self._queued_requests.set(num_requests, tags=tags)
        self._queued_tokens.set(num_uncached_tokens, tags=tags)

    def set_pending_demand(self, role: str, model: str, num_refused: int) -> None:
        self._pending_demand.set(num_refused, tags={"role": role, "model": model})

    def observe_queue_wait(self, duration_s: float, *, outcome: str, model: str) -> None:
        self._queue_wait.observe(duration_s, tags={"outcome": outcome, "model": model})

    def count_placement(self, *, local_prefill: bool, model: str) -> None:
        path = PATH_LOCAL_PREFILL if local_prefill else PATH_DISAGGREGATED
        self._placements.inc(tags={"path": path, "model": model})

    def count_prefill_tokens(self, num_tokens: int, *, model: str) -> None:
        self._prefill_tokens.inc(num_tokens, tags={"model": model})

    def count_prefill_arrival(self, num_tokens: int, *, model: str) -> None:
        self._prefill_arrivals.inc(num_tokens, tags={"model": model})

    def count_unpaired(self, *, model: str) -> None:
        self._unpaired.inc(tags={"model": model})

    def count_burst(self, *, model: str) -> None:
        self._bursts.inc(tags={"model": model})

    def count_handoff(self, outcome: str) -> None:
        self._handoffs.inc(tags={"outcome": outcome})

    def count_ledger_rejected(self, reason: str) -> None:
        self._ledger_rejected.inc(tags={"reason": reason})
