"""Pools that can never pair are refused: a model whose spec gives its prefill and decode pools settings that make
their workers' KV fingerprints differ (``tandem_operator.spec.pairing_conflicts``) is an invalid spec
(``SpecValid=False``, no pool created or changed), where it used to run every request as a local prefill.
Only the declared spec counts: a rollout that changes both pools at once is valid, and its old and new pods,
which coexist for a while, are the rollout gate's (``tandem_operator.rollout``), never refused."""

from __future__ import annotations

from typing import Any

import pytest
from tandem_operator.reconcile import Owner, desired_objects, invalid_status
from tandem_operator.rollout import PodState, pods_to_pair, revision_changed
from tandem_operator.spec import (
    DTYPE_ENV,
    MODEL_REVISION_ENV,
    SERVED_NAME_ENV,
    TP_ENV,
    SpecError,
    pairing_conflicts,
    parse_spec,
)

OWNER = Owner(name="chat", namespace="ns", uid="u", labels={}, generation=3)
BASE: dict[str, Any] = {
    "model": {"servedModelName": "smol", "pvc": {"claimName": "models"}},
    "image": {"repository": "r", "tag": "t"},
    "redis": {"url": "redis://r:6379/0"},
}


def _spec(prefill: dict[str, Any], decode: dict[str, Any], **model: Any) -> dict[str, Any]:
    return {
        **BASE,
        "model": {**BASE["model"], **model},
        "pools": {"prefill": {"engineArgs": prefill}, "decode": {"engineArgs": decode}},
    }


@pytest.mark.parametrize(
    ("prefill", "decode", "found"),
    [
        ({"dtype": "bfloat16"}, {"dtype": "float16"}, "engineArgs.dtype: prefill bfloat16, decode float16"),
        ({"tensorParallelSize": 2}, {}, "engineArgs.tensorParallelSize: prefill 2, decode 1"),
        # extraEnv's value is the one the worker reads (it comes last).
        (
            {"dtype": "float16"},
            {"extraEnv": {DTYPE_ENV: "float32"}},
            "engineArgs.dtype: prefill float16, decode float32",
        ),
        ({}, {"extraEnv": {TP_ENV: "4"}}, "engineArgs.tensorParallelSize: prefill 1, decode 4"),
        ({"extraEnv": {SERVED_NAME_ENV: "other"}}, {}, f"{SERVED_NAME_ENV}: prefill other, decode smol"),
        (
            {"extraEnv": {MODEL_REVISION_ENV: "v2"}},
            {"extraEnv": {MODEL_REVISION_ENV: "v1"}},
            f"{MODEL_REVISION_ENV}: prefill v2, decode v1",
        ),
        # None declared: the decode worker's revision is the model folder's dir- digest, never "v2".
        ({"extraEnv": {MODEL_REVISION_ENV: "v2"}}, {}, f"{MODEL_REVISION_ENV}: prefill v2, decode none (the folder"),
    ],
)
def test_pools_that_can_never_pair_are_refused_naming_the_setting(
    prefill: dict[str, Any], decode: dict[str, Any], found: str
) -> None:
    with pytest.raises(SpecError) as exc:
        parse_spec(_spec(prefill, decode))
    message = str(exc.value)
    assert "pools: prefill and decode can never pair (" in message
    assert found in message
    assert "local prefill" in message


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [
        ({}, {}),
        ({"dtype": "bfloat16", "tensorParallelSize": 2}, {"dtype": "bfloat16", "tensorParallelSize": 2}),
        # "auto" is the model's and the platform's dtype: it may be bfloat16, so it is not refused.
        ({"dtype": "auto"}, {"dtype": "bfloat16"}),
        # vLLM's other names of one dtype.
        ({"extraEnv": {DTYPE_ENV: "half"}}, {"dtype": "float16"}),
        ({"extraEnv": {TP_ENV: "2"}}, {"tensorParallelSize": 2}),
        # Another folder may hold the same files: the fingerprint reads the files, not the path.
        ({"extraEnv": {"TANDEM_WORKER_ENGINE__MODEL_DIR": "/models/copy"}}, {}),
        # A declared dir- digest may be the other pool's folder digest.
        ({"extraEnv": {MODEL_REVISION_ENV: "dir-0123456789abcdef"}}, {}),
        # Settings outside the fingerprint differ freely.
        ({"kvCacheBytes": 1 << 30, "extraEnv": {"TANDEM_WORKER_KV__LEASE_S": "30"}}, {"kvCacheBytes": 1 << 32}),
    ],
)
def test_pools_that_may_pair_are_accepted(prefill: dict[str, Any], decode: dict[str, Any]) -> None:
    td = parse_spec(_spec(prefill, decode))
    assert pairing_conflicts(td.served_models()[0]) == []


