"""Promise: an engine death is a worker death, and no internal call can cause one.

A supervised local stack (as ``make run`` starts it: a worker that exits is started
again) with one prefill and two decode workers, real vLLM engines:

* hostile internal calls, straight to a worker's gRPC port as anything on the
  worker network could send them (the reproduction first: ``first_token_id``
  4,000,000,000 killed the decode engine), then hypothesis-driven values for
  every internal RPC: each is answered, and the engine never dies;
* the engine-core process SIGKILLed while the worker process lives: the worker
  answers NOT_SERVING, leaves the registry within 1 s, exits 70, and the
  supervisor brings it back; requests meanwhile are all served;
* an engine step that raises mid-stream (failpoint ``engine.step``) and a step
  that hangs past the watchdog: the worker goes the same way, and the stream
  migrates to the other decode worker, identical to an uninterrupted one;
  through a gateway with migration off, what the client is told names nothing
  inside.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.common import kv_capability
from tandem.common.tls import channel
from tandem.gateway.api.errors import PUBLIC_MESSAGES
from tandem.local.stack import LocalStack, free_port
from tandem.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tandem.worker.liveness import EXIT_ENGINE_DEAD
from tests.faults.backend.client import chat_body, num_content_events, stream_chat
from tests.faults.backend.conftest import BackendStack, registered_workers
from tests.faults.conftest import running_stack
from tests.faults.ledger import FaultLedger
from tests.probes import quiesce, wait_until, worker_names

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(900)]

STEP_TIMEOUT_S = 12.0
PULL_TIMEOUT_S = 8.0
REGISTRY_TTL_S = 5.0
#: Engine death seen → registration deleted (the issue's bound).
DEREGISTER_BOUND_S = 1.0
#: A worker's death → the router's last placement on it (the issue's bound).
PLACEMENT_BOUND_S = 1.0


@pytest.fixture(scope="module")
def death_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackendStack]:
    failpoints = Path(tmp_path_factory.mktemp("death-failpoints"))
    with running_stack(
        tmp_path_factory,
        "death",
        num_prefill_workers=1,
        num_decode_workers=2,
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
        kv_lease_s=20.0,
        supervise=True,
        restart_backoff_s=0.5,
        extra_env={
            "TANDEM_FAILPOINTS_DIR": str(failpoints),
            "TANDEM_WORKER_KV__PULL_TIMEOUT_S": str(PULL_TIMEOUT_S),
            "TANDEM_WORKER_ENGINE__STEP_TIMEOUT_S": str(STEP_TIMEOUT_S),
            "TANDEM_WORKER_REGISTRY__TTL_S": str(REGISTRY_TTL_S),
        },
    ) as stack:
        yield BackendStack(stack, failpoints)


@pytest.fixture
def death(death_stack: BackendStack) -> BackendStack:
    """Every worker up and registered, failpoints disarmed."""
    stack = death_stack.stack
    death_stack.disarm_all()
    everyone = set(worker_names(stack))
    assert wait_until(
        lambda: all(stack.is_running(n) for n in everyone) and registered_workers(stack) == everyone, timeout_s=240
    ), (registered_workers(stack), stack.restarts)
    time.sleep(2.5)  # channels to a restarted address redial (their reconnect backoff)
    return death_stack


def _health(stack: LocalStack, name: str) -> int:
    with stack.worker_channel(name) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="tandem.v1.Worker"), timeout=2
        )
        return int(reply.status)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _engine_core_pid(stack: LocalStack, name: str) -> int:
    for pid in _descendants(stack.pid(name)):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"EngineCore" in title:
            return pid
    raise AssertionError(f"no EngineCore process under {name}")


def _assert_public(error: dict[str, object]) -> None:
    assert error.get("message") in PUBLIC_MESSAGES.values(), error
    text = str(error)
    for inside in ("127.0.0.1", "Engine", "class", "Traceback", "vllm", "UNKNOWN"):
        assert inside not in text, (inside, text)


def _wait_deregistered(stack: LocalStack, name: str, since_s: float, timeout_s: float = 10.0) -> float:
    """Seconds from ``since_s`` until ``name`` has no registration (polled every 10 ms)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if name not in registered_workers(stack):
            return time.monotonic() - since_s
        time.sleep(0.01)
    raise AssertionError(f"{name} still registered {timeout_s} s after its engine died")


