"""Offline validation of Gateway API objects (HTTPRoute), as kubernetes-validate does for the core kinds:
the Gateway API's own OpenAPI schemas, compiled into validators by the npm package
``@kubernetes-models/gateway-api`` (``make gateway-api-schemas``), run by node
(``validate_gateway_api.mjs``). A missing install fails the test, it does not skip it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.chart.conftest import ROOT

INSTALL_DIR = ROOT / ".tools" / "gateway-api"
SCRIPT = Path(__file__).with_name("validate_gateway_api.mjs")


def validate(objects: list[dict[str, Any]]) -> list[str]:
    """One verdict per object: ``ok`` or ``invalid: <why>``."""
    node = shutil.which("node")
    if node is None or not (INSTALL_DIR / ".installed").is_file():
        pytest.fail("node and the Gateway API schemas are needed: run `make gateway-api-schemas`", pytrace=False)
    stdin = "".join(json.dumps(obj) + "\n" for obj in objects)
    proc = subprocess.run(
        [node, str(SCRIPT), str(INSTALL_DIR)], input=stdin, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()
