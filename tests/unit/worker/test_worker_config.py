"""Worker configuration pieces: settings and flags, engine arguments, sampling."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tandem.v1 import common_pb2
from tandem.worker.__main__ import parse_settings
from tandem.worker.engine import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    engine_args_kwargs,
    kv_events_plan,
    resolve_dtype,
)
from tandem.worker.kv_connector.layout import KVLayout
from tandem.worker.registration import build_record, kv_identity
from tandem.worker.sampling import sampling_kwargs, structured_output_spec
from tandem.worker.settings import WorkerSettings


def test_flags_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_WORKER_ROLE", "prefill")
    monkeypatch.setenv("TANDEM_WORKER_KV__LEASE_S", "42.5")
    monkeypatch.setenv("TANDEM_WORKER_ENGINE__MAX_MODEL_LEN", "2048")
    settings = parse_settings(["--role", "decode", "--port", "6000", "--kv-port", "6001", "--cpu-threads-bind", "1"])
    assert (settings.role, settings.port, settings.kv.port) == ("decode", 6000, 6001)
    assert settings.kv.lease_s == 42.5  # environment kept where no flag was given
    assert settings.engine.max_model_len == 2048
    assert settings.engine.cpu_threads_bind == "1"


def test_engine_args_wire_the_grpc_connector_per_role() -> None:
    prefill = engine_args_kwargs(WorkerSettings(role="prefill"), engine_id="p-1")
    decode = engine_args_kwargs(WorkerSettings(role="decode"), engine_id="d-1")
    for kwargs in (prefill, decode):
        kv = kwargs["kv_transfer_config"]
        assert (kv["kv_connector"], kv["kv_connector_module_path"]) == (CONNECTOR_CLASS, CONNECTOR_MODULE)
        assert kwargs["enable_prefix_caching"] and kwargs["disable_hybrid_kv_cache_manager"]
    assert prefill["kv_transfer_config"]["kv_role"] == "kv_producer"
    assert decode["kv_transfer_config"]["kv_role"] == "kv_consumer"
    assert prefill["kv_transfer_config"]["engine_id"] == "p-1"


def test_connector_module_path_imports_the_connector_class() -> None:
    import importlib

    module = importlib.import_module(CONNECTOR_MODULE)
    assert getattr(module, CONNECTOR_CLASS).__name__ == CONNECTOR_CLASS


class _Platform:
    def __init__(self, cpu: bool) -> None:
        self.cpu = cpu

    def is_cpu(self) -> bool:
        return self.cpu


@pytest.mark.parametrize(("cpu", "expected"), [(True, "float32"), (False, "auto")])
def test_auto_dtype_is_float32_on_cpu_only_and_explicit_dtype_is_kept(
    monkeypatch: pytest.MonkeyPatch, cpu: bool, expected: str
) -> None:
    import vllm.platforms

    # The platform is set here, not read off the host: the test means the same on a GPU machine.
    monkeypatch.setattr(vllm.platforms, "current_platform", _Platform(cpu), raising=False)
    assert resolve_dtype("auto") == expected
    assert resolve_dtype("bfloat16") == "bfloat16"


def test_sampling_keeps_engine_defaults_for_unset_options() -> None:
    options = common_pb2.SamplingOptions(max_tokens=9, temperature=0.0, stop=["\n\n"], ignore_eos=True)
    assert sampling_kwargs(options, max_tokens=1) == {
        "max_tokens": 1,
        "ignore_eos": True,
        "min_tokens": 0,
        "include_stop_str_in_output": False,
        "temperature": 0.0,
        "stop": ["\n\n"],
    }
    assert "top_p" not in sampling_kwargs(common_pb2.SamplingOptions(), max_tokens=4)


def test_unset_options_take_the_model_defaults_and_set_ones_win() -> None:
    defaults = {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.05}
    unset = sampling_kwargs(common_pb2.SamplingOptions(), max_tokens=4, model_defaults=defaults)
    assert (unset["temperature"], unset["top_p"], unset["repetition_penalty"]) == (0.2, 0.9, 1.05)
    greedy = sampling_kwargs(common_pb2.SamplingOptions(temperature=0.0), max_tokens=4, model_defaults=defaults)
    assert greedy["temperature"] == 0.0 and greedy["top_p"] == 0.9


def test_every_option_maps_to_vllm_and_prefill_caps_min_tokens() -> None:
    from vllm import SamplingParams

    options = common_pb2.SamplingOptions(
        max_tokens=20,
        min_tokens=5,
        min_p=0.1,
        repetition_penalty=1.2,
        stop_token_ids=[7],
        logit_bias={3: -2.5},
        logprobs=2,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        seed=9,
    )
    prefill = SamplingParams(**sampling_kwargs(options, max_tokens=1))
    assert prefill.max_tokens == 1 and prefill.min_tokens == 1  # masks end-of-sequence at the first token too
    decode = SamplingParams(**sampling_kwargs(options, max_tokens=20))
    assert decode.min_tokens == 5
    assert decode.min_p == pytest.approx(0.1) and decode.repetition_penalty == pytest.approx(1.2)
    assert decode.stop_token_ids == [7] and decode.logit_bias == {3: -2.5} and decode.logprobs == 2
    assert decode.include_stop_str_in_output and not decode.skip_special_tokens
    assert not decode.spaces_between_special_tokens and decode.seed == 9


def test_structured_output_specs() -> None:
    def spec(**kind: object) -> object:
        return structured_output_spec(common_pb2.SamplingOptions(structured_output=common_pb2.StructuredOutput(**kind)))

    assert spec(json_schema='{"type": "object"}') == {"json": {"type": "object"}}
    assert spec(json_object=True) == {"json_object": True}
    assert spec(regex="a+") == {"regex": "a+"}
    assert spec(grammar='root ::= "a"') == {"grammar": 'root ::= "a"'}
    assert spec(choice=common_pb2.ChoiceList(choices=["x", "y"])) == {"choice": ["x", "y"]}
    assert structured_output_spec(common_pb2.SamplingOptions()) is None


def test_registry_record_advertises_addresses_and_capacity() -> None:
    settings = WorkerSettings(role="prefill", bind_host="0.0.0.0", advertise_host="10.1.2.3", port=7000)
    record = build_record(settings, "w1", num_kv_blocks=100, block_size_tokens=128)
    assert record.address == "10.1.2.3:7000"
    assert record.kv_address == f"{settings.kv.host}:{settings.kv.port}"
    assert record.capacity_tokens == 12_800


def test_registry_record_carries_the_engines_kv_fingerprint_and_revision(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 30}')
    layout = KVLayout(model="m", dtype="float32", block_size_tokens=16, num_layers=30, block_shape=(2, 16, 3, 64))
    declared = WorkerSettings.model_validate({"engine": {"model_dir": str(tmp_path), "model_revision": "v2-ü"}})
    read = WorkerSettings.model_validate({"engine": {"model_dir": str(tmp_path)}})
    assert kv_identity(declared, layout) == ("v2-ü", layout.fingerprint("v2-ü"))
    revision, fingerprint = kv_identity(read, layout)
    assert revision.startswith("dir-") and fingerprint == layout.fingerprint(revision)
    assert kv_identity(read, dataclasses.replace(layout, dtype="bfloat16"))[1] != fingerprint
    record = build_record(
        read, "w1", num_kv_blocks=1, block_size_tokens=16, model_revision=revision, kv_fingerprint=fingerprint
    )
    assert (record.model_revision, record.kv_fingerprint) == (revision, fingerprint)


def test_engine_publishes_kv_events_on_the_workers_own_address_only() -> None:
    """Events carry prompt token ids: the engine publishes and replays on private ipc sockets only,
    and the worker's relay serves both, redacted, on tcp://<address> (the worker's, not every
    interface)."""
    settings = WorkerSettings.model_validate(
        {
            "role": "prefill",
            "bind_host": "0.0.0.0",
            "advertise_host": "10.0.0.5",
            "kv_events": {"port": 5600, "replay_port": 5601},
        }
    )
    kwargs = engine_args_kwargs(settings, engine_id="p-1")
    events = kwargs["kv_events_config"]
    assert events["enable_kv_cache_events"] and events["publisher"] == "zmq"
    assert events["endpoint"].startswith("ipc://") and events["endpoint"].endswith(".sock")
    assert events["replay_endpoint"].startswith("ipc://") and events["replay_endpoint"] != events["endpoint"]
    plan = kv_events_plan(settings)
    assert plan is not None and (plan.engine_publish, plan.engine_replay) == (
        events["endpoint"],
        events["replay_endpoint"],
    )
    assert (plan.public_publish, plan.public_replay) == ("tcp://10.0.0.5:5600", "tcp://10.0.0.5:5601")
    assert kwargs["prefix_caching_hash_algo"] == "sha256"
    record = build_record(settings, "w-1", num_kv_blocks=10, block_size_tokens=128)
    assert record.kv_events_endpoint == "tcp://10.0.0.5:5600"
    assert record.kv_events_replay_endpoint == "tcp://10.0.0.5:5601"
    assert (record.block_hash_algo, record.block_hash_seed) == ("sha256", "vllm-none-hash")


def test_kv_events_on_all_interfaces_only_when_asked_and_relayed_all_the_same() -> None:
    settings = WorkerSettings.model_validate(
        {"bind_host": "10.0.0.5", "kv_events": {"host": "0.0.0.0", "port": 5600, "replay_port": 5601}}
    )
    events = engine_args_kwargs(settings, engine_id="p-1")["kv_events_config"]
    assert events["endpoint"].startswith("ipc://") and events["replay_endpoint"].startswith("ipc://")
    plan = kv_events_plan(settings)
    assert plan is not None and (plan.public_publish, plan.public_replay) == (
        "tcp://0.0.0.0:5600",
        "tcp://0.0.0.0:5601",
    )
    record = build_record(settings, "w-1", num_kv_blocks=10, block_size_tokens=128)
    assert record.kv_events_endpoint == "tcp://10.0.0.5:5600"
    assert record.kv_events_replay_endpoint == "tcp://10.0.0.5:5601"


def test_kv_events_can_be_turned_off() -> None:
    settings = WorkerSettings.model_validate({"kv_events": {"enabled": False}})
    assert "kv_events_config" not in engine_args_kwargs(settings, engine_id="p-1")
    assert build_record(settings, "w-1", num_kv_blocks=1, block_size_tokens=16).kv_events_endpoint == ""


def test_a_pull_timeout_at_or_past_the_lease_is_refused() -> None:
    """The decode side must give up a pull before the blocks it waits for can be freed under it."""
    import pydantic

    from tandem.worker.settings import KVSettings

    with pytest.raises(pydantic.ValidationError, match="pull_timeout_s"):
        KVSettings(lease_s=10, pull_timeout_s=10)
    assert KVSettings(lease_s=20, pull_timeout_s=8).pull_timeout_s == 8


def test_lora_is_off_by_default_and_on_with_as_many_adapters_in_a_batch_as_in_memory() -> None:
    """vLLM holds exactly the adapters tandem.worker.adapters loaded: max_cpu_loras = max_loras."""
    off = engine_args_kwargs(WorkerSettings(role="decode"), engine_id="d-1")
    assert not {"enable_lora", "max_loras", "max_cpu_loras", "max_lora_rank"} & set(off)
    on = engine_args_kwargs(
        WorkerSettings(role="decode", adapters={"max_adapters": 3, "max_adapter_rank": 32}), engine_id="d-1"
    )
    assert (on["enable_lora"], on["max_loras"], on["max_cpu_loras"], on["max_lora_rank"]) == (True, 3, 3, 32)


@pytest.mark.parametrize("rank", [0, 12, 1024])
def test_a_lora_rank_vllm_cannot_start_with_is_refused(rank: int) -> None:
    import pydantic

    with pytest.raises(pydantic.ValidationError, match="max_adapter_rank"):
        WorkerSettings(adapters={"max_adapters": 1, "max_adapter_rank": rank})


def test_the_adapter_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_WORKER_ADAPTERS__MAX_ADAPTERS", "2")
    monkeypatch.setenv("TANDEM_WORKER_ADAPTERS__MAX_ADAPTER_RANK", "8")
    adapters = WorkerSettings().adapters
    assert (adapters.max_adapters, adapters.max_adapter_rank) == (2, 8)
