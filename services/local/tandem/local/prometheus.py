"""A real Prometheus (Debian's package, ``make prometheus``) scraping a local stack, for the
live-query test and the autoscaling demo. The scrape configuration adds what the chart's
ServiceMonitors and PodMonitor add in a cluster: a ``namespace`` label on every series, and
``pod`` and ``pool`` on the workers' (pods named as a Deployment names them,
``<deployment>-<pool>-<pod-template-hash>-<suffix>``: here ``local`` and the worker's index)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tandem.local.stack import StackConfig, free_port


class PrometheusError(RuntimeError):
    pass


@dataclass(frozen=True)
class ScrapeTarget:
    job: str
    address: str
    labels: dict[str, str] = field(default_factory=dict)


def stack_targets(config: StackConfig, namespace: str, deployment: str) -> list[ScrapeTarget]:
    """The gateway, Ray's export of the router and every vLLM worker of a ``StackConfig``."""
    targets = []
    if config.start_gateway:
        targets.append(ScrapeTarget("gateway", f"{config.host}:{config.gateway_port}", {"namespace": namespace}))
    if config.start_router and config.router_metrics_port:
        targets.append(ScrapeTarget("router", f"{config.host}:{config.router_metrics_port}", {"namespace": namespace}))
    if config.start_workers:
        for name, worker in config.worker_ports().items():  # prefill, prefill-1, ..., decode, ...
            pool, _, index = name.partition("-")
            labels = {"namespace": namespace, "pod": f"{deployment}-{pool}-local-{index or 0}", "pool": pool}
            targets.append(ScrapeTarget("workers", f"{config.host}:{worker.metrics_port}", labels))
    return targets


class LocalPrometheus:
    """Start with :meth:`start`, query at :attr:`url`, stop with :meth:`stop`."""

    def __init__(
        self,
        workdir: Path,
        targets: Sequence[ScrapeTarget],
        *,
        rule_groups: list[dict[str, Any]] | None = None,
        scrape_interval_s: float = 1.0,
    ) -> None:
        self._workdir = workdir
        self._targets = list(targets)
        self._rule_groups = rule_groups or []
        self._interval = f"{scrape_interval_s:g}s"
        self._proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def config(self) -> dict[str, Any]:
        jobs: dict[str, list[dict[str, Any]]] = {}
        for t in self._targets:
            jobs.setdefault(t.job, []).append({"targets": [t.address], "labels": dict(t.labels)})
        return {
            "global": {"scrape_interval": self._interval, "evaluation_interval": self._interval},
            "rule_files": ["rules.yml"],
            "scrape_configs": [{"job_name": job, "static_configs": static} for job, static in jobs.items()],
        }

    def start(self, timeout_s: float = 60.0) -> str:
        binary = shutil.which("prometheus")
        if binary is None:
            raise PrometheusError("prometheus not found: run `make prometheus` (Debian's package)")
        self._workdir.mkdir(parents=True, exist_ok=True)
        config = self._workdir / "prometheus.yml"
        config.write_text(json.dumps(self.config(), indent=1))  # JSON is YAML
        (self._workdir / "rules.yml").write_text(json.dumps({"groups": self._rule_groups}, indent=1))
        check = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True)
        if check.returncode != 0:
            raise PrometheusError(check.stdout + check.stderr)
        port = free_port()
        log = (self._workdir / "prometheus.log").open("wb")
        self._proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={self._workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            if self._proc.poll() is not None:
                break
            time.sleep(0.5)
        self.stop()
        raise PrometheusError((self._workdir / "prometheus.log").read_text()[-2000:])

    def query(self, promql: str) -> list[dict[str, Any]]:
        answer = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10).json()
        if answer.get("status") != "success":
            raise PrometheusError(f"{promql}: {answer}")
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._proc = None
