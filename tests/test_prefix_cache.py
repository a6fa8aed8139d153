"""Prefix caching (hash chain and radix), copy-on-write forks and beam forks at the block-manager
and scheduler level: exact block ids, LRU eviction order, salt isolation, and a hypothesis state
machine that simulates the device pool's contents to prove every cache hit reads the right K/V."""

import pytest
from hypothesis import event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxkv.blocks.block_manager import BlockManager
from jaxkv.blocks.prefix_cache import make_prefix_cache
from jaxkv.config import CacheConfig, SchedulerConfig
from jaxkv.config.kv_groups import KVGroups
from jaxkv.runner import batch
from jaxkv.sched.plan import ScheduledSeq as S
from jaxkv.sched.scheduler import abort, add_request, check_invariants, fork, schedule, update
from jaxkv.sched.state import Request, StopSpec, init_state


def configs(block_size, num_blocks, budget, *, mode="hash", max_num_seqs=8, max_model_len=32,
            policy="fcfs", windows=(None,)):
    return (CacheConfig(block_size=block_size, num_blocks=num_blocks, prefix_caching=mode,
                        kv_groups=KVGroups(windows)),
            SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                            max_model_len=max_model_len, policy=policy))


def req(rid, prompt, *, max_tokens=4, salt=None, fork_of=None, arrival_time=0.0):
    return Request(request_id=rid, prompt_token_ids=tuple(prompt), cache_salt=salt,
                   fork_of=fork_of, arrival_time=arrival_time,
                   stop=StopSpec(max_tokens=max_tokens))


def add(state, sc, *requests):
    for r in requests:
        state = add_request(state, r, sc)
        check_invariants(state, sc)
    return state


def step(state, sc, sampled=None):
    state, plan = schedule(state, sc)
    check_invariants(state, sc)
    state = update(state, plan, [0] * len(plan.seqs) if sampled is None else sampled)
    check_invariants(state, sc)
    return state, plan


def run_to_end(state, sc, token=7):
    while state.requests:
        state, plan = schedule(state, sc)
        check_invariants(state, sc)
        state = update(state, plan, [token] * len(plan.seqs))
        check_invariants(state, sc)
    return state, None


# ---- block manager -------------------------------------------------------------------------

def test_hash_register_lookup_share_and_lru_eviction():
    bm = BlockManager(num_blocks=6, block_size=2, prefix_caching="hash")
    assert bm.allocate("a", 5) == (1, 2, 3)
    bm.register("a", [10, 11, 12, 13, 14])          # 2 full blocks; the partial third ignored
    assert bm.num_registered("a") == 2 and bm.num_cached_blocks == 2
    blocks, keys, partial = bm.lookup([10, 11, 12, 13, 99])
    assert blocks == (1, 2) and len(keys) == 2 and partial is None
    assert bm.lookup([10, 11, 12, 99])[0] == (1,)
    assert bm.lookup([10, 11, 12, 13], salt="tenant")[0] == ()   # salts never share
    table, copy = bm.allocate_cached("b", 6, blocks, keys, partial)
    assert table == (1, 2, 4) and copy is None
    assert [bm.ref_count(b) for b in (1, 2, 3, 4)] == [2, 2, 1, 1]
    bm.check_invariants()
    bm.free("a")   # 3 is uncached: head of the queue; 1, 2 still used by b
    assert bm.free_block_ids() == (3, 5)
    bm.free("b")   # cached blocks go to the tail, tail blocks first (2 before 1); 4 uncached
    assert bm.free_block_ids() == (4, 3, 5, 2, 1)
    assert bm.num_cached_blocks == 2
    bm.check_invariants()
    # uncached free blocks are used first; the cache is evicted LRU, tails first
    assert bm.allocate("c", 6) == (4, 3, 5)
    assert bm.num_cached_blocks == 2
    assert bm.allocate("d", 2) == (2,)
    assert bm.num_cached_blocks == 1 and bm.lookup([10, 11, 12, 13])[0] == (1,)
    bm.check_invariants()


def test_hash_hit_takes_a_free_cached_block_out_of_the_queue():
    bm = BlockManager(num_blocks=5, block_size=2, prefix_caching="hash")
    bm.allocate("a", 4)
    bm.register("a", [1, 2, 3, 4])
    bm.free("a")
    assert bm.free_block_ids() == (3, 4, 2, 1)
    blocks, keys, _ = bm.lookup([1, 2, 3, 4])
    assert not bm.can_allocate_cached(10, blocks, None)
    table, _ = bm.allocate_cached("b", 5, blocks, keys, None)
    assert table == (1, 2, 3) and bm.free_block_ids() == (4,)
    bm.check_invariants()


