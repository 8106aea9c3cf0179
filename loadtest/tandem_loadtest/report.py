"""The report of a run: ``report.json`` (config, summaries, every request's
record), ``summary.md`` and the plots.

Called by the CLI after a run (and by ``plot`` on a saved JSON); calls
:mod:`tandem_loadtest.metrics` and :mod:`tandem_loadtest.plots`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem_loadtest import __version__
from tandem_loadtest.metrics import FORMULAS, LATENCY_METRICS, PERCENTILES, breakdown, summarize
from tandem_loadtest.records import RequestRecord
from tandem_loadtest.runner import RunResult

REPORT_JSON = "report.json"
SUMMARY_MD = "summary.md"


def build_report(
    result: RunResult,
    *,
    slos_ms: dict[str, float] | None = None,
    replicas: dict[str, list[list[float]]] | None = None,
) -> dict[str, Any]:
    records = result.records
    return {
        "tool": {"name": "tandem-loadtest", "version": __version__},
        "started_unix_s": result.started_unix_s,
        "config": result.config,
        "slos_ms": slos_ms or {},
        "summary": summarize(records, result.duration_s, slos_ms),
        "by_label": breakdown(records, result.duration_s, "label", slos_ms),
        "by_tenant": breakdown(records, result.duration_s, "tenant", slos_ms),
        "replicas": replicas or {},
        "requests": [r.to_dict() for r in records],
    }


def load_report(path: Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / REPORT_JSON
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def records_of(report: dict[str, Any]) -> list[RequestRecord]:
    return [RequestRecord.from_dict(r) for r in report["requests"]]


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def markdown_summary(report: dict[str, Any]) -> str:
    s = report["summary"]
    cfg = report["config"]
    lines = [
        "# Load test summary",
        "",
        f"Endpoint `{cfg['base_url']}`, model `{cfg['model']}`, arrivals `{cfg['arrival']}`, "
        f"tenants {', '.join(t['name'] for t in cfg['tenants'])}; "
        f"{s['num_requests']} requests in {s['duration_s']:.1f} s.",
        "",
        "| Requests | ok | 429 | errors | cancelled | req/s | output tok/s | total tok/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {s['num_requests']} | {s['num_ok']} | {s['num_rate_limited']} | {s['num_errors']} | "
        f"{s['num_cancelled']} | {_fmt(s['request_throughput_rps'], 2)} | "
        f"{_fmt(s['output_token_throughput_tps'])} | {_fmt(s['total_token_throughput_tps'])} |",
        "",
        "| Metric (ms) | Definition | mean | " + " | ".join(f"p{p}" for p in PERCENTILES) + " | n |",
        "|---|---|---:|" + "---:|" * len(PERCENTILES) + "---:|",
    ]
    for name in LATENCY_METRICS:
        st = s[f"{name}_ms"]
        lines.append(
            f"| {name.upper()} | {FORMULAS[name]} | {_fmt(st['mean'])} | "
            + " | ".join(_fmt(st[f"p{p}"]) for p in PERCENTILES)
            + f" | {st['n']} |"
        )
    if "goodput" in s:
        g = s["goodput"]
        slos = ", ".join(f"{k} ≤ {v:g} ms" for k, v in g["slos_ms"].items())
        frac = "–" if g["good_fraction"] is None else f"{100 * g['good_fraction']:.0f} %"
        lines += ["", f"Goodput ({slos}): {g['num_good']} good requests, "
                  f"{_fmt(g['request_goodput_rps'], 2)} req/s, {frac} of the requests sent (cancellations aside)."]
    if s["num_ok_without_usage"]:
        lines += ["", f"{s['num_ok_without_usage']} completed requests had no usage chunk: no TPOT or tokens."]
    for title, key in (("workload", "by_label"), ("tenant", "by_tenant")):
        groups = report[key]
        if len(groups) < 2:
            continue
        lines += [
            "",
            f"By {title}:",
            "",
            f"| {title} | ok/sent | 429 | err | cancel | TTFT p50 | TTFT p90 | TTFT p99 | TPOT p50 | ITL p50 "
            "| ITL p99 | E2E p50 | cached prompt |" + (" good |" if "goodput" in s else ""),
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if "goodput" in s else ""),
        ]
        for name, g in groups.items():
            cached = "–" if g["cached_prompt_fraction"] is None else f"{100 * g['cached_prompt_fraction']:.0f} %"
            row = (
                f"| {name} | {g['num_ok']}/{g['num_requests']} | {g['num_rate_limited']} | {g['num_errors']} | "
                f"{g['num_cancelled']} | {_fmt(g['ttft_ms']['p50'])} | {_fmt(g['ttft_ms']['p90'])} | "
                f"{_fmt(g['ttft_ms']['p99'])} | {_fmt(g['tpot_ms']['p50'])} | {_fmt(g['itl_ms']['p50'])} | "
                f"{_fmt(g['itl_ms']['p99'])} | {_fmt(g['e2e_ms']['p50'])} | {cached} |"
            )
            if "goodput" in s:
                frac = g["goodput"]["good_fraction"]
                row += " – |" if frac is None else f" {100 * frac:.0f} % |"
            lines.append(row)
    lines += ["", "Token counts come from each stream's usage chunk; percentiles as numpy (linear).", ""]
    return "\n".join(lines)


def write_report(report: dict[str, Any], out_dir: Path, *, plots: bool = True) -> list[Path]:
    """Write report.json, summary.md and (unless disabled) the PNG plots; returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / REPORT_JSON
    json_path.write_text(json.dumps(report, indent=1))
    md_path = out_dir / SUMMARY_MD
    md_path.write_text(markdown_summary(report))
    written = [json_path, md_path]
    if plots:
        from tandem_loadtest.plots import write_plots  # matplotlib is slow to import

        written += write_plots(report, out_dir)
    return written
