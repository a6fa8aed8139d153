"""The hybrid KV cache's host side: layer groups (vLLM's uniform-page grouping), a sliding
group's blocks given back exactly as they leave its window, prefix hits every group can serve
(the fixed point), forks, swaps and rewinds per group; exact block ids throughout."""

import pytest

from jaxkv.blocks.block_manager import NULL_BLOCK, BlockManager
from jaxkv.config import CacheConfig, SchedulerConfig
from jaxkv.config.kv_groups import KVGroups
from jaxkv.sched.scheduler import add_request, check_invariants, schedule, update
from jaxkv.sched.state import Request, StopSpec, init_state


def test_gemma3_layers_group_like_vllm():
    """26 layers, 5 sliding : 1 full: one full group of 4 and the 22 sliding layers in 6 groups
    of <= 4, every 6th layer (strided), over 4 pool slots."""
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
    g = KVGroups.from_windows(windows)
    assert g.windows == (None,) + (512,) * 6
    assert g.layers[0] == (5, 11, 17, 23)
    assert g.layers[1:] == ((0, 7, 14, 21), (1, 8, 15, 22), (2, 9, 16, 24), (3, 10, 18, 25),
                            (4, 12, 19), (6, 13, 20))
    assert g.num_slots(26) == 4
    assert [g.place(i) for i in (5, 0, 8, 20)] == [(0, 0), (1, 0), (2, 1), (6, 2)]
    assert sorted(i for ls in g.layers for i in ls) == list(range(26))


def test_equal_buckets_pad_to_the_larger_and_one_kind_is_one_group():
    """gpt-oss (alternating, 12 + 12): two groups of 12; 12 full + 11 sliding (< 1.5x): two
    groups of 12 slots (one padded); a single kind: one group, every layer its own slot."""
    g = KVGroups.from_windows([128 if i % 2 == 0 else None for i in range(24)])
    assert g.windows == (None, 128) and g.layers[1] == tuple(range(0, 24, 2))
    g = KVGroups.from_windows([None] * 12 + [64] * 11)
    assert g.windows == (None, 64) and g.num_slots(23) == 12
    one = KVGroups.from_windows([4096] * 8)
    assert not one.hybrid and one.num_slots(8) == 8 and one.place(3) == (0, 3)
    with pytest.raises(ValueError, match="sliding_window"):
        KVGroups((None, 0))


def test_sliding_group_gives_back_blocks_exactly_as_they_leave_the_window():
    """Block 4 (positions 0-3) leaves window 8 when the query reaches position 11 (it sees
    4..11); then block 5 at 16 (sees 9..16). Group 0 (full) keeps everything; without a prefix cache freed blocks
    join the queue's tail."""
    bm = BlockManager(num_blocks=20, block_size=4, windows=(None, 8))
    bm.allocate("a", 12)
    assert bm.block_tables("a") == ((1, 2, 3), (4, 5, 6))
    assert bm.release_window("a", 10) == 0          # the query at 10 still sees position 3
    assert bm.release_window("a", 11) == 1
    assert bm.block_tables("a") == ((1, 2, 3), (NULL_BLOCK, 5, 6))
    assert bm.free_block_ids()[-1] == 4
    bm.append_slots("a", 16)
    assert bm.block_tables("a") == ((1, 2, 3, 7), (NULL_BLOCK, 5, 6, 8))
    assert bm.release_window("a", 16) == 1 and bm.block_table("a") == (1, 2, 3, 7)
    assert bm.block_tables("a")[1] == (NULL_BLOCK, NULL_BLOCK, 6, 8)
    assert bm.blocks_per_group() == (4, 2)
    bm.check_invariants()
    bm.free("a")
    assert bm.num_free_blocks == 19
    bm.check_invariants()


