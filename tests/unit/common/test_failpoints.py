"""Failpoints: inert without a folder, an armed action runs, ``once`` runs it at the first hit only."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.common import failpoints


def test_an_armed_error_raises_at_every_hit_and_once_at_the_first_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(failpoints, "_DIR", str(tmp_path))
    failpoints.hit("engine.step")  # not armed: nothing
    (tmp_path / "engine.step").write_text("error boom")
    for _ in range(2):
        with pytest.raises(failpoints.FailpointError, match="boom"):
            failpoints.hit("engine.step")
    (tmp_path / "engine.step").write_text("once error boom")
    with pytest.raises(failpoints.FailpointError, match="boom"):
        failpoints.hit("engine.step")
    assert not (tmp_path / "engine.step").exists()
    failpoints.hit("engine.step")  # spent


def test_without_a_folder_nothing_runs_and_unknown_names_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(failpoints, "_DIR", None)
    failpoints.hit("no.such.failpoint")  # production: one None check, nothing else
    monkeypatch.setattr(failpoints, "_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="unknown failpoint"):
        failpoints.hit("no.such.failpoint")
