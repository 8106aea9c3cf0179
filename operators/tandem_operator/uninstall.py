"""``helm uninstall``'s pre-delete hook: ``python -m tandem_operator.uninstall --namespace NS --name NAME``.

Without it, ``helm uninstall`` deletes the release's TandemDeployment and the operator's Deployment at the
same time: the resource waits for the operator's finalizer (which drains and deletes the pools), the
operator is gone, and the resource stays ``Terminating`` until someone removes the finalizer by hand.

Helm runs this hook before it deletes anything, so the operator is still running. The hook deletes the
resource and waits until it is gone: the operator drains the pools, deletes them and releases its
finalizer. If the resource is still there after ``--timeout-s`` (the operator is not running, or stuck),
the hook removes the finalizers itself, says so, and exits 0: the pools carry owner references to the
resource, so Kubernetes' garbage collector deletes them with it, undrained. An uninstall never leaves a
resource stuck; an API error (no permission, API server down) fails the hook, and helm reports it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from typing import Literal

from tandem_operator.kube import KubeClient, KubeError
from tandem_operator.settings import OperatorSettings
from tandem_operator.spec import GROUP, KIND, VERSION

API_VERSION = f"{GROUP}/{VERSION}"
log = logging.getLogger("tandem_operator.uninstall")

Outcome = Literal["absent", "released", "forced"]


async def uninstall(kube: KubeClient, namespace: str, name: str, *, timeout_s: float, poll_s: float = 1.0) -> Outcome:
    """Delete the TandemDeployment ``namespace/name`` and wait for it to go: ``absent`` (there was none),
    ``released`` (the operator finished it), ``forced`` (its finalizers were removed after ``timeout_s``)."""
    if not await kube.delete(API_VERSION, KIND, namespace, name):
        return "absent"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if await kube.get(API_VERSION, KIND, namespace, name) is None:
            return "released"
        await asyncio.sleep(poll_s)
    if await kube.get(API_VERSION, KIND, namespace, name) is None:
        return "released"
    await kube.patch(API_VERSION, KIND, namespace, name, {"metadata": {"finalizers": None}})
    return "forced"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tandem_operator.uninstall", description=__doc__.split("\n")[0])
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--name", required=True, help="the release's TandemDeployment")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="how long the operator may take to drain")
    parser.add_argument("--poll-s", type=float, default=1.0)
    return parser


async def _main(args: argparse.Namespace, settings: OperatorSettings) -> Outcome:
    if settings.api_server_url:
        kube = KubeClient(settings.api_server_url, insecure=True)
    else:
        kube = KubeClient.in_cluster(settings.kubernetes_service_host, settings.kubernetes_service_port)
    try:
        return await uninstall(kube, args.namespace, args.name, timeout_s=args.timeout_s, poll_s=args.poll_s)
    finally:
        await kube.close()


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        outcome = asyncio.run(_main(args, OperatorSettings()))
    except KubeError as exc:
        log.error("could not delete TandemDeployment %s/%s: %s", args.namespace, args.name, exc)
        return 1
    if outcome == "forced":
        log.warning(
            "TandemDeployment %s/%s: the operator did not finish it within %.0f s; finalizers removed, its pools "
            "go with it undrained (garbage collector)",
            args.namespace,
            args.name,
            args.timeout_s,
        )
    else:
        log.info("TandemDeployment %s/%s: %s", args.namespace, args.name, outcome)
    return 0


if __name__ == "__main__":
    sys.exit(main())