def test_hit_is_the_longest_prefix_every_group_serves():
    """A 20-token prompt registered in both groups (window 6, blocks of 4): a later prompt
    hits all 5 blocks, the sliding group only its window's 2; with the sliding group's block 4
    evicted, no hit can end after it, and 4 blocks (window blocks 2, 3) are what both serve."""
    bm = BlockManager(num_blocks=40, block_size=4, prefix_caching="hash", windows=(None, 6))
    prompt = tuple(range(100, 121))
    bm.allocate("a", 20)
    bm.register("a", prompt[:20])
    full, sliding = bm.block_tables("a")
    bm.free("a")
    blocks, keys, partial = bm.lookup(prompt[:20])
    assert blocks == full and len(keys) == 5 and partial is None
    bm.allocate_cached("b", 21, blocks, keys, None)
    assert bm.block_tables("b")[0][:5] == full
    assert bm.block_tables("b")[1][:5] == (NULL_BLOCK, NULL_BLOCK, NULL_BLOCK) + sliding[3:]
    bm.check_invariants()
    bm.free("b")
    bm.prefix_cache.evict(sliding[4])
    blocks, keys, _ = bm.lookup(prompt[:20])
    assert blocks == full[:4]
    assert bm.can_allocate_cached(17, blocks, None, keys=keys)
    bm.allocate_cached("c", 17, blocks, keys, None)
    assert bm.block_tables("c")[1][:4] == (NULL_BLOCK, NULL_BLOCK) + sliding[2:4]
    bm.check_invariants()


def test_fork_swap_layout_and_rewind_cover_every_group():
    bm = BlockManager(num_blocks=30, block_size=2, windows=(None, 3))
    bm.allocate("a", 6)
    bm.release_window("a", 6)                       # sees 4, 5: block 0 and 1 go
    assert bm.block_tables("a") == ((1, 2, 3), (0, 0, 6))
    bm.fork("a", "b")
    assert bm.copy_on_write("b", 5) == ((3, 7), (6, 8))
    assert bm.block_tables("b") == ((1, 2, 7), (0, 0, 8))
    flat = bm.flat_table("b")
    kept = [b != NULL_BLOCK for b in flat]
    bm.free("b")
    placed = bm.allocate_layout("b", kept, 8)       # back from the host, room for 2 more tokens
    tables = bm.block_tables("b")
    assert placed == tables[0][:3] + tables[1][:3]  # where each kept entry's swap-in goes
    assert [len(t) for t in tables] == [4, 4] and tables[1][:2] == (0, 0)
    bm.append_slots("b", 10)
    free = bm.free_block_ids()
    bm.truncate("b", 8)                             # rejected drafts: the queue as before
    assert bm.free_block_ids()[2:] == free
    bm.check_invariants()


def test_scheduler_holds_windows_not_whole_sequences():
    """A 100-token generation with window 8: the sliding group's table keeps at most the
    window's blocks plus a step's, the full group all of them; the scheduler's invariants
    (nothing inside a window is gone) hold at every step."""
    cc = CacheConfig(block_size=4, num_blocks=80, kv_groups=KVGroups((None, 8, 8)))
    sc = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=128)
    state = add_request(init_state(cc), Request(request_id="a", prompt_token_ids=tuple(range(20)),
                                                stop=StopSpec(max_tokens=100)), sc)
    peak = 0
    while state.requests:
        state, plan = schedule(state, sc)
        check_invariants(state, sc)
        if "a" in state.block_manager:
            held = state.block_manager.blocks_per_group()
            peak = max(peak, held[1])
            assert held[1] == held[2]
        state = update(state, plan, [7] * len(plan.seqs))
    assert peak <= (8 - 1 + 8) // 4 + 2
    assert state.block_manager.num_free_blocks == 79


@pytest.mark.parametrize("fields,message", [
    (dict(layer_types=("sliding_attention", "chunked_attention")), "layer_types=.*must name one of"),
    (dict(layer_types=("sliding_attention",)), "layer_types=.*for each of num_layers=2"),
    (dict(sliding_window=0), "sliding_window=0 must be >= 1"),
    (dict(num_experts=4, num_experts_per_tok=5), r"num_experts_per_tok=5 must be in \[1, "),
])
def test_bad_layer_kinds_are_refused_naming_the_field(fields, message):
    from jaxkv.model.config import ModelConfig
    base = dict(architecture="gemma3_text", vocab_size=64, hidden_size=32, intermediate_size=64,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=16)
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**base, **fields})
