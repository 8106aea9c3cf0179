"""The vLLM general plugin: registered where vLLM looks for it (the worker package's entry point),
inert without its setting, and with it a busy message-queue reader of vLLM's own shared-memory
queue sleeps between looks instead of spinning on sched_yield."""

from __future__ import annotations

import importlib.metadata
import time

import pytest

from tandem.worker import vllm_plugin


@pytest.fixture
def spin_condition(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """vLLM's real SpinCondition class, its wait restored after the test."""
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    monkeypatch.setattr(SpinCondition, "wait", SpinCondition.wait)
    return SpinCondition


def _busy_reader(spin_condition):  # type: ignore[no-untyped-def]
    """A reader of vLLM's SpinCondition over real zmq sockets, as a MessageQueue makes it."""
    import zmq
    from vllm.utils.network_utils import get_open_zmq_ipc_path

    context = zmq.Context()
    address = get_open_zmq_ipc_path()
    writer = spin_condition(is_reader=False, context=context, notify_address=address)
    reader = spin_condition(is_reader=True, context=context, notify_address=address)
    reader.record_read()  # a message was just read: the reader is in its busy second
    return context, writer, reader


def test_the_plugin_is_registered_where_vllm_loads_general_plugins() -> None:
    from vllm.plugins import DEFAULT_PLUGINS_GROUP

    found = {e.name: e.value for e in importlib.metadata.entry_points(group=DEFAULT_PLUGINS_GROUP)}
    assert found.get("tandem_mq_poll") == "tandem.worker.vllm_plugin:register", found


def test_without_its_setting_the_plugin_leaves_vllm_as_it_is(spin_condition, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv(vllm_plugin.ENV, raising=False)
    before = spin_condition.wait
    vllm_plugin.register()
    monkeypatch.setenv(vllm_plugin.ENV, "0")
    vllm_plugin.register()
    assert spin_condition.wait is before


def test_a_busy_reader_sleeps_between_looks_instead_of_spinning(
    spin_condition, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(vllm_plugin.ENV, "0.0005")
    vllm_plugin.register()
    patched = spin_condition.wait
    vllm_plugin.register()  # vLLM may load plugins more than once: patched once
    assert spin_condition.wait is patched
    context, writer, reader = _busy_reader(spin_condition)
    try:
        num_looks = 200
        wall_s, cpu_s = time.perf_counter(), time.process_time()
        for _ in range(num_looks):
            reader.wait(timeout_ms=1000)
        wall_s, cpu_s = time.perf_counter() - wall_s, time.process_time() - cpu_s
        # vLLM's own wait returns at once here (sched_yield, nothing else to run): ~µs a look.
        assert wall_s >= num_looks * 0.0005, wall_s
        assert cpu_s <= 0.5 * wall_s, (cpu_s, wall_s)
        # Past the busy second, vLLM's own wait: a poll of the notify socket, woken by the writer.
        reader.last_read = time.monotonic() - 2 * reader.busy_loop_s
        writer.notify()
        started = time.perf_counter()
        reader.wait(timeout_ms=5000)
        assert time.perf_counter() - started < 2.0
    finally:
        context.destroy(linger=0)


def test_the_setting_defaults_to_sleeping_on_vllms_cpu_backend_only() -> None:
    from vllm.platforms import current_platform

    from tandem.worker.engine import CPU_MQ_POLL_S, resolve_mq_poll_s

    assert resolve_mq_poll_s(None) == (CPU_MQ_POLL_S if current_platform.is_cpu() else 0.0)
    assert resolve_mq_poll_s(0.0) == 0.0 and resolve_mq_poll_s(0.002) == 0.002
