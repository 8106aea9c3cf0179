"""The KV-layout fingerprint: one function, equal exactly when a handoff is byte-exact, carried in the
registry record (old records without it still parse)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tandem.common.errors import KVLayoutMismatchError
from tandem.common.kv_fingerprint import kv_fingerprint, model_revision
from tandem.common.registry import WorkerRecord
from tandem.worker.kv_connector.layout import KVLayout

LAYOUT = KVLayout(
    model="SmolLM2-135M-Instruct",
    dtype="float32",
    block_size_tokens=128,
    num_layers=30,
    block_shape=(2, 128, 3, 64),
    tp_size=1,
    block_dim=1,
)
#: Each field of the layout changed alone (the layout check refuses every one of them).
CHANGED = {
    "model": "SmolLM2-360M-Instruct",
    "dtype": "bfloat16",
    "block_size_tokens": 16,
    "num_layers": 32,
    "block_shape": (2, 128, 5, 64),
    "tp_size": 2,
    "block_dim": 0,
}


def test_the_layout_fingerprint_is_the_one_function() -> None:
    fields = {name: value for name, value in dataclasses.asdict(LAYOUT).items() if name != "model_revision"}
    assert LAYOUT.fingerprint("r1") == kv_fingerprint(model_revision="r1", **fields)
    assert LAYOUT.fingerprint("r1") == KVLayout.from_dict(LAYOUT.to_dict()).fingerprint("r1")
    assert LAYOUT.fingerprint("r1").startswith("kv1-") and len(LAYOUT.fingerprint("r1")) == 4 + 16


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_fingerprints_differ_exactly_where_the_layout_check_refuses(field: str) -> None:
    other = dataclasses.replace(LAYOUT, **{field: CHANGED[field]})
    with pytest.raises(KVLayoutMismatchError):
        LAYOUT.check_compatible(other)
    assert other.fingerprint("r1") != LAYOUT.fingerprint("r1")
    same = dataclasses.replace(other)
    same.check_compatible(other)
    assert same.fingerprint("r1") == other.fingerprint("r1")


def test_another_revision_of_the_weights_is_another_fingerprint() -> None:
    # Same shapes, other weights: a byte-exact copy would be silently wrong. The layout check refuses it
    # where both sides name their revision, and lets a side that names none (an older worker) through.
    LAYOUT.check_compatible(dataclasses.replace(LAYOUT))
    r1, r2 = (dataclasses.replace(LAYOUT, model_revision=r) for r in ("r1", "r2"))
    with pytest.raises(KVLayoutMismatchError, match="model_revision"):
        r1.check_compatible(r2)
    r1.check_compatible(LAYOUT)
    revised = dataclasses.replace(LAYOUT, model_revision="ревизия-ü")
    assert KVLayout.from_dict(revised.to_dict()) == KVLayout.from_proto(revised.to_proto()) == revised
    revisions = ["r1", "r2", "", "ревизия-ü", "a\x00b", "' OR 1=1 --"]
    assert len({LAYOUT.fingerprint(r) for r in revisions}) == len(revisions)


def _model_folder(root: Path, config: dict[str, object], weight_bytes: int) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    (root / "model.safetensors").write_bytes(b"\0" * weight_bytes)
    (root / "tokenizer.json").write_text("{}")
    return root


def test_model_revision_declared_or_read_from_the_folder(tmp_path: Path) -> None:
    base = _model_folder(tmp_path / "a", {"num_hidden_layers": 30, "torch_dtype": "bfloat16"}, 64)
    same = _model_folder(tmp_path / "b", {"num_hidden_layers": 30, "torch_dtype": "bfloat16"}, 64)
    other_config = _model_folder(tmp_path / "c", {"num_hidden_layers": 30, "torch_dtype": "float16"}, 64)
    other_weights = _model_folder(tmp_path / "d", {"num_hidden_layers": 30, "torch_dtype": "bfloat16"}, 65)
    read = model_revision(base)
    assert read.startswith("dir-") and read == model_revision(same)
    assert read != model_revision(other_config) and read != model_revision(other_weights)
    # A tokenizer file is not the weights.
    (base / "tokenizer.json").write_text('{"changed": true}')
    assert model_revision(base) == read
    assert model_revision(base, "main@3f1c2e") == "main@3f1c2e"
    assert model_revision(tmp_path / "missing").startswith("dir-")


def test_records_carry_the_fingerprint_and_older_records_parse() -> None:
    record = WorkerRecord("w", "decode", "m", "h:1", model_revision="r2", kv_fingerprint=LAYOUT.fingerprint("r2"))
    assert WorkerRecord.from_json(record.to_json()) == record
    # A worker of an older Tandem (rolling upgrade of Tandem itself) registers neither field.
    old = json.dumps({"worker_id": "w", "role": "prefill", "model": "m", "address": "h:1", "load": {}})
    parsed = WorkerRecord.from_json(old)
    assert (parsed.model_revision, parsed.kv_fingerprint) == ("", "")
