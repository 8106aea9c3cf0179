"""Text across the prefill → decode boundary equals one colocated engine's stream.

Drives vLLM's own incremental detokenizer (the one inside every engine's output
processor) with the real SmolLM2 tokenizer, on generated output id sequences:
multi-byte characters (emoji, CJK, accents) whose bytes spread over several
byte-level tokens, special tokens, whitespace runs, stop strings that begin in
the first token. The boundary between prompt and answer is moved over every
position of each sequence, so the first generated token starts at every
possible byte of a character.

The engine loop below follows vLLM's: the core's ``check_stop``
(``vllm/v1/core/sched/utils.py``: end-of-sequence and stop token ids, then
length) and the output processor (``detokenizer.update(new_ids, stopped_by_token)``,
a matched stop string also ends the request, then
``get_next_output_text(finished, delta)``). Three runs of it per case:

* colocated: one engine generates the whole answer, streamed (DELTA);
* prefill: the same request with ``max_tokens=1``, final output only, cut by
  :func:`first_streamed_text`;
* decode: as the worker decides (:func:`appends_first_token`), either the
  request again (decode replays the first token, so its engine sees the
  colocated request), streamed, through :class:`ReplaySkipper`; or the first
  token appended to the prompt, ``max_tokens`` and ``min_tokens`` one lower,
  streamed as it comes.

Prefill's text followed by decode's must be the colocated stream, delta for
delta after the first, with the same finish.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.v1 import common_pb2
from tandem.worker.continuation import (
    ReplaySkipper,
    appended_options,
    appends_first_token,
    first_streamed_text,
    resumed_split,
)
from tandem.worker.sampling import sampling_kwargs

MODEL_DIR = Path.home() / ".cache" / "tandem" / "models" / "SmolLM2-135M-Instruct"

pytestmark = pytest.mark.skipif(not MODEL_DIR.is_dir(), reason="needs the default model folder (make model)")

TEXTS = [
    "😀😀 日本語の文です。",
    "Café crème, ñandú, über — déjà vu",
    "👩‍👩‍👧 family 🇫🇷 flag",
    "a\n\n\n   b\t\tc  ",
    "中文和English混合",
    "lit <|im_start|>eral <|im_end|> text",
    "Hello world, hello world!",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from vllm.tokenizers.registry import get_tokenizer

    return get_tokenizer(str(MODEL_DIR))


@dataclass
class Run:
    deltas: list[str]
    finish_reason: str | None
    num_tokens: int


def engine_params(max_tokens: int, options: common_pb2.SamplingOptions | None = None, **sampling: Any) -> Any:
    """vLLM ``SamplingParams`` as the worker builds them (tandem.worker.sampling) from the client's options."""
    from vllm import SamplingParams

    options = options or common_pb2.SamplingOptions(**sampling)
    return SamplingParams(**sampling_kwargs(options, max_tokens=max_tokens))


def engine_run(tokenizer: Any, prompt_ids: list[int], output_ids: list[int], *, params: Any, delta: bool) -> Run:
    """vLLM's detokenization and stop checks over ``output_ids`` as the engine would sample them."""
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    max_tokens = params.max_tokens
    params.update_from_tokenizer(tokenizer)
    request = EngineCoreRequest(
        request_id="r",
        prompt_token_ids=prompt_ids,
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )
    detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
    deltas: list[str] = []
    for n, token_id in enumerate(output_ids, start=1):
        stopped_by_token = (not params.ignore_eos and token_id == tokenizer.eos_token_id) or token_id in (
            params.stop_token_ids or ()
        )
        length = n >= max_tokens
        stop_string = detokenizer.update([token_id], stopped_by_token)
        finished = stopped_by_token or length or stop_string is not None
        if delta or finished:
            deltas.append(detokenizer.get_next_output_text(finished, delta))
        if finished:
            reason = "stop" if stopped_by_token or stop_string is not None else "length"
            return Run(deltas, reason, n)
    return Run(deltas, None, len(output_ids))