# -- hostile internal calls ----------------------------------------------------------------------


def test_the_call_that_killed_an_engine_is_refused(death: BackendStack, ledger: FaultLedger) -> None:
    stack = death.stack
    pid = stack.pid("decode")
    with ledger.fault("Decode with first_token_id 4,000,000,000 sent straight to a decode worker") as f:
        with stack.worker_channel("decode") as channel:
            call = worker_pb2_grpc.WorkerStub(channel).Decode(
                worker_pb2.DecodeRequest(
                    request_id="hostile-1",
                    prompt_token_ids=[1, 2, 3, 4],
                    first_token_id=4_000_000_000,
                    sampling=common_pb2.SamplingOptions(max_tokens=8),
                ),
                timeout=30,
            )
            with pytest.raises(grpc.RpcError) as caught:
                list(call)
        f.tried()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
        f.saw("INVALID_ARGUMENT")
        result = stream_chat(stack, chat_body(stack, "Olá 👋 東京 <|im_start|>system", max_tokens=8))
        assert result.done and not result.errors, result
        assert stack.pid("decode") == pid and not stack.restarts
        assert _health(stack, "decode") == health_pb2.HealthCheckResponse.SERVING
        f.saw("the engine serves on: next chat 200, health SERVING, same process")


_u32 = st.integers(min_value=0, max_value=2**32 - 1)
_token = st.one_of(st.integers(min_value=0, max_value=49_151), _u32)
_float = st.one_of(st.floats(min_value=-3, max_value=3), st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -0.0]))
_options = st.builds(
    common_pb2.SamplingOptions,
    max_tokens=st.sampled_from([0, 1, 2, 3, 4097, 2**32 - 1]),
    temperature=_float,
    top_p=_float,
    top_k=st.integers(min_value=-(2**31), max_value=2**31 - 1),
    presence_penalty=_float,
    frequency_penalty=_float,
    repetition_penalty=_float,
    min_p=_float,
    seed=st.integers(min_value=-(2**63), max_value=2**63 - 1),
    min_tokens=_u32,
    logprobs=st.sampled_from([0, 5, 21, 2**32 - 1]),
    stop=st.lists(st.sampled_from(["", "<|im_end|>", "東京", "\n", "a" * 2000]), max_size=3),
    stop_token_ids=st.lists(_token, max_size=3),
    logit_bias=st.dictionaries(_token, _float, max_size=3),
    structured_output=st.sampled_from(
        [
            common_pb2.StructuredOutput(),
            common_pb2.StructuredOutput(regex="[0-9]+"),
            common_pb2.StructuredOutput(regex="(((("),
            common_pb2.StructuredOutput(json_schema="{not json"),
            common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=[])),
        ]
    ),
)
#: Values the engine accepts, at their edges: these calls run (greedy or seeded, at most 3 tokens), so the
#: engine itself meets extreme biases, penalties, seeds, control-token stop strings and grammars.
_edge_options = st.builds(
    common_pb2.SamplingOptions,
    max_tokens=st.integers(min_value=1, max_value=3),
    temperature=st.sampled_from([0.0, 1e-30, 0.7, 2.0]),
    top_p=st.sampled_from([1e-6, 0.5, 1.0]),
    top_k=st.sampled_from([-1, 0, 1, 49_152]),
    presence_penalty=st.sampled_from([-2.0, 0.0, 2.0]),
    frequency_penalty=st.sampled_from([-2.0, 2.0]),
    repetition_penalty=st.sampled_from([1e-3, 1.0, 100.0]),
    min_p=st.sampled_from([0.0, 1.0]),
    seed=st.sampled_from([-(2**63), 0, 2**63 - 1]),
    min_tokens=st.integers(min_value=0, max_value=3),
    logprobs=st.sampled_from([0, 20]),
    stop=st.lists(st.sampled_from(["<|im_end|>", "<|im_start|>", "東京", "👋", "\n"]), max_size=3),
    stop_token_ids=st.lists(st.integers(min_value=0, max_value=49_151), max_size=3),
    logit_bias=st.dictionaries(
        st.integers(min_value=0, max_value=49_151), st.sampled_from([-100.0, 100.0]), max_size=3
    ),
    structured_output=st.sampled_from(
        [
            common_pb2.StructuredOutput(),
            common_pb2.StructuredOutput(regex="[0-9]+"),
            common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=["東京", "👋"])),
        ]
    ),
)
_options = st.one_of(_edge_options, _options)
_request_id = st.one_of(st.from_regex(r"[a-z0-9-]{1,20}", fullmatch=True), st.text(min_size=0, max_size=10))
_prompt = st.one_of(
    st.lists(st.integers(min_value=0, max_value=49_151), min_size=1, max_size=12),
    st.lists(_token, min_size=0, max_size=12),
)


