"""BlockManager: exact block ids and free-queue order, errors, forks, invariants, stateful."""

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxkv.blocks.block_manager import BlockManager
from jaxkv.config import CacheConfig


def test_cache_config_validation():
    assert CacheConfig(num_blocks=4).block_size == 16
    assert CacheConfig(num_blocks=4).num_usable_blocks == 3
    with pytest.raises(ValueError, match="num_blocks"):
        CacheConfig(num_blocks=1)
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="num_blocks \\* block_size"):
        CacheConfig(num_blocks=2**27, block_size=16)


def test_fresh_pool():
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.num_free_blocks == 5
    assert bm.free_block_ids() == (1, 2, 3, 4, 5)
    assert bm.usage() == 0.0
    bm.check_invariants()
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=1, block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(num_blocks=4, block_size=0)


def test_interleaved_growth_and_reuse_order():
    bm = BlockManager(num_blocks=10, block_size=4)
    assert bm.allocate("a", 5) == (1, 2)
    assert bm.allocate("b", 3) == (3,)
    assert bm.append_slots("a", 9) == (1, 2, 4)
    assert bm.append_slots("b", 8) == (3, 5)
    assert bm.append_slots("b", 8) == (3, 5)  # room already: no-op
    assert bm.append_slots("b", 2) == (3, 5)  # never shrinks
    bm.check_invariants()
    assert bm.num_free_blocks == 4
    assert bm.usage() == pytest.approx(5 / 9)

    bm.free("a")  # joins the tail in reverse order: the table's tail is reused first
    assert bm.free_block_ids() == (6, 7, 8, 9, 4, 2, 1)
    assert "a" not in bm and "b" in bm
    bm.check_invariants()
    assert bm.allocate("c", 12) == (6, 7, 8)
    assert bm.allocate("d", 1) == (9,)
    assert bm.allocate("e", 8) == (4, 2)
    assert bm.block_table("e") == (4, 2)
    assert bm.request_ids() == ("b", "c", "d", "e")
    assert bm.free_block_ids() == (1,)
    bm.check_invariants()


def test_errors_change_nothing():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 3)
    with pytest.raises(ValueError, match="request_id='a' already has"):
        bm.allocate("a", 1)
    with pytest.raises(ValueError, match="num_tokens=0"):
        bm.allocate("b", 0)
    with pytest.raises(ValueError, match="num_tokens=5 needs 3 more blocks but only 1 are free"):
        bm.allocate("b", 5)
    with pytest.raises(ValueError, match="new_total_tokens=7 needs 2 more blocks"):
        bm.append_slots("a", 7)
    for method in (bm.block_table, bm.free):
        with pytest.raises(ValueError, match="request_id='zz' has no block table"):
            method("zz")
    with pytest.raises(ValueError, match="has no block table"):
        bm.can_append_slots("zz", 1)
    assert bm.block_table("a") == (1, 2)
    assert bm.free_block_ids() == (3,)
    assert bm.can_allocate(2) and not bm.can_allocate(3)
    assert bm.can_append_slots("a", 6) and not bm.can_append_slots("a", 7)
    bm.check_invariants()


def test_fork_shares_blocks_until_both_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("x", 2)
    bm.allocate("p", 6)
    assert bm.fork("p", "c") == (2, 3)
    with pytest.raises(ValueError, match="child_id='c' already has"):
        bm.fork("p", "c")
    with pytest.raises(ValueError, match="request_id='nope'"):
        bm.fork("nope", "d")
    bm.check_invariants()
    assert bm.num_free_blocks == 4
    bm.free("p")
    assert bm.num_free_blocks == 4  # still referenced by the child
    bm.check_invariants()
    assert bm.append_slots("c", 9) == (2, 3, 4)
    bm.free("c")
    assert bm.free_block_ids() == (5, 6, 7, 4, 3, 2)
    bm.check_invariants()


def test_copy_is_independent():
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.allocate("a", 3)
    snap = bm.copy()
    bm.free("a")
    bm.allocate("b", 2)
    assert snap.block_table("a") == (1, 2)
    assert "b" not in snap
    assert snap.free_block_ids() == (3, 4, 5)
    snap.check_invariants()
    bm.check_invariants()


def test_check_invariants_catches_corruption():
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.allocate("a", 3)
    bad = bm.copy()
    bad._ref[1] = 2
    with pytest.raises(AssertionError, match="ref counts"):
        bad.check_invariants()
    bad = bm.copy()
    bad._tables["b"] = ((6,),)
    with pytest.raises(AssertionError, match="out of"):
        bad.check_invariants()
    bad = bm.copy()
    bad._num_free += 1
    with pytest.raises(AssertionError, match="free queue holds"):
        bad.check_invariants()


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / grow / fork / free against a model of table lengths and sharing."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=9, block_size=3)
        self.tokens = {}  # request id -> tokens its table must hold
        self.next_id = 0

    @rule(num_tokens=st.integers(1, 12))
    def allocate(self, num_tokens):
        rid, self.next_id = self.next_id, self.next_id + 1
        if self.bm.can_allocate(num_tokens):
            assert len(self.bm.allocate(rid, num_tokens)) == -(-num_tokens // 3)
            self.tokens[rid] = num_tokens
        else:
            with pytest.raises(ValueError):
                self.bm.allocate(rid, num_tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.integers(0, 7))
    def grow(self, data, extra):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        total = self.tokens[rid] + extra
        before = self.bm.block_table(rid)
        if self.bm.can_append_slots(rid, total):
            table = self.bm.append_slots(rid, total)
            assert table[:len(before)] == before and len(table) == max(len(before), -(-total // 3))
            self.tokens[rid] = total
        else:
            with pytest.raises(ValueError):
                self.bm.append_slots(rid, total)
            assert self.bm.block_table(rid) == before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        rid, self.next_id = self.next_id, self.next_id + 1
        assert self.bm.fork(parent, rid) == self.bm.block_table(parent)
        self.tokens[rid] = len(self.bm.block_table(parent)) * 3

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(rid)
        del self.tokens[rid]

    @invariant()
    def consistent(self):
        self.bm.check_invariants()

    def teardown(self):
        for rid in list(self.tokens):
            self.bm.free(rid)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == 8


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