def test_radix_partial_block_is_cached_on_free_and_reused_by_copy():
    bm = BlockManager(num_blocks=8, block_size=4, prefix_caching="radix")
    assert bm.allocate("a", 7) == (1, 2)
    bm.register("a", [0, 1, 2, 3])
    bm.free("a", partial_tokens=[4, 5, 6])         # tail block 2 holds 3 computed tokens
    assert bm.num_cached_blocks == 2
    bm.check_invariants()
    blocks, keys, partial = bm.lookup([0, 1, 2, 3, 4, 5, 9, 9])
    assert blocks == (1,) and partial == (2, 2)
    table, copy = bm.allocate_cached("b", 8, blocks, keys, partial)
    assert table == (1, 3) and copy == (2, 3)       # 2 is copied into 3, never written
    # 2 stays held until the plan ends: no swap-in of the same plan may overwrite it first
    assert bm.ref_count(2) == 1 and 2 not in bm.free_block_ids()
    bm.check_invariants()
    bm.release_copy_sources()
    assert bm.ref_count(2) == 0 and bm.free_block_ids()[0] == 2
    bm.check_invariants()
    # the full block with a partial match also counts (token granular)
    assert bm.lookup([0, 1, 2, 9])[2] == (1, 3)


@pytest.mark.parametrize("mode", ["hash", "radix"])
def test_evicted_parent_recomputed_finds_its_cached_children_again(mode):
    cache = make_prefix_cache(mode, 2)
    a = cache.insert(cache.root(None), (1, 2), 5)
    b = cache.insert(a, (3, 4), 6)
    assert (cache.insert(b, (5,), 7) is None) and (7 in cache) == (mode == "radix")
    assert cache.evict(5) == (5,)
    assert cache.child(cache.root(None), (1, 2)) is None
    assert cache.insert(cache.root(None), (1, 2), 8) == a     # content keys: same key again
    assert cache.child(a, (3, 4)) == (6, b)
    assert cache.partial(b, (5, 0)) == ((7, 1) if mode == "radix" else None)
    cache.check(10)


def test_fork_and_copy_on_write():
    bm = BlockManager(num_blocks=6, block_size=4)
    bm.allocate("p", 6)                              # (1, 2): block 2 half full
    assert bm.fork("p", "c", 1) == (1,)
    assert bm.fork("p", "d") == (1, 2)
    assert bm.needs_copy("d", 5) and not bm.needs_copy("d", 8)
    assert bm.copy_on_write("d", 5) == ((2, 3),)
    assert bm.block_table("d") == (1, 3) and bm.ref_count(2) == 1
    assert bm.copy_on_write("d", 6) == ()
    bm.check_invariants()


def test_reset_prefix_cache_keeps_owners():
    bm = BlockManager(num_blocks=4, block_size=1, prefix_caching="hash")
    bm.allocate("a", 2)
    bm.register("a", [1, 2])
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.num_registered("a") == 0
    bm.register("a", [1, 2])
    assert bm.num_cached_blocks == 2
    bm.check_invariants()


# ---- scheduler -------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["hash", "radix"])
def test_second_request_skips_the_cached_prefix(mode):
    cc, sc = configs(4, 12, 32, mode=mode)
    prefix = list(range(100, 110))                   # 2 full blocks + 2 tokens
    state = add(init_state(cc), sc, req("a", prefix + [1], max_tokens=1))
    state, plan = step(state, sc)
    assert plan.seqs == (S("a", tuple(prefix + [1]), 0, True, (1, 2, 3)),)
    assert not state.requests                        # finished: blocks cached and free
    state = add(state, sc, req("b", prefix + [2, 3], max_tokens=1))
    state, plan = step(state, sc)
    if mode == "hash":   # full blocks 1, 2 shared; b computes from token 8 (3 was uncached)
        assert plan.seqs == (S("b", tuple(prefix[8:] + [2, 3]), 8, True, (1, 2, 3), 8),)
        assert plan.copy_ops == ()
    else:                # plus the 2 matching tokens of a's partial block 3, copied into 4
        assert plan.seqs == (S("b", (2, 3), 10, True, (1, 2, 4), 10),)
        assert plan.copy_ops == ((3, 4),)
    assert (plan.num_lookup_tokens, plan.num_hit_tokens) == (12, plan.seqs[0].start_pos)


