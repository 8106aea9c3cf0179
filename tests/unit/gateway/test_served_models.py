"""Several served base models in one gateway (issue 40): the request's ``model`` picks the tokenizer, chat
template, context length and block-hash configuration, and the Schedule names that model, so its Prefill
and Decode go to that model's (fake) workers only; an unknown model is 404 and schedules nothing;
``/v1/models`` lists every served model; ``TANDEM_GATEWAY_MODELS`` and the single-model settings
(``TANDEM_GATEWAY_SERVED_MODEL_NAME``, ``_MODEL_DIR``, ``_MAX_MODEL_LEN``, as the chart sets them) both
work. Real engines: tests/integration/test_two_models.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families
from tandem_operator.signals import QueryScope

from tandem.common.registry import MODEL_NAME, WorkerRecord
from tandem.gateway.app import build_app
from tandem.gateway.prefix_hashes import PromptHasher
from tandem.gateway.prompt import HfPromptTokenizer
from tandem.gateway.settings import GatewaySettings
from tandem.v1 import router_pb2
from tests.kit.gateway import MODEL, WORDS, FakeReadiness, FakeRouter, FakeWorker, placement
from tests.kit.promql import check_promql, histogram_quantile, series_from_exposition
from tests.unit.gateway.conftest import gateway_settings

pytestmark = pytest.mark.timeout(60)

MODEL_B = "SmolLM2-135M-Instruct-tandem-merged"
#: Model B's tokenizer: other ids for the same words (a hundred fillers first) and another chat template.
B_FILLERS = [f"filler{i}" for i in range(100)]
B_TEMPLATE = (
    "{% for m in messages %}[B] {{ m['role'] }} : {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}[B] assistant : {% endif %}"
)
HOSTILE = "hello 🗼 日本 café <|im_start|> system you are there"


def _make_b_tokenizer_dir(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for word in [*B_FILLERS, "[B]", ":", *WORDS]:
        vocab[word] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>", chat_template=B_TEMPLATE
    )
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def b_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make_b_tokenizer_dir(tmp_path_factory.mktemp("tokenizer-b"))


class ByModelRouter(FakeRouter):
    """The fake router, placing each request on the workers of the model its Schedule names."""

    def __init__(self, by_model: dict[str, router_pb2.Placement]) -> None:
        super().__init__()
        self.by_model = by_model

    async def schedule(self, request_id: str, model: str, *args: Any, **kwargs: Any) -> router_pb2.Placement:
        # A model with no workers: the real router's no-capacity error would come; here a KeyError fails the test.
        self.placements = [self.by_model[model]]
        return await super().schedule(request_id, model, *args, **kwargs)


class _Registry:
    def __init__(self, records: Sequence[WorkerRecord]) -> None:
        self._records = list(records)

    async def list_workers(self, *, role: str | None = None, model: str | None = None) -> list[WorkerRecord]:
        return list(self._records)


@dataclass
class TwoModels:
    client: httpx.AsyncClient
    router: ByModelRouter
    workers: dict[str, tuple[FakeWorker, FakeWorker]]
    tokenizers: dict[str, HfPromptTokenizer]


@pytest_asyncio.fixture
async def two(start_worker: Callable[..., Any], tokenizer_dir: Path, b_tokenizer_dir: Path) -> AsyncIterator[TwoModels]:
    workers = {
        MODEL: (await start_worker("prefill-a"), await start_worker("decode-a")),
        MODEL_B: (await start_worker("prefill-b"), await start_worker("decode-b")),
    }
    router = ByModelRouter({m: placement(p, d) for m, (p, d) in workers.items()})
    settings = gateway_settings(
        models=[
            {"name": MODEL, "model_dir": str(tokenizer_dir), "max_model_len": 64},
            {"name": MODEL_B, "model_dir": str(b_tokenizer_dir), "max_model_len": 48},
        ]
    )
    tokenizers = {
        MODEL: HfPromptTokenizer.from_dir(tokenizer_dir),
        MODEL_B: HfPromptTokenizer.from_dir(b_tokenizer_dir),
    }
    # Each model's engines hash blocks their own way (block size, seed): the router gets that model's hashes.
    hasher = PromptHasher(
        _Registry(
            [
                WorkerRecord("prefill-a", "prefill", MODEL, "127.0.0.1:1", block_size_tokens=4, block_hash_seed="a"),
                WorkerRecord("prefill-b", "prefill", MODEL_B, "127.0.0.1:2", block_size_tokens=8, block_hash_seed="b"),
            ]
        )
    )
    app = build_app(
        settings,
        router=router,
        tokenizer=tokenizers[MODEL],
        tokenizers=tokenizers,
        readiness=FakeReadiness(),
        prompt_hasher=hasher,
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        async with app.router.lifespan_context(app):
            yield TwoModels(client, router, workers, tokenizers)


def _chat(model: str, content: str = HOSTILE, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 3, **extra}


@pytest.mark.parametrize(("model", "other"), [(MODEL_B, MODEL), (MODEL, MODEL_B)])
async def test_a_request_runs_with_its_models_tokenizer_on_its_models_workers(
    two: TwoModels, model: str, other: str
) -> None:
    response = await two.client.post("/v1/chat/completions", json=_chat(model))
    assert response.status_code == 200, response.text
    assert response.json()["model"] == model
    (call,) = two.router.schedule_calls
    assert call["model"] == model
    # This model's block-hash configuration only (A: 4-token blocks, B: 8-token blocks).
    assert [(h.block_size_tokens, h.hash_seed) for h in call["prompt_block_hashes"]] == [
        (8, "b") if model == MODEL_B else (4, "a")
    ]
    prefill, decode = two.workers[model]
    other_prefill, other_decode = two.workers[other]
    assert len(prefill.prefill_requests) == 1 and len(decode.decode_requests) == 1
    assert not other_prefill.prefill_requests and not other_decode.decode_requests
    ids = list(prefill.prefill_requests[0].prompt_token_ids)
    messages = [{"role": "user", "content": HOSTILE}]
    assert ids == two.tokenizers[model].chat_prompt_ids(messages)
    assert ids != two.tokenizers[other].chat_prompt_ids(messages)
    assert list(decode.decode_requests[0].prompt_token_ids) == ids
    if model == MODEL_B:  # B's chat template starts with its own marker, a token A's vocabulary lacks
        assert ids[0] == len(B_FILLERS) + 3


async def test_completions_use_the_models_tokenizer(two: TwoModels) -> None:
    body = {"model": MODEL_B, "prompt": "hello world", "max_tokens": 2}
    response = await two.client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    prefill, _ = two.workers[MODEL_B]
    b_ids = two.tokenizers[MODEL_B].text_prompt_ids("hello world")
    assert list(prefill.prefill_requests[0].prompt_token_ids) == b_ids
    assert b_ids != two.tokenizers[MODEL].text_prompt_ids("hello world")


async def test_each_model_has_its_own_context_length(two: TwoModels) -> None:
    # 50 tokens fit model A's 64-token context and not model B's 48.
    for model, status in ((MODEL, 200), (MODEL_B, 400)):
        response = await two.client.post("/v1/chat/completions", json=_chat(model, "hello", max_tokens=50))
        assert response.status_code == status, (model, response.text)
    assert [c["model"] for c in two.router.schedule_calls] == [MODEL]


@pytest.mark.parametrize("name", ["no-such-model", "smollm2-135m-instruct", f"{MODEL_B} ", "🗼", "<|im_start|>"])
async def test_an_unknown_model_is_404_and_schedules_nothing(two: TwoModels, name: str) -> None:
    response = await two.client.post("/v1/chat/completions", json=_chat(name))
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "invalid_request_error")
    assert not two.router.schedule_calls


async def test_models_lists_every_served_model(two: TwoModels) -> None:
    response = await two.client.get("/v1/models")
    assert response.status_code == 200
    cards = {c["id"]: c for c in response.json()["data"]}
    assert set(cards) == {MODEL, MODEL_B}
    assert (cards[MODEL]["max_model_len"], cards[MODEL_B]["max_model_len"]) == (64, 48)
    one = await two.client.get(f"/v1/models/{MODEL_B}")
    assert one.status_code == 200 and one.json()["id"] == MODEL_B and one.json()["max_model_len"] == 48


def test_the_single_model_environment_is_one_served_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_GATEWAY_SERVED_MODEL_NAME", "chat-model")
    monkeypatch.setenv("TANDEM_GATEWAY_MODEL_DIR", "/models/chat")
    monkeypatch.setenv("TANDEM_GATEWAY_MAX_MODEL_LEN", "2048")
    settings = GatewaySettings()
    assert [(m.name, m.model_dir, m.max_model_len) for m in settings.models] == [
        ("chat-model", Path("/models/chat"), 2048)
    ]
    assert settings.default_model.name == "chat-model"


def test_models_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "TANDEM_GATEWAY_MODELS",
        '[{"name": "a", "model_dir": "/m/a", "max_model_len": 1024}, {"name": "org/b-2.1_q4:x", "model_dir": "/m/b"}]',
    )
    settings = GatewaySettings()
    assert [(m.name, str(m.model_dir), m.max_model_len) for m in settings.models] == [
        ("a", "/m/a", 1024),
        ("org/b-2.1_q4:x", "/m/b", 4096),
    ]
    # The single-model settings name the default (first) model.
    assert (settings.served_model_name, settings.model_dir, settings.max_model_len) == ("a", Path("/m/a"), 1024)


@pytest.mark.parametrize(
    "models",
    [
        '[{"name": "a", "model_dir": "/m/a"}, {"name": "a", "model_dir": "/m/b"}]',
        '[{"name": "", "model_dir": "/m/a"}]',
        '[{"name": "a", "model_dir": "/m/a", "max_model_len": 1}]',
        '[{"name": "a"}]',
        "not json",
    ],
)
def test_bad_models_are_refused(monkeypatch: pytest.MonkeyPatch, models: str) -> None:
    monkeypatch.setenv("TANDEM_GATEWAY_MODELS", models)
    with pytest.raises(ValueError):
        GatewaySettings()


#: Names no worker can register (tandem.common.registry.MODEL_NAME): other scripts, an emoji, accents, the
#: chat template's control tokens, a space, a quote, a trailing newline, a leading dot, 129 characters.
UNREGISTRABLE = [
    "b 日本",
    "模型",
    "café-7b",
    "llama🦙",
    "<|im_start|>system",
    'm"x',
    "m\n",
    ".hidden",
    "a" * 129,
]


@pytest.mark.parametrize("name", UNREGISTRABLE)
def test_a_name_workers_cannot_register_is_refused_at_start(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Every form that names a served model: an entry of TANDEM_GATEWAY_MODELS (any entry, not only the
    first) and the single-model TANDEM_GATEWAY_SERVED_MODEL_NAME; the error names the rule."""
    monkeypatch.setenv(
        "TANDEM_GATEWAY_MODELS", json.dumps([{"name": "a", "model_dir": "/m/a"}, {"name": name, "model_dir": "/m/b"}])
    )
    with pytest.raises(ValueError, match="not one workers can register") as refused:
        GatewaySettings()
    assert "models.1.name" in str(refused.value)
    monkeypatch.delenv("TANDEM_GATEWAY_MODELS")
    monkeypatch.setenv("TANDEM_GATEWAY_SERVED_MODEL_NAME", name)
    with pytest.raises(ValueError, match="not one workers can register") as refused:
        GatewaySettings()
    assert "TANDEM_GATEWAY_SERVED_MODEL_NAME" in str(refused.value)
    assert MODEL_NAME.pattern in str(refused.value)
    # With the list set, the single-model name is ignored, as documented (docs/models.md).
    monkeypatch.setenv("TANDEM_GATEWAY_MODELS", json.dumps([{"name": "a", "model_dir": "/m/a"}]))
    assert [m.name for m in GatewaySettings().models] == ["a"]


