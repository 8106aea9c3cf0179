from __future__ import annotations

import pytest

from tandem.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tandem.router.kv_index import KVIndex


def test_match_counts_leading_blocks_per_worker() -> None:
    index = KVIndex()
    index.store("w0", [1, 2, 3])
    index.store("w1", [1, 2])
    index.store("w2", [2, 3])  # holds no first block: no prefix
    assert index.match([1, 2, 3, 4]) == {"w0": 3, "w1": 2}
    assert index.match([9, 2, 3]) == {}
    assert index.match([]) == {}


def test_events_store_remove_and_clear() -> None:
    index = KVIndex()
    index.apply("w0", BlockStored((1, 2, 3)))
    index.apply("w0", BlockRemoved((2,)))
    assert index.match([1, 2, 3]) == {"w0": 1}
    index.apply("w0", AllBlocksCleared())
    assert index.match([1]) == {} and index.num_blocks("w0") == 0


def test_offload_tiers_are_not_the_engines_cache() -> None:
    index = KVIndex()
    index.apply("w0", BlockStored((1,), medium="CPU"))
    index.apply("w0", BlockStored((2,), medium="GPU"))
    assert index.match([1]) == {} and index.match([2]) == {"w0": 1}


def test_removing_a_worker_drops_its_entries_and_reuses_its_bit() -> None:
    index = KVIndex()
    index.store("w0", [1, 2])
    index.store("w1", [1])
    index.remove_worker("w0")
    assert index.match([1, 2]) == {"w1": 1}
    assert index.num_block_entries == 1 and index.workers() == ["w1"]
    index.store("w2", [1, 2])  # takes w0's freed bit; must not inherit its blocks
    assert index.match([1, 2]) == {"w1": 1, "w2": 2}


def test_memory_is_bounded_per_worker_oldest_first() -> None:
    index = KVIndex(max_blocks_per_worker=3)
    index.store("w0", [1, 2, 3])
    index.store("w0", [1])  # re-stored: now the newest
    index.store("w0", [4, 5])
    assert index.num_blocks("w0") == 3
    assert index.match([1]) == {"w0": 1} and index.match([2]) == {} and index.match([3]) == {}
    assert index.match([4, 5]) == {"w0": 2}


def test_removing_unknown_blocks_and_workers_is_harmless() -> None:
    index = KVIndex()
    index.remove("nobody", [1])
    index.store("w0", [1])
    index.remove("w0", [7])
    index.remove_worker("nobody")
    assert index.match([1]) == {"w0": 1}


def test_rejects_nonpositive_bound() -> None:
    with pytest.raises(ValueError):
        KVIndex(max_blocks_per_worker=0)
