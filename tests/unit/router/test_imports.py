from __future__ import annotations

import subprocess
import sys


def test_client_import_stays_light() -> None:
    """The gateway imports the client: it must not drag in Ray (or torch, vLLM, settings)."""
    code = (
        "import sys, tandem.common.router_client\n"
        "heavy = [m for m in ('ray', 'torch', 'vllm', 'pydantic_settings') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_scheduler_import_needs_no_ray() -> None:
    code = "import sys, tandem.router.scheduler, tandem.router.settings\nassert 'ray' not in sys.modules\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
