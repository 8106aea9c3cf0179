"""tandem.worker.validation: each bound with the value just inside and just outside it, and, with
hypothesis, that no message of any shape makes a check raise rather than answer."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.common import kv_capability
from tandem.v1 import common_pb2, worker_pb2
from tandem.worker.validation import (
    ModelLimits,
    check_abort,
    check_decode,
    check_prefetch,
    check_prefill,
    check_sampling,
)

LIMITS = ModelLimits(vocab_size=49_152, max_model_len=4096, max_logprobs=20, block_size_tokens=128)


def _handle(num_tokens: int = 200, num_blocks: int = 2) -> common_pb2.KVHandle:
    return common_pb2.KVHandle(
        engine_id="prefill-abc",
        kv_address="127.0.0.1:50061",
        block_ids=list(range(num_blocks)),
        num_tokens=num_tokens,
    )


CAPABILITY = kv_capability.mint()


def _decode(**fields: object) -> worker_pb2.DecodeRequest:
    values: dict[str, object] = {
        "request_id": "chatcmpl-0123abcd",
        "prompt_token_ids": [1] * 200,
        "first_token_id": 42,
        "sampling": common_pb2.SamplingOptions(max_tokens=16),
        "kv_handle": _handle(),
        "kv_capability": CAPABILITY,
        **fields,
    }
    return worker_pb2.DecodeRequest(**values)  # type: ignore[arg-type]


def test_the_requests_tandem_sends_pass() -> None:
    assert check_decode(_decode(), LIMITS) == ""
    assert check_decode(_decode(first_token_id=LIMITS.vocab_size - 1, first_text="Olá 👋 東京"), LIMITS) == ""
    prefill = worker_pb2.PrefillRequest(
        request_id="r1", prompt_token_ids=[0, 49_151], keep_kv=True, kv_capability=CAPABILITY
    )
    assert check_prefill(prefill, LIMITS) == ""
    assert check_abort(worker_pb2.AbortRequest(request_id="cmpl-1")) == ""


def test_the_first_token_that_killed_an_engine_is_refused() -> None:
    assert "first_token_id" in check_decode(_decode(first_token_id=4_000_000_000), LIMITS)
    assert "first_token_id" in check_decode(_decode(first_token_id=LIMITS.vocab_size), LIMITS)


@pytest.mark.parametrize(
    ("prompt", "refused"),
    [([], True), ([49_152], True), ([1] * 4096, True), ([1] * 4095, False), ([0], False)],
)
def test_prompt_bounds(prompt: list[int], refused: bool) -> None:
    request = worker_pb2.PrefillRequest(request_id="r1", prompt_token_ids=prompt)
    assert bool(check_prefill(request, LIMITS)) is refused


@pytest.mark.parametrize(
    "options",
    [
        common_pb2.SamplingOptions(temperature=math.nan),
        common_pb2.SamplingOptions(temperature=math.inf),
        common_pb2.SamplingOptions(temperature=-0.1),
        common_pb2.SamplingOptions(top_p=1.5),
        common_pb2.SamplingOptions(presence_penalty=math.nan),
        common_pb2.SamplingOptions(repetition_penalty=math.inf),
        common_pb2.SamplingOptions(top_k=-2),
        common_pb2.SamplingOptions(logprobs=21),
        common_pb2.SamplingOptions(max_tokens=4097),
        common_pb2.SamplingOptions(min_tokens=4_294_967_295),
        common_pb2.SamplingOptions(stop=[""]),
        common_pb2.SamplingOptions(stop=["x"] * 65),
        common_pb2.SamplingOptions(stop_token_ids=[49_152]),
        common_pb2.SamplingOptions(logit_bias={49_152: 1.0}),
        common_pb2.SamplingOptions(logit_bias={5: math.nan}),
        common_pb2.SamplingOptions(logit_bias={5: 101.0}),
        common_pb2.SamplingOptions(structured_output=common_pb2.StructuredOutput(regex="")),
        common_pb2.SamplingOptions(
            structured_output=common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=[]))
        ),
    ],
)
def test_sampling_values_the_engine_cannot_take_are_refused(options: common_pb2.SamplingOptions) -> None:
    assert check_sampling(options, LIMITS) != ""


def test_sampling_values_at_their_bounds_pass() -> None:
    options = common_pb2.SamplingOptions(
        max_tokens=4096,
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        min_p=0.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=1.2,
        logprobs=20,
        stop=["<|im_end|>", "東京"],
        stop_token_ids=[49_151],
        logit_bias={0: -100.0, 49_151: 100.0},
    )
    assert check_sampling(options, LIMITS) == ""


@pytest.mark.parametrize(
    "handle",
    [
        _handle(num_tokens=201),  # more tokens than the prompt
        _handle(num_tokens=0),
        _handle(num_blocks=1),  # 200 tokens need 2 blocks of 128
        _handle(num_blocks=100),  # more than a whole context's blocks
        common_pb2.KVHandle(engine_id="e", kv_address="no-port", block_ids=[0], num_tokens=1),
        common_pb2.KVHandle(kv_address="h:1", block_ids=[0], num_tokens=1),  # no engine id
    ],
)
def test_handles_that_do_not_describe_this_prompts_blocks_are_refused(handle: common_pb2.KVHandle) -> None:
    assert check_decode(_decode(kv_handle=handle), LIMITS) != ""


@pytest.mark.parametrize("request_id", ["", "a" * 129, "r\n1", "r 1", "../etc/passwd", "東京"])
def test_request_ids_are_plain_names(request_id: str) -> None:
    assert check_abort(worker_pb2.AbortRequest(request_id=request_id)) != ""


@pytest.mark.parametrize("capability", ["", "0" * 31, "g" * 32, "A" * 32, "0" * 33])
def test_a_kv_call_without_a_well_formed_capability_is_refused(capability: str) -> None:
    """Whatever reads or keeps a prompt's KV names its capability (tandem.common.kv_capability)."""
    keep = worker_pb2.PrefillRequest(request_id="r1", prompt_token_ids=[1], keep_kv=True, kv_capability=capability)
    assert "kv_capability" in check_prefill(keep, LIMITS)
    assert "kv_capability" in check_decode(_decode(kv_capability=capability), LIMITS)
    prefetch = worker_pb2.PrefetchKVRequest(
        request_id="r1", kv_address="10.0.0.7:50061", num_prompt_tokens=300, kv_capability=capability
    )
    assert "kv_capability" in check_prefetch(prefetch, LIMITS)
    # A prefill that keeps nothing, and a local prefill, need none.
    assert check_prefill(worker_pb2.PrefillRequest(request_id="r1", prompt_token_ids=[1]), LIMITS) == ""


