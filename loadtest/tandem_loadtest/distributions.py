"""Length distributions for prompts and answers, parsed from short specs.

Called by :mod:`tandem_loadtest.workloads` and the CLI; calls numpy only.

Specs: ``256`` (fixed), ``uniform:128:512`` (inclusive bounds),
``normal:256:64`` (mean, std), ``lognormal:256:0.5`` (median, sigma of the
log). Samples are rounded and clipped to at least 1 token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

DistKind = Literal["fixed", "uniform", "normal", "lognormal"]


@dataclass(frozen=True)
class LengthDist:
    kind: DistKind
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str | int) -> LengthDist:
        if isinstance(spec, int):
            return cls("fixed", float(spec))
        parts = spec.strip().split(":")
        try:
            if len(parts) == 1:
                dist = cls("fixed", float(parts[0]))
            elif parts[0] in ("uniform", "normal", "lognormal") and len(parts) == 3:
                dist = cls(parts[0], float(parts[1]), float(parts[2]))  # type: ignore[arg-type]
            else:
                raise ValueError
        except ValueError:
            raise ValueError(
                f"bad length spec {spec!r}: use N, uniform:LO:HI, normal:MEAN:STD or lognormal:MEDIAN:SIGMA"
            ) from None
        if dist.a < 1 or (dist.kind == "uniform" and dist.b < dist.a) or (dist.kind != "uniform" and dist.b < 0):
            raise ValueError(f"bad length spec {spec!r}: lengths must be >= 1 and spreads >= 0")
        return dist

    def sample(self, rng: np.random.Generator) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = float(rng.integers(int(self.a), int(self.b) + 1))
        elif self.kind == "normal":
            value = float(rng.normal(self.a, self.b))
        else:
            value = float(self.a * np.exp(rng.normal(0.0, self.b)))
        return max(1, round(value))

    @property
    def mean(self) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        if self.kind == "normal":
            return self.a
        return float(self.a * np.exp(self.b**2 / 2))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"{self.a:g}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"
