"""The KV connector's threads leave the engine's pinned core (``tandem.worker.kv_connector.cpus``).

vLLM pins the model-runner process's main thread to the engine's core, and every thread started
from it inherits the pin: here a thread pinned to one CPU plays that main thread, builds a prefill
side and a decode side, and moves KV between them; the OS then says (``/proc/self/task/<tid>``)
which CPUs the KV server's and the puller's threads may use."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import pytest

from tandem.worker.engine import kv_thread_cpus
from tandem.worker.kv_connector.cpus import parse_cpu_list
from tandem.worker.kv_connector.metadata import GrpcKVMetadata, LoadSpec
from tandem.worker.settings import KVSettings
from tests.kit.net import free_port
from tests.unit.worker.test_kv_connector import holds_of, make_handle, make_side, wait_until

ALLOWED = frozenset(os.sched_getaffinity(0))
needs_two_cpus = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two CPUs to tell a pinned thread from a free one")


def _allowed_cpus_of_threads(prefix: str, older: set[int]) -> list[frozenset[int]]:
    """The CPUs each live Python thread named ``prefix*`` and not in ``older`` (idents) may run on,
    as the OS reports them."""
    out = []
    for thread in threading.enumerate():
        if thread.name.startswith(prefix) and thread.ident not in older and thread.native_id is not None:
            with open(f"/proc/self/task/{thread.native_id}/status") as status:
                line = next(x for x in status if x.startswith("Cpus_allowed_list:"))
            out.append(parse_cpu_list(line.split(":", 1)[1].strip()))
    return out


def _as_pinned_engine(body: Callable[[], Any]) -> Any:
    """Run ``body`` on a thread pinned to one CPU, as vLLM's model-runner main thread is."""
    result: dict[str, Any] = {}

    def run() -> None:
        os.sched_setaffinity(0, {min(ALLOWED)})
        try:
            result["value"] = body()
        except BaseException as exc:  # re-raised on the test's thread
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result.get("value")


def _move_kv(thread_cpus: frozenset[int]) -> tuple[list[frozenset[int]], list[frozenset[int]]]:
    """Build both sides on the pinned thread, pull three blocks, and return the CPUs of the serving
    and the pulling threads."""
    sides: list[Any] = []
    older = {t.ident for t in threading.enumerate() if t.ident is not None}  # an earlier test's, winding down

    def start_and_pull() -> None:
        prefill, _ = make_side(free_port(), thread_cpus=thread_cpus)
        decode, _ = make_side(free_port(), fill=0.0, thread_cpus=thread_cpus)
        sides.extend((prefill, decode))
        handle = make_handle((2, 5, 9), num_tokens=11, kv_address=prefill.server.address)
        prefill.begin_step(GrpcKVMetadata(holds=holds_of(handle)))
        decode.begin_step(GrpcKVMetadata(loads=[LoadSpec("req-1-abcdefgh", handle, (5, 9), (0, 3), 7, 0)]))
        wait_until(lambda: "req-1-abcdefgh" in decode.puller._ended)

    try:
        _as_pinned_engine(start_and_pull)
        return _allowed_cpus_of_threads("tandem-kv-serve", older), _allowed_cpus_of_threads("tandem-kv-pull", older)
    finally:
        for side in sides:
            side.shutdown()


@needs_two_cpus
def test_kv_threads_started_by_a_pinned_engine_run_on_the_cpus_given() -> None:
    serving, pulling = _move_kv(ALLOWED)
    assert serving and pulling
    assert all(cpus == ALLOWED for cpus in serving + pulling), (serving, pulling)


@needs_two_cpus
def test_without_cpus_given_kv_threads_keep_the_engines_pin() -> None:
    """What every thread of a running worker's model runner showed before (2026-12-05)."""
    serving, pulling = _move_kv(frozenset())
    assert serving and pulling
    assert all(cpus == {min(ALLOWED)} for cpus in serving + pulling), (serving, pulling)


def test_the_setting_names_cpus_all_or_the_engines_own() -> None:
    assert KVSettings().thread_cpus == "inherit"  # measured better where every core runs an engine
    assert kv_thread_cpus("all") == sorted(ALLOWED)
    assert kv_thread_cpus("inherit") == []
    assert kv_thread_cpus("0-2,5") == [0, 1, 2, 5]
    assert parse_cpu_list(" 3 , 1-1,") == {1, 3}
    for bad in ("x", "3-1", "-2", "1-2-3", ""):
        with pytest.raises(ValueError):
            KVSettings(thread_cpus=bad)
