"""PromQL evaluated by promtool (Debian's prometheus package, ``apt-get install prometheus``) over
series taken from a real component's ``/metrics`` text: the queries Tandem ships (the operator's
:meth:`tandem_operator.signals.QueryScope.queries`) checked against what the gateway and the router
really export, without a Prometheus server.

:func:`series_from_exposition` turns the exposition text into promtool's ``input_series``, with the
labels a scrape adds (``namespace``): gauges hold their value, counters and histograms grow by it
each minute (so ``rate`` over a minute sees it). :func:`check_promql` asserts each expression's value
at the third sample; ``None`` expects no result at all.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

#: Relative tolerance of an expected value: promtool's float arithmetic (rate, sums, quantile
#: interpolation) need not match Python's to the last bit.
REL_TOLERANCE = 1e-9
_GROWING = ("counter", "histogram", "summary")


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("needs promtool (apt-get install prometheus)")
    return path


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def series_from_exposition(text: str, labels: Mapping[str, str]) -> list[dict[str, str]]:
    """promtool input series, one per sample of ``text``, each with ``labels`` added; three samples a
    minute apart (gauges constant, counters and histograms 0, v, 2v)."""
    series = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            selector = ",".join(f"{k}={_quote(v)}" for k, v in sorted({**sample.labels, **labels}.items()))
            v = float(sample.value)
            values = f"0 {v!r} {2 * v!r}" if family.type in _GROWING else f"{v!r} {v!r} {v!r}"
            series.append({"series": f"{sample.name}{{{selector}}}", "values": values})
    return series


def check_promql(tmp_path: Path, series: list[dict[str, str]], expected: Mapping[str, float | None]) -> None:
    """Each expression of ``expected`` evaluates, at 2m, to one sample within :data:`REL_TOLERANCE` of
    its value (None: to nothing)."""
    cases: list[dict[str, Any]] = []
    for expr, value in expected.items():
        if value is None:
            cases.append({"expr": expr, "eval_time": "2m", "exp_samples": []})
        else:
            tolerance = REL_TOLERANCE * max(1.0, abs(value))
            near = f"abs(({expr}) - {value!r}) <= bool {tolerance!r}"
            cases.append({"expr": near, "eval_time": "2m", "exp_samples": [{"labels": "{}", "value": 1}]})
    spec = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": cases}],
    }
    path = tmp_path / "promql_tests.yml"
    path.write_text(json.dumps(spec))  # YAML 1.2 reads JSON
    proc = subprocess.run([promtool(), "test", "rules", str(path)], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float:
    """Prometheus's ``histogram_quantile`` over cumulative ``buckets`` (upper bound: count, +Inf
    included): linear within the bucket the rank falls in, the lowest bucket starting at 0."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    rank = q * total
    below_bound, below_count = 0.0, 0.0
    for i, bound in enumerate(bounds):
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return bounds[i - 1]
            return below_bound + (bound - below_bound) * (rank - below_count) / (count - below_count)
        below_bound, below_count = bound, count
    raise ValueError("no bucket holds the rank")