def disaggregated_run(
    tokenizer: Any, prompt_ids: list[int], output_ids: list[int], *, max_tokens: int, **sampling: Any
) -> Run:
    prefill_params = engine_params(1, **sampling)
    prefill = engine_run(tokenizer, prompt_ids, output_ids[:1], params=prefill_params, delta=False)
    finished = prefill.finish_reason == "stop" or max_tokens == 1
    buffer_chars = prefill_params.output_text_buffer_length
    first_text = first_streamed_text(prefill.deltas[-1], finished=finished, stop_buffer_chars=buffer_chars)
    if finished:
        return Run([first_text], prefill.finish_reason, 1)
    options = common_pb2.SamplingOptions(**sampling)
    if appends_first_token(options, sampling_kwargs(options, max_tokens=max_tokens), first_text):
        appended = engine_run(
            tokenizer,
            [*prompt_ids, output_ids[0]],
            output_ids[1:],
            params=engine_params(max_tokens - 1, appended_options(options)),
            delta=True,
        )
        return Run([first_text, *appended.deltas], appended.finish_reason, appended.num_tokens + 1)
    decode = engine_run(tokenizer, prompt_ids, output_ids, params=engine_params(max_tokens, **sampling), delta=True)
    skipper = ReplaySkipper([output_ids[0]], first_text)
    rest = []
    for index, text in enumerate(decode.deltas):
        skipper.tokens([output_ids[index]])
        rest.append(skipper.text(text))
    assert not skipper.mismatch
    return Run([first_text, *rest[1:]], decode.finish_reason, decode.num_tokens)


def assert_same_stream(
    tokenizer: Any, prompt_ids: list[int], output_ids: list[int], *, max_tokens: int, **sampling: Any
) -> None:
    from vllm import SamplingParams

    colocated_params = SamplingParams(max_tokens=max_tokens, **sampling)  # as a client would ask plain vLLM
    colocated = engine_run(tokenizer, prompt_ids, output_ids, params=colocated_params, delta=True)
    disaggregated = disaggregated_run(tokenizer, prompt_ids, output_ids, max_tokens=max_tokens, **sampling)
    kwargs = {"max_tokens": max_tokens, **sampling}
    assert disaggregated.deltas == colocated.deltas, (output_ids, kwargs)
    assert disaggregated.finish_reason == colocated.finish_reason
    assert disaggregated.num_tokens == colocated.num_tokens
    assert "\ufffd" not in "".join(disaggregated.deltas) or "\ufffd" in tokenizer.decode(output_ids)


