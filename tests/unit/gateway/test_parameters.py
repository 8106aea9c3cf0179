"""Every request parameter is honoured end to end, refused, or (only where OpenAI calls it metadata) ignored.

The table in ``tandem.gateway.api.parameters`` is the truth; ``docs/api-parameters.md`` must list every entry
with the same verdict, and every honoured option must reach both workers' requests unchanged.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tandem.gateway.api.parameters import MESSAGE_FIELDS, PARAMETERS
from tandem.gateway.api.validation import ChatCompletionRequest, CompletionRequest

pytestmark = [pytest.mark.timeout(30)]  # asyncio_mode is auto

DOCS = Path(__file__).resolve().parents[3] / "docs" / "api-parameters.md"
MODEL = "SmolLM2-135M-Instruct"
USER = [{"role": "user", "content": "hello"}]


def _docs_rows() -> dict[tuple[str, str], str]:
    """(section, parameter) → verdict, from the Markdown tables of the docs page."""
    rows: dict[tuple[str, str], str] = {}
    section = ""
    for line in DOCS.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        match = re.match(r"\| `([a-z_]+)` \| (honoured|refused|metadata) \|", line)
        if match:
            rows[(section, match.group(1))] = match.group(2)
    return rows


def test_docs_table_matches_the_code() -> None:
    rows = _docs_rows()
    expected = {("Request parameters", p.name): p.kind for p in PARAMETERS}
    expected |= {("Message fields", p.name): p.kind for p in MESSAGE_FIELDS}
    assert rows == expected


def test_every_honoured_parameter_is_a_request_field() -> None:
    fields = {
        "chat": set(ChatCompletionRequest.model_fields) | {"schema_", "json_"},
        "completions": set(CompletionRequest.model_fields),
    }
    for parameter in PARAMETERS:
        if parameter.kind == "honoured":
            for endpoint in parameter.endpoints:
                assert parameter.name in fields[endpoint], (endpoint, parameter.name)


async def test_unknown_parameters_are_accepted(stack: Any) -> None:
    response = await stack.client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": USER, "max_tokens": 3, "some_future_field": {"x": 1}, "user": "u1"},
    )
    assert response.status_code == 200, response.text
    response = await stack.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "tools": [{"x": 1}]}
    )
    assert response.status_code == 200, response.text  # tools is a chat parameter: unknown to completions


@pytest.mark.parametrize(
    "fields",
    [
        {"tool_choice": "none"},
        {"tools": []},
        {"n": 1},
        {"modalities": ["text"]},
        {"service_tier": "auto"},
        {"use_beam_search": False},
        {"metadata": {"k": "v"}, "store": False, "safety_identifier": "s", "prompt_cache_key": "p"},
    ],
)
async def test_neutral_values_of_refused_parameters_are_accepted(stack: Any, fields: dict[str, Any]) -> None:
    response = await stack.client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 3, **fields}
    )
    assert response.status_code == 200, response.text


async def test_honoured_options_reach_both_workers(stack: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {
        "model": MODEL,
        "messages": USER,
        "max_tokens": 6,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "seed": 42,
        "stop": ["x", "yz"],
        "stop_token_ids": [7, 9],
        "min_tokens": 2,
        "include_stop_str_in_output": True,
        "logit_bias": {"17": -5.5, "3": 100},
        "logprobs": True,
        "top_logprobs": 3,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    }
    response = await stack.client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    (prefill,) = stack.prefill.prefill_requests
    (decode,) = stack.decode.decode_requests
    for options in (prefill.sampling, decode.sampling):
        assert options.max_tokens == 6
        assert options.temperature == pytest.approx(0.7)
        assert options.top_p == pytest.approx(0.9)
        assert options.top_k == 5
        assert options.min_p == pytest.approx(0.05)
        assert options.repetition_penalty == pytest.approx(1.1)
        assert options.presence_penalty == pytest.approx(0.5)
        assert options.frequency_penalty == pytest.approx(-0.5)
        assert options.seed == 42
        assert list(options.stop) == ["x", "yz"]
        assert list(options.stop_token_ids) == [7, 9]
        assert options.min_tokens == 2
        assert options.include_stop_str_in_output
        assert dict(options.logit_bias) == {17: pytest.approx(-5.5), 3: pytest.approx(100.0)}
        assert options.logprobs == 3
        assert options.skip_special_tokens is False and options.HasField("skip_special_tokens")
        assert options.spaces_between_special_tokens is False
        assert options.structured_output.WhichOneof("kind") == "json_schema"
    assert decode.first_token_id == 101  # the fake prefill worker's first token, replayed by decode
    assert decode.first_text == "Hello"


@pytest.mark.parametrize(
    ("fields", "kind", "value"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", True),
        ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ["yes", "no"]),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", 'root ::= "a"'),
        ({"structured_outputs": {"json": '{"type": "string"}'}}, "json_schema", '{"type": "string"}'),
        ({"response_format": {"type": "text"}}, None, None),
    ],
)
async def test_structured_output_kinds(stack: Any, fields: dict[str, Any], kind: str | None, value: Any) -> None:
    response = await stack.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3, **fields}
    )
    assert response.status_code == 200, response.text
    options = stack.prefill.prefill_requests[0].sampling
    assert options.structured_output.WhichOneof("kind") == kind
    if kind == "choice":
        assert list(options.structured_output.choice.choices) == value
    elif kind == "json_schema":
        assert options.structured_output.json_schema.replace(" ", "") == value.replace(" ", "")
    elif kind is not None:
        assert getattr(options.structured_output, kind) == value
