from __future__ import annotations

import random

import numpy as np
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


class _ReferenceIndex:
    """What KVIndex must answer, the obvious way: every worker's blocks in storage order."""

    def __init__(self, max_blocks_per_worker: int) -> None:
        self.max_blocks_per_worker = max_blocks_per_worker
        self.blocks: dict[str, dict[int, None]] = {}

    def store(self, worker_id: str, block_hashes: list[int]) -> None:
        blocks = self.blocks.setdefault(worker_id, {})
        for h in block_hashes:
            blocks.pop(h, None)
            blocks[h] = None
        while len(blocks) > self.max_blocks_per_worker:
            del blocks[next(iter(blocks))]

    def remove(self, worker_id: str, block_hashes: list[int]) -> None:
        for h in block_hashes:
            self.blocks.get(worker_id, {}).pop(h, None)

    def match(self, block_hashes: list[int]) -> dict[str, int]:
        result = {}
        for worker_id, blocks in self.blocks.items():
            num_matched = 0
            while num_matched < len(block_hashes) and block_hashes[num_matched] in blocks:
                num_matched += 1
            if num_matched:
                result[worker_id] = num_matched
        return result


def _assert_table_is_ordered_linear_probing(index: KVIndex, absent: list[int]) -> None:
    """The compiled probe against the plain one: the slot table holds exactly the live rows, each at
    or past its home slot with no empty slot or later home before it (runs sorted by home, so a probe
    ends), its last slot empty; and a probe finds every live key's row and none of ``absent``."""
    table, keys = index._table, index._keys
    slots = table.slots.tolist()
    home_mask = int(table.home_mask)
    assert slots[-1] == -1
    live = {int(r) for r in np.flatnonzero(index._holder_columns[0][: index._num_rows])}
    assert sorted(r for r in slots if r >= 0) == sorted(live)
    row_of = {}
    for i, r in enumerate(slots):
        if r >= 0:
            home = int(keys[r]) & home_mask
            assert home <= i and all(slots[k] >= 0 and int(keys[slots[k]]) & home_mask <= home for k in range(home, i))
            row_of[int(keys[r])] = r
    hashes = np.array([*row_of, *absent], np.uint64)
    rows = np.empty(len(hashes), np.int32)
    assert table.find(keys, hashes, rows, stop_at_missing=False) == len(hashes)
    assert rows.tolist() == [*row_of.values(), *(-1 for _ in absent)]


def _assert_same(index: KVIndex, reference: _ReferenceIndex, prompts: list[list[int]]) -> None:
    assert index.workers() == list(reference.blocks)
    assert index.num_block_entries == sum(len(b) for b in reference.blocks.values())
    for worker_id, blocks in reference.blocks.items():
        assert index.num_blocks(worker_id) == len(blocks)
    entries = index.entries_by_worker()
    assert {w: e.tolist() for w, e in entries.items()} == {w: sorted(b) for w, b in reference.blocks.items()}
    assert all(e.dtype == np.uint64 for e in entries.values())
    for prompt in prompts:
        assert index.match(prompt) == reference.match(prompt)


