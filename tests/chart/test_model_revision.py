"""``model.revision``: the weights' revision, from the values through the TandemDeployment to every worker of
the model (``TANDEM_WORKER_ENGINE__MODEL_REVISION``, part of its KV fingerprint), so that changing it is a
new revision the operator rolls prefill and decode of together (:mod:`tandem_operator.rollout`). Given twice
(also in a pool's ``engineArgs.extraEnv``) it fails the render, and the operator refuses the resource."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from tandem_operator.rollout import revision_changed
from tandem_operator.spec import MODEL_REVISION_ENV, SpecError, parse_spec

from tests.chart.conftest import CHART, RELEASE, find, render, run_helm
from tests.chart.test_pool_scheduling import BASE_SPEC, FULL, _pools


def _values_file(tmp_path: Path, values: dict[str, Any], name: str = "values") -> str:
    """A values file of its own name (``render`` caches by path)."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(values, allow_unicode=True))
    return str(path)


def _revision_env(deployment: dict[str, Any]) -> list[str]:
    (worker,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "worker"]
    return [e["value"] for e in worker["env"] if e["name"] == MODEL_REVISION_ENV]


def test_the_revision_reaches_every_worker_and_a_new_one_is_a_new_revision(tmp_path: Path) -> None:
    before = _pools(render(_values_file(tmp_path, {}, "none")))
    after = _pools(render(_values_file(tmp_path, {"model": {"revision": "2024-06-01.v2"}}, "v2")))
    (td,) = find(render(_values_file(tmp_path, {"model": {"revision": "a1b2c3d"}}, "sha")), "TandemDeployment")
    assert td["spec"]["model"]["revision"] == "a1b2c3d"
    for role in ("prefill", "decode"):
        name = f"{FULL}-{role}"
        assert _revision_env(before[name]) == []  # none given: the worker reads the model folder's digest
        assert _revision_env(after[name]) == ["2024-06-01.v2"]
        assert revision_changed(after[name], before[name])  # what gates the pools' rollout
        assert not revision_changed(after[name], after[name])


def test_in_the_models_form_each_model_has_its_own(tmp_path: Path) -> None:
    two = yaml.safe_load((CHART / "examples" / "values-gpu-two-models.yaml").read_text())
    two["tandemDeployment"]["models"][0]["revision"] = "main@3f2a"
    pools = _pools(render(_values_file(tmp_path, two)))
    revisions = {name: _revision_env(d) for name, d in pools.items()}
    assert len(revisions) == 4
    for name, found in revisions.items():  # <release>-<model slug>-<role>: Llama-3.1-8B-Instruct's are "llama"
        assert found == (["main@3f2a"] if "llama" in name else []), name


def test_a_revision_given_twice_fails_the_render_and_the_operator_refuses_it(tmp_path: Path) -> None:
    twice = {"engineArgs": {"extraEnv": {MODEL_REVISION_ENV: "v3"}}}
    values = {"model": {"revision": "v2"}, "tandemDeployment": {"pools": {"decode": twice}}}
    proc = run_helm("template", RELEASE, str(CHART), "-f", _values_file(tmp_path, values), check=False)
    assert proc.returncode != 0
    assert f"tandemDeployment.pools.decode: the revision is the model's (revision); drop {MODEL_REVISION_ENV}" in (
        proc.stderr
    )
    with pytest.raises(SpecError, match=f"decode: the revision is model.revision's; drop {MODEL_REVISION_ENV}"):
        parse_spec({**BASE_SPEC, "model": {**BASE_SPEC["model"], "revision": "v2"}, "pools": {"decode": twice}})
    # Either one alone is fine (extraEnv's on both pools: on one alone they could never pair).
    parse_spec({**BASE_SPEC, "pools": {"prefill": twice, "decode": twice}})
    parse_spec({**BASE_SPEC, "model": {**BASE_SPEC["model"], "revision": "v2"}})


@pytest.mark.parametrize("revision", ["-v2", "v 2", "ревизия", "v2\n", "x" * 129])
def test_the_schema_the_crd_and_the_operator_refuse_a_revision_that_is_no_name(tmp_path: Path, revision: str) -> None:
    proc = run_helm(
        "template", RELEASE, str(CHART), "-f", _values_file(tmp_path, {"model": {"revision": revision}}), check=False
    )
    assert proc.returncode != 0 and "revision" in proc.stderr
    with pytest.raises(SpecError, match="revision"):
        parse_spec({**BASE_SPEC, "model": {**BASE_SPEC["model"], "revision": revision}})
