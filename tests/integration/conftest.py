"""One real local stack per test session: Redis, Ray Serve router, vLLM
prefill and decode workers, gateway — the same launcher as ``make run``,
on free ports and a private registry prefix."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.local.stack import LocalStack, StackConfig, free_port

#: Below the router's default: every chat prompt here (the chat template alone is ~30 tokens) goes
#: through the handoff, so the tests of the prefill → decode path keep testing it; a prompt whose prefix
#: the decode worker already holds is finished there alone (test_local_prefill.py).
MIN_UNCACHED_TOKENS_TO_DISAGGREGATE = 16


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    log_dir = Path(tmp_path_factory.mktemp("stack-logs"))
    config = StackConfig.with_free_ports(
        key_prefix=f"tandem-it-{uuid.uuid4().hex[:8]}",
        log_dir=log_dir,
        min_uncached_tokens_to_disaggregate=MIN_UNCACHED_TOKENS_TO_DISAGGREGATE,
        router_metrics_port=free_port(),  # scraped by test_prometheus_queries.py
        # The gateway's defaults: every handoff is prefetched (PrefetchKV while the prefill runs); the
        # pull after the prefill is what a refused or unused prefetch falls back to.
    )
    with LocalStack(config, progress=lambda msg: print(f"[stack] {msg}", flush=True)) as stack:
        yield stack