def chat_prefix(tokenizer: Any) -> list[int]:
    messages = [{"role": "user", "content": "Hi"}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


@pytest.mark.parametrize("text", TEXTS)
def test_boundary_at_every_position(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    head = chat_prefix(tokenizer)
    assert len(ids) >= 3
    for boundary in range(len(ids)):
        prompt, answer = head + ids[:boundary], ids[boundary:]
        assert_same_stream(tokenizer, prompt, answer, max_tokens=len(answer) + 5)
        assert_same_stream(tokenizer, prompt, answer, max_tokens=2)


def test_answer_starting_with_a_split_emoji_never_shows_prompt_text(tokenizer: Any) -> None:
    ids = tokenizer.encode("😀 ok", add_special_tokens=False)
    assert tokenizer.decode(ids[:1]) != "😀"  # the emoji really is split over tokens
    prompt = chat_prefix(tokenizer)
    run = disaggregated_run(tokenizer, prompt, ids, max_tokens=10)
    assert "".join(run.deltas) == "😀 ok"
    assert run.deltas[0] == ""  # nothing to show after a partial character


@pytest.mark.parametrize(
    ("stop", "answer"),
    [
        (["Hello world"], "Hello world, and more"),  # begins in the first token, ends in decode's
        (["world"], "Hello world, and more"),
        ([","], "Hello, world"),
        (["Hello"], "Hello world"),  # complete in the first token
        (["lo wo"], "Hello world"),  # spans the boundary mid-token
        (["語の"], "日本語の文です"),
        (["😀"], "a😀b"),
    ],
)
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("min_tokens", [0, 1, 3])
def test_stop_strings_across_the_boundary(
    tokenizer: Any, stop: list[str], answer: str, include: bool, min_tokens: int
) -> None:
    ids = tokenizer.encode(answer, add_special_tokens=False)
    prompt = chat_prefix(tokenizer)
    assert_same_stream(
        tokenizer,
        prompt,
        ids,
        max_tokens=len(ids) + 3,
        stop=stop,
        include_stop_str_in_output=include,
        min_tokens=min(min_tokens, len(ids)),
    )


def test_stop_token_ids_and_eos_at_the_first_token_and_later(tokenizer: Any) -> None:
    prompt = chat_prefix(tokenizer)
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    for answer in ([eos], [ids[0], eos], [*ids, eos]):
        assert_same_stream(tokenizer, prompt, answer, max_tokens=10)
    assert_same_stream(tokenizer, prompt, ids, max_tokens=10, stop_token_ids=[ids[0]])
    assert_same_stream(tokenizer, prompt, ids, max_tokens=10, stop_token_ids=[ids[1]])
    assert_same_stream(tokenizer, prompt, [*ids, eos, ids[0]], max_tokens=10, ignore_eos=True)


def test_special_tokens_kept_or_skipped(tokenizer: Any) -> None:
    prompt = chat_prefix(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [*tokenizer.encode("x", add_special_tokens=False), im_end, *tokenizer.encode(" y", add_special_tokens=False)]
    for skip in (True, False):
        assert_same_stream(tokenizer, prompt, ids, max_tokens=10, skip_special_tokens=skip)
        assert_same_stream(tokenizer, prompt, [im_end, *ids], max_tokens=10, skip_special_tokens=skip)


_pieces = st.sampled_from(["😀", "日本", "é", " ", "\n", "  ", "a", "Hello", ",", "<|im_end|>", "🇫🇷", "ß"])


@settings(max_examples=60, deadline=None)
@given(
    pieces=st.lists(_pieces, min_size=2, max_size=12),
    boundary_seed=st.integers(min_value=0, max_value=10_000),
    stop=st.one_of(st.none(), st.lists(_pieces, min_size=1, max_size=3).map("".join)),
)
def test_generated_sequences(tokenizer: Any, pieces: list[str], boundary_seed: int, stop: str | None) -> None:
    ids = tokenizer.encode("".join(pieces), add_special_tokens=False)
    boundary = boundary_seed % len(ids)
    prompt, answer = chat_prefix(tokenizer) + ids[:boundary], ids[boundary:]
    kwargs: dict[str, Any] = {"stop": [stop]} if stop else {}
    assert_same_stream(tokenizer, prompt, answer, max_tokens=len(answer) + 2, **kwargs)


def test_first_streamed_text_rules() -> None:
    assert first_streamed_text("Hello", finished=False, stop_buffer_chars=3) == "He"
    assert first_streamed_text("Hello", finished=True, stop_buffer_chars=3) == "Hello"
    assert first_streamed_text("Hi", finished=False, stop_buffer_chars=5) == ""
    assert first_streamed_text("Hi", finished=False, stop_buffer_chars=0) == "Hi"


def test_replay_skipper_flags_a_disagreement() -> None:
    skipper = ReplaySkipper([7], "ab")
    assert skipper.tokens([8, 9]) == ([9], [])
    assert skipper.mismatch
    skipper = ReplaySkipper([7], "ab")
    assert skipper.text("a") == ""
    assert skipper.text("xcd") == "cd"
    assert skipper.mismatch
    skipper = ReplaySkipper([7], "ab")
    assert skipper.tokens([7], ["lp7"]) == ([], [])
    assert skipper.tokens([8], ["lp8"]) == ([8], ["lp8"])
    assert skipper.text("abc") == "c" and not skipper.mismatch


def test_the_first_token_is_appended_only_where_that_is_the_same_request() -> None:
    def appends(first_text: str = "Hi", defaults: dict[str, Any] | None = None, **fields: Any) -> bool:
        options = common_pb2.SamplingOptions(**fields)
        return appends_first_token(options, sampling_kwargs(options, max_tokens=8, model_defaults=defaults), first_text)

    assert appends() and appends(temperature=0.0) and appends(temperature=0.7)  # unseeded: any draw is the same draw
    assert appends(temperature=0.0, seed=3)  # greedy: the seed draws nothing
    assert appends(repetition_penalty=1.3, min_tokens=4, logit_bias={5: 2.0}, stop_token_ids=[9], logprobs=2)
    assert not appends(temperature=0.7, seed=3)  # a seeded sampler would be one draw behind
    assert not appends(defaults={"temperature": 0.2}, seed=3)  # the model's default temperature counts
    assert not appends(stop=["x"])
    # Presence and frequency penalties count output tokens only; the appended token carries its count
    # (tandem.worker.carried_penalties), so they append too.
    assert appends(presence_penalty=0.5) and appends(frequency_penalty=0.5)
    assert appends(defaults={"frequency_penalty": 0.5})
    assert not appends(structured_output=common_pb2.StructuredOutput(json_object=True))
    assert not appends(first_text="")  # the first token ends inside a character: nothing was streamed
    assert not appends(skip_special_tokens=False, spaces_between_special_tokens=False)
    assert appends(skip_special_tokens=False)
    assert appended_options(common_pb2.SamplingOptions(min_tokens=3, max_tokens=9)).min_tokens == 2
    assert appended_options(common_pb2.SamplingOptions(min_tokens=0)).min_tokens == 0


# -- a migrated stream: which resumed tokens become prompt ------------------------------------------

_VOCAB = {11: "Olá", 12: " 👋", 13: " 東", 14: "京", 15: "<|im_end|>"}


def _decode(ids: Sequence[int]) -> str:
    return "".join(_VOCAB.get(t, "\ufffd") for t in ids)


def _split(resume_text: str, resumed: Sequence[int] = (11, 12, 13), **options: Any) -> tuple[int, int]:
    sampling = common_pb2.SamplingOptions(max_tokens=50, **options)
    return resumed_split(sampling, sampling_kwargs(sampling, max_tokens=50), list(resumed), resume_text, _decode)


def test_a_greedy_stream_takes_every_resumed_token_as_prompt() -> None:
    assert _split("Olá 👋 東", temperature=0.0) == (3, 7)


def test_stop_strings_keep_enough_replayed_text_to_be_matched_across_the_failure() -> None:
    # "END" (3 characters): the replayed text must hold at least 2; " 東" has 2.
    assert _split("Olá 👋 東", temperature=0.0, stop=["END"]) == (2, 5)
    # "THE END": 6 characters are needed, and only all three tokens hold that: replay them all.
    assert _split("Olá 👋 東", temperature=0.0, stop=["THE END"]) == (0, 0)


def test_a_prefix_that_ends_inside_a_character_is_not_taken() -> None:
    # Token 99 is half a character (U+FFFD alone); the client has none of it.
    assert _split("Olá 👋", resumed=(11, 12, 99), temperature=0.0) == (2, 5)


def test_penalised_streams_take_their_tokens_as_prompt_and_carry_the_counts() -> None:
    assert _split("Olá 👋 東", temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3) == (3, 7)


def test_state_that_counts_output_tokens_replays_them_all() -> None:
    assert _split("Olá 👋 東", temperature=0.7, seed=3) == (0, 0)
    grammar = common_pb2.StructuredOutput(regex=".*")
    assert _split("Olá 👋 東", temperature=0.0, structured_output=grammar) == (0, 0)


def test_text_the_client_never_got_is_never_taken_as_said() -> None:
    # What the client has does not start with the tokens' text (a stop buffer held it back): replay.
    assert _split("Olá", temperature=0.0) == (1, 3)