def test_prefetch_bounds() -> None:
    good = worker_pb2.PrefetchKVRequest(
        request_id="r1", kv_address="10.0.0.7:50061", num_prompt_tokens=300, kv_capability=CAPABILITY
    )
    assert check_prefetch(good, LIMITS) == ""
    for bad in (
        worker_pb2.PrefetchKVRequest(request_id="r1", kv_address="10.0.0.7:50061", num_prompt_tokens=0),
        worker_pb2.PrefetchKVRequest(request_id="r1", kv_address="10.0.0.7:50061", num_prompt_tokens=5000),
        worker_pb2.PrefetchKVRequest(request_id="r1", kv_address="http://x/", num_prompt_tokens=3),
        worker_pb2.PrefetchKVRequest(
            request_id="r1", kv_address="10.0.0.7:50061", num_prompt_tokens=3, num_decode_cached_tokens=4
        ),
    ):
        assert check_prefetch(bad, LIMITS) != ""


_u32 = st.integers(min_value=0, max_value=2**32 - 1)
_floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
_options = st.builds(
    common_pb2.SamplingOptions,
    max_tokens=_u32,
    temperature=_floats,
    top_p=_floats,
    top_k=st.integers(min_value=-(2**31), max_value=2**31 - 1),
    presence_penalty=_floats,
    repetition_penalty=_floats,
    min_tokens=_u32,
    logprobs=_u32,
    stop=st.lists(st.text(max_size=5), max_size=3),
    stop_token_ids=st.lists(_u32, max_size=3),
    logit_bias=st.dictionaries(_u32, _floats, max_size=3),
)


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.lists(_u32, max_size=8),
    first_token_id=_u32,
    options=_options,
    num_tokens=_u32,
    block_ids=st.lists(_u32, max_size=4),
)
def test_any_decode_request_gets_an_answer_and_what_passes_is_in_bounds(
    prompt: list[int], first_token_id: int, options: common_pb2.SamplingOptions, num_tokens: int, block_ids: list[int]
) -> None:
    request = _decode(
        prompt_token_ids=prompt,
        first_token_id=first_token_id,
        sampling=options,
        kv_handle=common_pb2.KVHandle(engine_id="e", kv_address="h:1", block_ids=block_ids, num_tokens=num_tokens),
    )
    if check_decode(request, LIMITS) == "":
        assert prompt and max(prompt) < LIMITS.vocab_size and first_token_id < LIMITS.vocab_size
        assert all(math.isfinite(v) for v in options.logit_bias.values())
        assert not options.HasField("temperature") or math.isfinite(options.temperature)
        assert 0 < num_tokens <= len(prompt)
