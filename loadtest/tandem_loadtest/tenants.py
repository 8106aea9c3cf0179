"""Tenants: an API key, a share of the arrivals and a mix of workloads each.

Called by the CLI (``--tenant`` parsing) and :mod:`tandem_loadtest.runner`;
calls :mod:`tandem_loadtest.workloads`.

Spec: ``NAME:KEY:MIX[:SHARE]`` where MIX is ``kind=weight,kind=weight``,
e.g. ``alice:sk-alice:doc-qa=3,chat=1:2``. SHARE (default 1) weighs how many
of the run's arrivals go to this tenant.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np

from tandem_loadtest.workloads import WORKLOAD_KINDS, RequestSpec, Workload, WorkloadOptions, make_workload


@dataclass(frozen=True)
class TenantConfig:
    name: str
    api_key: str | None
    mix: dict[str, float]
    share: float = 1.0

    @classmethod
    def parse(cls, spec: str, *, default_key: str | None = None) -> TenantConfig:
        parts = spec.split(":")
        if len(parts) not in (3, 4) or not parts[0]:
            raise ValueError(f"bad tenant {spec!r}: use NAME:KEY:MIX[:SHARE], e.g. alice:sk-a:synthetic=2,chat=1")
        name, key, mix_spec = parts[:3]
        share = float(parts[3]) if len(parts) == 4 else 1.0
        return cls(name, key or default_key, parse_mix(mix_spec), share)


def parse_mix(spec: str) -> dict[str, float]:
    """``synthetic=2,chat=1`` (a bare kind means weight 1)."""
    mix: dict[str, float] = {}
    for item in spec.split(","):
        kind, _, weight = item.strip().partition("=")
        if kind not in WORKLOAD_KINDS:
            raise ValueError(f"unknown workload {kind!r} in {spec!r}; choose from {', '.join(WORKLOAD_KINDS)}")
        mix[kind] = float(weight) if weight else 1.0
        if mix[kind] <= 0:
            raise ValueError(f"workload weights must be > 0 in {spec!r}")
    return mix


@dataclass
class Tenant:
    """A tenant during a run: its workloads keep state (documents, chat sessions)."""

    config: TenantConfig
    workloads: dict[str, Workload] = field(default_factory=dict)

    @classmethod
    def build(cls, config: TenantConfig, options: WorkloadOptions) -> Tenant:
        seed = zlib.crc32(config.name.encode())
        workloads = {
            kind: make_workload(kind, options, tenant=config.name, tenant_seed=seed) for kind in config.mix
        }
        return cls(config, workloads)

    def next_request(self, rng: np.random.Generator) -> tuple[Workload, RequestSpec] | None:
        """A request from a workload drawn by weight; falls back to the others if it has none to give."""
        kinds = list(self.config.mix)
        weights = np.array([self.config.mix[k] for k in kinds], dtype=float)
        first = kinds[int(rng.choice(len(kinds), p=weights / weights.sum()))]
        for kind in [first, *[k for k in kinds if k != first]]:
            spec = self.workloads[kind].next_request(rng)
            if spec is not None:
                return self.workloads[kind], spec
        return None
