"""A model whose prefill and decode pools can never pair (settings that make their workers' KV fingerprints
differ: dtype, tensor-parallel size, served name or revision given per pool) fails ``helm template`` naming the
pools and the setting (``tandem.checkPairing``), as the operator refuses the resource
(``tandem_operator.spec.pairing_conflicts``, the same rule); pools that may pair still render."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from tandem_operator.spec import MODEL_REVISION_ENV, SpecError, parse_spec

from tests.chart.conftest import CHART, RELEASE, render, run_helm
from tests.chart.test_pool_scheduling import BASE_SPEC, FULL, _pools


def _values_file(tmp_path: Path, values: dict[str, Any], name: str = "values") -> str:
    """A values file of its own name (``render`` caches by path)."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(values, allow_unicode=True))
    return str(path)


@pytest.mark.parametrize(
    ("prefill", "decode", "setting"),
    [
        ({"dtype": "bfloat16"}, {"dtype": "float16"}, "engineArgs.dtype: prefill bfloat16, decode float16"),
        ({"tensorParallelSize": 2}, {}, "engineArgs.tensorParallelSize: prefill 2, decode 1"),
        (
            {},
            {"extraEnv": {MODEL_REVISION_ENV: "v2"}},
            f"{MODEL_REVISION_ENV}: prefill none (the folder digest), decode v2",
        ),
        (
            {"dtype": "float32", "extraEnv": {"TANDEM_WORKER_ENGINE__DTYPE": "half"}},
            {"dtype": "float32"},
            "engineArgs.dtype: prefill float16, decode float32",
        ),
    ],
)
def test_pools_that_can_never_pair_fail_the_render_and_the_operator_refuses_them(
    tmp_path: Path, prefill: dict[str, Any], decode: dict[str, Any], setting: str
) -> None:
    pools = {"prefill": {"engineArgs": prefill}, "decode": {"engineArgs": decode}}
    proc = run_helm(
        "template",
        RELEASE,
        str(CHART),
        "-f",
        _values_file(tmp_path, {"tandemDeployment": {"pools": pools}}),
        check=False,
    )
    assert proc.returncode != 0
    assert "tandemDeployment.pools: prefill and decode can never pair (" in proc.stderr, proc.stderr
    assert setting in proc.stderr
    with pytest.raises(SpecError) as exc:
        parse_spec({**BASE_SPEC, "pools": pools})
    assert setting in str(exc.value)


def test_in_the_models_form_the_model_is_named(tmp_path: Path) -> None:
    two = yaml.safe_load((CHART / "examples" / "values-gpu-two-models.yaml").read_text())
    two["tandemDeployment"]["models"][1]["decode"]["engineArgs"]["tensorParallelSize"] = 1  # 2 GPUs: one rank fits
    proc = run_helm("template", RELEASE, str(CHART), "-f", _values_file(tmp_path, two), check=False)
    assert proc.returncode != 0
    assert (
        "tandemDeployment.models[1] (Qwen/Qwen2.5-14B-Instruct): prefill and decode can never pair "
        "(engineArgs.tensorParallelSize: prefill 2, decode 1)"
    ) in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [
        ({"dtype": "bfloat16", "tensorParallelSize": 2}, {"dtype": "bfloat16", "tensorParallelSize": 2}),
        # "auto" is the model's and the platform's: it may be bfloat16.
        ({"dtype": "auto"}, {"dtype": "bfloat16"}),
        ({"extraEnv": {"TANDEM_WORKER_ENGINE__DTYPE": "half"}}, {"dtype": "float16"}),
        ({"extraEnv": {MODEL_REVISION_ENV: "v2"}}, {"extraEnv": {MODEL_REVISION_ENV: "v2"}}),
        # Settings outside the fingerprint differ freely.
        ({"kvCacheBytes": 1 << 30}, {"kvCacheBytes": 1 << 32, "extraEnv": {"TANDEM_WORKER_KV__LEASE_S": "30"}}),
    ],
)
def test_pools_that_may_pair_render_and_the_operator_builds_them(
    tmp_path: Path, prefill: dict[str, Any], decode: dict[str, Any]
) -> None:
    values = {"tandemDeployment": {"pools": {"prefill": {"engineArgs": prefill}, "decode": {"engineArgs": decode}}}}
    pools = _pools(render(_values_file(tmp_path, values)))  # the CR checked against the CRD and parsed
    assert set(pools) == {f"{FULL}-prefill", f"{FULL}-decode"}
