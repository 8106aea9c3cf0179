"""``tandem-loadtest compare A.json B.json``: two runs side by side with B/A ratios.

Called by the CLI; reads reports written by :mod:`tandem_loadtest.report`.
"""

from __future__ import annotations

from typing import Any

from tandem_loadtest.metrics import LATENCY_METRICS, PERCENTILES

_ROWS: list[tuple[str, tuple[str, ...]]] = [
    ("requests sent", ("num_requests",)),
    ("ok", ("num_ok",)),
    ("429", ("num_rate_limited",)),
    ("errors", ("num_errors",)),
    ("cancelled", ("num_cancelled",)),
    ("duration s", ("duration_s",)),
    ("request throughput req/s", ("request_throughput_rps",)),
    ("output token throughput tok/s", ("output_token_throughput_tps",)),
    ("total token throughput tok/s", ("total_token_throughput_tps",)),
    ("goodput req/s", ("goodput", "request_goodput_rps")),
]
for _metric in LATENCY_METRICS:
    for _stat in ("mean", *(f"p{p}" for p in PERCENTILES)):
        _ROWS.append((f"{_metric.upper()} {_stat} ms", (f"{_metric}_ms", _stat)))


def _get(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = summary
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return float(value) if isinstance(value, int | float) else None


def compare_rows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, float | None, float | None, float | None]]:
    rows = []
    for name, path in _ROWS:
        va, vb = _get(a["summary"], path), _get(b["summary"], path)
        ratio = vb / va if va not in (None, 0) and vb is not None else None
        if va is None and vb is None:
            continue
        rows.append((name, va, vb, ratio))
    return rows


def format_comparison(a: dict[str, Any], b: dict[str, Any], name_a: str = "A", name_b: str = "B") -> str:
    def fmt(v: float | None) -> str:
        return "–" if v is None else f"{v:,.2f}"

    lines = [f"| metric | {name_a} | {name_b} | B/A |", "|---|---:|---:|---:|"]
    for name, va, vb, ratio in compare_rows(a, b):
        lines.append(f"| {name} | {fmt(va)} | {fmt(vb)} | {'–' if ratio is None else f'{ratio:.2f}×'} |")
    return "\n".join(lines)
