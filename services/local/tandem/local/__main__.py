"""``python -m tandem.local`` (``make run``): start the local stack, print the
gateway URL and a ready-to-paste ``curl -N`` line, keep every process running
(a component that exits is started again, as Kubernetes would) and stop
everything on Ctrl-C. ``--help`` lists the flags."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from tandem.local.stack import (
    ExtraModel,
    LocalStack,
    StackConfig,
    StackError,
    WorkerPorts,
    default_second_model_dir,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tandem.local",
        description=(
            "Start Tandem on this machine: Redis (unless one answers already), the Ray Serve router, "
            "vLLM prefill and decode workers and the gateway. Components that exit are restarted. "
            "Environment: TANDEM_MODEL_DIR (a Hugging Face model folder), TANDEM_SERVED_MODEL_NAME, "
            "TANDEM_REDIS_DATA_DIR."
        ),
    )
    parser.add_argument("--prefill-workers", type=_at_least_one, default=1, metavar="N",
                        help="number of prefill workers (default 1)")
    parser.add_argument("--decode-workers", type=_at_least_one, default=1, metavar="N",
                        help="number of decode workers (default 1)")
    parser.add_argument("--second-model", action="store_true",
                        help="also serve the second base model `make model` prepares "
                             "(SmolLM2-135M-Instruct-tandem-merged) on a prefill and a decode worker of its own "
                             "(`make run RUN_ARGS=--second-model`; two more engines, ~6.6 GB)")
    parser.add_argument("--extra-model", action="append", default=[], type=Path, metavar="DIR",
                        help="also serve the Hugging Face model in DIR (named after the folder) on a prefill and "
                             "a decode worker of its own; repeatable")
    parser.add_argument("--gateway-port", type=int, default=8080, metavar="PORT",
                        help="the gateway's HTTP port (default 8080)")
    parser.add_argument("--no-supervise", action="store_true",
                        help="do not restart a component that exits (the stack keeps running without it)")
    parser.add_argument("--no-redis-users", action="store_true",
                        help="every process logs in to Redis as the URL's user (default: one ACL user per "
                             "component, created at start; needs a Redis you may administer)")
    parser.add_argument("--plaintext-internal", action="store_true",
                        help="internal gRPC without TLS and without role checks (default: mutual TLS, one "
                             "certificate per role from the local CA in ~/.cache/tandem/pki)")
    return parser.parse_args(argv)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def config_from_args(args: argparse.Namespace) -> StackConfig:
    # A Redis the stack starts itself keeps tenants, keys and usage across restarts (append-only file);
    # a Redis already running at the URL keeps its own persistence settings.
    config = StackConfig(
        redis_data_dir=Path(os.environ.get("TANDEM_REDIS_DATA_DIR", Path.home() / ".cache" / "tandem" / "redis")),
        gateway_port=args.gateway_port,
        extra_prefill_workers=[WorkerPorts.free() for _ in range(args.prefill_workers - 1)],
        extra_decode_workers=[WorkerPorts.free() for _ in range(args.decode_workers - 1)],
        supervise=not args.no_supervise,
        redis_users=not args.no_redis_users,
        keep_redis_users=True,  # reused by the next start, with the passwords kept in ~/.cache/tandem/redis-users
        internal_tls=not args.plaintext_internal,
    )
    model_dir = os.environ.get("TANDEM_MODEL_DIR")
    if model_dir:
        config.model_dir = Path(model_dir).expanduser()
        config.served_model_name = os.environ.get("TANDEM_SERVED_MODEL_NAME", config.model_dir.name)
    extra_dirs = [*([default_second_model_dir()] if args.second_model else []), *args.extra_model]
    config.extra_models = [ExtraModel.free(d.expanduser()) for d in extra_dirs]
    return config


def main(argv: list[str] | None = None) -> int:
    config = config_from_args(parse_args(argv))
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
        if config.extra_models:
            others = ", ".join(m.name for m in config.extra_models)
            print(f'[tandem] also serving {others}: name it in "model" (GET {url}/v1/models lists them)')
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
