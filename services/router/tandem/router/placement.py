"""Placement: where a request goes, and the one Python form of a request being placed.

The Schedule request has one form inside the router: :class:`tandem.router.policy.ScheduleRequest`
(the deployment decodes the ``tandem.v1.ScheduleRequest`` proto into it at the wire edge,
:func:`tandem.router.deployment.schedule_request_from_proto`). :class:`PendingRequest` is not a
second form of it: it is the router's working state while placing one request (the request itself,
unchanged, plus what placing it has learned so far: its block hashes per engine configuration,
computed once, and what its last try lacked). Another replica that places a waiter of this one
rebuilds it from the ledger (:mod:`tandem.router.handoff`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.common.registry import WorkerRecord
from tandem.router.policy import ScheduleRequest


@dataclass(frozen=True)
class PlacementDecision:
    """Where a request goes; the deployment turns it into a tandem.v1.Placement."""

    request_id: str
    #: None for a local prefill: the decode worker computes the prompt itself.
    prefill: WorkerRecord | None
    decode: WorkerRecord
    lease_s: float
    #: Prompt tokens the prefill worker is expected to have cached (0 for a local prefill).
    num_cached_tokens: int
    reason: str
    #: Prompt tokens the decode worker is expected to have cached.
    num_decode_cached_tokens: int = 0

    @property
    def local_prefill(self) -> bool:
        return self.prefill is None



@dataclass
class PendingRequest:
    """A request being placed, with its block hashes per engine configuration (computed once)."""

    request: ScheduleRequest
    hashes: dict[tuple[int, str], list[int]] = field(default_factory=dict)
    #: The roles whose budget it lacked at its last try (empty if not tried yet; both when both pools
    #: are full: each must grow before it can go), and its prompt tokens that no worker holds (the
    #: whole prompt until the KV index was asked).
    waiting_for: tuple[str, ...] = ()
    num_uncached_tokens: int = -1


