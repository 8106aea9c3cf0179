"""Per-request metrics and run summaries, with ``vllm bench serve``'s definitions.

Called by :mod:`tandem_loadtest.report`, :mod:`tandem_loadtest.plots` and
:mod:`tandem_loadtest.compare`; calls numpy.

Per request (times from just before the POST):

* TTFT  = time of the first chunk with non-empty content
* ITL   = gaps between consecutive content chunks (all gaps of all requests pooled)
* E2E   = time of the last chunk carrying ``choices`` (usage chunk and [DONE] excluded)
* TPOT  = (E2E − TTFT) / (output_tokens − 1), output_tokens from ``usage.completion_tokens``;
  undefined for a single token or without a usage chunk

Run: request throughput = completed / duration; output token throughput =
Σ output_tokens / duration; total token throughput = Σ (prompt + output) /
duration; duration from the first send to the end of the last request.
Goodput = requests meeting every SLO / duration (TPOT of a 1-token answer
counts as 0, as vLLM does). Only completed (``ok``) requests enter latency
figures; 429s, errors and client cancellations are counted apart.
Percentiles use numpy's linear interpolation, as vLLM does.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem_loadtest.records import RequestRecord

PERCENTILES = (50, 90, 95, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")
FORMULAS = {
    "ttft": "first non-empty content chunk − send",
    "tpot": "(E2E − TTFT) / (output_tokens − 1)",
    "itl": "gap between consecutive content chunks",
    "e2e": "last chunk with choices − send",
}
SLO_METRICS = ("ttft", "tpot", "e2e", "itl")


@dataclass(frozen=True)
class RequestMetrics:
    ttft_s: float
    e2e_s: float
    itl_s: list[float]
    tpot_s: float | None
    output_tokens: int | None
    prompt_tokens: int | None


def request_metrics(record: RequestRecord) -> RequestMetrics | None:
    """Metrics of a completed request; None for any other status."""
    if record.status != "ok" or not record.content_times_s:
        return None
    times = record.content_times_s
    ttft = times[0]
    e2e = record.last_choice_s if record.last_choice_s is not None else times[-1]
    n_out = record.completion_tokens
    tpot = (e2e - ttft) / (n_out - 1) if n_out is not None and n_out > 1 else None
    return RequestMetrics(
        ttft_s=ttft,
        e2e_s=e2e,
        itl_s=[b - a for a, b in itertools.pairwise(times)],
        tpot_s=tpot,
        output_tokens=n_out,
        prompt_tokens=record.prompt_tokens,
    )


def parse_slos(items: Iterable[str]) -> dict[str, float]:
    """``ttft:500 tpot:50`` (milliseconds, as ``vllm bench serve --goodput``); ``e2el`` is accepted for e2e."""
    slos: dict[str, float] = {}
    for item in items:
        for part in item.split():
            name, sep, value = part.partition(":")
            if not sep:
                name, sep, value = part.partition("=")
            name = {"e2el": "e2e"}.get(name.removesuffix("_ms"), name.removesuffix("_ms"))
            if name not in SLO_METRICS or not sep:
                raise ValueError(f"bad SLO {part!r}: use ttft:MS, tpot:MS, itl:MS or e2e:MS")
            slos[name] = float(value)
    return slos


def meets_slos(m: RequestMetrics, slos_ms: dict[str, float]) -> bool:
    values_ms = {
        "ttft": m.ttft_s * 1000,
        "e2e": m.e2e_s * 1000,
        "tpot": (m.tpot_s or 0.0) * 1000,
        "itl": max(m.itl_s, default=0.0) * 1000,  # every gap of the request
    }
    return all(values_ms[name] <= limit for name, limit in slos_ms.items())


def stats_ms(values_s: Sequence[float]) -> dict[str, float | int | None]:
    if not values_s:
        return {"n": 0, "mean": None, "std": None, "max": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values_s, dtype=float) * 1000.0
    out: dict[str, float | int | None] = {
        "n": len(arr),
        "mean": float(arr.mean()),
        "std": float(arr.std()),
        "max": float(arr.max()),
    }
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(arr, p))
    return out


def summarize(
    records: Sequence[RequestRecord], duration_s: float, slos_ms: dict[str, float] | None = None
) -> dict[str, Any]:
    """Counts, throughput, latency statistics (ms) and goodput of a set of records."""
    per_request = [(r, m) for r in records if (m := request_metrics(r)) is not None]
    metrics = [m for _, m in per_request]
    counts = {
        "num_requests": len(records),
        "num_ok": len(metrics),
        "num_rate_limited": sum(r.status == "rate_limited" for r in records),
        "num_errors": sum(r.status == "error" for r in records),
        "num_cancelled": sum(r.status == "cancelled" for r in records),
        "num_ok_without_usage": sum(m.output_tokens is None for m in metrics),
    }
    out_tokens = sum(m.output_tokens or 0 for m in metrics)
    in_tokens = sum(m.prompt_tokens or 0 for m in metrics)
    cached = sum(r.cached_tokens or 0 for r, _ in per_request)
    dur = duration_s if duration_s > 0 else float("nan")
    summary: dict[str, Any] = {
        **counts,
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "cached_prompt_fraction": cached / in_tokens if in_tokens else None,
        "request_throughput_rps": len(metrics) / dur,
        "output_token_throughput_tps": out_tokens / dur,
        "total_token_throughput_tps": (in_tokens + out_tokens) / dur,
        "ttft_ms": stats_ms([m.ttft_s for m in metrics]),
        "tpot_ms": stats_ms([m.tpot_s for m in metrics if m.tpot_s is not None]),
        "itl_ms": stats_ms([gap for m in metrics for gap in m.itl_s]),
        "e2e_ms": stats_ms([m.e2e_s for m in metrics]),
    }
    if slos_ms:
        num_good = sum(meets_slos(m, slos_ms) for m in metrics)
        expected = len(records) - counts["num_cancelled"]
        summary["goodput"] = {
            "slos_ms": slos_ms,
            "num_good": num_good,
            "request_goodput_rps": num_good / dur,
            "good_fraction": num_good / expected if expected else None,
        }
    return summary


def breakdown(
    records: Sequence[RequestRecord], duration_s: float, key: str, slos_ms: dict[str, float] | None = None
) -> dict[str, dict[str, Any]]:
    """``summarize`` per value of a record field (``label`` or ``tenant``)."""
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(str(getattr(r, key)), []).append(r)
    return {name: summarize(group, duration_s, slos_ms) for name, group in sorted(groups.items())}
