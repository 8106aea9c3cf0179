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
