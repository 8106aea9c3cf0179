"""make autoscale-demo's reversal count: one change of direction per load peak is the load's, any
other is the controller flapping."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[3] / "loadtest" / "autoscale_demo.py"


@pytest.fixture(scope="module")
def count_reversals():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("autoscale_demo", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.count_reversals


def test_one_peak_is_no_reversal_and_anything_else_counts(count_reversals) -> None:  # type: ignore[no-untyped-def]
    up, down = True, False
    assert count_reversals([]) == 0
    assert count_reversals([up, up, down, down]) == 0  # up the ramp, down after the peak
    assert count_reversals([up, down, up, down]) == 2  # stepped down on the way up, then up again
    assert count_reversals([up, up, up]) == 0
    assert count_reversals([down, up]) == 1  # below the minimum it starts from: a reversal


@pytest.fixture(scope="module")
def demo():  # type: ignore[no-untyped-def]
    return sys.modules.get("autoscale_demo") or _load()


def _load():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("autoscale_demo", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_line_says_the_cold_start_and_decode_returns_to_zero(demo) -> None:  # type: ignore[no-untyped-def]
    """Decode starts at zero in the demo: back at its minimum means back at zero, and the line ends with the
    first request's wait from zero."""
    spec = demo.demo_spec("SmolLM2-135M-Instruct")
    assert spec.pools.get("decode").min_replicas == 0 and spec.pools.get("decode").replicas == 0
    quiet = {"prefill": demo.PoolSignals(), "decode": demo.PoolSignals()}

    def tick(t_s: float, decode: int) -> object:
        return demo.Tick(t_s, {"prefill": 1, "decode": decode}, {"prefill": 1, "decode": decode}, quiet)

    back = demo.summary(spec, [tick(0, 0), tick(10, 3), tick(20, 0)], [], 15.0, 43.24)
    assert back.endswith("peak_decode=3 returned_to_min=yes from_zero_s=43.2"), back
    stuck = demo.summary(spec, [tick(0, 0), tick(10, 1)], [], 15.0, 43.24)
    assert "returned_to_min=no" in stuck
