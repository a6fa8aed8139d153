"""The host KV tier (issue 14): demoted prefix blocks, swap preemption, the persistent cache.

* ``HostTier`` bookkeeping: LRU order, busy slots, deferred frees, swapped sequences.
* ``kv_transfer``: a block unit out to a host row and back is bit-exact in every format.
* The pure scheduler: block-manager evictions drive the demotions and a host hit promotes,
  with exact block ids and host slots; swap preemption's copies out and back name exactly the
  victim's blocks; a hypothesis state machine over the device + host tiers with the
  invariants after every step (2,000 examples per setting in the slow run), and the two
  falsifying runs it found (issue 48) as explicit tests.
* The engine on the tiny model: outputs with the tier, with swap / recompute / auto
  preemption, after a restart on the same ``kv_cache_dir``, and with a corrupt file are
  token-identical to an unconstrained run; salts never cross tiers, and a request's hits are
  those of a twin run where the other salt shares no token.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, rule,
                                 run_state_machine_as_test)

from jaxkv import LLM, SamplingParams
from jaxkv.blocks.host_tier import NO_SLOT, HostTier, SwapCostModel
from jaxkv.blocks.prefix_cache import PrefixCache, group_key
from jaxkv.config import CacheConfig, SchedulerConfig
from jaxkv.config.kv_groups import KVGroups
from jaxkv.kvcache.disk_store import DiskKVStore, KVCacheFileError, decode, encode, namespace
from jaxkv.kvcache.host_pool import HostKVPool, block_units
from jaxkv.kvcache.pages import init_cache
from jaxkv.kvcache.spec import KVCacheSpec
from jaxkv.sched.scheduler import abort, add_request, check_invariants, schedule, update
from jaxkv.sched.state import Request, StopSpec, init_state, with_cost_model
from tiny_models import TINY_ENGINE

# ---------------------------------------------------------------------------- HostTier


def test_host_tier_lru_busy_and_deferred_slots():
    host = HostTier(3)
    assert [host.demote(k, b) for k, b in (("a", 7), ("b", 8), ("c", 9))] == [
        (7, 0, "a"), (8, 1, "b"), (9, 2, "c")]
    assert host.demote("a", 5) is None            # already held: now most recently used
    host.begin_plan()
    assert host.find("b") == 1                    # busy this plan
    assert host.demote("d", 4) == (4, 2, "d")     # evicts "c": "b" is busy, "a" is newer
    assert "c" not in host and host.find("c") is None
    assert host.demote("e", 3) == (3, 0, "e")     # then "a"'s slot; never the busy "b"
    assert host.demote("f", 2) is None            # "d", "e" are written by this plan
    assert "a" not in host and "b" in host
    host.check_invariants()
    host.begin_plan()
    assert host.demote("g", 1) == (1, 1, "g")     # "b" is evictable again next plan (LRU)
    host.check_invariants()
    full = HostTier(1)
    full.demote("x", 1)
    full.begin_plan()
    full.find("x")
    assert full.demote("y", 2) is None            # the only slot is busy: not demoted


def test_host_tier_indexes_radix_nodes_and_a_partial_block_takes_only_a_free_slot():
    host = HostTier(3)
    assert host.demote("f", 1, ("root", (1, 2, 3, 4))) == (1, 0, "f")
    assert host.demote("p", 2, ("root", (1, 2, 9)), partial=True) == (2, 1, None)
    assert host.partial("root", (1, 2, 9, 9)) == ("p", 3)
    assert host.partial("root", (1, 2, 3, 7)) == ("f", 3)
    assert host.partial("root", (1, 2, 5)) == ("f", 2)  # the first of equals
    assert host.partial("other", (1, 2)) is None and host.partial("root", (7,)) is None
    assert host.demote("g", 3) == (3, 2, "g")            # hash mode: no node
    host.begin_plan()
    assert host.demote("q", 4, ("f", (5,)), partial=True) is None   # no free slot
    assert host.demote("h", 5) == (5, 0, "h")            # a full block evicts "f" (LRU)
    assert host.partial("root", (1, 2, 3)) == ("p", 2)   # "f" left the index with its slot
    host.check_invariants()
    host.reset_prefix()
    assert host.partial("root", (1, 2, 9)) is None
    host.check_invariants()


def test_host_tier_swapped_slots_are_never_evicted_and_free_only_next_plan():
    host = HostTier(4)
    host.demote("p", 1)
    host.begin_plan()
    ops = host.swap_out("r", (5, 0, 6))           # a dropped (null) entry needs no slot
    assert ops == ((5, 1, None), (6, 2, None))
    assert host.swapped("r") == (1, NO_SLOT, 2)
    assert host.swap_out("q", (7, 8, 9)) is None  # 1 free + "p" < 3: nothing changes
    assert host.swapped("q") is None and "p" in host
    assert host.available() == 2 and host.num_swapped_blocks == 2
    host.begin_plan()
    assert host.swap_in("r") == (1, NO_SLOT, 2)
    assert host.num_free_slots == 1               # slots 1, 2 are read by this plan's swap-ins
    assert host.demote("x", 3) == (3, 3, "x")
    assert host.demote("y", 4) == (4, 0, "y")     # "p"'s slot (LRU), not 1 or 2
    assert host.demote("z", 5) is None            # "x", "y" are written by this plan
    assert "p" not in host
    host.check_invariants()
    host.begin_plan()
    assert host.num_free_slots == 2
    host.swap_out("s", (1,))
    with pytest.raises(ValueError, match="request_id='s' is already swapped out"):
        host.swap_out("s", (1,))


def test_cost_model_prefers_recompute_until_measured():
    cost = SwapCostModel(block_bytes=1000)
    assert not cost.prefers_swap(4, 10_000)
    cost = dataclasses.replace(cost, d2h_bytes_per_s=1e6, h2d_bytes_per_s=1e6,
                               prefill_tokens_per_s=1000.0)
    assert cost.swap_seconds(4) == pytest.approx(0.008, rel=1e-9)
    assert cost.prefers_swap(4, 9) and not cost.prefers_swap(4, 8)


# ---------------------------------------------------------------------------- units


def _random_cache(spec, seed=0):
    leaves, tree = jax.tree_util.tree_flatten(init_cache(spec))
    key = jax.random.PRNGKey(seed)
    out = []
    for i, leaf in enumerate(leaves):
        k = jax.random.fold_in(key, i)
        if leaf.dtype == jnp.bool_:
            out.append(jax.random.bernoulli(k, 0.5, leaf.shape))
        elif jnp.issubdtype(leaf.dtype, jnp.floating):
            out.append(jax.random.normal(k, leaf.shape).astype(leaf.dtype))
        else:
            out.append(jax.random.randint(k, leaf.shape, 0, 100).astype(leaf.dtype))
    return jax.tree_util.tree_unflatten(tree, out)


@pytest.mark.parametrize("staging", ["none", "pinned_host"])
@pytest.mark.parametrize("fmt,bounds", [("fp32", False), ("bf16", True), ("fp8_e4m3", False),
                                        ("int8", True), ("int4", False), ("int2", False)])
def test_block_units_round_trip_bit_exact(fmt, bounds, staging):
    kivi = fmt in ("int4", "int2")
    spec = KVCacheSpec(num_layers=2, num_blocks=9, block_size=4, num_kv_heads=2, head_dim=8,
                       dtype="float32", kv_cache_dtype=fmt, key_bounds=bounds,
                       num_residual_slots=5)
    cache = _random_cache(spec)
    pool = HostKVPool(cache, 6, staging=staging)
    assert pool.staging == staging
    src, slots, dst = [3, 5, 7], [4, 0, 2], [1, 2, 8]
    before = [np.asarray(a) for a in block_units(cache, jnp.asarray(src))]
    untouched = [np.asarray(a) for a in block_units(cache, jnp.asarray([4, 6]))]
    pool.swap_out(cache, src, slots)
    if staging == "pinned_host":   # the gather's outputs are host buffers
        assert {a.sharding.memory_kind for _, units in pool._pending for a in units} == \
            {"pinned_host"}
    pool.finish()
    # a row holds the unit's bytes, whatever the staging (the disk tier reads rows)
    plain = HostKVPool(cache, 6, staging="none")
    plain.swap_out(cache, src, slots)
    plain.finish()
    np.testing.assert_array_equal(pool.rows, plain.rows)
    cache = pool.swap_in(cache, slots, dst)
    after = [np.asarray(a) for a in block_units(cache, jnp.asarray(dst))]
    assert len(before) == len(after) > 0
    for x, y in zip(before, after):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(untouched, block_units(cache, jnp.asarray([4, 6]))):
        np.testing.assert_array_equal(x, np.asarray(y))
    if kivi:   # swapped-in blocks are read from their codes
        assert all(int(p.res_slot[b]) == 0 for p in cache.k for b in dst)


def test_host_pool_staging_is_checked():
    spec = KVCacheSpec(num_layers=1, num_blocks=3, block_size=4, num_kv_heads=1, head_dim=8,
                       dtype="float32")
    cache = _random_cache(spec)
    assert HostKVPool(cache, 2).staging == "none"     # auto on the CPU: its host memory
    with pytest.raises(ValueError, match="staging='pinned'"):
        HostKVPool(cache, 2, staging="pinned")


# ---------------------------------------------------------------------------- scheduler


def _configs(num_blocks, host_blocks, *, mode="recompute", prefix="hash", budget=64, seqs=4,
             windows=(None,)):
    return (CacheConfig(block_size=4, num_blocks=num_blocks, prefix_caching=prefix,
                        host_blocks=host_blocks, preemption_mode=mode,
                        kv_groups=KVGroups(windows)),
            SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=32))


def _req(rid, prompt, max_tokens=1, salt=None):
    return Request(request_id=rid, prompt_token_ids=tuple(prompt), cache_salt=salt,
                   stop=StopSpec(max_tokens=max_tokens))


def _step(state, sc):
    state, plan = schedule(state, sc)
    check_invariants(state, sc)
    state = update(state, plan, [1] * len(plan.seqs))
    check_invariants(state, sc)
    return state, plan


def _keys(tokens, salt=None, bs=4):
    pc = PrefixCache(bs)
    key, out = pc.root(salt), []
    for i in range(len(tokens) // bs):
        key = pc.key(key, tuple(tokens[i * bs:(i + 1) * bs]))
        out.append(key)
    return out


def test_evictions_demote_and_a_host_hit_promotes_with_exact_ids():
    cc, sc = _configs(num_blocks=9, host_blocks=4)
    a, b = list(range(100, 113)), list(range(200, 229))
    ka, kb = _keys(a), _keys(b)
    state = add_request(init_state(cc), _req("a", a), sc)
    state, plan = _step(state, sc)
    assert plan.seqs[0].block_table == (1, 2, 3, 4) and not plan.swap_out
    # free queue now 4 5 6 7 8 3 2 1 (a's cached blocks at the tail, reused last)
    state = add_request(state, _req("b", b), sc)
    state, plan = _step(state, sc)
    assert plan.seqs[0].block_table == (4, 5, 6, 7, 8, 3, 2, 1)
    assert plan.swap_out == ((3, 0, ka[2]), (2, 1, ka[1]), (1, 2, ka[0]))
    assert plan.num_hit_tokens == 0
    # free queue 1 2 3 8 7 6 5 4 (b's partial last block 1 first); a again: host hits
    state = add_request(state, _req("a2", a), sc)
    state, plan = _step(state, sc)
    (seq,) = plan.seqs
    assert seq.block_table == (1, 2, 3, 8) and seq.start_pos == 12
    assert plan.swap_in == ((2, 1), (1, 2), (0, 3))
    assert plan.num_hit_tokens == plan.num_host_hit_tokens == 12
    # reusing b's cached blocks 2, 3, 8: one free host slot; a's slots are busy this plan
    assert plan.swap_out == ((2, 3, kb[6]),)
    # the promoted blocks are in the device prefix cache now
    pc = state.block_manager.prefix_cache
    assert [pc.key_of_block(blk) for blk in (1, 2, 3)] == ka


def test_hybrid_groups_demote_and_promote_their_blocks_with_exact_ids():
    """A full group and a sliding one (window 6): evictions demote both groups' cached blocks
    under their group keys, and the host hit brings back the full group's every block and
    the sliding group's window only (from (12 - 6 + 1) // 4 = block 1 on)."""
    cc, sc = _configs(num_blocks=15, host_blocks=8, budget=12, windows=(None, 6))
    a, b = list(range(100, 113)), list(range(200, 225))
    ka = _keys(a)
    k1 = [group_key(k, 1) for k in ka]
    state = add_request(init_state(cc), _req("a", a), sc)
    state, plan = _step(state, sc)
    assert (plan.seqs[0].block_table, plan.seqs[0].group_tables) == ((1, 2, 3), ((4, 5, 6),))
    state = add_request(state, _req("b", b), sc)
    state, plan = _step(state, sc)      # b's first chunk
    state = add_request(state, _req("a2", a), sc)
    plans = []
    while not plans or plans[-1].seqs[0].request_id != "a2":   # b's last two chunks, then a2
        state, plan = _step(state, sc)
        plans.append(plan)
    assert len(plans) == 3 and [p.swap_out for p in plans[:2]] == [
        ((4, 0, k1[0]), (6, 1, k1[2]), (5, 2, k1[1]), (3, 3, ka[2])),
        ((2, 4, ka[1]), (1, 5, ka[0]))]
    (seq,) = plans[-1].seqs
    assert (seq.block_table, seq.group_tables, seq.start_pos) == ((2, 1, 12, 6),
                                                                  ((0, 14, 13, 3),), 12)
    assert plans[-1].swap_in == ((5, 2), (4, 1), (3, 12), (2, 14), (1, 13))
    assert plans[-1].num_hit_tokens == plans[-1].num_host_hit_tokens == 12
    pc = state.block_manager.prefix_cache
    assert [pc.find(k) for k in ka + k1[1:]] == [2, 1, 12, 14, 13]


