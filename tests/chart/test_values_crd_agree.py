"""The values schema and the CRD agree (issue 43, item 4): values generated from ``values.schema.json``'s
``tandemDeployment`` part (tests/chart/schema_strategy.py) either fail ``helm template`` with the chart's own message,
or render a TandemDeployment that the CRD's schema (strict, as the API server with strict field
validation) and the operator both accept. What must never happen is the install of an earlier
reviewer's finding: values the schema passes, a custom resource the API server rejects halfway through
``helm install``, or one the operator marks ``SpecValid=False``."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import tempfile
from typing import Any

import jsonschema
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from tandem_operator.spec import SpecError, parse_spec

from tests.chart.conftest import CHART, RELEASE, helm_path
from tests.chart.crd_schema import validate_custom_resource
from tests.chart.schema_strategy import strategy


class _KubeLoader(yaml.SafeLoader):
    """YAML as the API server reads it: Go's parser (helm's toYaml writes 1e-05, 5e+07) takes an exponent
    without a dot for a float, PyYAML's YAML 1.1 resolver for a string."""


_KubeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)[eE][-+]?[0-9]+$"), list("-+0123456789.")
)

#: How many value sets one run renders (each is one ``helm template``, ~0.3 s). 150 examples found the
#: disagreements this test was written for (a model without a source, adapters of no served model, a models-form
#: pool's replica bounds, duplicate names), each several times.
EXAMPLES = 80


def _tandem_deployment_values() -> st.SearchStrategy[dict[str, Any]]:
    """``tandemDeployment`` values the values schema passes, enabled, with lists short enough to render quickly."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    td = copy.deepcopy(schema["properties"]["tandemDeployment"])
    td["properties"]["enabled"] = {"const": True}
    td["properties"]["models"]["maxItems"] = 2
    td["properties"]["adapters"]["maxItems"] = 2
    return strategy(td, schema)


def _render(values: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump(values, f, allow_unicode=True)
        f.flush()
        return subprocess.run(
            [helm_path(), "template", RELEASE, str(CHART), "--namespace", "tandem", "-f", f.name],
            capture_output=True,
            text=True,
            timeout=120,
        )


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    # The same examples on every run (CI stays reproducible); no shrinking (minutes of helm runs): a failure
    # prints the whole values it drew.
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
@given(td=_tandem_deployment_values(), accelerator=st.sampled_from(["cpu", "gpu"]))
def test_values_the_schema_passes_render_a_resource_the_crd_and_the_operator_accept(
    td: dict[str, Any], accelerator: str
) -> None:
    proc = _render({"accelerator": accelerator, "tandemDeployment": td})
    if proc.returncode != 0:
        # A refusal must be the chart's own message (a `fail` or the schema), never a template crash.
        assert "execution error" in proc.stderr or "values don't meet" in proc.stderr, proc.stderr
        assert "nil pointer" not in proc.stderr and "wrong type" not in proc.stderr, proc.stderr
        return
    (cr,) = [d for d in yaml.load_all(proc.stdout, Loader=_KubeLoader) if d and d["kind"] == "TandemDeployment"]
    try:
        validate_custom_resource(cr)
    except jsonschema.ValidationError as exc:
        raise AssertionError(f"the CRD rejects what the chart rendered: {exc.message}\n{yaml.safe_dump(td)}") from exc
    try:
        parse_spec(cr["spec"])
    except SpecError as exc:
        raise AssertionError(f"the operator rejects what the chart rendered: {exc}\n{yaml.safe_dump(td)}") from exc


def test_the_property_sees_a_disagreement() -> None:
    """The check above is not a rubber stamp: a CR the CRD rejects fails it."""
    proc = _render({})
    (cr,) = [d for d in yaml.load_all(proc.stdout, Loader=_KubeLoader) if d and d["kind"] == "TandemDeployment"]
    cr["spec"]["pools"]["prefill"]["tolerations"] = [{"effect": "Sometimes"}]
    try:
        validate_custom_resource(cr)
    except jsonschema.ValidationError:
        return
    raise AssertionError("the CRD accepted an unknown toleration effect")


def test_a_value_yaml_cannot_encode_fails_the_render_instead_of_vanishing() -> None:
    """helm's toYaml renders nothing for a string with a C1 control character; without the chart's guard the
    custom resource would lose that whole list or map (an adapters list, a pool's annotations) silently."""
    proc = _render({"tandemDeployment": {"pools": {"prefill": {"podAnnotations": {"note": "caf\u00e9 \u0086"}}}}})
    assert proc.returncode != 0
    assert "a value holds characters YAML cannot encode" in proc.stderr
    ok = _render({"tandemDeployment": {"pools": {"prefill": {"podAnnotations": {"note": "café 東京 🚀"}}}}})
    assert ok.returncode == 0, ok.stderr
    (cr,) = [d for d in yaml.load_all(ok.stdout, Loader=_KubeLoader) if d and d["kind"] == "TandemDeployment"]
    assert cr["spec"]["pools"]["prefill"]["podAnnotations"] == {"note": "café 東京 🚀"}
