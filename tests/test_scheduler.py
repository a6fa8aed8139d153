"""Scheduler: golden plans with exact block ids, preemption, policies, abort, finishing, purity,
and a hypothesis state machine of random add / step / abort sequences that must lose nothing."""

import pytest
from hypothesis import event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxkv.config import CacheConfig, SchedulerConfig
from jaxkv.runner import batch
from jaxkv.sched.plan import ScheduledSeq as S, StepPlan
from jaxkv.sched.scheduler import abort, add_request, check_invariants, schedule, update
from jaxkv.sched.state import Request, StopSpec, init_state


def configs(block_size, num_blocks, budget, *, max_num_seqs=8, max_model_len=32, policy="fcfs"):
    return (CacheConfig(block_size=block_size, num_blocks=num_blocks),
            SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                            max_model_len=max_model_len, policy=policy))


def req(rid, prompt, *, max_tokens=4, arrival_time=0.0, priority=0, **stop):
    return Request(request_id=rid, prompt_token_ids=tuple(prompt), arrival_time=arrival_time,
                   priority=priority, stop=StopSpec(max_tokens=max_tokens, **stop))


def add(state, sc, *requests):
    for r in requests:
        state = add_request(state, r, sc)
        check_invariants(state, sc)
    return state


def step(state, sc, sampled=None, finished_ids=frozenset()):
    """schedule + update, checking invariants after each; returns (state, plan)."""
    state, plan = schedule(state, sc)
    check_invariants(state, sc)
    state = update(state, plan, [0] * len(plan.seqs) if sampled is None else sampled,
                   finished_ids)
    check_invariants(state, sc)
    return state, plan


def test_chunked_prefill_and_mixed_batches():
    cc, sc = configs(block_size=4, num_blocks=12, budget=6)
    state = add(init_state(cc), sc, req("a", range(100, 111)), req("b", range(200, 209)))

    state, plan = step(state, sc)
    assert plan == StepPlan((S("a", tuple(range(100, 106)), 0, False, (1, 2)),))
    # a's last prompt chunk, then b's first chunk in the budget left over
    state, plan = step(state, sc, [50, 999])
    assert plan == StepPlan((S("a", tuple(range(106, 111)), 6, True, (1, 2, 3)),
                             S("b", (200,), 0, False, (4,))))
    # a decodes (its sampled token), b's prefill chunk fills the rest of the budget
    state, plan = step(state, sc, [51, 999])
    assert plan == StepPlan((S("a", (50,), 11, True, (1, 2, 3)),
                             S("b", tuple(range(201, 206)), 1, False, (4, 5))))
    state, plan = step(state, sc, [52, 60])
    assert plan == StepPlan((S("a", (51,), 12, True, (1, 2, 3, 6)),
                             S("b", (206, 207, 208), 6, True, (4, 5, 7))))
    assert state.requests["a"].output_token_ids == (50, 51, 52)
    assert state.requests["b"].output_token_ids == (60,)
    assert state.requests["a"].num_computed_tokens == 13
    assert state.running == ("a", "b") and state.waiting == ()


def test_budget_is_reserved_for_decodes_before_prefill_chunks():
    cc, sc = configs(block_size=4, num_blocks=16, budget=4, policy="priority")
    state = add(init_state(cc), sc, req("c", (1, 2), priority=5, arrival_time=0),
                req("d", (3, 4), priority=5, arrival_time=1))
    state, plan = step(state, sc, [10, 20])
    assert plan == StepPlan((S("c", (1, 2), 0, True, (1,)), S("d", (3, 4), 0, True, (2,))))
    state = add(state, sc, req("h", range(30, 40), priority=0, arrival_time=2))
    state, plan = step(state, sc, [11, 21, 999])
    assert plan == StepPlan((S("c", (10,), 2, True, (1,)), S("d", (20,), 2, True, (2,)),
                             S("h", (30, 31), 0, False, (3,))))
    # h is now the most urgent running request, but only gets what the two decodes leave
    state, plan = step(state, sc, [999, 12, 22])
    assert plan == StepPlan((S("h", (32, 33), 2, False, (3,)), S("c", (11,), 3, True, (1,)),
                             S("d", (21,), 3, True, (2,))))
    state, plan = step(state, sc, [999, 13, 23])
    assert plan == StepPlan((S("h", (34, 35), 4, False, (3, 4)), S("c", (12,), 4, True, (1, 5)),
                             S("d", (22,), 4, True, (2, 6))))


