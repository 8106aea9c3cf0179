"""Workloads and length distributions: prompts, shared prefixes, chat history, mixes, tenants."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tandem_loadtest.distributions import LengthDist
from tandem_loadtest.tenants import Tenant, TenantConfig, parse_mix
from tandem_loadtest.workloads import (
    ChatWorkload,
    DocQAWorkload,
    FileWorkload,
    MixedWorkload,
    SyntheticWorkload,
    WorkloadOptions,
    make_workload,
)

RNG_SEED = 3


def rng() -> np.random.Generator:
    return np.random.default_rng(RNG_SEED)


def test_length_dist_specs_and_samples() -> None:
    r = rng()
    assert LengthDist.parse("128").sample(r) == 128
    uni = LengthDist.parse("uniform:10:20")
    samples = [uni.sample(r) for _ in range(2000)]
    assert min(samples) == 10 and max(samples) == 20
    normal = LengthDist.parse("normal:200:20")
    assert np.mean([normal.sample(r) for _ in range(4000)]) == pytest.approx(200, rel=0.02)
    logn = LengthDist.parse("lognormal:100:0.5")
    assert np.median([logn.sample(r) for _ in range(4000)]) == pytest.approx(100, rel=0.05)
    assert all(LengthDist.parse("normal:2:50").sample(r) >= 1 for _ in range(200))
    for bad in ("0", "uniform:5:1", "normal:10", "gamma:1:2", "x"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_synthetic_prompts_have_the_asked_length_and_are_unique() -> None:
    w = SyntheticWorkload(LengthDist.parse("100"), LengthDist.parse("uniform:5:9"))
    specs = [w.next_request(rng()) for _ in range(20)]
    contents = [s.messages[0]["content"] for s in specs if s.messages]
    assert len(set(contents)) == 20
    assert all(abs(len(c.split()) - 100) <= 3 for c in contents)
    assert all(5 <= s.max_tokens <= 9 and s.label == "synthetic" and s.endpoint == "chat" for s in specs)


def test_doc_qa_static_first_shares_the_document_prefix() -> None:
    w = DocQAWorkload(300, LengthDist.parse("20"), LengthDist.parse("8"), order="static-first", tenant_seed=1)
    r = rng()
    a, b = (w.next_request(r) for _ in range(2))
    ua, ub = a.messages[-1]["content"], b.messages[-1]["content"]  # type: ignore[index]
    assert a.messages[0] == b.messages[0]  # type: ignore[index]
    assert ua.startswith("Document:\n" + w.document) and ub.startswith("Document:\n" + w.document)
    assert ua != ub
    assert a.label == "doc-qa/static-first"
    assert len(w.document.split()) >= 300


def test_doc_qa_variable_first_puts_the_question_before_the_document() -> None:
    w = DocQAWorkload(300, LengthDist.parse("20"), LengthDist.parse("8"), order="variable-first", tenant_seed=1)
    spec = w.next_request(rng())
    content = spec.messages[-1]["content"]  # type: ignore[index]
    assert content.startswith("Question 1:") and content.endswith(w.document)
    assert spec.label == "doc-qa/variable-first"


def test_doc_qa_both_alternates_and_tenants_have_their_own_document() -> None:
    opts = WorkloadOptions(doc_tokens=200)
    w1 = make_workload("doc-qa", opts, tenant="a", tenant_seed=1)
    w2 = make_workload("doc-qa", opts, tenant="b", tenant_seed=2)
    r = rng()
    labels = [w1.next_request(r).label for _ in range(4)]  # type: ignore[union-attr]
    assert labels == ["doc-qa/static-first", "doc-qa/variable-first"] * 2
    assert isinstance(w1, DocQAWorkload) and isinstance(w2, DocQAWorkload)
    assert w1.document != w2.document
    assert w1.document == DocQAWorkload(200, LengthDist.parse("24"), LengthDist.parse("8"), tenant_seed=1).document


def test_chat_history_grows_with_the_real_answers() -> None:
    w = ChatWorkload(LengthDist.parse("3"), LengthDist.parse("10"), LengthDist.parse("8"), max_sessions=1)
    r = rng()
    first = w.next_request(r)
    assert first is not None and [m["role"] for m in first.messages or []] == ["system", "user"]
    assert w.next_request(r) is None  # the only session waits for its answer
    w.on_complete(first, "ANSWER-ONE", ok=True)
    second = w.next_request(r)
    assert second is not None and second.session_id == first.session_id
    roles = [m["role"] for m in second.messages or []]
    assert roles == ["system", "user", "assistant", "user"]
    assert (second.messages or [])[2]["content"] == "ANSWER-ONE"
    w.on_complete(second, "ANSWER-TWO", ok=True)
    third = w.next_request(r)
    assert third is not None and len(third.messages or []) == 6
    w.on_complete(third, "ANSWER-THREE", ok=True)  # third turn of three: the session ends
    fourth = w.next_request(r)
    assert fourth is not None and fourth.session_id != first.session_id and len(fourth.messages or []) == 2


def test_a_failed_chat_turn_ends_its_session() -> None:
    w = ChatWorkload(LengthDist.parse("5"), LengthDist.parse("10"), LengthDist.parse("8"), max_sessions=2)
    r = rng()
    spec = w.next_request(r)
    assert spec is not None
    w.on_complete(spec, "", ok=False)
    assert w.history_lengths() == {}


def test_mixed_labels_long_and_short_in_proportion() -> None:
    w = MixedWorkload(0.25, LengthDist.parse("400"), LengthDist.parse("4"), LengthDist.parse("20"),
                      LengthDist.parse("32"))
    r = rng()
    specs = [w.next_request(r) for _ in range(800)]
    longs = [s for s in specs if s.label == "mixed/long"]
    assert len(longs) / len(specs) == pytest.approx(0.25, abs=0.05)
    assert all(s.max_tokens == 4 and len((s.messages or [])[0]["content"].split()) > 390 for s in longs)
    shorts = [s for s in specs if s.label == "mixed/short"]
    assert all(s.max_tokens == 32 and len((s.messages or [])[0]["content"].split()) < 30 for s in shorts)


def test_file_workload_replays_in_order(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"p{i}", "output_tokens": i + 1}) for i in range(3)))
    w = FileWorkload(path, endpoint="completions")
    specs = [w.next_request(rng()) for _ in range(4)]
    assert [s.prompt for s in specs] == ["p0", "p1", "p2", "p0"]
    assert [s.max_tokens for s in specs] == [1, 2, 3, 1]
    assert specs[0].endpoint == "completions"


def test_tenant_spec_and_mix() -> None:
    t = TenantConfig.parse("alice:sk-a:doc-qa=3,chat:2")
    assert t == TenantConfig("alice", "sk-a", {"doc-qa": 3.0, "chat": 1.0}, 2.0)
    assert TenantConfig.parse("bob::synthetic", default_key="sk-d").api_key == "sk-d"
    assert parse_mix("synthetic") == {"synthetic": 1.0}
    for bad in ("alice", "alice:k:nope=1", "alice:k:chat=0", ":k:chat"):
        with pytest.raises(ValueError):
            TenantConfig.parse(bad)


def test_tenant_draws_workloads_by_weight() -> None:
    tenant = Tenant.build(TenantConfig("t", None, {"synthetic": 3, "mixed": 1}), WorkloadOptions())
    r = rng()
    kinds = []
    for _ in range(2000):
        picked = tenant.next_request(r)
        assert picked is not None
        kinds.append(picked[0].name)
    assert kinds.count("synthetic") / len(kinds) == pytest.approx(0.75, abs=0.04)