def test_radix_partial_blocks_are_demoted_and_promoted_with_exact_ids():
    cc, sc = _configs(num_blocks=9, host_blocks=4, prefix="radix")
    a, b = list(range(100, 110)), list(range(200, 229))
    ka = _keys(a)
    state = add_request(init_state(cc), _req("a", a), sc)
    state, plan = _step(state, sc)
    assert plan.seqs[0].block_table == (1, 2, 3)
    # a frees (1, 2) full and 3 partial, cached as [108, 109]: free queue 3 4 5 6 7 8 2 1
    state = add_request(state, _req("b", b), sc)
    state, plan = _step(state, sc)
    assert plan.seqs[0].block_table == (3, 4, 5, 6, 7, 8, 2, 1)
    # the partial block 3 goes first, with no key (host only: never written to disk)
    assert plan.swap_out == ((3, 0, None), (2, 1, ka[1]), (1, 2, ka[0]))
    # a's history and two more tokens: two full host hits, then the partial [108, 109]
    state = add_request(state, _req("a2", a + [110, 111, 112]), sc)
    state, plan = _step(state, sc)
    (seq,) = plan.seqs
    assert seq.block_table == (1, 2, 8, 7) and seq.start_pos == 10
    assert plan.swap_in == ((2, 1), (1, 2), (0, 8))
    assert plan.num_hit_tokens == plan.num_host_hit_tokens == 10 and not plan.copy_ops
    # reusing b's partial block 1 ([228]) and full 2, 8, 7: only slot 3 is free, the rest busy
    assert plan.swap_out == ((1, 3, None),)
    # the promoted full blocks join the device cache; the partial one became a2's own block 8
    pc = state.block_manager.prefix_cache
    assert [pc.key_of_block(blk) for blk in (1, 2, 8)] == _keys(a + [110, 111])
    # hash mode caches no partial block: the same requests recompute tokens 8, 9
    cc, sc = _configs(num_blocks=9, host_blocks=4, prefix="hash")
    state = add_request(init_state(cc), _req("a", a), sc)
    state, _ = _step(state, sc)
    state = add_request(state, _req("b", b), sc)
    state, plan = _step(state, sc)
    assert plan.swap_out == ((2, 0, ka[1]), (1, 1, ka[0]))
    state = add_request(state, _req("a2", a + [110, 111, 112]), sc)
    state, plan = _step(state, sc)
    assert plan.seqs[0].start_pos == plan.num_host_hit_tokens == 8