def test_preemption_victim_is_newest_and_resumes_with_its_tokens():
    cc, sc = configs(block_size=2, num_blocks=6, budget=16)
    state = add(init_state(cc), sc, req("a", (1, 2), max_tokens=4, stop_token_ids=(12,)),
                req("b", (3, 4, 5)), req("c", (6, 7, 8)))
    state, plan = step(state, sc, [10, 20, 30])
    assert plan == StepPlan((S("a", (1, 2), 0, True, (1,)), S("b", (3, 4, 5), 0, True, (2, 3)),
                             S("c", (6, 7, 8), 0, True, (4, 5))))
    # a needs a block, none is free: the newest running request (c) is preempted, its blocks
    # return tail first, and a takes block 5
    state, plan = step(state, sc, [11, 21])
    assert plan == StepPlan((S("a", (10,), 2, True, (1, 5)), S("b", (20,), 3, True, (2, 3))),
                            preempted_ids=("c",))
    c = state.requests["c"]
    assert (c.num_computed_tokens, c.output_token_ids, state.waiting) == (0, (30,), ("c",))
    # b takes the last free block; c (4 tokens, 2 blocks) does not fit yet; a stops on token 12
    state, plan = step(state, sc, [12, 22])
    assert plan == StepPlan((S("a", (11,), 3, True, (1, 5)), S("b", (21,), 4, True, (2, 3, 4))))
    assert state.finished["a"].finish_reason == "stop"
    assert state.block_manager.free_block_ids() == (5, 1)
    # c (4 tokens) would fill the 2 free blocks exactly, but back from a preemption it also
    # waits for a block of headroom per running request (b): readmitted now, it would be the
    # victim of b's next block. b reaches max_tokens.
    state, plan = step(state, sc, [23])
    assert plan == StepPlan((S("b", (22,), 5, True, (2, 3, 4)),), finished_ids=("a",))
    assert state.finished["b"].finish_reason == "length"
    assert state.block_manager.free_block_ids() == (5, 1, 4, 3, 2)
    # c re-prefills prompt + its generated token and samples its next token
    state, plan = step(state, sc, [31])
    assert plan == StepPlan((S("c", (6, 7, 8, 30), 0, True, (5, 1)),), finished_ids=("b",))
    assert state.requests["c"].output_token_ids == (30, 31)
    assert state.requests["c"].num_preemptions == 1


