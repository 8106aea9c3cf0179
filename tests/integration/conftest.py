"""One real local stack per test session: Redis, Ray Serve router, vLLM
prefill and decode workers, gateway — the same launcher as ``make run``,
on free ports and a private registry prefix."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.local.stack import LocalStack, StackConfig


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    log_dir = Path(tmp_path_factory.mktemp("stack-logs"))
    config = StackConfig.with_free_ports(key_prefix=f"tandem-it-{uuid.uuid4().hex[:8]}", log_dir=log_dir)
    stack = LocalStack(config, progress=lambda msg: print(f"[stack] {msg}", flush=True))
    try:
        stack.start()
    except BaseException:
        for name in ("router", "prefill", "decode", "gateway"):
            print(f"--- {name} log tail ---\n{stack.tail(name)}")
        stack.stop()
        raise
    yield stack
    stack.stop()
