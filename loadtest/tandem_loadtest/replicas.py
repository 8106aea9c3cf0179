"""Replicas per pool over a run, from Prometheus or from the operator's log.

Called by the CLI after a run; calls httpx (Prometheus HTTP API
``/api/v1/query_range``). The result is ``{pool: [[t_s, replicas], ...]}``
with ``t_s`` seconds from the run's start, stored in the report and plotted.

Operator log: one JSON object per line with a time (``ts``, ``time``,
``timestamp`` or ``asctime``: epoch seconds or ISO 8601), a pool (``pool``)
and a count (``replicas``, ``desired_replicas`` or ``num_replicas``); lines
of the form ``... pool=decode ... replicas=3`` work too. Other lines are skipped.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

DEFAULT_QUERY = "sum by (pool) (tandem_pool_replicas)"
_TIME_KEYS = ("ts", "time", "timestamp", "asctime", "created")
_REPLICA_KEYS = ("replicas", "desired_replicas", "num_replicas")
_TEXT_RE = re.compile(r"pool[=:]\s*\"?(?P<pool>[\w.-]+).*?replicas[=:]\s*(?P<n>\d+)")
_ISO_RE = re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?")

Timeline = dict[str, list[list[float]]]


def from_prometheus(
    url: str, start_unix_s: float, end_unix_s: float, *, query: str = DEFAULT_QUERY, label: str = "pool",
    step_s: float | None = None,
) -> Timeline:
    step = step_s or max(1.0, (end_unix_s - start_unix_s) / 200)
    resp = httpx.get(
        f"{url.rstrip('/')}/api/v1/query_range",
        params={"query": query, "start": start_unix_s, "end": end_unix_s, "step": step},
        timeout=30,
    )
    resp.raise_for_status()
    data = resp.json()
    timeline: Timeline = {}
    for series in data.get("data", {}).get("result", []):
        pool = series.get("metric", {}).get(label, "all")
        timeline[pool] = [[float(t) - start_unix_s, float(v)] for t, v in series.get("values", [])]
    return timeline


def _parse_time(value: Any) -> float | None:
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
        match = _ISO_RE.search(value)
        if match:
            text = match.group(0).replace(",", ".").replace("Z", "+00:00")
            try:
                return datetime.fromisoformat(text).timestamp()
            except ValueError:
                return None
    return None


def from_operator_log(path: Path, start_unix_s: float, end_unix_s: float) -> Timeline:
    timeline: Timeline = {}
    for line in Path(path).read_text(errors="replace").splitlines():
        t: float | None = None
        pool: str | None = None
        n: float | None = None
        try:
            obj = json.loads(line)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            t = next((_parse_time(obj[k]) for k in _TIME_KEYS if k in obj), None)
            pool = obj.get("pool")
            n = next((float(obj[k]) for k in _REPLICA_KEYS if isinstance(obj.get(k), int | float)), None)
        if pool is None or n is None:
            match = _TEXT_RE.search(line)
            if not match:
                continue
            pool, n = match.group("pool"), float(match.group("n"))
            t = t if t is not None else _parse_time(line)
        if t is None:
            continue
        timeline.setdefault(str(pool), []).append([t - start_unix_s, n])
    # Keep the last value before the run (the state at t=0) and everything up to the end.
    trimmed: Timeline = {}
    for pool, points in timeline.items():
        points.sort()
        before = [p for p in points if p[0] < 0]
        during = [p for p in points if 0 <= p[0] <= end_unix_s - start_unix_s]
        trimmed[pool] = ([[0.0, before[-1][1]]] if before else []) + during
    return {pool: pts for pool, pts in trimmed.items() if pts}
