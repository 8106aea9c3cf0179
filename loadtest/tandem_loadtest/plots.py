"""PNG plots of a report: latency CDFs, TTFT over time, throughput over time
and, when the report has them, replicas per pool over time; and a sweep's figures against the
offered rate.

Called by :mod:`tandem_loadtest.report` and :mod:`tandem_loadtest.sweep`; calls matplotlib (Agg backend, no display).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes

from tandem_loadtest.metrics import FORMULAS, LATENCY_METRICS, request_metrics
from tandem_loadtest.records import RequestRecord


def _records(report: dict[str, Any]) -> list[RequestRecord]:
    return [RequestRecord.from_dict(r) for r in report["requests"]]


def _values_ms(records: list[RequestRecord], metric: str) -> list[float]:
    out: list[float] = []
    for r in records:
        m = request_metrics(r)
        if m is None:
            continue
        if metric == "ttft":
            out.append(m.ttft_s * 1000)
        elif metric == "e2e":
            out.append(m.e2e_s * 1000)
        elif metric == "tpot" and m.tpot_s is not None:
            out.append(m.tpot_s * 1000)
        elif metric == "itl":
            out.extend(g * 1000 for g in m.itl_s)
    return out


def _cdf(ax: Axes, values: list[float], label: str) -> None:
    if not values:
        return
    xs = np.sort(np.asarray(values))
    ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=f"{label} (n={len(xs)})")


def plot_latency_cdfs(records: list[RequestRecord], path: Path) -> Path:
    labels = sorted({r.label for r in records})
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, metric in zip(axes.flat, LATENCY_METRICS, strict=True):
        _cdf(ax, _values_ms(records, metric), "all")
        if len(labels) > 1:
            for label in labels:
                _cdf(ax, _values_ms([r for r in records if r.label == label], metric), label)
        ax.set_title(f"{metric.upper()}: {FORMULAS[metric]}", fontsize=9)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of gaps")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle("Latency CDFs (completed requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_ttft_over_time(records: list[RequestRecord], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for label in sorted({r.label for r in records}):
        pts = [(r.send_s, m.ttft_s * 1000) for r in records if r.label == label and (m := request_metrics(r))]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.scatter(xs, ys, s=12, label=label, alpha=0.7)
    failed = [r.send_s for r in records if r.status in ("rate_limited", "error")]
    if failed:
        ax.scatter(failed, [0.0] * len(failed), marker="x", color="red", label="429 / error")
    ax.set_xlabel("send time (s from start)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT over time")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def throughput_series(
    records: list[RequestRecord], bin_s: float | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(bin starts, output tokens/s, completed requests/s, requests in flight) per time bin.

    Each request's usage token count is spread evenly over its [TTFT, E2E] span:
    the token count is exact, only its placement in time is approximate.
    """
    ends = [r.send_s + (r.end_s or 0.0) for r in records]
    horizon = max(ends, default=1.0)
    bin_s = bin_s or max(1.0, horizon / 60)
    edges = np.arange(0.0, horizon + bin_s, bin_s)
    tokens = np.zeros(len(edges) - 1)
    done = np.zeros(len(edges) - 1)
    inflight = np.zeros(len(edges) - 1)
    for r, end in zip(records, ends, strict=True):
        # Time-weighted: a request in flight for half a bin adds 0.5 to it.
        inflight += np.clip(np.minimum(edges[1:], end) - np.maximum(edges[:-1], r.send_s), 0, None) / bin_s
        hi = int(np.searchsorted(edges, end, side="right")) - 1
        m = request_metrics(r)
        if m is None:
            continue
        done[min(hi, len(done) - 1)] += 1
        if m.output_tokens:
            t0, t1 = r.send_s + m.ttft_s, r.send_s + m.e2e_s
            if t1 > t0:
                overlap = np.clip(np.minimum(edges[1:], t1) - np.maximum(edges[:-1], t0), 0, None)
                tokens += m.output_tokens * overlap / (t1 - t0)
            else:
                tokens[min(int(np.searchsorted(edges, t0, side="right")) - 1, len(tokens) - 1)] += m.output_tokens
    return edges[:-1], tokens / bin_s, done / bin_s, inflight


def plot_throughput_over_time(records: list[RequestRecord], path: Path) -> Path:
    starts, tok_s, req_s, inflight = throughput_series(records)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    ax1.step(starts, tok_s, where="post", label="output tokens/s")
    ax1.set_ylabel("output tokens/s")
    ax1.grid(alpha=0.3)
    ax1b = ax1.twinx()
    ax1b.step(starts, req_s, where="post", color="tab:orange", label="completed req/s")
    ax1b.set_ylabel("completed req/s", color="tab:orange")
    ax1.set_title("Throughput over time (usage tokens spread over each request's decode span)")
    ax2.step(starts, inflight, where="post", color="tab:green")
    ax2.set_ylabel("requests in flight (mean)")
    ax2.set_xlabel("time (s from start)")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_replicas(replicas: dict[str, list[list[float]]], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(11, 3.5))
    for pool, points in sorted(replicas.items()):
        xs, ys = zip(*points, strict=True)
        ax.step(xs, ys, where="post", label=pool)
    ax.set_xlabel("time (s from start)")
    ax.set_ylabel("replicas")
    ax.set_title("Replicas per pool")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    records = _records(report)
    paths = [
        plot_latency_cdfs(records, out_dir / "latency_cdf.png"),
        plot_ttft_over_time(records, out_dir / "ttft_over_time.png"),
        plot_throughput_over_time(records, out_dir / "throughput_over_time.png"),
    ]
    if report.get("replicas"):
        paths.append(plot_replicas(report["replicas"], out_dir / "replicas.png"))
    return paths


def plot_sweep(report: dict[str, Any], path: Path) -> Path:
    """Goodput and throughput, TTFT and ITL (p50, p90, the SLO's target) against the offered rate,
    with the knee marked."""
    steps = report["steps"]
    rates = [s["rate_rps"] for s in steps]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(8, 10), sharex=True)
    ax1.plot(rates, rates, ls=":", color="grey", label="offered")
    ax1.plot(rates, [s["throughput_rps"] for s in steps], marker="o", label="completed req/s")
    ax1.plot(rates, [s["goodput_rps"] for s in steps], marker="o", label="goodput (req/s within the SLO)")
    ax1.set_ylabel("req/s")
    for ax, metric, target_s in ((ax2, "ttft", report["slo"]["ttft_p90_s"]), (ax3, "itl", report["slo"]["itl_p90_s"])):
        for p in ("p50", "p90"):
            ys = [np.nan if s[f"{metric}_{p}_ms"] is None else s[f"{metric}_{p}_ms"] for s in steps]
            ax.plot(rates, ys, marker="o", label=f"{metric.upper()} {p}")
        ax.axhline(target_s * 1000, color="red", ls="--", label=f"SLO p90 {target_s * 1000:g} ms")
        ax.set_ylabel(f"{metric.upper()} (ms)")
    for ax in (ax1, ax2, ax3):
        if report["knee_rps"] is not None:
            ax.axvline(report["knee_rps"], color="green", alpha=0.5, label=f"knee {report['knee_rps']:g} req/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax3.set_xlabel("offered rate (req/s)")
    missed = [s["rate_rps"] for s in steps if not s["meets_slo"]]
    ax1.set_title(f"Sweep: {len(steps)} steps of {report['step_duration_s']:g} s; SLO missed at {missed or 'none'}",
                  fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
