"""BlockManager: block tables, ref counts, the free list and the chained-hash prefix cache."""

import pytest

import cache.blocks
from cache.blocks import BlockManager
from request import Request, SamplingParams


def make_request(token_ids: list[int], request_id: str = "r") -> Request:
    return Request(request_id, list(token_ids), SamplingParams(temperature=0.0))


def admit(bm: BlockManager, request: Request, num_new: int | None = None) -> int:
    """What the scheduler does at admission: cached prefix, then slots for the rest."""
    cached = bm.allocate(request)
    request.num_computed_tokens = cached
    num_new = request.num_tokens - cached if num_new is None else num_new
    assert bm.can_append(request, num_new)
    bm.append_slots(request, num_new)
    return cached


def compute(bm: BlockManager, request: Request, num_new: int) -> None:
    """What update() does after the runner wrote num_new tokens."""
    request.num_computed_tokens += num_new
    bm.cache_full_blocks(request)


def assert_all_free(bm: BlockManager) -> None:
    assert bm.num_free_blocks == bm.num_blocks
    assert all(block.ref_count == 0 for block in bm.blocks)


def test_append_slots_covers_exactly_the_computed_and_new_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    request = make_request(range(10))
    admit(bm, request, num_new=5)
    assert len(request.block_table) == 2
    compute(bm, request, 5)
    bm.append_slots(request, 3)  # tokens 0..7: still two blocks
    assert len(request.block_table) == 2
    bm.append_slots(request, 4)  # tokens 0..8
    assert len(request.block_table) == 3
    assert len(set(request.block_table)) == 3
    assert bm.num_free_blocks == 5


def test_can_append_refuses_more_blocks_than_are_free():
    bm = BlockManager(num_blocks=3, block_size=4)
    request = make_request(range(20))
    assert bm.can_append(request, 12)
    assert not bm.can_append(request, 13)


def test_free_returns_every_block_and_zeroes_ref_counts():
    bm = BlockManager(num_blocks=6, block_size=4)
    requests = [make_request(range(i * 100, i * 100 + 7), f"r{i}") for i in range(3)]
    for request in requests:
        admit(bm, request)
        compute(bm, request, 7)
    assert bm.num_free_blocks == 0
    for request in requests:
        bm.free(request)
        assert request.block_table == []
    assert_all_free(bm)


def test_prefix_hit_shares_full_computed_blocks_with_ref_counts():
    bm = BlockManager(num_blocks=10, block_size=4)
    first = make_request(list(range(10)), "a")
    admit(bm, first)
    compute(bm, first, 10)
    second = make_request(list(range(9)) + [99], "b")
    cached = admit(bm, second)
    assert cached == 8
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    assert [bm.blocks[b].ref_count for b in second.block_table] == [2, 2, 1]
    bm.free(first)
    bm.free(second)
    assert_all_free(bm)


def test_same_tokens_under_a_different_parent_block_miss():
    bm = BlockManager(num_blocks=12, block_size=4)
    first = make_request([1, 2, 3, 4, 5, 6, 7, 8, 0], "a")
    admit(bm, first)
    compute(bm, first, 9)
    second = make_request([9, 9, 9, 9, 5, 6, 7, 8, 0], "b")  # block 1 equal, its parent differs
    assert admit(bm, second) == 0
    compute(bm, second, 9)
    assert set(second.block_table).isdisjoint(first.block_table)
    third = make_request([9, 9, 9, 9, 5, 6, 7, 8, 1], "c")  # the hit follows its own parent chain
    assert admit(bm, third) == 8
    assert third.block_table[:2] == second.block_table[:2]


def test_hit_is_confirmed_by_comparing_tokens(monkeypatch):
    monkeypatch.setattr(cache.blocks, "block_hash", lambda parent, token_ids: b"collision")
    bm = BlockManager(num_blocks=10, block_size=4)
    first = make_request([1, 2, 3, 4, 0], "a")
    admit(bm, first)
    compute(bm, first, 5)
    assert admit(bm, make_request([5, 6, 7, 8, 0], "b")) == 0
    assert admit(bm, make_request([1, 2, 3, 4, 0], "c")) == 4


def test_never_caches_the_whole_sequence_so_one_token_is_computed():
    bm = BlockManager(num_blocks=10, block_size=4)
    first = make_request(range(8), "a")
    admit(bm, first)
    compute(bm, first, 8)
    second = make_request(range(8), "b")
    assert admit(bm, second) == 4
    assert second.num_tokens - second.num_computed_tokens == 4


def test_freed_block_stays_findable_until_reused_for_other_content():
    bm = BlockManager(num_blocks=4, block_size=4)
    first = make_request(range(9), "a")
    admit(bm, first)
    compute(bm, first, 9)
    bm.free(first)
    assert_all_free(bm)
    again = make_request(range(9), "b")
    assert admit(bm, again) == 8
    bm.free(again)
    # Four fresh blocks for other content evict every cached block.
    other = make_request(range(100, 116), "c")
    admit(bm, other)
    bm.free(other)
    assert bm.hash_to_block_id == {}
    assert admit(bm, make_request(range(9), "d")) == 0


def test_uncached_free_blocks_are_reused_before_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=4)
    first = make_request(range(6), "a")  # one full cached block, one partial block
    admit(bm, first)
    compute(bm, first, 6)
    cached_block = first.block_table[0]
    bm.free(first)
    third = make_request(range(50, 62), "b")  # needs three of the four blocks
    admit(bm, third)
    assert cached_block not in third.block_table
    bm.free(third)
    assert admit(bm, make_request(range(6), "c")) == 4


def test_identical_blocks_computed_concurrently_stay_consistent():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_request(range(9), "a"), make_request(range(9), "b")
    admit(bm, a)
    admit(bm, b)  # nothing computed yet: a miss, so b computes its own copy
    assert set(a.block_table).isdisjoint(b.block_table)
    compute(bm, a, 9)
    compute(bm, b, 9)
    assert bm.blocks[b.block_table[1]].hash == bm.blocks[a.block_table[1]].hash
    bm.free(b)
    other = make_request(range(100, 116), "c")  # may reuse b's duplicate blocks
    admit(bm, other)
    late = make_request(range(9), "d")
    assert admit(bm, late) == 8
    assert late.block_table[:2] == a.block_table[:2]
    for request in (a, other, late):
        bm.free(request)
    assert_all_free(bm)


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    first = make_request(range(9), "a")
    admit(bm, first)
    compute(bm, first, 9)
    bm.free(first)
    assert admit(bm, make_request(range(9), "b")) == 0
    assert bm.hash_to_block_id == {}


@pytest.mark.parametrize("kwargs", [{"num_blocks": 0}, {"num_blocks": 4, "block_size": 0}])
def test_invalid_sizes_raise_naming_the_field(kwargs):
    field = "block_size" if "block_size" in kwargs else "num_blocks"
    with pytest.raises(ValueError, match=field):
        BlockManager(**kwargs)