def test_radix_partial_takes_the_longer_match_of_both_tiers_the_device_on_a_tie():
    cc, sc = _configs(num_blocks=9, host_blocks=4, prefix="radix")
    state = add_request(init_state(cc), _req("a", range(100, 110)), sc)
    state, _ = _step(state, sc)       # partial [108, 109] in block 3, head of the free queue
    state = add_request(state, _req("b", range(200, 204)), sc)
    state, plan = _step(state, sc)    # b takes block 3: the partial goes to host slot 0
    assert plan.swap_out == ((3, 0, None),)
    state = add_request(state, _req("c", list(range(100, 109)) + [300, 301]), sc)
    state, plan = _step(state, sc)    # the host's [108, 109] gives 1 token: [108]
    assert plan.seqs[0].start_pos == 9 and plan.swap_in == ((0, plan.seqs[0].block_table[2]),)
    assert plan.num_host_hit_tokens == 1
    # c freed [108, 300, 301] (3 tokens) on the device: for [108, 300] both tiers give one
    # token ([108] on the host) or two (the device): the longer, the device's, is copied
    state = add_request(state, _req("d", list(range(100, 109)) + [300, 400, 401]), sc)
    state, plan = _step(state, sc)
    assert plan.seqs[0].start_pos == 10 and plan.num_host_hit_tokens == 0
    assert len(plan.copy_ops) == 1 and not plan.swap_in
    # for [108, 999] both give one token: the device copy
    state = add_request(state, _req("f", list(range(100, 109)) + [999, 998]), sc)
    state, plan = _step(state, sc)
    assert plan.seqs[0].start_pos == 9 and len(plan.copy_ops) == 1 and not plan.swap_in
    # for [108, 109, 500]: the host's two tokens beat the device's one
    state = add_request(state, _req("e", list(range(100, 110)) + [500, 501]), sc)
    state, plan = _step(state, sc)
    assert plan.seqs[0].start_pos == 10 and plan.num_host_hit_tokens == 2
    assert not plan.copy_ops and plan.swap_in == ((0, plan.seqs[0].block_table[2]),)


