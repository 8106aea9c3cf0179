"""tandem-loadtest against the real local stack: a short mixed multi-tenant
run whose report must hold sane figures, a short capacity sweep (knee and
capacity from the stack's answers), and agreement of its TTFT and ITL
medians with ``vllm bench serve`` on the same endpoint and prompts."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tandem_loadtest.arrivals import PoissonArrivals
from tandem_loadtest.distributions import LengthDist
from tandem_loadtest.report import build_report, write_report
from tandem_loadtest.runner import RunConfig, run_load
from tandem_loadtest.sweep import SloTargets, build_sweep_report, run_sweep, write_sweep
from tandem_loadtest.tenants import TenantConfig
from tandem_loadtest.workloads import WorkloadOptions

from tandem.local.stack import LocalStack

pytestmark = pytest.mark.integration

AGREEMENT_SCRIPT = Path(__file__).with_name("loadtest_vllm_agreement.py")
#: vllm bench serve and tandem-loadtest medians must agree this closely (the issue's bar).
AGREEMENT_TOLERANCE = 0.10


def test_mixed_multi_tenant_run_gives_a_sane_report(stack: LocalStack, tmp_path: Path) -> None:
    config = RunConfig(
        base_url=stack.config.gateway_url,
        model=stack.config.served_model_name,
        arrival=PoissonArrivals(1.0),
        tenants=[
            TenantConfig("alice", stack.create_tenant_key("alice"), {"doc-qa": 1.0, "chat": 1.0}),
            TenantConfig("bob", stack.create_tenant_key("bob"), {"synthetic": 1.0, "mixed": 1.0}),
        ],
        workload=WorkloadOptions(
            input_tokens=LengthDist.parse("48"),
            output_tokens=LengthDist.parse("8"),
            doc_tokens=400,
            chat_turns=LengthDist.parse("3"),
            long_fraction=0.5,
            long_input_tokens=LengthDist.parse("600"),
            long_output_tokens=LengthDist.parse("4"),
        ),
        num_requests=14,
        duration_s=60.0,
        max_concurrency=4,
        cancel_fraction=0.15,
        cancel_after_s=0.3,
        request_timeout_s=120.0,
        ignore_eos=True,
        seed=5,
    )
    result = asyncio.run(run_load(config))
    report = build_report(result, slos_ms={"ttft": 60_000})
    paths = write_report(report, tmp_path)
    assert {p.name for p in paths} >= {"report.json", "summary.md", "latency_cdf.png", "ttft_over_time.png",
                                       "throughput_over_time.png"}
    assert all(p.stat().st_size > 0 for p in paths)

    s = report["summary"]
    errors = [r.error for r in result.records if r.status == "error"]
    assert s["num_errors"] == 0 and s["num_rate_limited"] == 0, errors
    assert s["num_requests"] == len(result.records) >= 8  # bounded by 14 requests or 60 s
    assert s["num_ok"] + s["num_cancelled"] == s["num_requests"]
    assert s["num_ok"] >= s["num_requests"] // 2
    planned_cancels = [r for r in result.records if r.cancel_after_s is not None]
    assert planned_cancels, "seed 5 draws at least one cancellation"
    # A 0.3 s budget is shorter than any answer here: every planned cancellation happened.
    assert s["num_cancelled"] == len(planned_cancels)
    assert s["num_ok_without_usage"] == 0

    ttft, tpot, itl, e2e = (s[f"{m}_ms"] for m in ("ttft", "tpot", "itl", "e2e"))
    assert 0 < ttft["p50"] <= e2e["p50"] and ttft["p50"] <= ttft["p90"] <= ttft["p99"]
    assert 0 < tpot["p50"] < e2e["p50"] and 0 < itl["p50"] < e2e["p50"]
    assert e2e["max"] < 120_000
    assert s["request_throughput_rps"] > 0 and s["output_token_throughput_tps"] > 0
    assert s["total_token_throughput_tps"] > s["output_token_throughput_tps"]
    assert s["goodput"]["num_good"] == s["num_ok"]

    ok = [r for r in result.records if r.status == "ok"]
    # Token counts come from usage; ignore_eos makes them exactly max_tokens.
    assert all(r.completion_tokens == r.max_tokens for r in ok), [(r.completion_tokens, r.max_tokens) for r in ok]
    assert all((r.prompt_tokens or 0) > 10 for r in ok)
    doc = [r for r in ok if r.label.startswith("doc-qa")]
    assert all((r.prompt_tokens or 0) > 400 for r in doc)
    assert {r.tenant for r in result.records} == {"alice", "bob"}
    md = (tmp_path / "summary.md").read_text()
    assert "| TTFT |" in md and "By tenant:" in md


def test_sweep_finds_the_knee_and_capacity_on_the_local_stack(stack: LocalStack, tmp_path: Path) -> None:
    """Two short steps with a target every step meets (the knee is the higher rate), then the same steps
    judged against a TTFT target no CPU prefill meets (no knee): the knee and capacity come from the
    stack's own answers (usage), not from the request parameters alone."""
    base = RunConfig(
        base_url=stack.config.gateway_url,
        model=stack.config.served_model_name,
        arrival=PoissonArrivals(1.0),
        tenants=[TenantConfig("sweep", stack.create_tenant_key("sweep"), {"synthetic": 1.0})],
        workload=WorkloadOptions(input_tokens=LengthDist.parse("uniform:64:192"), output_tokens=LengthDist.parse("8")),
        num_requests=1,
        request_timeout_s=120.0,
        ignore_eos=True,
        seed=7,
    )
    lax = SloTargets(ttft_p90_s=60.0, itl_p90_s=5.0)
    steps = asyncio.run(run_sweep(base, [0.3, 0.6], step_duration_s=8.0, slo=lax, arrival="constant"))
    assert [s.rate_rps for s in steps] == [0.3, 0.6]
    for s in steps:
        assert s.num_failed == 0 and s.num_ok == s.num_requests >= 2, s
        assert s.ttft_p50_ms is not None and s.ttft_p90_ms is not None and 0 < s.ttft_p50_ms <= s.ttft_p90_ms
        assert s.itl_p50_ms is not None and s.itl_p90_ms is not None and 0 < s.itl_p50_ms <= s.itl_p90_ms
        assert 0 < s.goodput_rps <= s.throughput_rps
        assert s.mean_output_tokens == 8.0  # ignore_eos: usage says exactly max_tokens
        # The chat template adds tokens to each drawn prompt; prefix caching may have served some.
        assert s.mean_prompt_tokens is not None and s.mean_prompt_tokens > 64
        assert s.mean_uncached_prompt_tokens is not None and 0 < s.mean_uncached_prompt_tokens <= s.mean_prompt_tokens
    report = build_sweep_report(steps, lax, config=base.describe(), step_duration_s=8.0,
                                num_prefill_workers=1, num_decode_workers=1)
    knee = steps[-1]
    assert report["knee_rps"] == 0.6
    cap = report["capacity"]
    assert cap["decode_tokens_per_s_per_worker"] == pytest.approx(0.6 * 8.0)
    assert cap["prefill_tokens_per_s_per_worker"] == pytest.approx(0.6 * (knee.mean_uncached_prompt_tokens or 0.0))
    paths = write_sweep(report, tmp_path)
    assert {p.name for p in paths} == {"sweep.json", "steps.csv", "capacity.json", "sweep.png"}
    assert json.loads((tmp_path / "capacity.json").read_text())["tandemDeployment"]["autoscaling"]["capacity"] == {
        "prefillTokensPerSecondPerWorker": int(cap["prefill_tokens_per_s_per_worker"]),
        "decodeTokensPerSecondPerWorker": int(cap["decode_tokens_per_s_per_worker"]),
    }
    strict = SloTargets(ttft_p90_s=0.001, itl_p90_s=5.0)
    assert build_sweep_report(steps, strict, config={}, step_duration_s=8.0, num_prefill_workers=1,
                              num_decode_workers=1)["knee_rps"] is None


@pytest.mark.timeout(1200)
def test_ttft_and_itl_medians_agree_with_vllm_bench_serve(stack: LocalStack) -> None:
    proc = subprocess.run(
        [sys.executable, str(AGREEMENT_SCRIPT), "--url", stack.config.gateway_url,
         "--model", stack.config.served_model_name, "--tokenizer", str(stack.config.model_dir),
         "--tolerance", str(AGREEMENT_TOLERANCE)],
        capture_output=True, text=True, timeout=1100,
        # Both tools authenticate as the stack's dev tenant (vllm bench serve reads OPENAI_API_KEY).
        env={**os.environ, "OPENAI_API_KEY": stack.api_key},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("AGREEMENT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("AGREEMENT "))
    print(json.dumps(result, indent=1))
    assert result["num_samples"]["ours_ttft"] == result["num_samples"]["vllm_ttft"] >= 12
    assert result["ttft_rel_diff"] <= AGREEMENT_TOLERANCE, result
    assert result["itl_rel_diff"] <= AGREEMENT_TOLERANCE, result