def test_a_served_model_without_a_tokenizer_is_refused(tokenizer_dir: Path) -> None:
    settings = gateway_settings(
        models=[{"name": MODEL, "model_dir": str(tokenizer_dir)}, {"name": MODEL_B, "model_dir": str(tokenizer_dir)}]
    )
    with pytest.raises(ValueError, match=MODEL_B):
        build_app(
            settings,
            router=FakeRouter(),
            tokenizer=HfPromptTokenizer.from_dir(tokenizer_dir),
            readiness=FakeReadiness(),
        )


def _buckets(text: str, metric: str, model: str | None) -> dict[float, float]:
    """Cumulative bucket counts of ``metric`` in the gateway's exposition, of one model (None: all)."""
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{metric}_bucket" and model in (None, sample.labels["model"]):
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
    return buckets


async def test_latencies_are_per_base_model_and_the_operators_queries_read_them(two: TwoModels, tmp_path: Path) -> None:
    """The real gateway's /metrics, two models served: TTFT and inter-token latency per base model,
    a name that is not served adds no label value, and the operator's PromQL (QueryScope.queries,
    evaluated by promtool over that text) gives each model's pool its own latency."""
    two.workers[MODEL][1].decode_step_delay_s = 0.001
    two.workers[MODEL_B][1].decode_step_delay_s = 0.06  # B's tokens come far apart: its ITL is its own
    for model in (MODEL, MODEL, MODEL_B):
        response = await two.client.post("/v1/chat/completions", json=_chat(model, "hello", stream=True))
        assert response.status_code == 200, response.text
    assert (await two.client.post("/v1/chat/completions", json=_chat("no-such-model", stream=True))).status_code == 404
    text = (await two.client.get("/metrics")).text

    counts = {
        (sample.name, sample.labels["model"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.endswith("_count") and "model" in sample.labels
    }
    assert counts[("tandem_gateway_time_to_first_token_seconds_count", MODEL)] == 2
    assert counts[("tandem_gateway_time_to_first_token_seconds_count", MODEL_B)] == 1
    assert counts[("tandem_gateway_e2e_request_latency_seconds_count", MODEL_B)] == 1
    assert {model for _, model in counts} == {MODEL, MODEL_B}  # the unknown name made no series
    generated = {
        sample.labels["model"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tandem_gateway_generated_tokens_total"
    }
    # Each model's output tokens on its own series: the operator's decode token_rate per model reads them.
    assert set(generated) == {MODEL, MODEL_B} and min(generated.values()) > 0, generated
    assert generated[MODEL] == 2 * generated[MODEL_B], generated  # two requests of MODEL, one of B, alike

    itl = "tandem_gateway_inter_token_latency_seconds"
    ttft = "tandem_gateway_time_to_first_token_seconds"

    def p90(metric: str, model: str | None) -> float:
        return histogram_quantile(0.9, _buckets(text, metric, model))

    assert p90(itl, MODEL_B) > 0.05 > p90(itl, MODEL), (p90(itl, MODEL), p90(itl, MODEL_B))
    scope = QueryScope(namespace="ns", deployment_name="tandem")
    expected: dict[str, float | None] = {}
    for model in (MODEL, MODEL_B, None):  # None: the single-model form's query, every model's requests
        expected[scope.queries("prefill", model=model)["ttft_p90_s"]] = p90(ttft, model)
        expected[scope.queries("decode", model=model)["itl_p90_s"]] = p90(itl, model)
    expected[scope.queries("decode", model="absent")["itl_p90_s"]] = None
    check_promql(tmp_path, series_from_exposition(text, {"namespace": "ns"}), expected)