def _handles(kv_address: str) -> st.SearchStrategy[common_pb2.KVHandle]:
    return st.builds(
        common_pb2.KVHandle,
        engine_id=st.sampled_from(["", "prefill-x"]),
        kv_address=st.sampled_from(["", kv_address, "127.0.0.1:1", "no-port"]),
        block_ids=st.lists(_u32, max_size=3),
        num_tokens=st.sampled_from([0, 1, 5, 2**32 - 1]),
        lease_expires_unix_s=st.sampled_from([0.0, math.nan, 1e12]),
    )


def _code_of(call: Callable[[], object]) -> grpc.StatusCode:
    """The status ``call`` (a whole RPC: a unary call, or a stream read to its end) ended with."""
    try:
        call()
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]


#: What a hostile call may be answered: refused, or run (it was a valid request after all). Never
#: UNAVAILABLE (the engine died) or UNKNOWN (an unhandled exception in the worker).
#: Mostly a well-formed capability, so that the other hostile values get past its check to the engine.
_capability = st.sampled_from([kv_capability.mint(), kv_capability.mint(), "", "Z" * 40])
_ANSWERS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}


def test_hostile_values_in_every_internal_rpc_kill_no_engine(death: BackendStack, ledger: FaultLedger) -> None:
    stack = death.stack
    pids = {n: stack.pid(n) for n in worker_names(stack)}
    kv_address = f"{stack.config.host}:{stack.config.worker_ports()['prefill'].kv_port}"
    seen: dict[str, set[str]] = {}

    with ledger.fault("hostile values in Prefill, Decode, PrefetchKV, Abort (hypothesis, real workers)") as f:
        with stack.worker_channel("prefill") as prefill_channel, stack.worker_channel("decode") as decode_channel:
            prefill = worker_pb2_grpc.WorkerStub(prefill_channel)
            decode = worker_pb2_grpc.WorkerStub(decode_channel)

            def answered(rpc: str, call: Callable[[], object]) -> None:
                code = _code_of(call)
                seen.setdefault(rpc, set()).add(code.name)
                f.tried()
                assert code in _ANSWERS, (rpc, code)

            @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
            @given(
                request_id=_request_id, prompt=_prompt, options=_options, keep_kv=st.booleans(), capability=_capability
            )
            def prefill_calls(
                request_id: str, prompt: list[int], options: common_pb2.SamplingOptions, keep_kv: bool, capability: str
            ) -> None:
                request = worker_pb2.PrefillRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt,
                    sampling=options,
                    keep_kv=keep_kv,
                    kv_capability=capability,
                )
                try:
                    answered("Prefill", lambda: prefill.Prefill(request, timeout=60))
                finally:
                    if request_id:
                        _quietly(lambda: prefill.Abort(worker_pb2.AbortRequest(request_id=request_id), timeout=10))

            @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
            @given(
                request_id=_request_id,
                prompt=_prompt,
                first_token_id=_token,
                options=_options,
                handle=st.one_of(st.none(), st.none(), _handles(kv_address)),
                local=st.booleans(),
                first_text=st.sampled_from(["", "Olá", "👋", "<|im_end|>", "x" * 5000]),
                capability=_capability,
            )
            def decode_calls(
                request_id: str,
                prompt: list[int],
                first_token_id: int,
                options: common_pb2.SamplingOptions,
                handle: common_pb2.KVHandle | None,
                local: bool,
                first_text: str,
                capability: str,
            ) -> None:
                request = worker_pb2.DecodeRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt,
                    first_token_id=first_token_id,
                    sampling=options,
                    local_prefill=local,
                    first_text=first_text,
                    kv_capability=capability,
                )
                if handle is not None:
                    request.kv_handle.CopyFrom(handle)
                answered("Decode", lambda: list(decode.Decode(request, timeout=60)))

            @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
            @given(
                request_id=_request_id,
                address=st.sampled_from(["", kv_address, "127.0.0.1:1", "http://x/", "a" * 300]),
                num_prompt=_u32,
                num_cached=_u32,
                capability=_capability,
            )
            def prefetch_calls(
                request_id: str, address: str, num_prompt: int, num_cached: int, capability: str
            ) -> None:
                request = worker_pb2.PrefetchKVRequest(
                    request_id=request_id,
                    kv_address=address,
                    num_prompt_tokens=num_prompt,
                    num_decode_cached_tokens=num_cached,
                    kv_capability=capability,
                )
                try:
                    answered("PrefetchKV", lambda: decode.PrefetchKV(request, timeout=30))
                finally:
                    if request_id:
                        _quietly(lambda: decode.Abort(worker_pb2.AbortRequest(request_id=request_id), timeout=10))

            @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
            @given(request_id=st.text(max_size=300))
            def abort_calls(request_id: str) -> None:
                answered("Abort", lambda: decode.Abort(worker_pb2.AbortRequest(request_id=request_id), timeout=10))

            for run in (prefill_calls, decode_calls, prefetch_calls, abort_calls):
                run()
        f.saw("answers: " + "; ".join(f"{rpc} {sorted(codes)}" for rpc, codes in sorted(seen.items())))
        assert {n: stack.pid(n) for n in worker_names(stack)} == pids and not stack.restarts
        for name in worker_names(stack):
            assert _health(stack, name) == health_pb2.HealthCheckResponse.SERVING
        result = stream_chat(stack, chat_body(stack, max_tokens=8))
        assert result.done and not result.errors, result
        f.saw("no engine died: the same processes, all SERVING, next chat 200")
        left = quiesce(stack, timeout_s=30)
        f.leaked("running or held requests", sum(r.total for r in left.values()))


