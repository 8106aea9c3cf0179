"""Output tokens taken as prompt carry their presence and frequency penalties: checked against vLLM's own
``apply_penalties`` on both forms of the same request (the colocated one, whose output holds the tokens,
and the resumed one, whose prompt does)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from vllm import SamplingParams
from vllm.model_executor.layers.utils import apply_penalties
from vllm.v1.sample.logits_processor import BatchUpdate
from vllm.v1.sample.logits_processor.interface import MoveDirectionality

from tandem.worker.carried_penalties import CARRIED_TOKEN_IDS, CarriedPenalties, carried_args

VOCAB = 64


def _processor() -> CarriedPenalties:
    config = SimpleNamespace(model_config=SimpleNamespace(get_vocab_size=lambda: VOCAB))
    return CarriedPenalties(config, torch.device("cpu"), False)


def _padded(rows: list[list[int]]) -> torch.Tensor:
    width = max(1, *(len(r) for r in rows))
    return torch.tensor([r + [VOCAB] * (width - len(r)) for r in rows], dtype=torch.int64)


def _vllm_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    return apply_penalties(
        logits,
        _padded([prompt]),
        _padded([output]),
        torch.tensor([params.presence_penalty]),
        torch.tensor([params.frequency_penalty]),
        torch.tensor([params.repetition_penalty]),
    )


def _both_forms(
    seed: int, presence: float, frequency: float, repetition: float
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    rng = random.Random(seed)
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
    carried = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))]
    new_output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 8))]
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4
    params = SamplingParams(
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        extra_args={CARRIED_TOKEN_IDS: carried},
    )
    colocated = _vllm_penalties(logits.clone(), prompt, carried + new_output, params)
    processor = _processor()
    processor.update_state(
        BatchUpdate(batch_size=1, removed=[], added=[(0, params, prompt + carried, new_output)], moved=[])
    )
    resumed = _vllm_penalties(processor.apply(logits.clone()), prompt + carried, new_output, params)
    return colocated, resumed, carried


@pytest.mark.parametrize("repetition", [1.0, 1.3, 0.8])
def test_the_resumed_request_gets_the_colocated_requests_penalised_logits(repetition: float) -> None:
    for seed in range(200):
        rng = random.Random(seed)
        presence, frequency = rng.uniform(-2, 2), rng.uniform(-2, 2)
        colocated, resumed, _ = _both_forms(seed, presence, frequency, repetition)
        torch.testing.assert_close(resumed, colocated, rtol=1e-5, atol=1e-5)
        assert int(resumed.argmax()) == int(colocated.argmax())


def test_without_the_processor_the_forms_differ() -> None:
    # The check above can fail: taking the tokens as prompt without carrying their penalties changes the logits.
    prompt, carried = [1, 2, 3], [5, 5, 9]
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=0.4)
    colocated = _vllm_penalties(logits.clone(), prompt, carried, params)
    uncarried = _vllm_penalties(logits.clone(), prompt + carried, [], params)
    assert not torch.allclose(colocated, uncarried)


def test_the_output_list_is_read_live_for_presence() -> None:
    processor = _processor()
    params = SamplingParams(presence_penalty=1.0, extra_args={CARRIED_TOKEN_IDS: [7]})
    output: list[int] = []
    processor.update_state(BatchUpdate(batch_size=1, removed=[], added=[(0, params, [1, 7], output)], moved=[]))
    assert float(processor.apply(torch.zeros(1, VOCAB))[0, 7]) == -1.0  # 7 not yet in the new output: carried
    output.append(7)  # vLLM appends the sampled token to the same list
    assert float(processor.apply(torch.zeros(1, VOCAB))[0, 7]) == 0.0  # vLLM's own presence penalty covers it now


def test_removed_and_moved_requests_and_past_vocabulary_ids() -> None:
    processor = _processor()
    params = SamplingParams(frequency_penalty=0.5, extra_args={CARRIED_TOKEN_IDS: [3, 3]})
    hostile = SamplingParams(frequency_penalty=0.5, extra_args={CARRIED_TOKEN_IDS: [VOCAB + 5]})
    processor.update_state(
        BatchUpdate(batch_size=2, removed=[], added=[(0, params, [3, 3], []), (1, hostile, [1], [])], moved=[])
    )
    logits = processor.apply(torch.zeros(2, VOCAB))
    assert float(logits[0, 3]) == -1.0 and float(logits[1].abs().sum()) == 0.0  # a bad id carries nothing
    processor.update_state(BatchUpdate(batch_size=2, removed=[], added=[], moved=[(0, 1, MoveDirectionality.SWAP)]))
    assert float(processor.apply(torch.zeros(2, VOCAB))[1, 3]) == -1.0
    processor.update_state(BatchUpdate(batch_size=1, removed=[1], added=[], moved=[]))
    assert float(processor.apply(torch.zeros(2, VOCAB)).abs().sum()) == 0.0


def test_only_penalised_requests_carry_anything() -> None:
    assert carried_args([5, 6], {"temperature": 0.0}) == {}
    assert carried_args([], {"presence_penalty": 0.5}) == {}
    assert carried_args([5, 6], {"frequency_penalty": 0.5}) == {CARRIED_TOKEN_IDS: [5, 6]}
    with pytest.raises(ValueError):
        CarriedPenalties.validate_params(SamplingParams(extra_args={CARRIED_TOKEN_IDS: [-1]}))
