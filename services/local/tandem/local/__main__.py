"""``python -m tandem.local`` (``make run``): start the local stack, print the
gateway URL and a ready-to-paste ``curl -N`` line, stop everything on Ctrl-C."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from tandem.local.stack import LocalStack, StackConfig, StackError


def main() -> int:
    # A Redis the stack starts itself keeps tenants, keys and usage across restarts (append-only file);
    # a Redis already running at the URL keeps its own persistence settings.
    config = StackConfig(
        redis_data_dir=Path(os.environ.get("TANDEM_REDIS_DATA_DIR", Path.home() / ".cache" / "tandem" / "redis"))
    )
    model_dir = os.environ.get("TANDEM_MODEL_DIR")
    if model_dir:
        config.model_dir = Path(model_dir).expanduser()
        config.served_model_name = os.environ.get("TANDEM_SERVED_MODEL_NAME", config.model_dir.name)
    started = time.monotonic()
    stack = LocalStack(config, progress=lambda msg: print(f"[tandem] {msg}", flush=True))
    stopping = False

    def _stop(*_: object) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    try:
        stack.start()
        url = config.gateway_url
        body = (
            f'{{"model": "{config.served_model_name}", "stream": true, "temperature": 0, "messages": '
            '[{"role": "user", "content": "What is the capital of France?"}]}'
        )
        print(
            f"\n[tandem] ready in {time.monotonic() - started:.0f} s: gateway {url} "
            f"(playground {url}/, metrics {url}/metrics); logs in {config.log_dir}/"
        )
        auth = f" -H 'Authorization: Bearer {stack.api_key}'" if stack.api_key else ""
        if stack.api_key:
            print(f"[tandem] API key of tenant {config.dev_tenant_id} (new at every start): {stack.api_key}")
            print(f"[tandem] admin key (GET {url}/v1/admin/usage): {stack.admin_key}")
        print("[tandem] try:\n")
        print(f"curl -N {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'\n")
        print("[tandem] Ctrl-C stops everything.", flush=True)
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        print("\n[tandem] stopping ...", flush=True)
        return 0
    except StackError as exc:
        print(f"[tandem] failed: {exc}", file=sys.stderr)
        return 1
    finally:
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