def _quietly(call: Callable[[], object]) -> None:
    with contextlib.suppress(grpc.RpcError):
        call()


# -- an engine that dies ----------------------------------------------------------------------


def test_engine_process_killed_while_the_worker_lives(death: BackendStack, ledger: FaultLedger) -> None:
    stack = death.stack
    name = "decode-1"
    proc = stack._children[name].proc
    restarts_before = stack.restarts.get(name, 0)
    with ledger.fault("decode engine-core process SIGKILLed, the worker process alive") as f:
        engine_pid = _engine_core_pid(stack, name)
        assert _health(stack, name) == health_pb2.HealthCheckResponse.SERVING
        killed_at = time.monotonic()
        os.kill(engine_pid, signal.SIGKILL)
        f.tried()
        deregistered_after_s = _wait_deregistered(stack, name, killed_at)
        f.saw(f"unregistered {deregistered_after_s * 1000:.0f} ms after the engine died")
        assert deregistered_after_s <= DEREGISTER_BOUND_S, deregistered_after_s
        # Requests meanwhile are served by the other decode worker.
        for i in range(4):
            result = stream_chat(stack, chat_body(stack, f"Count to {i + 3}.", max_tokens=6))
            assert result.status == 200 and result.done and not result.errors, result
        f.saw("requests meanwhile: 200")
        assert proc.wait(timeout=30) == EXIT_ENGINE_DEAD
        f.saw(f"worker exited {EXIT_ENGINE_DEAD}")
        assert wait_until(
            lambda: stack.restarts.get(name, 0) == restarts_before + 1 and name in registered_workers(stack),
            timeout_s=240,
        )
        assert _health(stack, name) == health_pb2.HealthCheckResponse.SERVING
        f.saw("the supervisor restarted it; registered and SERVING again")
        left = quiesce(stack, timeout_s=30)
        f.leaked("running or held requests", sum(r.total for r in left.values()))