def test_radix_salts_never_hit_each_others_host_partial_blocks():
    cc, sc = _configs(num_blocks=9, host_blocks=8, prefix="radix")
    a = list(range(100, 110))
    state = add_request(init_state(cc), _req("a", a, salt="t1"), sc)
    state, _ = _step(state, sc)
    state = add_request(state, _req("b", range(200, 229)), sc)
    state, plan = _step(state, sc)
    assert len(plan.swap_out) == 3 and plan.swap_out[0][2] is None   # the partial block
    state = add_request(state, _req("a-other-tenant", a + [110], salt="t2"), sc)
    state, plan = _step(state, sc)
    assert plan.num_hit_tokens == 0 and not plan.swap_in
    state = add_request(state, _req("a-same-tenant", a + [110], salt="t1"), sc)
    state, plan = _step(state, sc)
    assert plan.num_host_hit_tokens == 10


def test_salts_never_hit_each_others_host_blocks():
    cc, sc = _configs(num_blocks=9, host_blocks=8)
    a = list(range(100, 113))
    state = add_request(init_state(cc), _req("a", a, salt="t1"), sc)
    state, _ = _step(state, sc)
    state = add_request(state, _req("b", range(200, 229)), sc)
    state, plan = _step(state, sc)
    assert len(plan.swap_out) == 3
    state = add_request(state, _req("a-other-tenant", a, salt="t2"), sc)
    state, plan = _step(state, sc)
    assert plan.num_hit_tokens == 0 and not plan.swap_in
    state = add_request(state, _req("a-same-tenant", a, salt="t1"), sc)
    state, plan = _step(state, sc)
    assert plan.num_host_hit_tokens == 12


def test_swap_preemption_moves_exactly_the_victims_blocks():
    cc, sc = _configs(num_blocks=7, host_blocks=8, mode="swap", prefix=None)
    state = add_request(init_state(cc), _req("a", range(10, 17), max_tokens=10), sc)
    state = add_request(state, _req("b", range(20, 27), max_tokens=10), sc)
    tables, swapped_out = {}, None
    for _ in range(40):
        if not state.requests:
            break
        before = state
        state, plan = schedule(state, sc)
        check_invariants(state, sc)
        if plan.swapped_ids:
            (victim,) = plan.swapped_ids
            table = before.block_manager.block_table(victim)
            slots = state.host.swapped(victim)
            assert plan.swap_out == tuple((blk, s, None) for blk, s in zip(table, slots))
            assert state.requests[victim].swapped_tokens == before.requests[
                victim].num_computed_tokens
            swapped_out = (victim, slots, before.requests[victim].num_computed_tokens)
        if plan.swap_in:
            victim, slots, computed = swapped_out
            (seq,) = [s for s in plan.seqs if s.request_id == victim]
            assert seq.start_pos == computed
            assert plan.swap_in == tuple(zip(slots, seq.block_table))
            tables[victim] = seq.block_table
        state = update(state, plan, [1] * len(plan.seqs))
        check_invariants(state, sc)
    assert swapped_out is not None and tables
    assert not state.requests and state.host.num_free_slots == 8


