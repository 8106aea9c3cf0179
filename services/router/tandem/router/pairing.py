"""Which prefill and decode workers may form a pair: those of equal KV-layout fingerprints.

A decode worker copies the prefill worker's KV blocks byte for byte, so the two must run the same
weights in the same KV layout (:mod:`tandem.common.kv_fingerprint`; each worker registers its own in
``WorkerRecord.kv_fingerprint``). While a deployment rolls to a new revision (another dtype, model
revision or image), workers of the old and of the new fingerprint are registered side by side.
:class:`tandem.router.placement.Placer` asks this module, for each request:

* :meth:`Pairing.paired_decode` first: decode workers that have a prefill worker of their own
  fingerprint (others are excluded from the decode choice, so a pair is preferred);
* :meth:`Pairing.prefill_for` after the decode worker is chosen: only prefill workers of its
  fingerprint may take the prompt;
* :meth:`Pairing.decode_for` for a decode-only placement: decode workers of the fingerprint of the
  prefill worker that already holds the KV.

When no decode worker with a partner can take the request (none exists, or none has budget) but a
decode worker without one can, the placement is a local prefill there (the decode worker computes
the prompt itself: no KV crosses, nothing to mismatch), counted as ``unpaired`` in the metrics.
Waiting instead would hold requests for as long as the other role's new workers take to load
their model (minutes on a GPU), and a rollout that ends with one role alone would hold them
forever; the local prefill serves them at once at the price of decode time, and only while the
fleet is unpaired. A worker of an older Tandem registers no fingerprint (""), which pairs only
with "": unknown is not known to be equal.

Pure: the exclusions are returned as a new :class:`ScheduleRequest`, which the policies read as they
read any ``exclude_worker_ids``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from tandem.common.registry import ROLE_DECODE, ROLE_PREFILL, WorkerRecord
from tandem.router.policy import ScheduleRequest


@dataclass(frozen=True)
class Pairing:
    """The fingerprints of one model's workers, as one decision sees them."""

    request: ScheduleRequest
    #: Fingerprint by worker id, for the request's model's workers of both roles.
    fingerprints: dict[str, str]
    #: Fingerprints that have a prefill worker the request may use (not excluded, LoRA where needed).
    prefill_fingerprints: frozenset[str]

    @classmethod
    def of(
        cls, request: ScheduleRequest, workers: Sequence[WorkerRecord], model_fingerprints: Collection[str]
    ) -> Pairing:
        """The pairing of ``request``'s model among ``workers``, whose fingerprints for that model are
        ``model_fingerprints`` (kept by the fleet table per worker list). One fingerprint, the state
        outside a rollout, needs no look at the workers: a decision at 1,000 workers spent ~0.1 ms
        scanning them here, against a 1 ms budget (``make bench-router``'s fleet line)."""
        if len(model_fingerprints) <= 1:
            return cls(request, {}, frozenset())
        fingerprints = {w.worker_id: w.kv_fingerprint for w in workers if w.model == request.model}
        usable = frozenset(
            w.kv_fingerprint
            for w in workers
            if w.role == ROLE_PREFILL
            and w.model == request.model
            and w.worker_id not in request.exclude_worker_ids
            and (not request.adapter or w.max_adapters > 0)
        )
        return cls(request, fingerprints, usable)

    @property
    def uniform(self) -> bool:
        """One fingerprint across the model's workers (the state outside a rollout): nothing to exclude."""
        return len(set(self.fingerprints.values())) <= 1

    def paired_decode(self, workers: Sequence[WorkerRecord]) -> ScheduleRequest:
        """The request, excluding decode workers no prefill worker can pair with."""
        if self.uniform:
            return self.request
        return self._excluding(
            w.worker_id
            for w in workers
            if w.role == ROLE_DECODE
            and w.model == self.request.model
            and w.kv_fingerprint not in self.prefill_fingerprints
        )

    def has_unpaired_decode(self, workers: Sequence[WorkerRecord]) -> bool:
        """Whether some decode worker of the model has no prefill worker of its fingerprint."""
        return not self.uniform and any(
            w.role == ROLE_DECODE
            and w.model == self.request.model
            and w.kv_fingerprint not in self.prefill_fingerprints
            for w in workers
        )

    def prefill_for(self, decode: WorkerRecord) -> ScheduleRequest:
        """The request, excluding prefill workers of another fingerprint than ``decode``'s."""
        return self._excluding_other_than(decode.kv_fingerprint)

    def decode_for(self, prefill_worker_id: str) -> ScheduleRequest:
        """The request, excluding decode workers of another fingerprint than the prefill worker's (a
        decode-only placement: that worker holds the KV). Unchanged when that worker is not registered
        (gone: nothing tells which layout its KV had, and the pull fails alike on any decode worker)."""
        fingerprint = self.fingerprints.get(prefill_worker_id)
        if fingerprint is None:
            return self.request
        return self._excluding_other_than(fingerprint)

    def _excluding_other_than(self, fingerprint: str) -> ScheduleRequest:
        """Every worker of another fingerprint excluded (those of the role not being chosen do not matter)."""
        if self.uniform:
            return self.request
        return self._excluding(worker_id for worker_id, other in self.fingerprints.items() if other != fingerprint)

    def _excluding(self, worker_ids: Iterable[str]) -> ScheduleRequest:
        extra = frozenset(worker_ids)
        if not extra:
            return self.request
        return dataclasses.replace(self.request, exclude_worker_ids=self.request.exclude_worker_ids | extra)