# 8 workers (overflow rows, one word of holder bits), 8 of 130 slots (the others taken first and
# left empty: the matching workers sit in the third word of the bitsets, widened twice).
@pytest.mark.parametrize("num_idle_slots", [0, 122])
def test_random_operations_agree_with_a_reference_through_growth_and_shrinking(num_idle_slots: int) -> None:
    rnd = random.Random(7)
    bound = 300
    index = KVIndex(max_blocks_per_worker=bound)
    # Renumber stamps every couple of thousand stores instead of every 2**32 (there are <= 8 * 300 entries).
    index._max_stamp = 8_000
    reference = _ReferenceIndex(bound)
    for i in range(num_idle_slots):
        index.store(f"idle{i}", [])
        reference.blocks[f"idle{i}"] = {}
    workers = [f"w{i}" for i in range(8)]  # more holders than fit inline: overflow rows
    system_prompt = [0, 2**64 - 1, *(rnd.getrandbits(64) for _ in range(10))]  # stored by everyone
    # Hashes whose low bits are all ones share the last home slot: a run longer than the table's spare end.
    crowded = [k << 32 | 0xFFFF_FFFF for k in range(300)]
    pool = [rnd.getrandbits(64) for _ in range(3_000)] + crowded
    recent: list[list[int]] = [system_prompt]
    max_slot_bits = 0
    for step in range(4_000):
        worker_id = rnd.choice(workers)
        op = rnd.random()
        if op < 0.55:
            hashes = (system_prompt if rnd.random() < 0.1 else []) + rnd.choices(pool, k=rnd.randint(1, 40))
            index.store(worker_id, hashes)
            reference.store(worker_id, hashes)
            recent = [*recent[-20:], hashes]
        elif op < 0.9:
            hashes = rnd.choices(pool + system_prompt, k=rnd.randint(1, 60))
            index.remove(worker_id, hashes)
            reference.remove(worker_id, hashes)
        elif op < 0.97:
            index.clear_worker(worker_id)
            if worker_id in reference.blocks:
                reference.blocks[worker_id].clear()
        else:
            index.remove_worker(worker_id)
            reference.blocks.pop(worker_id, None)
        max_slot_bits = max(max_slot_bits, index._table.slot_bits)
        if step % 200 == 199:
            _assert_same(index, reference, [*recent, rnd.choices(pool, k=8)])
            _assert_table_is_ordered_linear_probing(index, [rnd.getrandbits(64) for _ in range(50)])
    assert index.num_evicted_over_bound > 0 and max_slot_bits > 10  # evicted, and grew
    # A burst of new blocks: the table doubles a few times and every worker hits its bound.
    for worker_id in workers:
        for _ in range(10):
            hashes = [rnd.getrandbits(64) for _ in range(50)]
            index.store(worker_id, hashes)
            reference.store(worker_id, hashes)
    _assert_same(index, reference, recent)
    assert index._table.slot_bits >= 12  # 2,400 rows: 4,096 home slots
    grown_bytes = index.approx_memory_bytes()
    # Shrinking back: half the workers leave, the rest forget most of their blocks but the system prompt.
    for worker_id in workers[:4]:
        index.remove_worker(worker_id)
        reference.blocks.pop(worker_id, None)
    for worker_id in workers[4:]:
        index.store(worker_id, system_prompt)  # four holders: overflow rows survive the renumbering
        reference.store(worker_id, system_prompt)
        forgotten = [h for h in reference.blocks[worker_id] if h not in system_prompt and rnd.random() < 0.9]
        index.remove(worker_id, forgotten)
        reference.remove(worker_id, forgotten)
    _assert_same(index, reference, recent)
    assert index.num_workers == 4 + num_idle_slots
    baseline = KVIndex()  # empty, with as many worker slots
    for i in range(num_idle_slots):
        baseline.store(f"idle{i}", [])
    empty_bytes = baseline.approx_memory_bytes()
    shrunk_bytes = index.approx_memory_bytes()
    assert shrunk_bytes - empty_bytes < (grown_bytes - empty_bytes) / 3 and shrunk_bytes < 2 * empty_bytes
    index.store("w9", system_prompt)  # a newcomer reuses a freed slot
    reference.store("w9", system_prompt)
    _assert_same(index, reference, recent)


def test_entries_by_worker_lists_sorted_hashes_of_every_known_worker() -> None:
    index = KVIndex()
    index.store("w0", [5, 2**64 - 1, 0, 3])
    index.store("w1", [3])
    index.store("w2", [4])
    index.clear_worker("w2")
    entries = index.entries_by_worker()
    assert list(entries) == ["w0", "w1", "w2"]
    assert entries["w0"].tolist() == [0, 3, 5, 2**64 - 1] and entries["w0"].dtype == np.uint64
    assert entries["w1"].tolist() == [3] and entries["w2"].tolist() == []


def test_a_reused_slot_inherits_nothing_from_overflow_rows() -> None:
    index = KVIndex()
    shared = [11, 12, 13]
    for i in range(6):  # more holders than fit in a row: the rest overflow
        index.store(f"w{i}", shared)
    index.store("w0", [14])
    index.remove_worker("w0")  # an inline holder of the overflow rows
    index.remove_worker("w4")  # an overflow holder
    assert index.match(shared) == {f"w{i}": 3 for i in (1, 2, 3, 5)}
    index.store("w6", [11])  # takes a freed slot
    index.store("w7", [])
    assert index.match(shared) == {**{f"w{i}": 3 for i in (1, 2, 3, 5)}, "w6": 1}
    assert index.match([14]) == {} and index.num_blocks("w7") == 0
    assert index.num_block_entries == 4 * 3 + 1
    assert index.entries_by_worker()["w6"].tolist() == [11]


def test_a_block_every_worker_holds_is_matched_for_each() -> None:
    index = KVIndex()
    system_prompt = list(range(100, 108))
    for i in range(300):
        index.store(f"w{i}", system_prompt)
    index.store("w7", [200])
    assert index.match([*system_prompt, 200]) == {**{f"w{i}": 8 for i in range(300)}, "w7": 9}
    index.remove("w7", [103])
    assert index.match(system_prompt)["w7"] == 3


def test_memory_grows_with_entries_and_comes_back() -> None:
    index = KVIndex()
    empty_bytes = index.approx_memory_bytes()
    assert empty_bytes < 64 * 1024
    index.store("w0", range(100_000))
    full_bytes = index.approx_memory_bytes()
    assert 100_000 * 14 < full_bytes < 100_000 * 64  # at least the key and a holder: honest, and compact
    index.store("w1", range(50_000))  # a second holder goes inline: no new rows
    assert index.approx_memory_bytes() < full_bytes + 1_000  # w1's name and counters
    index.remove_worker("w0")
    index.remove_worker("w1")
    assert index.num_block_entries == 0 and index.approx_memory_bytes() < 2 * empty_bytes


