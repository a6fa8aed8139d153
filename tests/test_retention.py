"""KV retention (jaxkv/retention/): StreamingLLM's sinks + window with out-of-window blocks given
back, checked with exact block ids through the pure scheduler, composed with prefix caching,
forks, preemption and speculative rewinds; a hypothesis state machine of random add / step /
abort sequences under streaming retention that must lose nothing."""

import dataclasses

import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from jaxkv.blocks.block_manager import NULL_BLOCK
from jaxkv.config import CacheConfig, RetentionArgs, SchedulerConfig
from jaxkv.retention import FullRetention, H2ORetention, StreamingRetention, from_args
from jaxkv.runner import batch
from jaxkv.sched.scheduler import abort, add_request, check_invariants, schedule, update
from jaxkv.sched.state import Request, StopSpec, init_state


def configs(*, block_size=4, num_blocks=12, budget=8, sinks=2, window=6, max_model_len=400,
            prefix_caching=None, max_num_seqs=8):
    cc = CacheConfig(block_size=block_size, num_blocks=num_blocks, prefix_caching=prefix_caching,
                     retention=StreamingRetention(sink_tokens=sinks, window_tokens=window))
    return cc, SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                               max_model_len=max_model_len)


def req(rid, prompt, max_tokens=4, **kw):
    return Request(request_id=rid, prompt_token_ids=tuple(prompt),
                   stop=StopSpec(max_tokens=max_tokens, ignore_eos=True), **kw)


def step(state, sc, cc, tokens=None, drafts=None):
    """schedule + batch.build + update with invariants checked; returns (state, plan)."""
    state, plan = schedule(state, sc, drafts or {})
    check_invariants(state, sc)
    batch.build(plan, cc, sc, max_drafts=8)   # the plan is a valid device step
    state = update(state, plan, tokens or [7] * len(plan.seqs))
    check_invariants(state, sc)
    return state, plan


def visible_positions(q_pos, sinks, window):
    """Positions a query at ``q_pos`` attends to: the sinks and the window (brute force)."""
    return {p for p in range(q_pos + 1) if p < sinks or q_pos - p < window}


# ---- the policy ------------------------------------------------------------------------------

@pytest.mark.parametrize("sinks, window, bs", [(2, 6, 4), (4, 20, 16), (0, 5, 4), (9, 3, 4),
                                               (1, 1, 1)])