def test_first_admission_takes_a_chunk_readmission_waits_for_the_whole_length():
    # b's 16-token prompt needs 4 blocks; 3 are free once a decodes. Admitted the first time,
    # b takes only its chunk's blocks (3 tokens, block 4) and prefills beside a's decodes
    # (whole-length admission would run them one after the other). Preempted when a needs a
    # block, it comes back only when the free blocks hold its whole prompt (and a block of
    # headroom per running request), not for one chunk as soon as a block is free.
    cc, sc = configs(block_size=4, num_blocks=7, budget=4)
    state = add(init_state(cc), sc, req("a", range(10, 18), max_tokens=8),
                req("b", range(20, 36), max_tokens=2))
    state, plan = step(state, sc)
    state, plan = step(state, sc)
    assert plan == StepPlan((S("a", (14, 15, 16, 17), 4, True, (1, 2)),))
    assert state.block_manager.free_block_ids() == (3, 4, 5, 6)
    state, plan = step(state, sc)
    assert plan == StepPlan((S("a", (0,), 8, True, (1, 2, 3)),
                             S("b", (20, 21, 22), 0, False, (4,))))
    for pos, table in ((3, (4, 5)), (6, (4, 5, 6)), (9, (4, 5, 6))):
        state, plan = step(state, sc)
        assert plan == StepPlan((S("a", (0,), 8 + pos // 3, True, (1, 2, 3)),
                                 S("b", tuple(range(20 + pos, 23 + pos)), pos, False, table)))
    # a's 13th token needs a block, none is free: b, the newest, is preempted
    state, plan = step(state, sc)
    assert plan == StepPlan((S("a", (0,), 12, True, (1, 2, 3, 6)),), preempted_ids=("b",))
    assert state.requests["b"].num_preemptions == 1
    assert state.block_manager.free_block_ids() == (5, 4)
    # 2 free blocks would hold b's first chunk, not its 4-block prompt: b waits
    for pos in (13, 14):
        state, plan = step(state, sc)
        assert plan == StepPlan((S("a", (0,), pos, True, (1, 2, 3, 6)),))
    assert state.finished["a"].finish_reason == "length"
    state, plan = step(state, sc)
    assert plan == StepPlan((S("b", (20, 21, 22, 23), 0, False, (5,)),), finished_ids=("a",))
    assert state.block_manager.free_block_ids() == (4, 6, 3, 2, 1)


def test_preemption_victim_is_lowest_priority_under_priority_policy():
    cc, sc = configs(block_size=2, num_blocks=6, budget=16, policy="priority")
    state = add(init_state(cc), sc, req("a", (1, 2), priority=0, arrival_time=0),
                req("b", (3, 4, 5), priority=2, arrival_time=1),
                req("c", (6, 7, 8), priority=1, arrival_time=2))
    state, plan = step(state, sc)
    assert plan == StepPlan((S("a", (1, 2), 0, True, (1,)), S("c", (6, 7, 8), 0, True, (2, 3)),
                             S("b", (3, 4, 5), 0, True, (4, 5))))
    state, plan = step(state, sc)
    assert plan == StepPlan((S("a", (0,), 2, True, (1, 5)), S("c", (0,), 3, True, (2, 3))),
                            preempted_ids=("b",))
    assert state.waiting == ("b",)


def test_least_urgent_request_preempts_itself():
    cc, sc = configs(block_size=2, num_blocks=6, budget=16)
    state = add(init_state(cc), sc, req("a", (1, 2, 3)), req("b", (4, 5, 6)), req("c", (7, 8)))
    state, plan = step(state, sc)
    assert [s.block_table for s in plan.seqs] == [(1, 2), (3, 4), (5,)]
    state, plan = step(state, sc)
    assert plan == StepPlan((S("a", (0,), 3, True, (1, 2)), S("b", (0,), 3, True, (3, 4))),
                            preempted_ids=("c",))
    assert state.block_manager.free_block_ids() == (5,)


@pytest.mark.parametrize("policy, order", [("fcfs", ["r0", "r1", "r2", "r3"]),
                                           ("priority", ["r1", "r3", "r2", "r0"])])
def test_admission_order(policy, order):
    cc, sc = configs(block_size=2, num_blocks=16, budget=2, policy=policy)
    state = init_state(cc)
    for i, priority in enumerate([3, 1, 2, 1]):
        state = add(state, sc, req(f"r{i}", (1, 2), max_tokens=1, priority=priority,
                                   arrival_time=float(i)))
    admitted = []
    for _ in range(4):
        state, plan = step(state, sc)
        admitted += [s.request_id for s in plan.seqs]
    assert admitted == order
    assert set(state.finished) == {order[-1]} and not state.requests


def test_fcfs_orders_by_arrival_time_not_add_order():
    cc, sc = configs(block_size=2, num_blocks=16, budget=2)
    state = add(init_state(cc), sc, req("late", (1, 2), arrival_time=5.0),
                req("early", (1, 2), arrival_time=1.0))
    assert state.waiting == ("early", "late")


def test_abort_running_and_queued_frees_blocks_at_once():
    cc, sc = configs(block_size=2, num_blocks=8, budget=8)
    state = add(init_state(cc), sc, req("a", range(5)), req("b", range(3)), req("c", range(4)))
    state, plan = step(state, sc)
    assert [s.block_table for s in plan.seqs] == [(1, 2, 3), (4, 5)]
    assert state.waiting == ("c",)

    state = abort(state, "a")
    check_invariants(state, sc)
    assert state.block_manager.free_block_ids() == (6, 7, 3, 2, 1)
    assert state.running == ("b",) and "a" not in state.requests
    assert state.finished["a"].finish_reason == "abort"
    state = abort(state, "c")
    check_invariants(state, sc)
    assert state.waiting == () and state.block_manager.num_free_blocks == 5
    with pytest.raises(ValueError, match="request_id='c' is not queued or running"):
        abort(state, "c")

    state, plan = schedule(state, sc)
    assert plan.finished_ids == ("a", "c") and not state.finished


def test_abort_between_schedule_and_update_drops_the_token():
    cc, sc = configs(block_size=2, num_blocks=8, budget=8)
    state = add(init_state(cc), sc, req("a", (1, 2)), req("b", (3, 4)))
    state, plan = schedule(state, sc)
    state = update(abort(state, "a"), plan, [10, 20])
    check_invariants(state, sc)
    assert state.finished["a"].output_token_ids == ()
    assert state.requests["b"].output_token_ids == (20,)


def test_requests_that_can_never_run_are_rejected():
    cc, sc = configs(block_size=4, num_blocks=5, budget=8, max_model_len=20)
    state = init_state(cc)
    with pytest.raises(ValueError, match="max_tokens = 21 exceeds max_model_len=20"):
        add_request(state, req("x", range(13), max_tokens=8), sc)
    with pytest.raises(ValueError, match="need 5 blocks .* num_blocks - 1 = 4 usable"):
        add_request(state, req("x", range(10), max_tokens=8), sc)
    state = add_request(state, req("x", range(8), max_tokens=8), sc)  # 16 tokens: 4 blocks
    with pytest.raises(ValueError, match="request_id='x' is already queued or running"):
        add_request(state, req("x", range(2)), sc)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request(request_id="y", prompt_token_ids=())
    with pytest.raises(ValueError, match="max_tokens=0"):
        StopSpec(max_tokens=0)
    with pytest.raises(ValueError, match="min_tokens=5"):
        StopSpec(max_tokens=4, min_tokens=5)


@pytest.mark.parametrize("stop, tokens, outputs, reason", [
    (dict(stop_token_ids=(7,)), [5, 7, 9], (5, 7), "stop"),
    (dict(eos_token_ids=(2,)), [2, 9], (2,), "stop"),
    (dict(eos_token_ids=(2,), ignore_eos=True, max_tokens=3), [2, 2, 2, 2], (2, 2, 2), "length"),
    (dict(stop_token_ids=(7,), eos_token_ids=(2,), min_tokens=2), [7, 2, 9], (7, 2), "stop"),
    (dict(max_tokens=2), [5, 5, 5], (5, 5), "length"),
])
def test_finish_detection(stop, tokens, outputs, reason):
    cc, sc = configs(block_size=2, num_blocks=8, budget=8)
    state = add(init_state(cc), sc, req("a", (1,), **{"max_tokens": 8, **stop}))
    for token in tokens:
        if "a" not in state.requests:
            break
        state, _ = step(state, sc, [token])
    done = state.finished["a"]
    assert (done.output_token_ids, done.finish_reason) == (outputs, reason)
    assert state.block_manager.num_free_blocks == 7


def test_engine_declared_finish_hook():
    cc, sc = configs(block_size=2, num_blocks=8, budget=8)
    state = add(init_state(cc), sc, req("a", (1,)), req("b", (2,), max_tokens=1), req("c", (3,)))
    state, plan = schedule(state, sc)
    with pytest.raises(ValueError, match="sampled_tokens has 2 rows"):
        update(state, plan, [5, 6])
    with pytest.raises(ValueError, match="finished_ids names request_id='zz'"):
        update(state, plan, [5, 6, 7], frozenset({"zz"}))
    state = update(state, plan, [5, 6, 7], frozenset({"a", "b"}))
    check_invariants(state, sc)
    assert {k: v.finish_reason for k, v in state.finished.items()} == {"a": "stop", "b": "length"}
    assert state.finished["a"].output_token_ids == (5,)
    assert state.running == ("c",)


def test_schedule_is_pure():
    cc, sc = configs(block_size=2, num_blocks=6, budget=16)
    state = add(init_state(cc), sc, req("a", (1, 2)), req("b", (3, 4, 5)), req("c", (6, 7, 8)))
    state, _ = step(state, sc, [10, 20, 30])
    free_before = state.block_manager.free_block_ids()
    (s1, p1), (_, p2) = schedule(state, sc), schedule(state, sc)
    assert p1 == p2 and p1.preempted_ids == ("c",)
    assert s1.block_manager is not state.block_manager
    assert state.block_manager.free_block_ids() == free_before
    assert state.block_manager.block_table("c") == (4, 5)
    assert state.running == ("a", "b", "c") and state.requests["c"].num_computed_tokens == 3
    check_invariants(state, sc)
    # a second schedule before the update plans nothing twice: decodes wait for their token
    _, p3 = schedule(s1, sc)
    assert p3.seqs == ()


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / step (random tokens, random engine finishes) / abort on a tiny pool."""

    @initialize(policy=st.sampled_from(["fcfs", "priority"]), block_size=st.integers(1, 4),
                extra_blocks=st.integers(0, 6), budget=st.integers(1, 8),
                max_num_seqs=st.integers(1, 4))
    def setup(self, policy, block_size, extra_blocks, budget, max_num_seqs):
        # the pool holds one request of max_model_len = 16 tokens plus a few blocks: every
        # admissible request fits alone, a few together contend
        num_blocks = -(-16 // block_size) + 1 + extra_blocks
        self.cc, self.sc = configs(block_size, num_blocks, budget, max_num_seqs=max_num_seqs,
                                   max_model_len=16, policy=policy)
        self.state = init_state(self.cc)
        self.added = {}      # id -> Request
        self.outputs = {}    # id -> tokens sampled for it (shadow of output_token_ids)
        self.aborted = set()
        self.done = {}       # id -> final RequestState
        self.pending_finished = set()  # finished since the last schedule
        self.next_id = 0

    def _collect_finished(self):
        self.done.update(self.state.finished)
        self.pending_finished |= set(self.state.finished)

    @rule(specs=st.lists(st.tuples(st.integers(1, 10), st.integers(1, 8), st.integers(0, 2),
                                   st.integers(0, 2), st.sets(st.integers(1, 5), max_size=2),
                                   st.booleans()), min_size=1, max_size=3))
    def add(self, specs):
        for prompt_len, max_tokens, priority, min_tokens, stop_ids, ignore_eos in specs:
            rid, self.next_id = self.next_id, self.next_id + 1
            prompt = [(rid + i) % 31 for i in range(prompt_len)]
            r = Request(request_id=rid, prompt_token_ids=prompt,
                        arrival_time=float(rid), priority=priority,
                        stop=StopSpec(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens),
                                      stop_token_ids=tuple(stop_ids), eos_token_ids=(0,),
                                      ignore_eos=ignore_eos))
            total = prompt_len + max_tokens
            if total > 16 or -(-total // self.cc.block_size) > self.cc.num_usable_blocks:
                with pytest.raises(ValueError):
                    add_request(self.state, r, self.sc)
                continue
            self.state = add_request(self.state, r, self.sc)
            self.added[rid], self.outputs[rid] = r, []

    def _step(self, sampled_for, finish_for):
        """One schedule + update; ``sampled_for(n)`` gives n tokens, ``finish_for(ids)`` the
        ids the engine declares finished."""
        live = set(self.state.requests)
        self.state, plan = schedule(self.state, self.sc)
        check_invariants(self.state, self.sc)
        assert set(plan.finished_ids) == self.pending_finished
        self.pending_finished = set()
        if plan.preempted_ids:
            event("preemption")
        assert plan.seqs or not live, "live requests but nothing scheduled: deadlock"
        assert len(plan.seqs) <= self.sc.max_num_seqs
        assert plan.num_tokens <= self.sc.max_num_batched_tokens
        assert len({s.request_id for s in plan.seqs}) == len(plan.seqs)
        for s in plan.seqs:
            known = list(self.added[s.request_id].prompt_token_ids) + self.outputs[s.request_id]
            end = s.start_pos + len(s.token_ids)
            assert list(s.token_ids) == known[s.start_pos:end]
            assert s.sample == (end == len(known))
            assert len(s.block_table) == -(-end // self.cc.block_size)
        batch.build(plan, self.cc, self.sc)
        sampled = sampled_for(len(plan.seqs))
        # the engine's detokenizer may end any request that has generated text (stop strings)
        finish = finish_for(sorted(i for i in self.state.requests if self.outputs[i]))
        self.state = update(self.state, plan, sampled, frozenset(finish))
        check_invariants(self.state, self.sc)
        for s, token in zip(plan.seqs, sampled):
            if s.sample:
                self.outputs[s.request_id].append(token)
        self._collect_finished()

    @rule(data=st.data(), num_steps=st.integers(1, 4))
    def step(self, data, num_steps):
        for _ in range(num_steps):
            self._step(
                lambda n: data.draw(st.lists(st.integers(0, 30), min_size=n, max_size=n)),
                lambda ids: data.draw(st.sets(st.sampled_from(ids), max_size=1)) if ids else ())

    @precondition(lambda self: self.state.requests)
    @rule(data=st.data())
    def abort_one(self, data):
        rid = data.draw(st.sampled_from(sorted(self.state.requests)))
        self.state = abort(self.state, rid)
        self.aborted.add(rid)
        self._collect_finished()

    @invariant()
    def consistent(self):
        check_invariants(self.state, self.sc)

    def teardown(self):
        """Drain with a token that never stops (maximum contention), then account for every
        request: each added one finished exactly once, aborted ones as aborts, all blocks free."""
        if not hasattr(self, "state"):
            return
        for _ in range(2000):
            if not self.state.requests:
                break
            self._step(lambda n: [7] * n, lambda ids: ())
        assert not self.state.requests, "requests never finished"
        bm = self.state.block_manager
        assert bm.num_free_blocks == self.cc.num_usable_blocks and not bm.request_ids()
        assert set(self.done) == set(self.added), "a request was lost"
        for rid, rs in self.done.items():
            assert (rs.finish_reason == "abort") == (rid in self.aborted)
            assert list(rs.output_token_ids) == self.outputs[rid]
            if rid not in self.aborted:
                assert 1 <= len(rs.output_token_ids) <= rs.request.stop.max_tokens


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
