"""The record of one request, as measured by the client and stored in the JSON report.

Written by :mod:`tandem_loadtest.client`, read by :mod:`tandem_loadtest.metrics`,
:mod:`tandem_loadtest.report` and :mod:`tandem_loadtest.plots`. Plain data only.

Times are seconds. ``send_s`` is from the start of the run; the chunk times
are from ``send_s`` (the moment just before the POST).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["ok", "rate_limited", "error", "cancelled"]


@dataclass
class RequestRecord:
    index: int
    tenant: str
    label: str
    endpoint: str
    max_tokens: int
    send_s: float
    status: Status = "error"
    http_status: int | None = None
    error: str | None = None
    #: Times of every SSE chunk with non-empty content (chat ``delta.content``, text ``text``).
    content_times_s: list[float] = field(default_factory=list)
    #: Time of the last chunk that carried ``choices`` (content or finish_reason); vLLM's end of request.
    last_choice_s: float | None = None
    #: Time the stream ended ([DONE] or close).
    end_s: float | None = None
    #: From the usage chunk; None when the server sent none (never estimated from chunk counts).
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    output_chars: int = 0
    session_id: str | None = None
    cancel_after_s: float | None = None
    retry_after_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)