def test_droppable_blocks_are_exactly_the_blocks_no_later_query_sees(sinks, window, bs):
    policy = StreamingRetention(sink_tokens=sinks, window_tokens=window)
    for start in range(0, 80):
        first, stop = policy.droppable(start, bs)
        later = set().union(*(visible_positions(q, sinks, window)
                              for q in range(start, start + 60)))
        for j in range(start // bs + 1):
            block = set(range(j * bs, (j + 1) * bs))
            assert (first <= j < stop) == (not block & later), (start, j)


def test_max_blocks_bounds_what_a_sequence_holds():
    policy = StreamingRetention(sink_tokens=3, window_tokens=10)
    bs, step_tokens = 4, 5
    for start in range(0, 100):
        for n in range(1, step_tokens + 1):
            first, stop = policy.droppable(start, bs)
            held = -(-(start + n) // bs) - (stop - first)
            assert held <= policy.max_blocks(10**6, step_tokens, bs)
    assert policy.max_blocks(7, step_tokens, bs) == 2   # never more than the sequence's blocks
    assert FullRetention().max_blocks(17, 8, 4) == 5


def test_attention_options():
    assert StreamingRetention(sink_tokens=4, window_tokens=1020).attention.sink_position_cap == 1023
    original = StreamingRetention(sink_tokens=4, window_tokens=1020, positions="original")
    assert original.attention.sink_position_cap is None
    assert original.attention.sliding_window == 1020 and original.attention.num_sinks == 4
    assert FullRetention(sliding_window=64).attention.sliding_window == 64


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="kv_window_tokens"):
        RetentionArgs(kv_retention="streaming")
    with pytest.raises(ValueError, match="kv_window_tokens=8 is used only"):
        RetentionArgs(kv_window_tokens=8)
    with pytest.raises(ValueError, match="kv_retention"):
        RetentionArgs(kv_retention="h3o")
    with pytest.raises(ValueError, match="kv_positions"):
        RetentionArgs(kv_retention="streaming", kv_window_tokens=8, kv_positions="absolute")
    with pytest.raises(ValueError, match="own sliding_window=4096"):
        from_args(RetentionArgs(kv_retention="streaming", kv_window_tokens=8), 4096)
    with pytest.raises(ValueError, match="kv_window_tokens=8 must cover the KIVI"):
        StreamingRetention(window_tokens=8).check_block_size(16, 1)


# ---- the scheduler drops exactly the out-of-window blocks ----------------------------------

def test_streaming_frees_blocks_as_the_window_slides():
    # block 4, sinks 2, window 6: block 0 (the sinks) stays; block j goes once the next query
    # position q has q - 6 + 1 >= 4 (j + 1)
    cc, sc = configs(num_blocks=8, budget=4)
    state = init_state(cc)
    state = add_request(state, req("a", range(10, 22), max_tokens=30), sc)   # 12-token prompt
    state, plan = step(state, sc, cc)
    assert plan.seqs[0].block_table == (1,)
    state, plan = step(state, sc, cc)
    assert plan.seqs[0].block_table == (1, 2)
    state, plan = step(state, sc, cc)       # positions 8..11: q 8 sees 3..8, block 0 holds 3
    assert plan.seqs[0].block_table == (1, 2, 3)
    tables = []
    for _ in range(20):                      # decodes at positions 12, 13, ...
        state, plan = step(state, sc, cc)
        tables.append((plan.seqs[0].start_pos, plan.seqs[0].block_table))
    assert tables[0] == (12, (1, 2, 3, 4))     # q 12 sees 7..12: logical 1 (4..7) still seen
    assert tables[1] == (13, (1, 0, 3, 4))     # q 13 sees 8..13: logical 1 dropped
    assert tables[2] == (14, (1, 0, 3, 4))
    assert tables[3] == (15, (1, 0, 3, 4))
    # a dropped block joins the free queue's tail (no prefix cache), so 16..19 get block 5
    assert tables[4] == (16, (1, 0, 3, 4, 5))
    assert tables[5] == (17, (1, 0, 0, 4, 5))  # q 17 sees 12..17: logical 2 (8..11) dropped
    # the pool never holds more than the sinks, the window and one step's blocks
    for start, table in tables:
        held = [b for b in table if b != NULL_BLOCK]
        assert len(held) <= 4, (start, table)
        assert len(set(held)) == len(held)
    assert state.block_manager.num_free_blocks == 7 - len(
        [b for b in state.block_manager.block_table("a") if b])


def test_a_sequence_longer_than_the_pool_runs_to_the_end():
    # 19 usable blocks of 4 = 76 tokens; the request grows to 300 and the pool stays at 4 blocks
    cc, sc = configs(num_blocks=20, budget=8)
    state = add_request(init_state(cc), req("a", range(30), max_tokens=270), sc)
    peak = 0
    while "a" not in state.finished:
        state, _ = step(state, sc, cc)
        peak = max(peak, 19 - state.block_manager.num_free_blocks)
    assert len(state.finished["a"].output_token_ids) == 270
    assert peak <= StreamingRetention(sink_tokens=2, window_tokens=6).max_blocks(300, 8, 4)
    assert state.block_manager.num_free_blocks == 19


def test_admission_bounds_by_retained_blocks_not_length():
    cc, sc = configs(num_blocks=7, budget=8)          # 6 usable blocks: 1 sink + 5 window/step
    add_request(init_state(cc), req("a", range(30), max_tokens=300), sc)   # 330 tokens: fine
    with pytest.raises(ValueError, match="need 6 blocks at once but the pool has num_blocks - 1 = 5"):
        add_request(init_state(configs(num_blocks=6, budget=8)[0]), req("a", range(30)), sc)
    cc_full = CacheConfig(block_size=4, num_blocks=7)
    with pytest.raises(ValueError, match="need 83 blocks at once"):
        add_request(init_state(cc_full), req("a", range(30), max_tokens=300), sc)


def test_shared_prefix_blocks_are_never_dropped_from_under_another_sequence():
    cc, sc = configs(num_blocks=30, budget=16, prefix_caching="hash")
    prompt = tuple(range(100, 124))                   # 6 full blocks
    state = add_request(init_state(cc), req("a", prompt, max_tokens=20), sc)
    for _ in range(3):
        state, _ = step(state, sc, cc)
    a_table = state.block_manager.block_table("a")
    state = add_request(state, req("b", prompt, max_tokens=20), sc)
    state, plan = step(state, sc, cc)
    (b,) = [s for s in plan.seqs if s.request_id == "b"]
    # b took a's cached prefix; the blocks out of its window were dropped from ITS table only
    assert b.num_cached_tokens == 20 and b.start_pos == 20
    bm = state.block_manager
    b_table = bm.block_table("b")
    first, stop = cc.retention.droppable(20, 4)
    assert all(b_table[j] == NULL_BLOCK for j in range(first, stop))
    for j, block in enumerate(a_table):
        if block and first <= j < stop:
            assert bm.ref_count(block) >= (1 if block in bm.block_table("a") else 0)
    for block in set(bm.block_table("a")) & set(b_table) - {NULL_BLOCK}:
        assert bm.ref_count(block) == 2
    while state.requests:
        state, _ = step(state, sc, cc)
    assert state.block_manager.num_free_blocks == 29


def test_forks_share_the_kept_blocks():
    cc, sc = configs(num_blocks=30, budget=32)
    prompt = tuple(range(40))
    state = add_request(init_state(cc), req("a", prompt, max_tokens=12), sc)
    state = add_request(state, req("a#1", prompt, max_tokens=12, fork_of="a"), sc)
    while state.requests:
        state, plan = step(state, sc, cc)
        bm = state.block_manager
        for rid in bm.request_ids():
            assert bm.block_table(rid)[-1] != NULL_BLOCK
    assert state.block_manager.num_free_blocks == 29


def test_speculative_rewind_under_streaming():
    cc, sc = configs(num_blocks=12, budget=16)
    state = add_request(init_state(cc), req("a", range(20), max_tokens=40), sc)
    while state.requests["a"].num_computed_tokens < 20:
        state, _ = step(state, sc, cc)
    for i in range(12):   # 3 drafts a step, alternately all accepted and all rejected
        state, plan = step(state, sc, cc, tokens=[(1, 2, 3, 4) if i % 2 else (9,)],
                           drafts={"a": (1, 2, 3)})
    rs = state.requests["a"]
    table = state.block_manager.block_table("a")
    assert len(table) == -(-rs.num_computed_tokens // 4)
    state = abort(state, "a")
    assert state.block_manager.num_free_blocks == 11


class StreamingMachine(RuleBasedStateMachine):
    """Random adds, steps and aborts under streaming or H2O retention (random attention mass)
    with prefix caching and forks: invariants after every call, every request finishes with
    exactly its max_tokens."""

    @initialize(window=st.integers(1, 12), sinks=st.integers(0, 6),
                mode=st.sampled_from([None, "hash", "radix"]), h2o=st.booleans(),
                seed=st.integers(0, 2**16))
    def setup(self, window, sinks, mode, h2o, seed):
        self.cc, self.sc = configs(num_blocks=24, budget=8, sinks=sinks, window=window,
                                   prefix_caching=mode, max_num_seqs=4)
        if h2o:
            self.cc = dataclasses.replace(self.cc, retention=H2ORetention(
                budget_tokens=4 * (window + sinks) + 8, sink_tokens=sinks, recent_tokens=window))
        self.rng = np.random.default_rng(seed) if h2o else None
        self.state = init_state(self.cc)
        self.n = 0
        self.expected = {}

    @rule(prompt_len=st.integers(1, 30), max_tokens=st.integers(1, 40), share=st.booleans(),
          fork=st.booleans())
    def add(self, prompt_len, max_tokens, share, fork):
        prompt = tuple(range(prompt_len)) if share else tuple(range(1000 + self.n, 1000 + self.n
                                                                    + prompt_len))
        rid = f"r{self.n}"
        self.n += 1
        self.state = add_request(self.state, req(rid, prompt, max_tokens), self.sc)
        self.expected[rid] = max_tokens
        if fork:
            self.state = add_request(self.state, req(rid + "#1", prompt, max_tokens,
                                                     fork_of=rid), self.sc)
            self.expected[rid + "#1"] = max_tokens

    @rule()
    def step(self):
        if self.rng is None:
            self.state, _ = step(self.state, self.sc, self.cc)
        else:
            self.state, plan = schedule(self.state, self.sc, {})
            check_invariants(self.state, self.sc)
            width = max([len(s.block_table) for s in plan.seqs], default=1)
            self.state = update(self.state, plan, [7] * len(plan.seqs),
                                block_mass=self.rng.random((len(plan.seqs), width)))
        for rid, rs in self.state.finished.items():
            if rs.finish_reason != "abort":
                assert len(rs.output_token_ids) == self.expected.pop(rid)

    @rule(data=st.data())
    def abort_one(self, data):
        if self.state.requests:
            rid = data.draw(st.sampled_from(sorted(self.state.requests)))
            self.state = abort(self.state, rid)
            self.expected.pop(rid)

    @invariant()
    def consistent(self):
        check_invariants(self.state, self.sc)


StreamingMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40,
                                              deadline=None)
test_streaming_state_machine = StreamingMachine.TestCase


def test_drop_order_keeps_lru():
    """Dropped cached blocks join the free queue's tail (reused last), uncached ones its head."""
    cc, sc = configs(num_blocks=16, budget=4, prefix_caching="hash")
    state = add_request(init_state(cc), req("a", range(12), max_tokens=20), sc)
    for _ in range(8):
        state, _ = step(state, sc, cc)
    free = state.block_manager.free_block_ids()
    cached = [b for b in free if b in state.block_manager.prefix_cache]
    assert cached and free[-len(cached):] == tuple(cached)
    assert np.all(np.diff([free.index(b) for b in cached]) > 0)


# ---- H2O: heavy hitters + a recent window in a budget ---------------------------------------

def h2o_configs(*, budget=16, recent=8, sinks=0, num_blocks=40, step_budget=8,
                prefix_caching=None):
    cc = CacheConfig(block_size=4, num_blocks=num_blocks, prefix_caching=prefix_caching,
                     retention=H2ORetention(budget_tokens=budget, recent_tokens=recent,
                                            sink_tokens=sinks))
    return cc, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=step_budget,
                               max_model_len=400)


