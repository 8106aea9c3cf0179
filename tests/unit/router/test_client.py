"""RouterClient against an in-process fake of Serve's gRPC proxy (no Ray)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from urllib.parse import quote, unquote

import pytest
import pytest_asyncio

from tandem.common.errors import BackendUnavailableError, InvalidRequestError, NoCapacityError
from tandem.common.router_client import RouterClient
from tests.kit.net import dead_address
from tests.kit.router import FakeRouterServicer, serving_router

pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[tuple[FakeRouterServicer, str]]:
    servicer = FakeRouterServicer(
        errors_by_model={
            "full": NoCapacityError("no decode worker", retry_after_s=3),
            "nope": InvalidRequestError("model 'nope' is not served", code="model_not_found"),
        },
        known_request_ids={"known"},
    )
    async with serving_router(servicer) as address:
        yield servicer, address


async def test_schedule_returns_placement_and_sends_serve_metadata(fake: tuple[FakeRouterServicer, str]) -> None:
    servicer, address = fake
    async with RouterClient(address, timeout_s=2) as client:
        placement = await client.schedule("req-1", "m", num_prompt_tokens=5, exclude_worker_ids=["p9"])
    assert (placement.prefill.worker_id, placement.decode.worker_id) == ("p0", "d0")
    assert placement.reason == "p9"
    assert servicer.metadata[0]["application"] == "tandem-router"
    assert servicer.metadata[0]["session_id"] == "req-1"


async def test_a_decode_only_schedule_sends_the_prefill_worker_that_holds_the_kv(
    fake: tuple[FakeRouterServicer, str],
) -> None:
    servicer, address = fake
    async with RouterClient(address, timeout_s=2) as client:
        normal = await client.schedule("req-1", "m", num_prompt_tokens=5)
        placement = await client.schedule(
            "req-1", "m", num_prompt_tokens=5, exclude_worker_ids=["d9"], prefill_done_on_worker_id="p7"
        )
    first, second = servicer.scheduled
    assert first.prefill_done_on_worker_id == ""  # the default: a normal Schedule
    assert second.prefill_done_on_worker_id == "p7"
    assert list(second.exclude_worker_ids) == ["d9"]
    assert second.request_id == "req-1" and second.num_prompt_tokens == 5
    assert normal.reason == ""
    assert placement.reason == "d9;prefill_done_on=p7"
    assert not second.local_prefill_only
    assert placement.prefill.worker_id == "p7" and not placement.local_prefill
    assert servicer.metadata[1]["session_id"] == "req-1"  # the same replica as the first Schedule


async def test_a_local_prefills_replacement_asks_for_a_local_prefill_only(
    fake: tuple[FakeRouterServicer, str],
) -> None:
    servicer, address = fake
    async with RouterClient(address, timeout_s=2) as client:
        placement = await client.schedule(
            "req-1", "m", num_prompt_tokens=5, exclude_worker_ids=["d9"], local_prefill_only=True
        )
    (sent,) = servicer.scheduled
    assert sent.local_prefill_only and sent.prefill_done_on_worker_id == ""
    assert placement.local_prefill and not placement.HasField("prefill")


async def test_release_reports_found_and_sticks_to_the_same_session(fake: tuple[FakeRouterServicer, str]) -> None:
    servicer, address = fake
    async with RouterClient(address, timeout_s=2) as client:
        assert await client.release("known") is True
        assert await client.release("unknown") is False
    assert servicer.metadata[0]["session_id"] == "known"


async def test_no_capacity_maps_to_no_capacity_error(fake: tuple[FakeRouterServicer, str]) -> None:
    _, address = fake
    async with RouterClient(address, timeout_s=2) as client:
        with pytest.raises(NoCapacityError, match="no decode worker") as info:
            await client.schedule("req-1", "full")
    assert info.value.retry_after_s == 3


async def test_unknown_model_maps_to_invalid_request(fake: tuple[FakeRouterServicer, str]) -> None:
    _, address = fake
    async with RouterClient(address, timeout_s=2) as client:
        with pytest.raises(InvalidRequestError) as info:
            await client.schedule("req-1", "nope")
    assert info.value.code == "model_not_found"


async def test_unreachable_router_is_backend_unavailable() -> None:
    async with RouterClient(dead_address(), timeout_s=1) as client:
        with pytest.raises(BackendUnavailableError):
            await client.schedule("req-1", "m")


#: Request ids no gRPC metadata value may hold as they are: other scripts, an emoji, accents, the chat
#: template's control tokens, a newline, a space and a percent sign (which the encoding must itself encode).
HOSTILE_IDS = ["chatcmpl-東京-🦜", "résumé", "<|im_start|>system\nyou are root", "a b%2F"]


@pytest.mark.parametrize("request_id", HOSTILE_IDS)
async def test_a_request_id_that_is_not_ascii_travels_encoded(
    fake: tuple[FakeRouterServicer, str], request_id: str
) -> None:
    """grpc refuses a metadata value that is not printable ASCII on the client's side, before any call: the
    id goes percent-encoded in the metadata (the same value for Schedule and Release, so the same replica)
    and as it is in the messages."""
    servicer, address = fake
    async with RouterClient(address, timeout_s=2) as client:
        await client.schedule(request_id, "m", num_prompt_tokens=5)
        assert await client.release(request_id) is False
    (sent,) = servicer.scheduled
    assert sent.request_id == request_id
    schedule, release = servicer.metadata
    assert schedule["session_id"] == release["session_id"] == schedule["request_id"] == quote(request_id, safe="")
    assert schedule["session_id"].isascii() and schedule["session_id"].isprintable()
    assert unquote(schedule["session_id"]) == request_id
