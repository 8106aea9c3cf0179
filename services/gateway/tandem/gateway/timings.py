"""Per-request stage timings: one clock per request, marked where each stage ends:
received (the clock's creation), authenticated and prompt built
(:func:`tandem.gateway.api.prepare.prepare`), admitted (the route, once the quota
let the request in), scheduled and prefill done (the orchestrator), first byte and
done (the response writers in :mod:`tandem.gateway.api`), plus what the workers
report (prefill engine time, KV transfer time and bytes).

Every mark also feeds ``tandem_gateway_stage_seconds{stage=…}`` when the request
ends; a client that sends ``X-Tandem-Timings: 1`` gets :meth:`StageClock.breakdown`
as a final SSE event (``event: tandem.timings``) or a ``tandem_timings`` field.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TIMINGS_HEADER = "x-tandem-timings"
TIMINGS_EVENT = "tandem.timings"

#: Marks in request order; a stage's duration is the gap from the previous mark that was reached.
MARKS = ("received", "authenticated", "prompt_built", "admitted", "scheduled", "prefill_done", "first_byte", "done")
#: The stage that ends at each mark, as named in the histogram.
STAGE_ENDING_AT = {
    "authenticated": "auth",
    "prompt_built": "tokenize",
    "admitted": "quota",
    "scheduled": "schedule",
    "prefill_done": "prefill",
    "first_byte": "first_byte_write",
    "done": "decode",
}


@dataclass
class StageClock:
    clock: Callable[[], float] = time.monotonic
    marks: dict[str, float] = field(default_factory=dict)
    #: Figures reported by the workers (seconds and bytes), merged into the breakdown.
    worker: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.marks.setdefault("received", self.clock())

    def mark(self, name: str) -> None:
        """First mark wins: a retried prefill keeps its first schedule time out of nobody's way."""
        self.marks.setdefault(name, self.clock())

    def remark(self, name: str) -> None:
        self.marks[name] = self.clock()

    def stages_s(self) -> dict[str, float]:
        """Duration of each stage that completed."""
        out: dict[str, float] = {}
        previous = self.marks["received"]
        for name in MARKS[1:]:
            at = self.marks.get(name)
            if at is None:
                continue
            out[STAGE_ENDING_AT[name]] = max(0.0, at - previous)
            previous = at
        return out

    def breakdown(self) -> dict[str, Any]:
        """What a client that asked sees: marks as ms since received, stage durations, worker figures."""
        return {
            "marks_ms": {
                name: round((at - self.marks["received"]) * 1000, 3)
                for name, at in sorted(self.marks.items(), key=lambda kv: kv[1])
            },
            "stages_ms": {name: round(s * 1000, 3) for name, s in self.stages_s().items()},
            "worker": {
                (name[:-2] + "_ms" if name.endswith("_s") else name): (round(v * 1000, 3) if name.endswith("_s") else v)
                for name, v in sorted(self.worker.items())
            },
        }


def wants_timings(header_value: str | None) -> bool:
    return (header_value or "").strip().lower() in {"1", "true", "yes", "on"}
