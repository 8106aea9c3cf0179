"""Autoscaling under a rising and then falling load, without a cluster.

Simulated workers (tests/unit/operator/simulated_cluster.py — made-up
capacities, not model speed) under a request rate that ramps 1 → 14 req/s,
holds, and ramps back down. The operator's real decision function scales each
pool every 15 s. The test shows both pools scale up in time to hold the SLOs
(compared with the same load at fixed minimum replicas, which breaks them) and
come back down afterwards. Decisions go to reports/autoscaling/decisions.jsonl,
the plot to reports/autoscaling/autoscaling.png.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import itertools

import matplotlib.pyplot as plt
from tandem_operator.spec import TandemSpec, parse_spec

from tests.unit.operator.simulated_cluster import Sample, SimulatedCluster

REPORT_DIR = Path(__file__).resolve().parents[3] / "reports" / "autoscaling"
DURATION_S = 4500.0
DECIDE_EVERY_S = 15.0


def rate_per_s(t: float) -> float:
    """1 req/s, ramp to 14 over 10 min from t=5 min, hold 15 min, ramp down over 10 min, then 1."""
    low, high = 1.0, 14.0
    if t < 300:
        return low
    if t < 900:
        return low + (high - low) * (t - 300) / 600
    if t < 1800:
        return high
    if t < 2400:
        return high - (high - low) * (t - 1800) / 600
    return low


def spec() -> TandemSpec:
    return parse_spec({
        "model": {"servedModelName": "simulated", "pvc": {"claimName": "none"}},
        "image": {"repository": "simulated", "tag": "0"},
        "redis": {"url": "redis://simulated:6379/0"},
        "pools": {"prefill": {"replicas": 1, "minReplicas": 1, "maxReplicas": 8},
                  "decode": {"replicas": 1, "minReplicas": 1, "maxReplicas": 8}},
        "slo": {"ttftP90Seconds": 2.0, "itlP90Seconds": 0.1},
        "autoscaling": {"intervalSeconds": DECIDE_EVERY_S, "scaleUpStabilizationSeconds": 30,
                        "scaleDownStabilizationSeconds": 300, "maxScaleUpStep": 2, "maxScaleDownStep": 1,
                        "prefill": {"queueDepthPerReplica": 4, "uncachedTokensPerReplica": 600},
                        "decode": {"kvUsage": 0.7}},
    })


def _fraction_over(samples: list[Sample], attr: str, slo: float, start_s: float, end_s: float) -> float:
    window = [s for s in samples if start_s <= s.t_s < end_s]
    role = "prefill" if attr == "ttft_p90_s" else "decode"
    return sum(1 for s in window if getattr(s.signals[role], attr) > slo) / len(window)


def _report(cluster: SimulatedCluster, fixed: SimulatedCluster) -> None:
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    with (REPORT_DIR / "decisions.jsonl").open("w") as out:
        for t, d in cluster.decisions:
            if d.changed or d.reason.startswith(("scale up pending", "scale down pending")):
                out.write(json.dumps({"t_s": t, "role": d.role, "current": d.current_replicas,
                                      "desired": d.desired_replicas, "reason": d.reason, "votes": d.votes,
                                      "simulated": True}) + "\n")
    t = [s.t_s / 60 for s in cluster.samples]
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    fig.suptitle("Tandem autoscaler on SIMULATED workers (made-up capacities, not model speed)")
    axes[0].plot(t, [s.arrival_rate for s in cluster.samples], color="black")
    axes[0].set_ylabel("arrivals (req/s)")
    axes[1].plot(t, [s.prefill_replicas for s in cluster.samples], label="prefill desired")
    axes[1].plot(t, [s.prefill_ready for s in cluster.samples], "--", label="prefill ready")
    axes[1].plot(t, [s.decode_replicas for s in cluster.samples], label="decode desired")
    axes[1].plot(t, [s.decode_ready for s in cluster.samples], "--", label="decode ready")
    axes[1].set_ylabel("replicas")
    axes[1].legend(loc="upper right", fontsize=8)
    slo = cluster.spec.slo
    for ax, role, attr, limit, label in [(axes[2], "prefill", "ttft_p90_s", slo.ttft_p90_seconds, "TTFT p90 (s)"),
                                         (axes[3], "decode", "itl_p90_s", slo.itl_p90_seconds, "ITL p90 (s)")]:
        ax.plot(t, [getattr(s.signals[role], attr) for s in cluster.samples], label="autoscaled")
        ax.plot(t, [getattr(s.signals[role], attr) for s in fixed.samples], alpha=0.5, label="fixed at 1 replica")
        ax.axhline(limit, color="red", linestyle=":", label="SLO")
        ax.set_ylabel(label)
        ax.set_ylim(0, limit * 3)
        ax.legend(loc="upper right", fontsize=8)
    for t_s, d in cluster.decisions:
        if d.changed:
            axes[1].axvline(t_s / 60, color="grey", alpha=0.15)
    axes[3].set_xlabel("simulated time (min)")
    fig.tight_layout()
    fig.savefig(REPORT_DIR / "autoscaling.png", dpi=80)
    plt.close(fig)


def test_both_pools_scale_up_in_time_and_back_down() -> None:
    cluster = SimulatedCluster(spec(), rate_per_s)
    cluster.run(DURATION_S, decide_every_s=DECIDE_EVERY_S)
    fixed = SimulatedCluster(spec(), rate_per_s, autoscale=False)
    fixed.run(DURATION_S, decide_every_s=DECIDE_EVERY_S)
    _report(cluster, fixed)
    slo = cluster.spec.slo
    samples = cluster.samples

    # Both pools grew under load, each on its own signal.
    peak = [s for s in samples if 900 <= s.t_s < 1800]
    assert max(s.prefill_replicas for s in peak) >= 3
    assert max(s.decode_replicas for s in peak) >= 3
    reasons = {d.role: d.reason for _, d in cluster.decisions if d.changed and d.desired_replicas > d.current_replicas}
    assert any(k in reasons["prefill"] for k in ("queue_depth", "uncached_tokens", "ttft_p90"))
    assert any(k in reasons["decode"] for k in ("kv_usage", "itl_p90"))

    # SLOs held: over the whole run, p90 above its SLO at most 10 % of the time
    # (the ramp's start, while new workers load), and never during the plateau.
    for attr, limit in (("ttft_p90_s", slo.ttft_p90_seconds), ("itl_p90_s", slo.itl_p90_seconds)):
        assert _fraction_over(samples, attr, limit, 0, DURATION_S) <= 0.10, attr
        assert _fraction_over(samples, attr, limit, 1200, 1800) == 0.0, attr
        # Without autoscaling the same load breaks the SLO for most of the peak: the test can fail.
        assert _fraction_over(fixed.samples, attr, limit, 900, 1800) >= 0.5, attr

    # Back down after the load is gone, one step at a time, without flapping:
    # no scale-up once the load falls, few changes of direction overall.
    end = samples[-1]
    assert end.prefill_replicas == 1 and end.decode_replicas == 1
    for role in ("prefill", "decode"):
        changes = [(t, d) for t, d in cluster.decisions if d.role == role and d.changed]
        ups = [t for t, d in changes if d.desired_replicas > d.current_replicas]
        downs = [d for _, d in changes if d.desired_replicas < d.current_replicas]
        assert all(d.current_replicas - d.desired_replicas == 1 for d in downs)
        assert max(ups) < 1800, f"{role} scaled up while the load was falling"
        # Under the rising ramp and the plateau, no step down (not-ready replicas are no capacity, and a
        # pool with replicas still starting does not shrink), but for the one replica a trend vote may
        # have asked for at the ramp's top, where the growth it projected stopped: removed once, after
        # the scale-down window, while the load holds.
        early_downs = [(t, d.reason) for t, d in changes if t < 1800 and d.desired_replicas < d.current_replicas]
        trend_ups = [d for _, d in changes if d.desired_replicas > d.current_replicas and "_trend" in d.reason]
        allowed = 1 if trend_ups else 0
        assert len(early_downs) <= allowed, f"{role} stepped down while the load rose or held: {early_downs}"
        directions = [d.desired_replicas > d.current_replicas for _, d in changes]
        num_reversals = sum(1 for a, b in itertools.pairwise(directions) if a != b)
        assert num_reversals == 1, f"{role}: {num_reversals} reversals (one load peak: up, then down)"
    assert (REPORT_DIR / "autoscaling.png").stat().st_size > 10_000
    assert (REPORT_DIR / "decisions.jsonl").read_text().count('"simulated": true') >= 4
