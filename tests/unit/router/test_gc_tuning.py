"""The router replica's GC setting (tandem.router.gc_tuning)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from tandem.router.gc_tuning import tune_gc
from tandem.router.settings import RouterConfig


@pytest.fixture
def thresholds() -> Iterator[tuple[int, int, int]]:
    before = gc.get_threshold()
    yield before
    gc.set_threshold(*before)


def test_the_young_threshold_is_set_and_the_older_ones_kept(thresholds: tuple[int, int, int]) -> None:
    tune_gc(RouterConfig().gc_young_threshold)
    assert gc.get_threshold() == (20_000, thresholds[1], thresholds[2])


def test_zero_leaves_pythons_own(thresholds: tuple[int, int, int]) -> None:
    tune_gc(0)
    assert gc.get_threshold() == thresholds


def test_the_setting_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.router.settings import TandemRouterSettings

    monkeypatch.setenv("TANDEM_ROUTER_GC_YOUNG_THRESHOLD", "0")
    assert TandemRouterSettings().router_config().gc_young_threshold == 0
