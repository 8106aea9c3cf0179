"""The local stack with its components in containers: the router, the workers and the gateway
each run from their image (``make images``) under ``podman run`` on the host's network, instead of
this venv's Python. Everything else is :class:`tandem.local.stack.LocalStack`'s own: the ports,
the per-role certificates, the Redis users and their password files, the ledger secret, the
readiness probes and the stop.

What each container gets is what a pod gets from the chart: its ``TANDEM_*`` settings, the model
folder read-only, the certificates and password files (owned by the images' user, 10001, as a
Secret's files are readable by the pod), a read-only root filesystem with ``/tmp`` writable
(HOME=/tmp, the chart's emptyDir). Redis is the host's (127.0.0.1:6379)."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tandem.local.stack import LocalStack, StackConfig

#: The images' user (docker/*.Dockerfile: useradd --uid 10001).
IMAGE_UID = 10001

#: Component module -> image name (docker/<name>.Dockerfile).
IMAGE_OF_MODULE = {"tandem.gateway": "gateway", "tandem.router": "router", "tandem.worker": "worker-cpu"}

#: Variables of the stack's environment a container receives, by prefix (the rest is the host's own
#: environment: PATH, the venv, ...).
_PASSED_PREFIXES = ("TANDEM_", "VLLM_", "PYTHONUNBUFFERED")


def image_name(name: str) -> str:
    prefix = os.environ.get("TANDEM_IMAGE_PREFIX", "localhost/tandem-")
    tag = os.environ.get("TANDEM_IMAGE_TAG", "dev")
    return f"{prefix}{name}:{tag}"


@dataclass(frozen=True)
class Podman:
    """How to run a container on this host: podman's global flags (OCI runtime, cgroup manager) and
    the run flags (ulimits) that work here. Hosts differ: where the default crun refuses a hybrid
    cgroup hierarchy, or root lacks CAP_SYS_RESOURCE so that podman's default ulimits (above the
    host's hard limits) cannot be set, runc with cgroupfs and the host's own limits do."""

    global_flags: tuple[str, ...]
    run_flags: tuple[str, ...]

    def run_command(self, *args: str) -> list[str]:
        return ["podman", *self.global_flags, "run", *self.run_flags, *args]

    def command(self, *args: str) -> list[str]:
        return ["podman", *self.global_flags, *args]


def _candidates() -> list[Podman]:
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    limits: list[tuple[str, ...]] = [()]
    for n in (nproc, 32768, 4096):
        if n != resource.RLIM_INFINITY and n > 0:
            limits.append(("--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={n}:{n}"))
    runtimes: list[tuple[str, ...]] = [()]
    if shutil.which("runc"):
        runtimes.append(("--runtime", "runc", "--cgroup-manager", "cgroupfs"))
    return [Podman(g, r) for g in runtimes for r in limits]


def probe_podman(image: str) -> tuple[Podman | None, list[str]]:
    """The first way of running ``image`` that works here (it runs ``python -c pass`` in it), and the
    errors of those that did not."""
    errors: list[str] = []
    for candidate in _candidates():
        cmd = candidate.run_command("--rm", "--network", "host", "--entrypoint", "python", image, "-c", "pass")
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if result.returncode == 0:
            return candidate, errors
        errors.append(f"{' '.join(cmd)}: {result.stderr.strip().splitlines()[-1:]}")
    return None, errors


class ContainerStack(LocalStack):
    """A :class:`LocalStack` whose router, workers and gateway are containers of the images."""

    def __init__(self, config: StackConfig, podman: Podman, *, secrets_dir: Path, **kwargs: object) -> None:
        super().__init__(config, **kwargs)  # type: ignore[arg-type]
        self.podman = podman
        #: Holds pki_dir, redis_users_dir and the ledger secret: handed to the images' user.
        self.secrets_dir = secrets_dir
        self.container_names: dict[str, str] = {}

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> None:
        module = args[-1] if len(args) == 3 and args[0] == sys.executable and args[1] == "-m" else ""
        if module not in IMAGE_OF_MODULE:
            super()._spawn(name, args, env)  # Redis, when the host has none running
            return
        container = f"{self.config.key_prefix}-{name}"
        self.container_names[name] = container
        # The certificates, keys and password files exist by now (start() makes them first): the pod's
        # user reads them, as it reads a mounted Secret.
        subprocess.run(["chown", "-R", f"{IMAGE_UID}:{IMAGE_UID}", str(self.secrets_dir)], check=True)
        super()._spawn(name, self._container_command(container, module, env), dict(os.environ))

    def mounts(self) -> dict[str, str]:
        """Host folder -> where the containers see it (read-only): the models under /models, as the
        chart mounts them, and the secrets under /secrets (the host's paths sit in folders only root
        may enter: /root, pytest's /tmp/pytest-of-root)."""
        c = self.config
        found = {str(self.secrets_dir): "/secrets", str(c.model_dir): "/models/model"}
        found.update({str(m.model_dir): f"/models/model-m{i}" for i, m in enumerate(c.extra_models, start=1)})
        return found

    def _container_command(self, container: str, module: str, env: Mapping[str, str]) -> list[str]:
        c = self.config
        mounts = self.mounts()
        passed = {k: v for k, v in env.items() if k.startswith(_PASSED_PREFIXES) or k in c.extra_env}
        for key, value in passed.items():
            for host_path, container_path in mounts.items():
                value = value.replace(host_path, container_path)
            passed[key] = value
        args = ["--rm", "--replace", "--name", container, "--network", "host", "--no-healthcheck"]
        # The chart's pod: read-only root, /tmp writable (HOME=/tmp); Ray and vLLM's CPU backend use
        # shared memory.
        args += ["--read-only", "--shm-size", "1g"]
        for host_path, container_path in mounts.items():
            args += ["--volume", f"{Path(host_path).resolve()}:{container_path}:ro"]
        for key, value in sorted(passed.items()):
            args += ["--env", f"{key}={value}"]
        return self.podman.run_command(
            *args, "--entrypoint", "python", image_name(IMAGE_OF_MODULE[module]), "-m", module
        )

    def container_state(self, name: str) -> dict[str, str]:
        """The running container of component ``name``: its image, user and state, as podman reports."""
        fmt = "{{.ImageName}}|{{.Config.User}}|{{.State.Status}}|{{.State.Pid}}"
        cmd = self.podman.command("inspect", "--format", fmt, self.container_names[name])
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
        image, user, status, pid = out.split("|")
        return {"image": image, "user": user, "status": status, "pid": pid}

    def stop(self, *, timeout_s: float = 30.0) -> None:
        try:
            super().stop(timeout_s=timeout_s)  # SIGTERM to each `podman run`, which passes it on
        finally:
            for container in self.container_names.values():
                subprocess.run(
                    self.podman.command("rm", "--force", "--time", "5", "--ignore", container),
                    capture_output=True,
                    check=False,
                )