def test_aborting_a_swapped_request_frees_its_host_slots():
    cc, sc = _configs(num_blocks=7, host_blocks=8, mode="swap", prefix=None)
    state = add_request(init_state(cc), _req("a", range(10, 17), max_tokens=10), sc)
    state = add_request(state, _req("b", range(20, 27), max_tokens=10), sc)
    while True:
        state, plan = schedule(state, sc)
        state = update(state, plan, [1] * len(plan.seqs))
        if plan.swapped_ids:
            break
    (victim,) = plan.swapped_ids
    assert state.host.swapped(victim) is not None
    state = abort(state, victim)
    check_invariants(state, sc)
    assert state.host.num_swapped_blocks == 0


def test_auto_mode_follows_the_cost_model():
    cc, sc = _configs(num_blocks=7, host_blocks=8, mode="auto", prefix=None)
    for rates, expect_swap in (((1e9, 1e9, 1.0), True), ((1.0, 1.0, 1e9), False)):
        state = init_state(cc)
        state = with_cost_model(state, SwapCostModel(1000, *rates))
        state = add_request(state, _req("a", range(10, 17), max_tokens=10), sc)
        state = add_request(state, _req("b", range(20, 27), max_tokens=10), sc)
        preempted = swapped = 0
        while state.requests:
            state, plan = schedule(state, sc)
            check_invariants(state, sc)
            preempted += len(plan.preempted_ids)
            swapped += len(plan.swapped_ids)
            state = update(state, plan, [1] * len(plan.seqs))
        assert preempted > 0 and swapped == (preempted if expect_swap else 0)


def test_a_radix_copy_source_is_not_a_swap_in_target_of_the_same_plan():
    """The falsifying run of the state machine (issue 48): r2, preempted, comes back with a
    device partial match copied from block 6 into its own 7; r3, admitted in the same plan,
    promotes r0's partial host block. 6 had gone back to the head of the free queue, so r3's
    swap-in took it, and since the runner applies swap-ins before block copies, r2 read r0's
    token 0 where its own tokens 58-60 belonged. The copy source is held until the plan ends."""
    cc, sc = _configs(num_blocks=9, host_blocks=1, mode="swap", prefix="radix", budget=12,
                      seqs=3)
    state = with_cost_model(init_state(cc), SwapCostModel(1, 1e9, 1e9, 1.0))
    state = add_request(state, _req("r0", [0]), sc)
    state = add_request(state, _req("r1", range(9), max_tokens=5, salt="s"), sc)
    for _ in range(3):
        state, _ = _step(state, sc)
    state = add_request(state, _req("r2", [*range(50, 62), *range(1002, 1007)]), sc)
    state = add_request(state, _req("r3", [0, 1]), sc)
    state, plan = _step(state, sc)
    assert plan.swap_out == ((1, 0, None),)    # r0's partial [0] to the host's only slot
    state, plan = _step(state, sc)
    assert plan.preempted_ids == ("r2",) and not plan.swapped_ids   # 3 blocks, 1 host slot
    state, plan = _step(state, sc)
    r2, r3 = plan.seqs
    assert r2.block_table == (1, 5, 7, 8, 4) and r2.start_pos == 11
    assert plan.copy_ops == ((6, 7),)          # [58, 59, 60] of r2's freed partial block 6
    assert r3.start_pos == 1 and plan.swap_in == ((0, 3),) and r3.block_table == (3,)


def test_a_device_partial_match_after_host_hits_is_copied_after_them():
    """The engine-level failure of issue 48 (swap + radix + host tier): full host hits, then a
    device partial match. The copy went to the first fresh block, the one the first host hit
    is swapped into, so the copy overwrote that block and the block after it was never filled."""
    cc, sc = _configs(num_blocks=12, host_blocks=4, prefix="radix", seqs=4)
    a = list(range(100, 108))
    state = add_request(init_state(cc), _req("r1", a + [1]), sc)
    state = add_request(state, _req("r2", a + [108, 109, 110, 111, 2], max_tokens=6), sc)
    state, plan = _step(state, sc)
    # r1 registers a in blocks 1, 2; r2 (same plan) computes a again in 4, 5, then registers
    # block 6 [108..111] as a child of a's key
    assert [s.block_table for s in plan.seqs] == [(1, 2, 3), (4, 5, 6, 7)]
    state = add_request(state, _req("b", range(200, 224)), sc)
    state, plan = _step(state, sc)        # b's sixth block evicts a's second (2) to the host
    assert plan.swap_out == ((3, 0, None), (2, 1, _keys(a)[1]))
    while state.requests:
        state, plan = _step(state, sc)    # r2 grows into block 1: a's first goes too
    state = add_request(state, _req("d", a + [108, 109, 999, 998]), sc)
    state, plan = _step(state, sc)
    (seq,) = plan.seqs
    assert seq.block_table == (4, 5, 1) and seq.start_pos == 10
    assert plan.swap_in == ((2, 4), (1, 5))   # a's two blocks promoted from the host
    assert plan.copy_ops == ((6, 1),)         # [108, 109] of block 6, after them