@pytest.mark.parametrize("mode", ["hash", "radix"])
def test_full_hit_still_computes_the_last_token(mode):
    cc, sc = configs(2, 10, 32, mode=mode)
    state = add(init_state(cc), sc, req("a", [5, 6, 7, 8], max_tokens=1))
    state, _ = step(state, sc)
    state = add(state, sc, req("b", [5, 6, 7, 8], max_tokens=1))
    state, plan = step(state, sc)
    (seq,) = plan.seqs
    assert seq.token_ids[-1] == 8 and seq.sample
    if mode == "hash":
        assert (seq.start_pos, seq.block_table, plan.copy_ops) == (2, (1, 3), ())
    else:   # token 7 is reused from block 2 through a copy
        assert (seq.start_pos, seq.block_table, plan.copy_ops) == (3, (1, 3), ((2, 3),))


def test_request_arriving_during_the_prefill_of_its_prefix_shares_only_computed_blocks():
    cc, sc = configs(2, 16, 6)
    prefix = [1, 2, 3, 4, 5, 6, 7, 8]
    state = add(init_state(cc), sc, req("a", prefix + [9], max_tokens=1))
    state, plan = step(state, sc)                    # a: chunk 0..5 in blocks 1, 2, 3
    assert plan.seqs == (S("a", (1, 2, 3, 4, 5, 6), 0, False, (1, 2, 3)),)
    state = add(state, sc, req("b", prefix + [10], max_tokens=1))
    state, plan = step(state, sc)
    # b shares the computed blocks 1..3 but not block 4, which a fills in this very step
    assert plan.seqs == (S("a", (7, 8, 9), 6, True, (1, 2, 3, 4, 5)),
                         S("b", (7, 8, 10), 6, True, (1, 2, 3, 6, 7), 6))


def test_cache_salt_isolates_tenants():
    cc, sc = configs(2, 12, 32)
    state = add(init_state(cc), sc, req("a", [1, 2, 3, 4, 5], max_tokens=1, salt="x"))
    state, _ = step(state, sc)
    state = add(state, sc, req("b", [1, 2, 3, 4, 5], max_tokens=1, salt="y"),
                req("c", [1, 2, 3, 4, 5], max_tokens=1, salt="x"))
    state, plan = step(state, sc)
    assert [(s.request_id, s.start_pos) for s in plan.seqs] == [("b", 0), ("c", 4)]


@pytest.mark.parametrize("mode", [None, "hash"])
def test_parallel_samples_fork_the_prompt(mode):
    cc, sc = configs(4, 12, 32, mode=mode)
    prompt = list(range(10))                         # blocks: full, full, 2 tokens
    state = add(init_state(cc), sc, req("p", prompt, max_tokens=2),
                req("c", prompt, max_tokens=2, fork_of="p"))
    state, plan = step(state, sc, [50])
    assert [s.request_id for s in plan.seqs] == ["p"]   # c waits for p's prompt
    state, plan = step(state, sc, [51, 60])
    # c shares blocks 1, 2, 3, copies the partial block 3 and computes only the last token
    assert plan.seqs[1] == S("c", (9,), 9, True, (1, 2, 4), 9)
    assert plan.copy_ops == ((3, 4),)
    assert plan.seqs[0] == S("p", (50,), 10, True, (1, 2, 3))
    state, _ = run_to_end(state, sc)
    assert state.block_manager.num_free_blocks == cc.num_usable_blocks


def test_beam_fork_shares_blocks_and_copies_the_diverging_block():
    cc, sc = configs(2, 12, 32, mode=None)
    state = add(init_state(cc), sc, req("r", [1, 2, 3], max_tokens=8))
    state, plan = schedule(state, sc)
    state = fork(state, sc, [("r", "b0", 5), ("r", "b1", 6)], release=["r"])
    check_invariants(state, sc)
    assert state.block_manager.block_table("b0") == state.block_manager.block_table("b1") == (1, 2)
    state, plan = schedule(state, sc)
    check_invariants(state, sc)
    # b0 writes position 3 into shared block 2: copy; b1 then owns block 2 alone
    assert plan.seqs == (S("b0", (5,), 3, True, (1, 3)), S("b1", (6,), 3, True, (1, 2)))
    assert plan.copy_ops == ((2, 3),)
    state = update(state, plan, [7, 8])              # b0, b1 now have a pending token each
    with pytest.raises(ValueError, match="fork parent_id='b0'"):
        fork(state, sc, [("b0", "x", 1)])
    with pytest.raises(ValueError, match="release names request_id='r'"):
        fork(state, sc, [], release=["r"])


