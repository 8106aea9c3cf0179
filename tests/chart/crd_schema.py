"""The TandemDeployment CRD's openAPIV3Schema as a strict JSON Schema, for
validating custom resources offline (the API server does this with strict
field validation; here jsonschema does)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import yaml

CRD_PATH = Path(__file__).resolve().parents[2] / "charts" / "tandem" / "crds" / "tandemdeployments.tandem.dev.yaml"


def _strict(node: Any) -> Any:
    if isinstance(node, dict):
        preserves_unknown = node.get("x-kubernetes-preserve-unknown-fields") is True
        node = {k: _strict(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
        if node.get("exclusiveMinimum") is True:  # OpenAPI 3.0 boolean form → JSON Schema number form
            node["exclusiveMinimum"] = node.pop("minimum")
        # An object that preserves unknown fields keeps them (the API server prunes nothing there).
        if "properties" in node and "additionalProperties" not in node and not preserves_unknown:
            node["additionalProperties"] = False  # strict field validation: unknown fields are errors
        return node
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


def crd_version_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD_PATH.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return copy.deepcopy(version["schema"]["openAPIV3Schema"])


def validate_custom_resource(obj: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError if ``obj`` does not fit the CRD (strictly)."""
    schema = _strict(crd_version_schema())
    schema["properties"]["metadata"] = {"type": "object"}
    schema["properties"]["status"] = {"type": "object"}
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(obj)