def test_the_models_form_names_the_model_and_checks_each_one() -> None:
    models = [
        {"name": "smol", "pvc": {"claimName": "models"}},
        {
            "name": "Qwen/Qwen2.5-7B-Instruct",
            "pvc": {"claimName": "qwen"},
            "prefill": {"engineArgs": {"tensorParallelSize": 2}},
            "decode": {"engineArgs": {"tensorParallelSize": 2, "dtype": "float16"}},
        },
    ]
    spec = {key: value for key, value in BASE.items() if key != "model"} | {"models": models}
    parse_spec(spec)  # "auto" against float16: may pair
    models[1]["prefill"] = {"engineArgs": {"tensorParallelSize": 1, "dtype": "bfloat16"}}
    with pytest.raises(SpecError) as exc:
        parse_spec(spec)
    assert "models[1] (Qwen/Qwen2.5-7B-Instruct): prefill and decode can never pair (" in str(exc.value)
    assert "engineArgs.dtype: prefill bfloat16, decode float16; engineArgs.tensorParallelSize: prefill 1, decode 2" in (
        str(exc.value)
    )


def test_the_refusal_is_the_invalid_spec_status_and_builds_no_pool() -> None:
    """What the reconcile handler does with it: ``SpecValid=False`` (and ``Ready=False``) with the message, and
    nothing applied (the handler returns before any pool is built; here: parse_spec raises before
    desired_objects could be called)."""
    with pytest.raises(SpecError) as exc:
        parse_spec(_spec({"dtype": "bfloat16"}, {"dtype": "float32"}))
    status = invalid_status(OWNER, str(exc.value), [], "2026-12-07T10:00:00Z")
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["SpecValid"]["status"] == "False" and conditions["SpecValid"]["reason"] == "InvalidSpec"
    assert "engineArgs.dtype: prefill bfloat16, decode float32" in conditions["SpecValid"]["message"]
    assert conditions["Ready"]["status"] == "False"
    assert status["observedGeneration"] == 3
    assert "pools" not in status


def test_a_rollout_of_both_pools_is_valid_and_its_mixed_pods_are_the_gates() -> None:
    """The declared steady state is checked, never the pods: the old spec and the new one (both pools moved to
    bfloat16 / tensor-parallel 2 at once) are each valid, both pools roll (a new revision each), and while old
    and new pods coexist the gate pairs the new ones as before."""
    old = _spec({}, {})
    new = _spec(*([{"dtype": "bfloat16", "tensorParallelSize": 2}] * 2))
    live = {
        o["metadata"]["name"].rsplit("-", 1)[1]: o
        for o in desired_objects(OWNER, parse_spec(old), {"prefill": 1, "decode": 1})
        if o["kind"] == "Deployment"
    }
    rolled = {
        o["metadata"]["name"].rsplit("-", 1)[1]: o
        for o in desired_objects(OWNER, parse_spec(new), {"prefill": 1, "decode": 1}, live)
        if o["kind"] == "Deployment"
    }
    assert all(revision_changed(rolled[role], live[role]) for role in ("prefill", "decode"))
    # Mid-rollout: old pods of both roles serve, a new prefill pod waits for a new decode pod.
    pods = [
        PodState("p-old", "prefill", "r1", True, True, False),
        PodState("d-old", "decode", "r1", True, True, False),
        PodState("p-new", "prefill", "r2", True, False, True),
    ]
    assert pods_to_pair(pods) == []
    assert pods_to_pair([*pods, PodState("d-new", "decode", "r2", True, False, True)]) == ["d-new", "p-new"]
    # Moving one pool alone declares pools that never pair: refused (the live pools stay as they are).
    with pytest.raises(SpecError, match="can never pair"):
        parse_spec(_spec({"dtype": "bfloat16", "tensorParallelSize": 2}, {}))
