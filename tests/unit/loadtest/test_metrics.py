"""Metric maths on recorded streams: what counts as a token chunk, TTFT, ITL,
TPOT from usage, E2E, throughput, percentiles and goodput."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tandem_loadtest.client import StreamParser
from tandem_loadtest.metrics import parse_slos, request_metrics, stats_ms, summarize
from tandem_loadtest.records import RequestRecord

CHUNK = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def chat_event(delta: dict[str, str] | None = None, finish: str | None = None, usage: dict[str, object] | None = None,
               ) -> str:
    choices = [] if delta is None and finish is None else [
        {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
    ]
    return "data: " + json.dumps({**CHUNK, "choices": choices, "usage": usage})


# A stream as the Tandem gateway writes it (role chunk with empty content, one
# chunk holding two tokens, finish chunk, usage chunk, [DONE]), with the time
# in seconds since send at which each event arrived.
RECORDED_CHAT: list[tuple[float, str]] = [
    (0.300, chat_event({"role": "assistant", "content": ""})),
    (0.301, chat_event({"content": "Paris"})),
    (0.351, chat_event({"content": " is"})),
    (0.371, chat_event({"content": ""})),  # an empty delta is not a token
    (0.401, chat_event({"content": " the capital"})),  # two tokens in one chunk
    (0.402, chat_event(finish="stop")),
    (0.403, chat_event(usage={"prompt_tokens": 30, "completion_tokens": 4, "total_tokens": 34,
                              "prompt_tokens_details": {"cached_tokens": 16}})),
    (0.404, "data: [DONE]"),
]


def record(**overrides: object) -> RequestRecord:
    base: dict[str, object] = {"index": 0, "tenant": "t", "label": "x", "endpoint": "chat", "max_tokens": 4,
                               "send_s": 0.0}
    base.update(overrides)
    return RequestRecord(**base)  # type: ignore[arg-type]


def replay(events: list[tuple[float, str]], rec: RequestRecord | None = None) -> tuple[RequestRecord, StreamParser]:
    rec = rec or record()
    parser = StreamParser(rec)
    for t, line in events:
        parser.feed_line(line, t)
        parser.feed_line("", t)
    parser.close(events[-1][0])
    rec.status = "ok" if rec.error is None and rec.content_times_s else "error"
    return rec, parser


def test_recorded_chat_stream_gives_vllm_metrics() -> None:
    rec, parser = replay(RECORDED_CHAT)
    assert parser.done and "".join(parser.text_parts) == "Paris is the capital"
    m = request_metrics(rec)
    assert m is not None
    assert m.ttft_s == pytest.approx(0.301)  # the role chunk does not count
    assert m.itl_s == pytest.approx([0.050, 0.050])  # gaps between content chunks only
    assert m.e2e_s == pytest.approx(0.402)  # last chunk with choices; usage and [DONE] excluded
    # Four tokens from usage, not three content chunks.
    assert m.output_tokens == 4 and m.prompt_tokens == 30 and rec.cached_tokens == 16
    assert m.tpot_s == pytest.approx((0.402 - 0.301) / 3)
    assert rec.finish_reason == "stop"


def test_text_completion_stream_and_sse_comments() -> None:
    events = [
        (0.1, ": ping"),
        (0.2, 'data: {"choices":[{"index":0,"text":"a","finish_reason":null}]}'),
        (0.25, 'data: {"choices":[{"index":0,"text":"b","finish_reason":"length"}]}'),
        (0.26, 'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}'),
        (0.27, "data: [DONE]"),
    ]
    rec, _ = replay(events, record(endpoint="completions"))
    m = request_metrics(rec)
    assert m is not None and m.ttft_s == pytest.approx(0.2) and m.tpot_s == pytest.approx(0.05)


def test_without_usage_there_are_no_token_counts_or_tpot() -> None:
    rec, _ = replay([e for e in RECORDED_CHAT if "usage\": {" not in e[1]])
    m = request_metrics(rec)
    assert m is not None and m.output_tokens is None and m.tpot_s is None
    assert summarize([rec], 1.0)["num_ok_without_usage"] == 1


def test_error_event_mid_stream_is_an_error() -> None:
    events = [*RECORDED_CHAT[:3], (0.5, 'data: {"error": {"message": "decode worker died", "type": "x"}}')]
    rec, _ = replay(events)
    assert rec.status == "error" and "decode worker died" in (rec.error or "")
    assert request_metrics(rec) is None


def test_single_token_answer_has_no_tpot_and_counts_as_zero_for_goodput() -> None:
    rec, _ = replay([RECORDED_CHAT[1], RECORDED_CHAT[5],
                     (0.41, chat_event(usage={"prompt_tokens": 3, "completion_tokens": 1}))])
    m = request_metrics(rec)
    assert m is not None and m.tpot_s is None and m.itl_s == []
    assert summarize([rec], 1.0, {"tpot": 1.0})["goodput"]["num_good"] == 1


def _ok(send_s: float, ttft_s: float, gap_s: float, n: int, tenant: str = "t", label: str = "x") -> RequestRecord:
    times = [ttft_s + i * gap_s for i in range(n)]
    return record(send_s=send_s, status="ok", content_times_s=times, last_choice_s=times[-1],
                  end_s=times[-1] + 0.001, prompt_tokens=10, completion_tokens=n, tenant=tenant, label=label)


def test_summary_counts_throughput_percentiles_and_goodput() -> None:
    records = [
        _ok(0.0, 0.1, 0.02, 11),
        _ok(0.5, 0.2, 0.04, 11),
        _ok(1.0, 0.9, 0.02, 11, tenant="u"),
        record(index=3, status="rate_limited", http_status=429),
        record(index=4, status="error", error="HTTP 500"),
        record(index=5, status="cancelled", content_times_s=[0.1]),
    ]
    s = summarize(records, 2.0, {"ttft": 500, "tpot": 30})
    assert (s["num_requests"], s["num_ok"], s["num_rate_limited"], s["num_errors"], s["num_cancelled"]) == (
        6, 3, 1, 1, 1)
    assert s["request_throughput_rps"] == pytest.approx(1.5)
    assert s["output_token_throughput_tps"] == pytest.approx(33 / 2)
    assert s["total_token_throughput_tps"] == pytest.approx(63 / 2)
    assert s["ttft_ms"]["p50"] == pytest.approx(200)
    assert s["ttft_ms"]["p90"] == pytest.approx(np.percentile([100, 200, 900], 90))
    assert s["tpot_ms"]["p50"] == pytest.approx(20)
    assert s["itl_ms"]["n"] == 30 and s["itl_ms"]["p50"] == pytest.approx(20)
    assert s["e2e_ms"]["max"] == pytest.approx(1000 * (0.9 + 10 * 0.02))
    g = s["goodput"]
    # Only the first meets both SLOs (the second's TPOT is 40 ms, the third's TTFT 900 ms).
    assert g["num_good"] == 1 and g["request_goodput_rps"] == pytest.approx(0.5)
    assert g["good_fraction"] == pytest.approx(1 / 5)  # 429 and errors count against it, cancellations do not


def test_stats_of_nothing_are_empty() -> None:
    assert stats_ms([]) == {"n": 0, "mean": None, "std": None, "max": None,
                            "p50": None, "p90": None, "p95": None, "p99": None}


def test_parse_slos() -> None:
    assert parse_slos(["ttft:500", "tpot:50 e2el:3000"]) == {"ttft": 500, "tpot": 50, "e2e": 3000}
    assert parse_slos(["ttft_ms=200"]) == {"ttft": 200}
    with pytest.raises(ValueError):
        parse_slos(["latency:5"])