def test_h2o_drops_exactly_the_lowest_scoring_unprotected_blocks():
    policy = H2ORetention(budget_tokens=32, recent_tokens=16, sink_tokens=4)
    table = tuple(range(1, 14))                       # 13 blocks of 4: positions 0..51
    scores = np.array([9, .1, .9, .2, .05, .6, .3, .4, .7, 5, 5, 5, 5])
    # budget 8 blocks; block 0 is the sink, blocks >= (52 - 16) // 4 = 9 the recent window
    assert policy.drops(52, table, scores, 4) == (4, 1, 3, 6, 7)
    assert policy.may_drop(52, 4, 4) and not policy.may_drop(52, 0, 4)
    assert not policy.may_drop(52, 9, 4)
    # ties go to the older block; without scores H2O drops the oldest unprotected blocks
    assert policy.drops(52, table, None, 4) == (1, 2, 3, 4, 5)
    assert policy.drops(52, table[:8], scores, 4) == ()
    assert policy.max_blocks(10**6, 8, 4, 20) == 8 + 2 + 2
    assert policy.max_blocks(10**6, 8, 4, 100) == 25 + 1     # the prompt is kept whole first


def test_h2o_config_errors():
    with pytest.raises(ValueError, match="must exceed the recent window"):
        H2ORetention(budget_tokens=16, recent_tokens=16)
    with pytest.raises(ValueError, match="kv_budget_tokens=0"):
        H2ORetention(budget_tokens=0, recent_tokens=0)


