"""``loadtest/autoscale_demo.py`` (a script, not a package) as a module, for the tests that call its pieces."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

DEMO = Path(__file__).resolve().parents[2] / "loadtest" / "autoscale_demo.py"


def load() -> Any:
    """The demo's module, imported once as ``autoscale_demo``."""
    if "autoscale_demo" in sys.modules:
        return sys.modules["autoscale_demo"]
    spec = importlib.util.spec_from_file_location("autoscale_demo", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module