def test_a_worker_killed_outright_gets_no_placement_a_second_after_its_death(
    death: BackendStack, ledger: FaultLedger
) -> None:
    """SIGKILL leaves the worker no moment to unregister; the supervisor removes its registration, and
    the router, which reads the registry every 0.5 s, places nothing more on it within 1 s. Measured on
    the router's own answers: Schedule/Release pairs sent every ~10 ms across the kill."""
    stack = death.stack
    name = "decode-1"
    dead_id = stack.worker_ids[name]
    restarts_before = stack.restarts.get(name, 0)
    placed: list[tuple[float, str]] = []  # (monotonic time of the answer, decode worker id)
    stop = threading.Event()

    def schedule_in_a_loop() -> None:
        with channel(stack.router_address, stack.tls("gateway")) as router_channel:
            stub = router_pb2_grpc.RouterStub(router_channel)
            metadata = (("application", "tandem-router"),)
            i = 0
            while not stop.is_set():
                i += 1
                request = router_pb2.ScheduleRequest(
                    request_id=f"placement-probe-{i}",
                    model=stack.config.served_model_name,
                    num_prompt_tokens=32,
                    max_tokens=8,
                    tenant="placement-probe",
                )
                with contextlib.suppress(grpc.RpcError):
                    placement = stub.Schedule(request, timeout=5, metadata=metadata)
                    placed.append((time.monotonic(), placement.decode.worker_id))
                    stub.Release(
                        router_pb2.RouterReleaseRequest(request_id=request.request_id), timeout=5, metadata=metadata
                    )
                time.sleep(0.01)

    prober = threading.Thread(target=schedule_in_a_loop, daemon=True)
    with ledger.fault("decode worker process SIGKILLed (no chance to unregister), router placing meanwhile") as f:
        prober.start()
        assert wait_until(lambda: sum(1 for _, w in placed if w == dead_id) >= 3, timeout_s=30), placed[-5:]
        killed_at = time.monotonic()
        stack.kill(name, signal.SIGKILL)
        f.tried()
        deregistered_after_s = _wait_deregistered(stack, name, killed_at)
        time.sleep(3.0)
        stop.set()
        prober.join(timeout=10)
        last_on_dead = max((t for t, w in placed if w == dead_id), default=killed_at)
        after_s = max(0.0, last_on_dead - killed_at)
        f.saw(
            f"unregistered {deregistered_after_s * 1000:.0f} ms and last placed on "
            f"{after_s * 1000:.0f} ms after its death"
        )
        assert after_s <= PLACEMENT_BOUND_S, after_s
        later = [w for t, w in placed if t > killed_at + PLACEMENT_BOUND_S]
        assert later and dead_id not in later, later[:5]  # placements went on, all elsewhere
        f.saw(f"{len(later)} placements after that, none on it")
        assert wait_until(
            lambda: stack.restarts.get(name, 0) >= restarts_before + 1 and name in registered_workers(stack),
            timeout_s=240,
        )
        f.saw("the supervisor restarted it under a new id")
        left = quiesce(stack, timeout_s=30)
        f.leaked("running or held requests", sum(r.total for r in left.values()))


@pytest.fixture(scope="module")
def no_migration_gateway(death_stack: BackendStack) -> str:
    """A second gateway in front of the same stack, with migration off; its base URL."""
    return death_stack.stack.start_gateway_variant(
        "gateway-no-migration", free_port(), {"TANDEM_GATEWAY_MAX_MIGRATIONS_PER_REQUEST": "0"}
    )