def test_h2o_keeps_the_heavy_hitters_the_step_reports():
    cc, sc = h2o_configs(budget=20)                   # 5 blocks: 2 recent (8 tokens) + heavy
    state = add_request(init_state(cc), req("a", range(40), max_tokens=40), sc)
    heavy = {1, 4}                                    # logical blocks the attention favours
    kept_history = []
    while "a" not in state.finished:
        state, plan = schedule(state, sc, {})
        check_invariants(state, sc)
        width = max(len(s.block_table) for s in plan.seqs)
        mass = np.full((len(plan.seqs), width), 0.01)
        for j in heavy & set(range(width)):
            mass[:, j] = 1.0
        state = update(state, plan, [7] * len(plan.seqs), block_mass=mass)
        check_invariants(state, sc)
        if "a" in state.requests:
            table = state.block_manager.block_table("a")
            kept_history.append(table)
            assert sum(1 for b in table if b) <= cc.retention.max_blocks(80, 8, 4, 40)
    # once over budget, the sequence kept its heavy hitters and the recent window only
    final = kept_history[-1]
    n = len(final)
    kept = {j for j, b in enumerate(final) if b}
    recent = set(range((79 - 8) // 4, n))             # blocks of the last 8 positions
    assert heavy | recent <= kept and len(kept) <= 5
    assert state.block_manager.num_free_blocks == 39


def test_h2o_prefix_cache_registers_only_blocks_before_the_first_drop():
    cc, sc = h2o_configs(prefix_caching="hash", step_budget=4)   # budget 16 tokens
    prompt = tuple(range(100, 140))                    # 10 blocks
    state = add_request(init_state(cc), req("a", prompt, max_tokens=12), sc)
    while "a" not in state.finished:
        state, _ = step(state, sc, cc)
        rs = state.requests.get("a")
        if rs is not None and rs.first_drop is not None:
            first_drop = rs.first_drop
            assert state.block_manager.num_registered("a") <= first_drop // 4
    assert first_drop == 40                            # the prompt is computed in full first
    # a second request with the same prompt hits the prompt's blocks (all but its last token:
    # 9 full blocks), all computed before the first drop; nothing computed after it
    state = add_request(state, req("b", prompt, max_tokens=4), sc)
    state, plan = schedule(state, sc, {})
    assert plan.seqs[0].num_cached_tokens == 36
    assert state.block_manager.num_cached_blocks == 10


def test_h2o_forks_and_preemption_keep_invariants():
    # admission waits for a whole prompt's blocks, so preemption takes requests that outgrow
    # a pool two prompts fit: a 32-token budget held by each
    cc, sc = h2o_configs(num_blocks=26, step_budget=16, budget=32)
    state = init_state(cc)
    for i in range(3):
        state = add_request(state, req(f"r{i}", range(10 * i, 10 * i + 30), max_tokens=30), sc)
    state = add_request(state, req("r0#1", range(0, 30), max_tokens=30, fork_of="r0"), sc)
    rng = np.random.default_rng(0)
    preempted = 0
    while state.requests:
        state, plan = schedule(state, sc, {})
        preempted += len(plan.preempted_ids)
        check_invariants(state, sc)
        width = max([len(s.block_table) for s in plan.seqs], default=1)
        state = update(state, plan, [7] * len(plan.seqs),
                       block_mass=rng.random((len(plan.seqs), width)))
        check_invariants(state, sc)
    assert preempted > 0
    assert all(len(rs.output_token_ids) == 30 for rs in state.finished.values())
    assert state.block_manager.num_free_blocks == 25
