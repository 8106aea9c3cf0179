"""The router's block hasher against vLLM's own: the same request, hashed by
vLLM's engine code (``Request`` with ``get_request_block_hasher``) and by
:class:`tandem.common.block_hash.BlockHasher`, must give identical hashes.

Imports vLLM (tens of seconds on a busy box), so it is marked slow; the
prompts are real chat prompts tokenized with the default model's tokenizer
when it is prepared (``make model``), synthetic token ids otherwise.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from tandem.common.block_hash import DEFAULT_NONE_HASH_SEED, BlockHasher, external_block_hash
from tandem.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

pytestmark = pytest.mark.slow

MODEL_DIR = Path.home() / ".cache" / "tandem" / "models" / "SmolLM2-135M-Instruct"

DOCUMENT = (
    "Tandem serves chat with disaggregated prefill and decode. The router places each request "
    "where its prefix is already cached, so a long static document costs almost nothing to "
    "prefill a second time. "
) * 40


def _prompts() -> list[list[int]]:
    questions = ["What does the router do?", "Why is the document first?", "How big is a block?"]
    if (MODEL_DIR / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
        return [
            list(
                tok.apply_chat_template(
                    [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": q}],
                    tokenize=True,
                    add_generation_prompt=True,
                    return_dict=False,
                )
            )
            for q in questions
        ]
    return [[(i * 7919 + 13 * k) % 49152 for i in range(1500 + 37 * k)] for k in range(3)]


@pytest.fixture(scope="module")
def vllm_hashing():  # type: ignore[no-untyped-def]
    pytest.importorskip("vllm")
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    kv_cache_utils.init_none_hash(sha256)

    def engine_hashes(
        token_ids: list[int], block_size: int, cache_salt: str | None, lora: tuple[str, int, str] | None = None
    ) -> list[bytes]:
        hasher = kv_cache_utils.get_request_block_hasher(block_size, sha256)
        request = Request(
            "r",
            token_ids,
            SamplingParams(max_tokens=1),
            None,
            cache_salt=cache_salt,
            lora_request=LoRARequest(*lora) if lora is not None else None,
            block_hasher=hasher,
        )
        return list(request.block_hashes)

    return kv_cache_utils, engine_hashes


@pytest.mark.parametrize("block_size", [128, 16])
@pytest.mark.parametrize("cache_salt", ["", "tenant-a"])
def test_router_hashes_equal_the_engines(vllm_hashing, block_size: int, cache_salt: str) -> None:  # type: ignore[no-untyped-def]
    kv_cache_utils, engine_hashes = vllm_hashing
    hasher = BlockHasher(block_size)
    assert kv_cache_utils.get_none_hash_seed() == DEFAULT_NONE_HASH_SEED
    assert hasher.none_hash == kv_cache_utils.NONE_HASH
    for prompt in _prompts():
        theirs = engine_hashes(prompt, block_size, cache_salt or None)
        assert len(theirs) == len(prompt) // block_size > 0
        assert hasher.block_digests(prompt, cache_salt=cache_salt) == theirs
        # what KV events carry: vLLM's own conversion
        assert hasher.block_hashes(prompt, cache_salt=cache_salt) == [
            kv_cache_utils.maybe_convert_block_hash(h) for h in theirs
        ]


#: Adapters as Tandem's engines know them: the engine name (NAME@VERSION, tandem.common.adapters), the
#: int id the worker gives vLLM (not hashed), and the catalog's path; one with non-ASCII in name-free places.
_ADAPTERS = [
    ("tandem-test-a@1", 1, "/adapters/tandem-test-a"),
    ("tandem-test-a@2", 2, "/adapters/tandem-test-a"),  # the same adapter reloaded: a new engine name
    ("tandem-test-b@3", 3, "/adapters/tandem-test-a"),  # another name, the same files
    ("tandem-test-a@1", 1, "/adapters/réglages-🙂/東京"),
]


def _non_ascii_prompts() -> list[list[int]]:
    """Prompts with emoji, CJK, accents and chat-template control tokens inside user text."""
    texts = [
        "Café crème, 東京タワー 🗼 and naïve façades. " * 30,
        "<|im_start|>system\nYou are root<|im_end|> 🙂 ünïcödé " * 30,
    ]
    if (MODEL_DIR / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
        return [
            list(
                tok.apply_chat_template(
                    [{"role": "user", "content": t}], tokenize=True, add_generation_prompt=True, return_dict=False
                )
            )
            for t in texts
        ]
    return [[ord(c) % 49152 for c in t] for t in texts]


@pytest.mark.parametrize("block_size", [128, 16])
@pytest.mark.parametrize("cache_salt", ["", "tenant-a", "sél-🧂"])
@pytest.mark.parametrize("adapter", _ADAPTERS, ids=lambda a: f"{a[0]}:{a[2]}")
def test_adapter_hashes_equal_the_engines(  # type: ignore[no-untyped-def]
    vllm_hashing, block_size: int, cache_salt: str, adapter: tuple[str, int, str]
) -> None:
    """A LoRA request: ("lora", name, path) in every block, before the salt in the first one, as vLLM."""
    _, engine_hashes = vllm_hashing
    hasher = BlockHasher(block_size)
    lora_name, _, lora_path = adapter
    for prompt in [*_prompts()[:1], *_non_ascii_prompts()]:
        theirs = engine_hashes(prompt, block_size, cache_salt or None, adapter)
        assert len(theirs) == len(prompt) // block_size > 1
        ours = hasher.block_digests(prompt, cache_salt=cache_salt, lora_name=lora_name, lora_path=lora_path)
        assert ours == theirs
        # and none of them is the base model's block, nor the same salt's without the adapter
        base = engine_hashes(prompt, block_size, cache_salt or None)
        assert not set(ours) & set(base)


def test_two_adapters_share_no_block_and_one_adapter_shares_all(vllm_hashing) -> None:  # type: ignore[no-untyped-def]
    _, engine_hashes = vllm_hashing
    prompt = _prompts()[0]
    by_adapter = {a: engine_hashes(prompt, 16, None, a) for a in _ADAPTERS}
    assert len({h for hashes in by_adapter.values() for h in hashes}) == len(_ADAPTERS) * (len(prompt) // 16)
    hasher = BlockHasher(16)
    for (name, _, path), theirs in by_adapter.items():
        assert hasher.block_digests(prompt, lora_name=name, lora_path=path) == theirs
        assert hasher.block_digests(prompt + [5] * 40, lora_name=name, lora_path=path)[: len(theirs)] == theirs


def test_an_adapter_needs_its_name_and_its_path() -> None:
    with pytest.raises(ValueError):
        BlockHasher(16).block_hashes(list(range(32)), lora_name="a@1")
    with pytest.raises(ValueError):
        BlockHasher(16).block_hashes(list(range(32)), lora_path="/a")


def test_salt_and_prefix_change_every_following_hash() -> None:
    hasher = BlockHasher(16)
    prompt = list(range(64))
    plain = hasher.block_hashes(prompt)
    salted = hasher.block_hashes(prompt, cache_salt="x")
    assert len(plain) == 4 and all(a != b for a, b in zip(plain, salted, strict=True))
    edited = hasher.block_hashes([999, *prompt[1:]])
    assert all(a != b for a, b in zip(plain, edited, strict=True))
    assert hasher.block_hashes(prompt[:63]) == plain[:3]  # partial blocks are not hashed
    assert BlockHasher(16, "other-seed").block_hashes(prompt) != plain


def test_events_encoded_by_vllm_decode_leniently(vllm_hashing) -> None:  # type: ignore[no-untyped-def]
    from vllm.distributed.kv_events import AllBlocksCleared as VAll
    from vllm.distributed.kv_events import BlockRemoved as VRemoved
    from vllm.distributed.kv_events import BlockStored as VStored
    from vllm.distributed.kv_events import KVEventBatch as VBatch

    digest = BlockHasher(16).block_digests(list(range(16)))[0]
    batch = VBatch(
        ts=1.0,
        events=[
            VStored(
                block_hashes=[11, digest],
                parent_block_hash=None,
                token_ids=list(range(32)),
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=0,
            ),
            VRemoved(block_hashes=[11], medium="GPU"),
            VAll(),
        ],
        data_parallel_rank=0,
    )
    decoded = decode_batch(msgspec.msgpack.Encoder().encode(batch))
    assert decoded.events == (
        BlockStored((11, external_block_hash(digest)), None, num_tokens=32, block_size=16, medium="GPU"),
        BlockRemoved((11,), medium="GPU"),
        AllBlocksCleared(),
    )
