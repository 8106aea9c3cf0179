"""Registry records carry what the router's KV index needs, and old or newer records still parse."""

from __future__ import annotations

import json

from tandem.common.registry import WorkerLoad, WorkerRecord


def test_kv_fields_round_trip() -> None:
    record = WorkerRecord(
        "w", "prefill", "m", "h:1",
        kv_events_endpoint="tcp://h:5557",
        kv_events_replay_endpoint="tcp://h:6557",
        block_size_tokens=128,
        num_kv_blocks=40,
        block_hash_seed="42",
        load=WorkerLoad(num_prompt_tokens_in_flight=7, num_kv_tokens_in_flight=9),
    )
    assert WorkerRecord.from_json(record.to_json()) == record


def test_records_from_older_and_newer_workers_parse() -> None:
    old = json.dumps({"worker_id": "w", "role": "decode", "model": "m", "address": "h:1", "load": {}})
    parsed = WorkerRecord.from_json(old)
    assert parsed.kv_events_endpoint == "" and parsed.block_hash_algo == "sha256"
    newer = json.dumps(
        {"worker_id": "w", "role": "decode", "model": "m", "address": "h:1", "future": 1,
         "load": {"num_kv_tokens_in_flight": 3, "future_load": 2}}
    )
    assert WorkerRecord.from_json(newer).load.num_kv_tokens_in_flight == 3