def test_lpm_admits_the_longest_cached_prefix_first_with_an_age_bound():
    cc, sc = configs(2, 40, 6, policy="lpm", max_num_seqs=1, max_model_len=40)
    shared = list(range(20, 30))
    state = add(init_state(cc), sc, req("warm", shared, max_tokens=1))
    state, _ = run_to_end(state, sc)
    state = add(state, sc, req("cold", [1, 2, 3], max_tokens=1, arrival_time=1.0),
                req("hot", shared + [5], max_tokens=1, arrival_time=2.0))
    state, plan = step(state, sc)
    assert [s.request_id for s in plan.seqs] == ["hot"]
    assert state.requests["cold"].num_skipped == 1
    sc_bound = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=6, max_model_len=40,
                               policy="lpm", lpm_max_skips=1)
    state = add(state, sc, req("hot2", shared + [6], max_tokens=1, arrival_time=3.0))
    _, plan = step(state, sc)
    assert [s.request_id for s in plan.seqs] == ["hot2"]
    _, plan = step(state, sc_bound)
    assert [s.request_id for s in plan.seqs] == ["cold"]   # overtaken once: its turn now


# ---- random workloads ------------------------------------------------------------------------

class PrefixMachine(RuleBasedStateMachine):
    """Random requests over a few shared prefixes and salts, forks, aborts and beam forks on a
    tiny pool, with a simulated device pool: each slot holds (group, salt, token, position).
    Before every step, every scheduled sequence's already computed positions must hold its own
    tokens in every cache group (a sliding group: those its window still sees): cache hits,
    copy-on-write, salt isolation and a hybrid cache's groups are all checked by this one
    assertion."""

    @initialize(mode=st.sampled_from([None, "hash", "radix"]), block_size=st.integers(1, 4),
                extra_blocks=st.integers(0, 8), budget=st.integers(1, 12),
                max_num_seqs=st.integers(1, 4), policy=st.sampled_from(["fcfs", "lpm"]),
                windows=st.sampled_from([(None,), (None,), (None, 3), (None, 5, 5), (2, None)]))
    def setup(self, mode, block_size, extra_blocks, budget, max_num_seqs, policy, windows):
        blocks_per_seq = sum(-(-16 // block_size) if w is None else
                             min(-(-16 // block_size), (w - 1 + budget) // block_size + 2)
                             for w in windows)
        num_blocks = blocks_per_seq + 1 + extra_blocks
        self.cc, self.sc = configs(block_size, num_blocks, budget, mode=mode,
                                   max_num_seqs=max_num_seqs, max_model_len=16, policy=policy,
                                   windows=windows)
        if len(windows) > 1:
            event("hybrid groups")
        self.state = init_state(self.cc)
        self.pool = {}       # slot -> (salt, token, position)
        self.next_id = 0
        self.prefixes = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]

    def _tokens(self, rid):
        rs = self.state.requests[rid]
        return rs.request.prompt_token_ids + rs.output_token_ids

    @rule(prefix=st.integers(0, 1), cut=st.integers(0, 8), tail=st.lists(st.integers(0, 9),
          max_size=4), salt=st.sampled_from([None, "t"]), max_tokens=st.integers(1, 5),
          n=st.integers(1, 3))
    def add(self, prefix, cut, tail, salt, max_tokens, n):
        prompt = self.prefixes[prefix][:cut] + tail or [1]
        if len(prompt) + max_tokens > 16:
            return
        parent = self.next_id
        for i in range(n):
            r = req(self.next_id, prompt, max_tokens=max_tokens, salt=salt,
                    fork_of=parent if i else None, arrival_time=float(self.next_id))
            self.state = add_request(self.state, r, self.sc)
            self.next_id += 1

    @rule(data=st.data(), num_steps=st.integers(1, 4))
    def step(self, data, num_steps):
        for _ in range(num_steps):
            self._step(lambda n: data.draw(st.lists(st.integers(0, 9), min_size=n, max_size=n)),
                       data)

    def _step(self, sampled_for, data=None):
        live = set(self.state.requests)
        self.state, plan = schedule(self.state, self.sc)
        check_invariants(self.state, self.sc)
        assert plan.seqs or not live, "deadlock"
        if plan.preempted_ids:
            event("preemption")
        bs = self.cc.block_size
        old = dict(self.pool)   # copies read before any write
        for src, dst in plan.copy_ops:
            for o in range(bs):
                self.pool.pop(dst * bs + o, None)
                if src * bs + o in old:
                    self.pool[dst * bs + o] = old[src * bs + o]
        if plan.copy_ops:
            event("copy-on-write")
        windows = self.cc.kv_groups.windows
        for s in plan.seqs:
            if s.num_cached_tokens:
                event("prefix hit")
            salt = self.state.requests[s.request_id].request.cache_salt
            tokens = self._tokens(s.request_id)
            for g, table in enumerate((s.block_table, *s.group_tables)):
                seen = 0 if windows[g] is None else max(0, s.start_pos - windows[g] + 1)
                for p in range(seen, s.start_pos):
                    slot = table[p // bs] * bs + p % bs
                    assert self.pool.get(slot) == (g, salt, tokens[p], p), (s, g, p)
        inputs = batch.build(plan, self.cc, self.sc)
        written = {}
        for s in plan.seqs:
            salt = self.state.requests[s.request_id].request.cache_salt
            for g, table in enumerate((s.block_table, *s.group_tables)):
                for i, tok in enumerate(s.token_ids):
                    p = s.start_pos + i
                    written[table[p // bs] * bs + p % bs] = (g, salt, tok, p)
        slots = [inputs.slot_mapping, *inputs.group_slot_mapping]
        assert set(written) == {int(x) for row in slots for x in row[:inputs.num_tokens]}
        self.pool.update(written)
        if data is not None:
            self._beam_fork(plan, data)
        self.state = update(self.state, plan, sampled_for(len(plan.seqs)))
        check_invariants(self.state, self.sc)

    def _beam_fork(self, plan, data):
        """Between the step and ``update``: replace a sampling sequence by 1-2 children that
        share its blocks (what beam search does); ``update`` then skips the released parent."""
        ready = [s.request_id for s in plan.seqs if s.sample]
        if not ready or not data.draw(st.booleans()):
            return
        parent = data.draw(st.sampled_from(ready))
        rs = self.state.requests[parent]
        if rs.num_tokens + 1 > 16 or len(rs.output_token_ids) + 1 >= rs.request.stop.max_tokens:
            return
        room = self.sc.max_num_seqs - len(self.state.running) + 1
        tokens = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=min(2, room)))
        forks = [(parent, self.next_id + i, t) for i, t in enumerate(tokens)]
        self.next_id += len(forks)
        self.state = fork(self.state, self.sc, forks, release=[parent])
        check_invariants(self.state, self.sc)
        event("beam fork")

    @precondition(lambda self: self.state.requests)
    @rule(data=st.data())
    def abort_one(self, data):
        rid = data.draw(st.sampled_from(sorted(self.state.requests)))
        self.state = abort(self.state, rid)

    @invariant()
    def consistent(self):
        check_invariants(self.state, self.sc)

    def teardown(self):
        if not hasattr(self, "state"):
            return
        for _ in range(2000):
            if not self.state.requests:
                break
            self._step(lambda n: [7] * n)
        assert not self.state.requests, "requests never finished"
        bm = self.state.block_manager
        # every block is free (possibly still cached) and nothing is owned
        assert bm.num_free_blocks == self.cc.num_usable_blocks and not bm.request_ids()
        assert bm.num_cached_blocks <= self.cc.num_usable_blocks


TestPrefixMachine = PrefixMachine.TestCase
TestPrefixMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("mode", ["hash", "radix"])
def test_lookup_stops_before_the_kivi_residual_window(mode):
    """A cached block holds codes only: with a residual window of R blocks, a prompt's last R - 1
    full blocks and any partial block are recomputed, not reused (exact block ids)."""
    for window, want in ((1, (1, 2, 3)), (2, (1, 2, 3)), (3, (1, 2)), (4, (1,)), (5, ())):
        bm = BlockManager(12, 2, mode, residual_window_blocks=window)
        bm.allocate("a", 7)
        bm.register("a", [10, 11, 12, 13, 14, 15, 16])          # blocks 1, 2, 3 cached
        prompt = [10, 11, 12, 13, 14, 15, 16, 17]               # 8 tokens: window from block
        blocks, keys, partial = bm.lookup(prompt[:-1])         # 8 // 2 - (R - 1)
        assert blocks == want and len(keys) == len(want) and partial is None
    bm = BlockManager(12, 2, mode)
    bm.allocate("a", 7)
    bm.register("a", [10, 11, 12, 13, 14, 15, 16])
    assert bm.lookup([10, 11, 12, 13, 14, 15, 16])[0] == (1, 2, 3)      # no window: all
