"""schemathesis against the gateway's own /openapi.json (fake router and workers
behind it): no generated request may get a 5xx."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def test_openapi_document_lists_the_endpoints() -> None:
    from tandem.gateway.api.openapi import build_document

    document = build_document()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/usage"} <= set(document["paths"])
    assert "ChatCompletionRequest" in document["components"]["schemas"]


async def test_schemathesis_finds_no_5xx(edge: Any, edge_url: str) -> None:
    import asyncio

    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error

    key = await edge.tenant("fuzz")
    failures: list[str] = []

    def run() -> None:  # in a thread: schemathesis calls are blocking, the server runs on this loop
        schema = schemathesis.openapi.from_url(f"{edge_url}/openapi.json")
        for operation in schema.get_all_operations():
            op = operation.ok()

            @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            @given(case=op.as_strategy())
            def check(case: Any) -> None:
                case.headers = {**(case.headers or {}), "Authorization": f"Bearer {key}"}
                response = case.call(timeout=20)
                if response.status_code >= 500:
                    failures.append(f"{case.operation.label}: {response.status_code} {response.text[:300]}")
                case.validate_response(response, checks=(not_a_server_error,))

            check()

    await asyncio.to_thread(run)
    assert not failures, failures