@pytest.mark.parametrize(
    ("fault", "migrate"),
    [("raises", True), ("hangs", True), ("raises", False)],
    ids=["raises", "hangs", "no-migration"],
)
def test_engine_step_fails_mid_stream(
    death: BackendStack, ledger: FaultLedger, request: pytest.FixtureRequest, fault: str, migrate: bool
) -> None:
    """Only the stream's engines step while it runs (idle engines take no steps), so arming the step
    failpoint mid-stream fails the decode engine serving it; it is disarmed once that worker is gone.
    The stream migrates to the other decode worker and reads exactly as an uninterrupted one; through a
    gateway with migration off it ends with one error event that names nothing inside."""
    stack = death.stack
    body = chat_body(stack, "Écris 👋 東京 <|im_start|>system une histoire.", max_tokens=150, ignore_eos=True)
    gateway_url = str(request.getfixturevalue("no_migration_gateway")) if not migrate else ""
    reference = stream_chat(stack, body, timeout_s=180)
    assert reference.done and not reference.errors, reference
    procs = {n: stack._children[n].proc for n in worker_names(stack, "decode")}
    name = "step raises mid-stream (failpoint)" if fault == "raises" else "step hangs past the watchdog"
    with ledger.fault(f"decode engine: {name}{'' if migrate else ', migration off'}") as f:
        armed_at: list[float] = []

        def arm_when_streaming(lines: list[str]) -> None:
            if not armed_at and num_content_events(lines) >= 5:
                death.arm("engine.step", "once error engine step failpoint" if fault == "raises" else "once sleep 300")
                armed_at.append(time.monotonic())
                f.tried()

        def disarm_when_a_worker_left() -> None:
            wait_until(lambda: bool(armed_at), timeout_s=120, interval_s=0.05)
            wait_until(
                lambda: len(registered_workers(stack)) < len(worker_names(stack)),
                timeout_s=STEP_TIMEOUT_S + 30,
                interval_s=0.02,
            )
            death.disarm_all()

        disarm = threading.Thread(target=disarm_when_a_worker_left)
        disarm.start()
        result = stream_chat(stack, body, on_line=arm_when_streaming, timeout_s=180, gateway_url=gateway_url)
        disarm.join()
        assert armed_at, "the stream ended before the failpoint was armed"
        ended_after_s = time.monotonic() - armed_at[0]
        assert result.status == 200 and result.done
        if migrate:
            assert not result.errors, result.errors
            assert result.text == reference.text, (result.text, reference.text)
            assert result.usage is not None and result.usage["completion_tokens"] == 150, result.usage
            f.saw(f"one stream identical to the uninterrupted one, done {ended_after_s:.1f} s after the fault")
        else:
            assert len(result.errors) == 1, result.errors
            _assert_public(result.errors[0])
            assert reference.text.startswith(result.text) and len(result.text) < len(reference.text)
            f.saw(f"one error event after {ended_after_s:.1f} s, naming nothing inside")
        wait_until(lambda: any(p.poll() is not None for p in procs.values()), timeout_s=30)
        dead = [n for n, p in procs.items() if p.poll() is not None]
        assert len(dead) == 1 and procs[dead[0]].returncode == EXIT_ENGINE_DEAD, {
            n: p.returncode for n, p in procs.items()
        }
        f.saw(f"worker exited {EXIT_ENGINE_DEAD}")
        if fault == "hangs":
            assert ended_after_s >= STEP_TIMEOUT_S * 0.9, ended_after_s
        assert wait_until(lambda: registered_workers(stack) == set(worker_names(stack)), timeout_s=240)
        after = stream_chat(stack, chat_body(stack, max_tokens=6))
        assert after.done and not after.errors, after
        f.saw("restarted by the supervisor; next chat 200")
        left = quiesce(stack, timeout_s=30)
        f.leaked("running or held requests", sum(r.total for r in left.values()))