def test_the_oldest_are_forgotten_first_across_many_stores() -> None:
    index = KVIndex(max_blocks_per_worker=1_000)
    for start in range(0, 10_000, 10):
        index.store("w0", range(start, start + 10))
    index.store("w0", [5_000])  # forgotten long ago: stored again, the newest
    assert index.num_blocks("w0") == 1_000 and index.num_evicted_over_bound == 9_001
    assert index.entries_by_worker()["w0"].tolist() == [5_000, *range(9_001, 10_000)]


def test_hashes_outside_64_bits_are_refused_and_never_match() -> None:
    index = KVIndex()
    index.store("w0", [2**64 - 1])
    with pytest.raises(ValueError):
        index.store("w0", [2**64])
    with pytest.raises(ValueError):
        index.store("w0", [-1])
    assert index.match([-1]) == {} and index.match([2**64 - 1 + 2**64]) == {}
    index.remove("w0", [-1])
    assert index.match([2**64 - 1]) == {"w0": 1} and index.num_block_entries == 1
    index.remove("w0", iter([-1, 2**64 - 1]))  # the others in a batch still go, from any iterable
    assert index.match([2**64 - 1]) == {} and index.num_block_entries == 0


def test_hashes_crowding_one_home_slot_are_indexed() -> None:
    index = KVIndex()
    # Low bits all ones: one home slot, the last, and a run longer than the table's spare end.
    crowded = [k << 32 | 0xFFFF_FFFF for k in range(600)]
    index.store("w0", crowded)
    index.store("w1", crowded[::2])
    assert index.match(crowded[:10]) == {"w0": 10, "w1": 1}
    assert index.match(crowded[::-1][:3]) == {"w0": 3}
    others = list(range(1_000))
    index.store("w2", others)  # the table doubles with the long run at its end
    assert index.match(crowded[:10]) == {"w0": 10, "w1": 1} and index.match(others) == {"w2": 1_000}
    index.remove("w0", crowded[1:])
    assert index.match(crowded[:2]) == {"w0": 1, "w1": 1} and index.num_block_entries == 1 + 300 + 1_000
    assert index.entries_by_worker()["w1"].tolist() == sorted(crowded[::2])


def test_match_by_slot_agrees_with_match_for_few_and_many_holders() -> None:
    index = KVIndex()
    shared = [11, 12, 13]
    for w in range(300):  # a system prompt every worker holds: far past the bitwise credit
        index.store(f"w{w}", shared + ([100 + w] if w % 3 == 0 else []))
    index.store("w7", [*shared, 99, 98])
    for prompt in ([*shared, 99, 98, 97], [*shared, 100], [5, 6], []):
        by_slot = index.match_by_slot(prompt)
        expected = index.match(prompt)
        assert {w: int(by_slot[index.slot_of(w)]) for w in index.workers() if by_slot[index.slot_of(w)]} == expected
    version = index.slots_version
    index.remove_worker("w7")
    assert index.slot_of("w7") == 0 and index.slots_version != version
    assert index.num_blocks_by_slot()[index.slot_of("w8")] == index.num_blocks("w8") == 3


def test_overflow_bitsets_follow_rows_through_compaction() -> None:
    """Rows with more holders than fit inline keep their holders in bitsets for the compiled lookup;
    when most rows go, the rows are renumbered and so are the bitsets, and every match stays right."""
    index = KVIndex()
    shared = [1_000 + i for i in range(100)]  # 100 overflow rows: the bitsets grow past their start
    for i in range(5):
        index.store(f"w{i}", shared)
    index.store("w0", range(5_000, 7_000))  # rows to compact away later
    index.store("w9", [*shared[:10], 99])
    grown = len(index._overflow_bits.bits)
    assert grown >= 100
    # The first half of the overflow rows (the first bitset rows) lose their fourth and fifth holders:
    # the other half's bitsets move down when most rows go and the arrays are compacted.
    index.remove("w1", shared[:50])
    index.remove("w2", shared[:50])
    index.remove("w0", range(5_000, 7_000))
    assert len(index._overflow_bits.bits) < grown and len(index._overflow) == 60  # shared[:10] (w9) and [50:]
    assert index.match([*shared, 99]) == {"w0": 100, "w3": 100, "w4": 100, "w9": 10}
    assert index.match(shared[60:]) == {f"w{i}": 40 for i in range(5)}
    index.store("w1", shared[:50])  # overflow again, in reused bitset rows
    assert index.match(shared) == {"w0": 100, "w1": 100, "w3": 100, "w4": 100, "w9": 10}
