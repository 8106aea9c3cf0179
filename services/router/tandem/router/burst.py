"""Balance under bursts: a long prompt runs on its decode worker alone when the prefill worker is backed up.

A request with at least ``DISAGGREGATION__MIN_UNCACHED_TOKENS`` uncached prompt tokens goes through a
prefill worker (:mod:`tandem.router.placement`). In a burst of long prompts that worker is busy: the
request would wait there behind the prompts ahead of it (or in the router's queue, when the prefill
budget is spent), while its decode worker, whose prefill speed is the same (a pair shares a KV-layout
fingerprint: the same model, dtype and parallelism), could compute the prompt now. Computing it there
costs the decode worker's other users a stall as long as that prefill (``make bench-local-prefill``:
the stall ~ the prefill's own time above ~128 tokens). The placer weighs both with one formula, every
term in tokens of prompt computation (the rate, tokens per second of one worker, is the same on both
sides of a pair and cancels)::

    wait  = tokens the chosen prefill worker has ahead of the request: its uncached prompt tokens in
            flight (every replica's reservations, capped by the worker's own report once a heartbeat
            could show them, as the budget counts them); with no prefill budget left, the least loaded
            paired prefill worker's (the request would queue for it)
    extra = ahead_on_decode + stall_weight * (streams + 1) * uncached_on_decode

    run the request on the decode worker alone  <=>  wait > extra

* ``ahead_on_decode``: uncached tokens of this replica's earlier burst placements on that decode worker
  whose reservations are still open (its own backlog of prompts to compute; counted until the request
  ends, which overstates a long answer's: fewer bursts, never more);
* ``streams``: requests in flight on the decode worker (every replica's), each stalled for the length
  of this prefill, plus one: the next request to arrive there waits as long;
* ``stall_weight`` (``DISAGGREGATION__BURST_STALL_WEIGHT``, 0.25): how much one other stream's stall
  counts against this request's wait. 0: any wait sends a long prompt to a decode worker with budget.

A prefill worker with nothing ahead never loses a request (wait = 0), so outside bursts long prompts
are handed off as before. A decode worker without budget takes nothing (the request waits for decode
budget as before). ``DISAGGREGATION__BURST_LOCAL_PREFILL=false`` turns it off; a threshold of 0 (every
request through a prefill worker) does too. Counted in
``ray_tandem_router_burst_local_prefills_total{model}`` (and as ``local_prefill`` in
``ray_tandem_router_placements_total``); the placement's reason reads ``local_prefill burst``.

The reverse, a prefill worker running a whole request when decode is short, does not fall out of this:
a prefill worker's engine never decodes here (the gateway calls only ``Prefill`` on it, and its KV is
held for a pull, not budgeted as decode KV). It would need the prefill role to serve ``Decode`` for its
own prompts, a decode budget on prefill workers, and the autoscaler to count such requests as decode
demand.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.router.reservations import Reservation, ReservationTable

#: See the module docstring.
DEFAULT_STALL_WEIGHT = 0.25


@dataclass(frozen=True)
class BurstCost:
    """Both sides of the formula for one request, in tokens of prompt computation."""

    wait_tokens: int
    extra_tokens: int

    @property
    def local(self) -> bool:
        return self.wait_tokens > self.extra_tokens


def burst_cost(
    *,
    wait_tokens: float,
    ahead_on_decode: int,
    num_decode_streams: float,
    uncached_on_decode: int,
    stall_weight: float,
) -> BurstCost:
    """The module docstring's formula, its only implementation."""
    extra = ahead_on_decode + stall_weight * (num_decode_streams + 1) * uncached_on_decode
    return BurstCost(int(wait_tokens), int(extra + 0.5))


class BurstLedger:
    """This replica's burst local prefills whose reservations are open: the decode worker's backlog of
    prompts it computes itself (``ahead_on_decode``)."""

    def __init__(self, reservations: ReservationTable) -> None:
        self._reservations = reservations
        #: request id -> (decode worker, uncached tokens, the reservation made for it).
        self._open: dict[str, tuple[str, int, Reservation | None]] = {}

    def placed(self, request_id: str, worker_id: str, num_tokens: int) -> None:
        self._open[request_id] = (worker_id, num_tokens, self._reservations.get(request_id))

    def ahead_on(self, worker_id: str) -> int:
        """Uncached tokens of open burst placements on ``worker_id`` (ended ones are forgotten here)."""
        total = 0
        for request_id, (on, num_tokens, reservation) in list(self._open.items()):
            if self._reservations.get(request_id) is not reservation:
                del self._open[request_id]  # ended, expired, or replaced by a retry's placement
            elif on == worker_id:
                total += num_tokens
        return total

    def __len__(self) -> int:
        return len(self._open)
