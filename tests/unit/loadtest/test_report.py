"""Reports: JSON round trip, Markdown summary, PNG plots, compare, replicas
from an operator log and from Prometheus, and the CLI end to end on a fake server."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from tandem_loadtest import cli
from tandem_loadtest.compare import compare_rows, format_comparison
from tandem_loadtest.plots import throughput_series
from tandem_loadtest.records import RequestRecord
from tandem_loadtest.replicas import from_operator_log, from_prometheus
from tandem_loadtest.report import build_report, load_report, markdown_summary, records_of, write_report
from tandem_loadtest.runner import RunResult

from tests.kit.openai_server import FakeOpenAIServer


def _ok(i: int, send_s: float, ttft_s: float, n: int, label: str, tenant: str) -> RequestRecord:
    times = [ttft_s + k * 0.05 for k in range(n)]
    return RequestRecord(index=i, tenant=tenant, label=label, endpoint="chat", max_tokens=n, send_s=send_s,
                         status="ok", http_status=200, content_times_s=times, last_choice_s=times[-1],
                         end_s=times[-1] + 0.01, prompt_tokens=100, completion_tokens=n, cached_tokens=50)


def make_result(ttft_s: float = 0.2) -> RunResult:
    records = [_ok(i, i * 0.5, ttft_s, 10, "doc-qa/static-first" if i % 2 else "chat", "ab"[i % 2])
               for i in range(8)]
    records.append(RequestRecord(index=8, tenant="a", label="chat", endpoint="chat", max_tokens=10, send_s=4.0,
                                 status="rate_limited", http_status=429))
    config = {"base_url": "http://x", "model": "m", "arrival": "poisson:2",
              "tenants": [{"name": "a"}, {"name": "b"}]}
    return RunResult(config=config, records=records, duration_s=4.5, started_unix_s=1_000.0)


def test_report_files_and_round_trip(tmp_path: Path) -> None:
    report = build_report(make_result(), slos_ms={"ttft": 250}, replicas={"decode": [[0.0, 1.0], [2.0, 2.0]]})
    paths = write_report(report, tmp_path)
    names = {p.name for p in paths}
    assert names == {"report.json", "summary.md", "latency_cdf.png", "ttft_over_time.png",
                     "throughput_over_time.png", "replicas.png"}
    for p in paths:
        assert p.stat().st_size > 0
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    loaded = load_report(tmp_path)
    assert loaded["summary"]["num_ok"] == 8 and loaded["summary"]["num_rate_limited"] == 1
    assert records_of(loaded)[3] == make_result().records[3]
    assert set(loaded["by_label"]) == {"chat", "doc-qa/static-first"}
    assert loaded["summary"]["cached_prompt_fraction"] == pytest.approx(0.5)
    assert loaded["summary"]["goodput"]["num_good"] == 8


def test_markdown_summary_has_the_figures() -> None:
    md = markdown_summary(build_report(make_result(), slos_ms={"ttft": 250}))
    assert "| TTFT | first non-empty content chunk − send | 200.0 | 200.0 |" in md
    assert "(E2E − TTFT) / (output_tokens − 1)" in md
    assert "By workload:" in md and "By tenant:" in md and "doc-qa/static-first" in md
    assert "Goodput (ttft ≤ 250 ms): 8 good requests" in md


def test_compare_prints_ratios() -> None:
    a = build_report(make_result(0.2))
    b = build_report(make_result(0.4))
    rows = {name: (va, vb, r) for name, va, vb, r in compare_rows(a, b)}
    assert rows["TTFT p50 ms"] == pytest.approx((200.0, 400.0, 2.0))
    assert rows["ITL p50 ms"][2] == pytest.approx(1.0)
    text = format_comparison(a, b)
    assert "| TTFT p50 ms | 200.00 | 400.00 | 2.00× |" in text


def test_throughput_series_conserves_tokens() -> None:
    records = make_result().records
    _starts, tok_s, req_s, inflight = throughput_series(records, bin_s=0.5)
    assert float(np.sum(tok_s) * 0.5) == pytest.approx(80)  # 8 completed × 10 usage tokens
    assert float(np.sum(req_s) * 0.5) == pytest.approx(8)
    assert inflight.max() <= 2.0


def test_replicas_from_operator_log(tmp_path: Path) -> None:
    log = tmp_path / "operator.log"
    log.write_text("\n".join([
        json.dumps({"ts": 990.0, "pool": "decode", "replicas": 1}),
        "not json at all",
        json.dumps({"time": "1970-01-01T00:16:45Z", "pool": "decode", "desired_replicas": 3}),
        "1970-01-01T00:16:50+00:00 INFO scaled pool=prefill replicas=2",
        json.dumps({"ts": 5000.0, "pool": "decode", "replicas": 9}),  # after the run
    ]))
    assert from_operator_log(log, 1000.0, 1020.0) == {"decode": [[0.0, 1.0], [5.0, 3.0]], "prefill": [[10.0, 2.0]]}


def test_replicas_from_prometheus(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_get(url: str, params: dict[str, object], timeout: float) -> httpx.Response:
        assert url == "http://prom:9090/api/v1/query_range" and params["query"] == "q"
        body = {"status": "success", "data": {"resultType": "matrix", "result": [
            {"metric": {"pool": "prefill"}, "values": [[1000, "1"], [1010, "2"]]}]}}
        return httpx.Response(200, json=body, request=httpx.Request("GET", url))

    monkeypatch.setattr(httpx, "get", fake_get)
    assert from_prometheus("http://prom:9090/", 1000.0, 1020.0, query="q") == {"prefill": [[0.0, 1.0], [10.0, 2.0]]}


def test_cli_run_compare_and_plot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    server = FakeOpenAIServer()
    real_client = httpx.AsyncClient

    def client_with_fake(*args: object, **kwargs: object) -> httpx.AsyncClient:
        kwargs["transport"] = server.transport()
        return real_client(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(httpx, "AsyncClient", client_with_fake)
    args = ["run", "--url", "http://fake", "--model", "m", "--tenant", "a:k1:synthetic=1,doc-qa=1",
            "--tenant", "b:k2:chat", "--arrival", "concurrency:2", "--num-requests", "6", "--output-tokens", "4",
            "--no-progress", "--goodput", "ttft:1000"]
    assert cli.main([*args, "--out", str(tmp_path / "A")]) == 0
    assert cli.main([*args, "--out", str(tmp_path / "B"), "--no-plots"]) == 0
    assert {h["authorization"] for h, _ in server.requests} == {"Bearer k1", "Bearer k2"}
    assert (tmp_path / "A" / "latency_cdf.png").exists() and not (tmp_path / "B" / "latency_cdf.png").exists()
    capsys.readouterr()
    assert cli.main(["compare", str(tmp_path / "A" / "report.json"), str(tmp_path / "B")]) == 0
    assert "| TTFT p50 ms |" in capsys.readouterr().out
    assert cli.main(["plot", str(tmp_path / "B" / "report.json")]) == 0
    assert (tmp_path / "B" / "latency_cdf.png").exists()
    assert cli.main(["run", "--url", "http://fake", "--model", "m", "--arrival", "zipf:1"]) == 2
