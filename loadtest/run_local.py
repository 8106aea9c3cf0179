"""``make loadtest``: a short mixed multi-tenant load test against the local
stack (started here with :class:`tandem.local.stack.LocalStack` on free
ports, stopped at the end), or against ``TANDEM_LOADTEST_URL`` when set.
The report goes to ``reports/loadtest-<timestamp>/`` unless ``--out`` is given.

``make loadtest-sweep`` (first argument ``sweep``): a short capacity sweep
(``tandem-loadtest sweep``) the same way, into ``reports/sweep-<timestamp>/``,
with the SLO of the chart's CPU example (``charts/tandem/examples/values-cpu-demo.yaml``)
unless ``--slo`` or ``--slo-values`` is given.

Extra arguments are passed to ``tandem-loadtest run`` (or ``sweep``) and
override the defaults below (argparse keeps the last value of a repeated flag).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path

from tandem_loadtest.cli import main as cli_main

# Two tenants with different mixes; bounded by count and by time so that the
# run takes a few minutes on a 2-core machine with CPU engines.
DEFAULT_ARGS = [
    "--tenant", "alice:sk-alice:doc-qa=2,chat=1",
    "--tenant", "bob:sk-bob:synthetic=1,mixed=1",
    "--arrival", "poisson:0.5",
    "--num-requests", "30",
    "--duration-s", "90",
    "--input-tokens", "uniform:64:256",
    "--output-tokens", "uniform:16:32",
    "--ignore-eos",
    "--doc-tokens", "800",
    "--long-input-tokens", "1500",
    "--long-output-tokens", "8",
    "--chat-turns", "uniform:2:4",
    "--cancel-fraction", "0.1",
    "--cancel-after-s", "1.0",
    "--request-timeout-s", "180",
    "--goodput", "ttft:3000", "tpot:250",
]

# A few short steps of one tenant's synthetic prompts (some long enough to load prefill, answers long
# enough to load decode), so that the whole sweep takes a few minutes on a 2-core machine. Constant
# arrivals: in a 20 s step, Poisson's draws would vary the number of requests more than the rate does.
SWEEP_ARGS = [
    "--tenant", "alice:sk-alice:synthetic=1",
    "--rates", "0.25,0.5,1,2",
    "--step-duration-s", "20",
    "--arrival-kind", "constant",
    "--input-tokens", "uniform:128:512",
    "--output-tokens", "32",
    "--ignore-eos",
    "--request-timeout-s", "60",
]
#: The local stack runs CPU engines: the SLO is the chart's CPU example's (tandemDeployment.slo), the line
#: a CPU holds for the 135M model; a deployment's sweep reads its own values (--slo-values) or --slo.
CPU_VALUES = Path(__file__).resolve().parent.parent / "charts" / "tandem" / "examples" / "values-cpu-demo.yaml"


def main() -> int:
    extra = sys.argv[1:]
    command, defaults = "run", DEFAULT_ARGS
    if extra[:1] == ["sweep"]:
        extra = extra[1:]
        command, defaults = "sweep", SWEEP_ARGS
        if "--slo" not in extra and "--slo-values" not in extra:
            defaults = [*defaults, "--slo-values", str(CPU_VALUES)]
    stamp = time.strftime(f"{'loadtest' if command == 'run' else 'sweep'}-%Y%m%d-%H%M%S")
    out = ["--out", str(Path("reports") / stamp)] if "--out" not in extra else []
    url = os.environ.get("TANDEM_LOADTEST_URL")
    if url:
        return cli_main([command, "--url", url, *defaults, *out, *extra])

    from tandem.local.stack import LocalStack, StackConfig, StackError

    config = StackConfig.with_free_ports(
        key_prefix=f"tandem-loadtest-{uuid.uuid4().hex[:8]}", log_dir=Path(".run/loadtest-logs")
    )
    stack = LocalStack(config, progress=lambda msg: print(f"[loadtest] {msg}", flush=True))
    try:
        stack.start()
    except StackError as exc:
        print(f"[loadtest] local stack failed: {exc}", file=sys.stderr)
        stack.stop()
        return 1
    try:
        print(f"[loadtest] local stack ready at {config.gateway_url}", flush=True)
        # The demo tenants get real keys from the stack's tenant store (auth is on, as in production).
        args = list(defaults)
        if stack.api_key:
            for tenant in ("alice", "bob"):
                key = stack.create_tenant_key(tenant)
                args = [a.replace(f"{tenant}:sk-{tenant}:", f"{tenant}:{key}:") for a in args]
        if command == "sweep":  # the stack's own pools
            args += ["--prefill-workers", str(1 + len(config.extra_prefill_workers)),
                     "--decode-workers", str(1 + len(config.extra_decode_workers))]
        return cli_main([command, "--url", config.gateway_url, "--model", config.served_model_name, *args, *out,
                         *extra])
    finally:
        print("[loadtest] stopping the local stack", flush=True)
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