class TieredMachine(RuleBasedStateMachine):
    """Random adds (shared prefixes of any length, two salts), aborts and steps over a small
    device pool and a smaller host tier, swap or recompute preemption, one cache group or a
    hybrid cache's full and sliding groups; invariants after every step, and a shadow copy of
    every block's content: a hit (device or host, full or a radix partial match, in every
    group) must give exactly the KV the prompt's tokens would have computed."""

    @initialize(mode=st.sampled_from(["swap", "recompute", "auto"]),
                prefix=st.sampled_from(["hash", "radix"]), host=st.integers(1, 6),
                windows=st.sampled_from([(None,), (None,), (None, 6), (None, 5, 9)]))
    def setup(self, mode, prefix, host, windows):
        num_blocks = 1 + sum(8 if w is None else min(8, (w - 1 + 12) // 4 + 2) for w in windows)
        self.cc, self.sc = _configs(num_blocks=num_blocks, host_blocks=host * len(windows),
                                    mode=mode, prefix=prefix, budget=12, seqs=3,
                                    windows=windows)
        self.state = with_cost_model(init_state(self.cc), SwapCostModel(1, 1e9, 1e9, 1.0))
        self.device = {}   # block -> (group, salt, the tokens whose KV it holds, by position)
        self.host = {}     # slot -> the same
        self.n = 0

    @rule(base=st.integers(0, 1), shared=st.integers(1, 12), extra=st.integers(0, 8),
          max_tokens=st.integers(1, 6), salt=st.sampled_from([None, "s"]))
    def add(self, base, shared, extra, max_tokens, salt):
        prompt = tuple(range(base * 50, base * 50 + shared)) + tuple(
            range(1000 + self.n, 1000 + self.n + extra))
        self.state = add_request(self.state, _req(f"r{self.n}", prompt, max_tokens, salt), self.sc)
        self.n += 1

    @rule(data=st.data())
    def abort_one(self, data):
        if self.state.requests:
            rid = data.draw(st.sampled_from(sorted(self.state.requests)))
            self.state = abort(self.state, rid)

    @rule(n=st.integers(1, 4))
    def steps(self, n):
        for _ in range(n):
            self.step()
            check_invariants(self.state, self.sc)

    def step(self):
        state, plan = schedule(self.state, self.sc)
        bs = self.cc.block_size
        for block, slot, _ in plan.swap_out:            # 1. out
            self.host[slot] = self.device.get(block)
        for slot, block in plan.swap_in:                # 3. in (no disk here)
            self.device[block] = self.host[slot]
        for src, dst in plan.copy_ops:
            self.device[dst] = self.device.get(src)
        windows = self.cc.kv_groups.windows
        for seq in plan.seqs:   # what the step reads must be what these tokens compute
            rs = state.requests[seq.request_id]
            salt = rs.request.cache_salt
            for g, table in enumerate((seq.block_table, *seq.group_tables)):
                first = 0 if windows[g] is None else max(0, (seq.start_pos - windows[g] + 1) // bs)
                for j in range(first, seq.start_pos // bs):
                    want = (g, salt, rs.token_ids(0, (j + 1) * bs))
                    assert self.device.get(table[j]) == want, (seq.request_id, g, j, table[j])
                if seq.start_pos % bs:   # the block it resumes in: its first tokens' KV is there
                    got = self.device.get(table[seq.start_pos // bs])
                    assert got is not None and got[:2] == (g, salt), (seq.request_id, got)
                    assert got[2][:seq.start_pos] == rs.token_ids(0, seq.start_pos), seq
                end = seq.start_pos + len(seq.token_ids)
                for j in range(seq.start_pos // bs, (end - 1) // bs + 1):
                    self.device[table[j]] = (g, salt, rs.token_ids(0, min((j + 1) * bs, end)))
        self.state = update(state, plan, [7] * len(plan.seqs))

    @invariant()
    def consistent(self):
        check_invariants(self.state, self.sc)


TieredMachine.TestCase.settings = settings(max_examples=50, stateful_step_count=40,
                                           deadline=None)
test_tiered_state_machine = TieredMachine.TestCase


@pytest.mark.slow
@pytest.mark.parametrize("host", range(1, 7))
@pytest.mark.parametrize("prefix", ["hash", "radix"])
@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_tiered_state_machine_at_2000_examples_per_setting(mode, prefix, host):
    class Pinned(TieredMachine):
        @initialize(mode=st.just(mode), prefix=st.just(prefix), host=st.just(host),
                    windows=st.sampled_from([(None,), (None, 6), (None, 5, 9)]))
        def setup(self, mode, prefix, host, windows):
            super().setup(mode, prefix, host, windows)

    run_state_machine_as_test(Pinned, settings=settings(
        max_examples=2000, stateful_step_count=40, deadline=None, database=None))


# ---------------------------------------------------------------------------- engine

ENGINE = dict(TINY_ENGINE, num_kv_blocks=24, max_model_len=128)
PROMPTS = [list(range(5 + 7 * i, 65 + 7 * i)) for i in range(6)]


def _run(path, rounds=2, salts=(None,), max_tokens=20, **kw):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(str(path), **dict(ENGINE, **kw)) as llm:
        outs = []
        for _ in range(rounds):
            for salt in salts:
                reqs = [{"prompt_token_ids": p} for p in PROMPTS]
                outs += [o.outputs[0].token_ids for o in llm.generate(
                    reqs, params, use_tqdm=False, cache_salt=salt)]
                llm.engine.check_invariants()
    return outs, llm.engine.stats()   # after close: its writes to disk counted


@pytest.fixture(scope="module")
def reference(tiny):
    return _run(tiny[0], num_kv_blocks=200)[0]


# 60-token prompts growing to 100 tokens (13 blocks): two fill the 23 usable blocks and
# preempt each other as they grow (admission waits for a whole prompt's blocks)
LONG = 40


@pytest.fixture(scope="module")
def long_reference(tiny):
    return _run(tiny[0], num_kv_blocks=200, max_tokens=LONG)[0]


@pytest.mark.parametrize("kv", ["fp32", *(pytest.param(kv, marks=pytest.mark.slow)
                                           for kv in ("int8", "int4"))])
def test_host_tier_outputs_equal_and_fewer_tokens_are_recomputed(tiny, reference, kv):
    base, s0 = _run(tiny[0], kv_cache_dtype=kv)
    tier, s1 = _run(tiny[0], kv_cache_dtype=kv, kv_offload_bytes=4 << 20)
    if kv == "fp32":
        assert base == tier == reference
    else:
        assert tier == base
    assert s1["prefix_cache_hits_host"] > 0
    assert s1["num_computed_tokens"] < s0["num_computed_tokens"]
    assert s1["prefix_cache_hits"] > s0["prefix_cache_hits"]


def _run_turns(path, **kw):
    """Two turns of the 6 PROMPTS conversations (the second sends each whole history, its
    reply and 3 more tokens): the replies of both turns and the engine stats."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with LLM(str(path), **dict(ENGINE, **kw)) as llm:
        first = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
        turn2 = [p + list(o) + [7, 8, 9] for p, o in zip(PROMPTS, first)]
        second = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in turn2], params, use_tqdm=False)]
        llm.engine.check_invariants()
    return first + second, llm.engine.stats()


def test_radix_host_tier_promotes_partial_blocks_with_identical_outputs(tiny):
    reference, _ = _run_turns(tiny[0], prefix_caching="radix", num_kv_blocks=200)
    base, s0 = _run_turns(tiny[0], prefix_caching="radix")
    tier, s1 = _run_turns(tiny[0], prefix_caching="radix", kv_offload_bytes=4 << 20)
    assert base == tier == reference
    # a turn-2 history ends in turn 1's partial last block (79 computed tokens: 7 in block 9)
    assert s1["prefix_cache_hits_host"] % ENGINE["block_size"] != 0   # partial host hits
    assert s1["num_computed_tokens"] < s0["num_computed_tokens"]


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_preemption_modes_give_identical_tokens(tiny, long_reference, mode):
    outs, stats = _run(tiny[0], kv_offload_bytes=4 << 20, preemption_mode=mode,
                       prefix_caching=None, max_tokens=LONG)
    assert outs == long_reference
    assert stats["num_preemptions"] > 0
    if mode == "recompute":
        assert stats["num_swap_preemptions"] == 0
    if mode == "swap":
        assert stats["num_swap_preemptions"] == stats["num_preemptions"]


def _salted_workload(offset_b=0):
    """24 requests: cuts 13, 22, 31, 40 of 3 base prompts, a 2-token tail each, under salts
    "A" and "B" (B's tokens shifted by ``offset_b``: 0 shares every prefix with A)."""
    bases = [list(range(5 + 40 * i, 45 + 40 * i)) for i in range(3)]
    reqs = []
    for salt, shift in (("A", 0), ("B", offset_b)):
        for i, base in enumerate(bases):
            for cut in (13, 22, 31, 40):
                prompt = [t + shift for t in base[:cut]] + [200 + i, 210 + cut % 7]
                reqs.append(({"prompt_token_ids": prompt}, salt))
    return reqs


def _run_salted(path, offset_b=0, max_tokens=12, **kw):
    """The salted workload sent three times over, all at once: (tokens, hits) per request in
    order, and the engine stats."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine = dict(ENGINE, block_size=4, max_num_seqs=6, max_model_len=64,
                  prefix_caching="radix", **kw)
    with LLM(str(path), **engine) as llm:
        ids = llm.engine.add_requests([dict(prompt=p, sampling_params=params, cache_salt=salt)
                                       for p, salt in _salted_workload(offset_b) * 3])
        done = {}
        while llm.engine.has_unfinished_requests():
            done.update((i, o) for i, o in llm.engine.step().items() if o.finished)
            llm.engine.check_invariants()
        stats = llm.engine.stats()
    return ([done[i].outputs[0].token_ids for i in ids],
            [done[i].num_cached_tokens for i in ids], stats)


@pytest.mark.parametrize("mode, budget, max_tokens", [("swap", 32, 12), ("recompute", 16, 20)])
def test_swap_radix_host_tier_and_salts_give_identical_tokens_and_own_hits_only(
        tiny, mode, budget, max_tokens):
    """Issue 48's end-to-end check: a 26-block pool with the radix cache, a host tier and swap
    (or recompute) preemption, two salts sharing every prompt prefix, gives the outputs of a
    400-block pool; and each request's hits equal those of a twin run where salt B's prompts
    share no token with A's: a hit never counts a block stored under the other salt. (Both
    settings gave other outputs before the fixes of the two tests above.)"""
    reference, _, _ = _run_salted(tiny[0], num_kv_blocks=400, max_num_batched_tokens=budget,
                                  max_tokens=max_tokens)
    kw = dict(num_kv_blocks=26, kv_offload_bytes=64 << 10, preemption_mode=mode,
              max_num_batched_tokens=budget, max_tokens=max_tokens)
    outs, hits, stats = _run_salted(tiny[0], **kw)
    assert outs == reference
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits_host"] > 0
    if mode == "swap":
        assert stats["num_swap_preemptions"] > 0
    _, twin_hits, _ = _run_salted(tiny[0], offset_b=250, **kw)
    assert hits == twin_hits


def test_kivi_swap_is_refused_and_auto_recomputes(tiny):
    with pytest.raises(ValueError, match="preemption_mode='swap'.*int4"):
        LLM(str(tiny[0]), **dict(ENGINE, kv_cache_dtype="int4", kv_offload_bytes=4 << 20,
                                 preemption_mode="swap"))
    _, stats = _run(tiny[0], rounds=1, kv_cache_dtype="int4", kv_offload_bytes=4 << 20,
                    prefix_caching=None, max_tokens=LONG)
    assert stats["num_preemptions"] > 0 and stats["num_swap_preemptions"] == 0


def test_restart_hits_the_persistent_cache_and_refuses_a_corrupt_file(tiny, reference, tmp_path):
    first, s1 = _run(tiny[0], rounds=1, kv_offload_bytes=4 << 20, kv_cache_dir=str(tmp_path))
    assert first == reference[:len(first)]
    files = sorted(tmp_path.rglob("*.kvb"))
    assert s1["kv_disk_written"] == len(files) > 0
    # a restarted engine (fresh device pool and host tier) finds them on disk
    again, s2 = _run(tiny[0], rounds=1, kv_offload_bytes=4 << 20, kv_cache_dir=str(tmp_path))
    assert again == first
    assert s2["prefix_cache_hits_disk"] > 0 and s2["kv_disk_refused"] == 0
    # truncate every file: each is refused (logged, moved aside), the engine still serves
    for f in tmp_path.rglob("*.kvb"):
        f.write_bytes(f.read_bytes()[:100])
    third, s3 = _run(tiny[0], rounds=1, kv_offload_bytes=4 << 20, kv_cache_dir=str(tmp_path))
    assert third == first
    assert s3["prefix_cache_hits_disk"] == 0 and s3["kv_disk_refused"] > 0
    assert list(tmp_path.rglob("*.corrupt"))


def test_persistent_cache_salt_isolation(tiny, tmp_path):
    _run(tiny[0], rounds=1, salts=("t1",), kv_offload_bytes=4 << 20, kv_cache_dir=str(tmp_path))
    _, other = _run(tiny[0], rounds=1, salts=("t2",), kv_offload_bytes=4 << 20,
                    kv_cache_dir=str(tmp_path))
    assert other["prefix_cache_hits_disk"] == 0
    _, same = _run(tiny[0], rounds=1, salts=("t1",), kv_offload_bytes=4 << 20,
                   kv_cache_dir=str(tmp_path))
    assert same["prefix_cache_hits_disk"] > 0


def test_block_file_checks_name_the_file_and_the_fault(tmp_path):
    ns, other = namespace(model="a"), namespace(model="b")
    row = np.arange(64, dtype=np.uint8)
    data = encode(ns, 42, row)
    np.testing.assert_array_equal(decode(data, ns, 42, 64, "f.kvb"), row)
    faults = {"truncated": data[:20], "not a jaxkv KV block file": b"X" * len(data),
              "another model": encode(other, 42, row), "holds key 42, expected 43": data,
              "checksum mismatch": data[:-40] + bytes([data[-40] ^ 1]) + data[-39:],
              "64-byte payload": encode(ns, 42, np.zeros(65, np.uint8))}
    for why, blob in faults.items():
        key = 43 if "expected 43" in why else 42
        with pytest.raises(KVCacheFileError, match=f"f.kvb: .*{why}"):
            decode(blob, ns, key, 64, "f.kvb")
    store = DiskKVStore(tmp_path, ns, 64)
    store.store(7, row)
    assert DiskKVStore(tmp_path, ns, 64).load(7) is not None          # a new process sees it
    (tmp_path / ns.hex()[:32] / "7.kvb").write_bytes(b"garbage")
    fresh = DiskKVStore(tmp_path, ns, 64)
    assert fresh.load(7) is None and fresh.num_refused == 1 and 7 not in fresh
    assert DiskKVStore(tmp_path, other, 64).load(7) is None           # another namespace
    assert not os.path.exists(tmp_path / ns.hex()[:32] / "7.kvb")


def test_bad_offload_arguments_are_refused(tiny):
    with pytest.raises(ValueError, match="kv_cache_dir=.*needs kv_offload_bytes"):
        LLM(str(tiny[0]), **dict(ENGINE, kv_cache_dir="/tmp/x"))
    with pytest.raises(ValueError, match="preemption_mode='swap' needs kv_offload_bytes"):
        LLM(str(tiny[0]), **dict(ENGINE, preemption_mode="swap"))
    with pytest.raises(ValueError, match="kv_offload_bytes=10 holds no block"):
        LLM(str(tiny[0]), **dict(ENGINE, kv_offload_bytes=10))


def test_server_metrics_report_hits_by_tier(tiny):
    from prometheus_client.parser import text_string_to_metric_families

    from jaxkv.server.metrics import ServerMetrics

    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with LLM(str(tiny[0]), **dict(ENGINE, kv_offload_bytes=4 << 20)) as llm:
        for _ in range(2):
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        stats = llm.engine.stats()
        text = ServerMetrics("tiny", llm.engine.stats).exposition().decode()
    samples = {(s.name, s.labels.get("tier")): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    by_tier = {t: samples[("jaxkv:prefix_cache_hits_by_tier_total", t)]
               for t in ("device", "host", "disk")}
    assert by_tier["host"] == stats["prefix_cache_hits_host"] > 0
    assert sum(by_tier.values()) == stats["prefix_cache_hits"]
    assert samples[("jaxkv:num_swap_preemptions_total", None)] == stats["num_swap_preemptions"]
    used = stats["kv_offload_blocks_prefix"] + stats["kv_offload_blocks_swapped"]
    assert samples[("jaxkv:kv_offload_usage_perc", None)] == pytest.approx(
        used / stats["kv_offload_blocks_total"], rel=1e-9)
