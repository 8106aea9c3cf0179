"""Command line: ``tandem-loadtest run | sweep | compare | plot``.

The entry point (console script and ``python -m tandem_loadtest``); parses
flags once, builds a :class:`~tandem_loadtest.runner.RunConfig`, runs
:func:`~tandem_loadtest.runner.run_load` under a progress bar and writes the
report. ``@file`` reads more arguments from a file, one per line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tandem_loadtest.arrivals import parse_arrival
from tandem_loadtest.distributions import LengthDist
from tandem_loadtest.metrics import parse_slos
from tandem_loadtest.records import RequestRecord
from tandem_loadtest.runner import ProgressFn, RunConfig, RunResult, run_load
from tandem_loadtest.sweep import StepResult
from tandem_loadtest.tenants import TenantConfig, parse_mix
from tandem_loadtest.workloads import WorkloadOptions


def _add_run_args(p: argparse.ArgumentParser, *, sweep: bool = False) -> None:
    """The flags of ``run``; ``sweep`` has its own load shape and report, the rest the same."""
    g = p.add_argument_group("target")
    g.add_argument("--url", required=True, help="base URL of the OpenAI-compatible server (with or without /v1)")
    g.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    g.add_argument("--api-key", default=None,
                   help="bearer key of the default tenant (default: $OPENAI_API_KEY)")
    g.add_argument("--tenant", action="append", default=[], metavar="NAME:KEY:MIX[:SHARE]",
                   help="a tenant with its own key and workload mix, e.g. alice:sk-a:doc-qa=3,chat=1 (repeatable)")
    g.add_argument("--workload", default="synthetic", metavar="MIX",
                   help="workload mix of the default tenant when no --tenant is given (default: synthetic)")

    g = p.add_argument_group("load")
    if sweep:
        _add_sweep_load_args(g)
    else:
        g.add_argument("--arrival", default="poisson:1", metavar="SPEC",
                       help="poisson:RATE | constant:RATE | burst:SIZE:EVERY_S | ramp:START:END:OVER_S | concurrency:N")
        g.add_argument("--num-requests", type=int, default=None, help="stop issuing after this many requests")
        g.add_argument("--duration-s", type=float, default=None, help="stop issuing after this many seconds")
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (open-loop modes)")
    g.add_argument("--cancel-fraction", type=float, default=0.0, help="share of requests the client cancels")
    g.add_argument("--cancel-after-s", type=float, default=1.0, help="delay after sending before cancelling")
    g.add_argument("--request-timeout-s", type=float, default=600.0)
    g.add_argument("--seed", type=int, default=0)

    g = p.add_argument_group("workloads")
    g.add_argument("--input-tokens", type=LengthDist.parse, default=LengthDist("fixed", 256),
                   help="prompt length: N | uniform:LO:HI | normal:MEAN:STD | lognormal:MEDIAN:SIGMA")
    g.add_argument("--output-tokens", type=LengthDist.parse, default=LengthDist("fixed", 64),
                   help="max_tokens per request (same forms)")
    g.add_argument("--ignore-eos", action="store_true", help="send vLLM's ignore_eos so answers are max_tokens long")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--doc-tokens", type=int, default=1500, help="doc-qa: length of each tenant's document")
    g.add_argument("--doc-order", choices=("static-first", "variable-first", "both"), default="both",
                   help="doc-qa: document before the question, after it, or alternating")
    g.add_argument("--question-tokens", type=LengthDist.parse, default=LengthDist("fixed", 24))
    g.add_argument("--chat-turns", type=LengthDist.parse, default=LengthDist("uniform", 3, 6))
    g.add_argument("--chat-user-tokens", type=LengthDist.parse, default=LengthDist("fixed", 32))
    g.add_argument("--chat-max-sessions", type=int, default=8, help="chat: open sessions per tenant")
    g.add_argument("--long-fraction", type=float, default=0.2, help="mixed: share of long prompts")
    g.add_argument("--long-input-tokens", type=LengthDist.parse, default=LengthDist("fixed", 2000))
    g.add_argument("--long-output-tokens", type=LengthDist.parse, default=LengthDist("fixed", 16))
    g.add_argument("--prompts-file", type=Path, default=None,
                   help='file: JSONL of {"prompt": ..., "output_tokens": N}')
    g.add_argument("--prompts-endpoint", choices=("chat", "completions"), default="chat")

    g = p.add_argument_group("report")
    g.add_argument("--out", type=Path, default=None,
                   help=f"report folder (default reports/{'sweep' if sweep else 'loadtest'}-<timestamp>)")
    if sweep:
        g.add_argument("--no-plots", action="store_true")
        g.add_argument("--no-progress", action="store_true")
        return
    g.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. --goodput ttft:500 tpot:50 e2e:5000")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--no-progress", action="store_true")
    g.add_argument("--prometheus-url", default=None, help="read replicas per pool over the run from Prometheus")
    g.add_argument("--replicas-query", default=None, help="PromQL for replicas (default: by pool)")
    g.add_argument("--replicas-label", default="pool")
    g.add_argument("--operator-log", type=Path, default=None, help="read replicas per pool from the operator's log")


def _add_sweep_load_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--rates", type=_rates, default=None, metavar="R1,R2,...",
                   help="offered rates (req/s), one step each, lowest first")
    g.add_argument("--start-rps", type=float, default=0.5, help="first rate without --rates")
    g.add_argument("--factor", type=float, default=2.0, help="each rate this times the last, without --rates")
    g.add_argument("--steps", type=int, default=5, help="number of rates without --rates")
    g.add_argument("--step-duration-s", type=float, default=30.0, help="seconds of arrivals per step")
    g.add_argument("--arrival-kind", choices=("poisson", "constant"), default="poisson")
    g.add_argument("--stop-after-breaches", type=int, default=1,
                   help="stop after this many steps missed the SLO (0: run every rate)")
    g.add_argument("--slo", nargs="+", default=None, metavar="METRIC:MS",
                   help="p90 targets, ttft:MS itl:MS (default: --slo-values)")
    g.add_argument("--slo-values", type=Path, default=None, metavar="VALUES.yaml",
                   help="read the targets from a Helm values file's tandemDeployment.slo (the chart's line)")
    g.add_argument("--prefill-workers", type=int, default=1, help="prefill workers serving during the sweep")
    g.add_argument("--decode-workers", type=int, default=1, help="decode workers serving during the sweep")


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad rates {text!r}: {exc}") from exc
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError("rates must be positive numbers, e.g. 0.5,1,2")
    return rates


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="tandem-loadtest", fromfile_prefix_chars="@",
                                   description="Load-test an OpenAI-compatible endpoint.")
    sub = root.add_subparsers(dest="command", required=True)
    _add_run_args(sub.add_parser("run", fromfile_prefix_chars="@", help="run a load test and write a report"))
    cmp_ = sub.add_parser("compare", help="print two reports side by side with ratios")
    cmp_.add_argument("a", type=Path)
    cmp_.add_argument("b", type=Path)
    _add_run_args(sub.add_parser("sweep", fromfile_prefix_chars="@",
                                 help="raise the offered rate step by step, find the knee, write per-worker capacity"),
                  sweep=True)
    plot = sub.add_parser("plot", help="(re)draw the plots and summary of a saved report")
    plot.add_argument("report", type=Path)
    return root


def first_model(base_url: str, api_key: str | None) -> str:
    import httpx

    from tandem_loadtest.runner import normalize_base_url

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.get(f"{normalize_base_url(base_url)}/v1/models", headers=headers, timeout=30)
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


def config_from_args(args: argparse.Namespace) -> RunConfig:
    api_key = args.api_key if args.api_key is not None else os.environ.get("OPENAI_API_KEY")
    if args.model is None:
        args.model = first_model(args.url, api_key)
    tenants = [TenantConfig.parse(t, default_key=api_key) for t in args.tenant] or [
        TenantConfig("default", api_key, parse_mix(args.workload))
    ]
    if args.command == "sweep":  # each step replaces the arrivals and the bounds
        args.arrival, args.num_requests, args.duration_s = "poisson:1", None, args.step_duration_s
    if args.num_requests is None and args.duration_s is None:
        args.num_requests = 100
    return RunConfig(
        base_url=args.url,
        model=args.model,
        arrival=parse_arrival(args.arrival),
        tenants=tenants,
        workload=WorkloadOptions(
            input_tokens=args.input_tokens,
            output_tokens=args.output_tokens,
            doc_tokens=args.doc_tokens,
            doc_order=args.doc_order,
            question_tokens=args.question_tokens,
            chat_turns=args.chat_turns,
            chat_user_tokens=args.chat_user_tokens,
            chat_max_sessions=args.chat_max_sessions,
            long_fraction=args.long_fraction,
            long_input_tokens=args.long_input_tokens,
            long_output_tokens=args.long_output_tokens,
            prompts_file=args.prompts_file,
            prompts_endpoint=args.prompts_endpoint,
        ),
        num_requests=args.num_requests,
        duration_s=args.duration_s,
        max_concurrency=args.max_concurrency,
        cancel_fraction=args.cancel_fraction,
        cancel_after_s=args.cancel_after_s,
        request_timeout_s=args.request_timeout_s,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        seed=args.seed,
    )


def run_with_progress(config: RunConfig, *, show: bool = True) -> RunResult:
    from tqdm import tqdm  # type: ignore[import-untyped]

    bar = tqdm(total=config.num_requests, unit="req", disable=not show, dynamic_ncols=True,
               desc=f"{config.arrival.describe()}")

    def progress(record: RequestRecord, counts: Counter[str]) -> None:
        bar.update(1)
        bar.set_postfix({k: counts[k] for k in ("ok", "rate_limited", "error", "cancelled") if counts[k]},
                        refresh=False)

    try:
        return asyncio.run(run_load(config, progress=progress))
    finally:
        bar.close()


def _cmd_run(args: argparse.Namespace) -> int:
    from tandem_loadtest.report import build_report, markdown_summary, write_report

    try:
        config = config_from_args(args)
        slos = parse_slos(args.goodput)
    except ValueError as exc:
        print(f"tandem-loadtest: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        print(f"tandem-loadtest: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 2
    out = args.out or Path("reports") / time.strftime("loadtest-%Y%m%d-%H%M%S")
    result = run_with_progress(config, show=not args.no_progress)
    replicas = _replicas(args, result)
    report = build_report(result, slos_ms=slos, replicas=replicas)
    paths = write_report(report, out, plots=not args.no_plots)
    print(markdown_summary(report))
    print(f"report: {', '.join(str(p) for p in paths)}")
    s = report["summary"]
    return 0 if s["num_ok"] > 0 else 1


def _replicas(args: argparse.Namespace, result: RunResult) -> dict[str, list[list[float]]]:
    from tandem_loadtest import replicas

    start, end = result.started_unix_s, result.started_unix_s + result.duration_s + 1
    try:
        if args.prometheus_url:
            timeline: dict[str, list[list[float]]] = replicas.from_prometheus(args.prometheus_url, start, end,
                                            query=args.replicas_query or replicas.DEFAULT_QUERY,
                                            label=args.replicas_label)
            return timeline
        if args.operator_log:
            return replicas.from_operator_log(args.operator_log, start, end)
    except Exception as exc:  # the run's data matter more than the replica plot
        print(f"tandem-loadtest: could not read replicas: {exc}", file=sys.stderr)
    return {}


def _cmd_sweep(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tandem_loadtest.sweep import SloTargets, build_sweep_report, run_sweep, summary_line, write_sweep

    try:
        if (args.slo is None) == (args.slo_values is None):
            raise ValueError("give the SLO once: --slo ttft:MS itl:MS or --slo-values VALUES.yaml")
        slo = SloTargets.parse(args.slo) if args.slo is not None else SloTargets.from_values(args.slo_values)
        rates = args.rates or [args.start_rps * args.factor**i for i in range(args.steps)]
        config = config_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"tandem-loadtest: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        print(f"tandem-loadtest: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 2
    out = args.out or Path("reports") / time.strftime("sweep-%Y%m%d-%H%M%S")
    print(f"sweep: {len(rates)} steps of {args.step_duration_s:g} s at {', '.join(f'{r:g}' for r in rates)} req/s; "
          f"SLO TTFT p90 {slo.ttft_p90_s * 1000:g} ms, ITL p90 {slo.itl_p90_s * 1000:g} ms ({slo.source})",
          flush=True)
    bars: list[Any] = []

    def progress_for(i: int, rate: float) -> ProgressFn:
        bar = tqdm(total=round(rate * args.step_duration_s), unit="req", disable=args.no_progress,
                   dynamic_ncols=True, desc=f"step {i + 1}/{len(rates)} {rate:g} req/s")
        bars.append(bar)
        return lambda record, counts: bar.update(1)

    def on_step(step: StepResult, met: bool) -> None:
        for bar in bars:
            bar.close()
        bars.clear()
        print(f"  {step.rate_rps:g} req/s: goodput {step.goodput_rps:.2f} req/s, TTFT p50/p90 "
              f"{_ms(step.ttft_p50_ms)}/{_ms(step.ttft_p90_ms)} ms, ITL p50/p90 {_ms(step.itl_p50_ms)}/"
              f"{_ms(step.itl_p90_ms)} ms, failed {step.num_failed}/{step.num_requests}: "
              f"{'meets the SLO' if met else 'misses the SLO'}", flush=True)

    steps = asyncio.run(run_sweep(config, rates, step_duration_s=args.step_duration_s, slo=slo,
                                  arrival=args.arrival_kind, stop_after_breaches=args.stop_after_breaches,
                                  on_step=on_step, progress_for=progress_for))
    report = build_sweep_report(steps, slo, config=config.describe(), step_duration_s=args.step_duration_s,
                                num_prefill_workers=args.prefill_workers, num_decode_workers=args.decode_workers)
    paths = write_sweep(report, out, plots=not args.no_plots)
    print(f"report: {', '.join(str(p) for p in paths)}")
    print(summary_line(report), flush=True)
    return 0 if report["knee_rps"] is not None else 1


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "run":
        return _cmd_run(args)
    if args.command == "sweep":
        return _cmd_sweep(args)
    from tandem_loadtest.report import load_report

    if args.command == "compare":
        from tandem_loadtest.compare import format_comparison

        print(format_comparison(load_report(args.a), load_report(args.b), str(args.a), str(args.b)))
        return 0
    from tandem_loadtest.report import write_report

    report = load_report(args.report)
    folder = args.report if args.report.is_dir() else args.report.parent
    for path in write_report(report, folder):
        print(path)
    return 0
