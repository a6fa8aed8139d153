"""Continuous-batching scheduler as pure functions over an immutable ``SchedulerState``.

    state = init_state(cache_config)
    state = add_request(state, request, scheduler_config)
    state, plan = schedule(state, scheduler_config, drafts)  # plan -> batch.build -> device step
    state = update(state, plan, accepted_tokens)           # append tokens, detect finished

``schedule`` copies the block manager once, plans on the copy and returns it in a new state, so
every function here is a function of its arguments. One step: retention gives back blocks (0),
running requests take their tokens, preempting the least urgent when blocks run out (1),
waiting requests are admitted (2, jaxkv/sched/admission.py), decodes take drafts (3). The
design, with preemption, prefix hits, forks and drafts: docs/scheduling.md.
"""

from __future__ import annotations

import dataclasses
import types
from collections import deque
from collections.abc import Hashable, Iterable, Mapping, Sequence

import numpy as np

from jaxkv.blocks import host_tier
from jaxkv.blocks.block_manager import NULL_BLOCK, BlockManager
from jaxkv.blocks.host_tier import HostTier
from jaxkv.config import SchedulerConfig
from jaxkv.sched.admission import admit_waiting, retain
from jaxkv.sched.plan import PlanBuilder, ScheduledSeq, StepPlan
from jaxkv.sched.state import (FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Request, RequestState,
                               SchedulerState, StopSpec, insert_by_key, policy_key)


def _free(bm: BlockManager, rs: RequestState) -> None:
    """Free ``rs``'s blocks, offering its computed partial last block to the prefix cache."""
    computed = rs.num_computed_tokens - rs.num_draft_tokens
    tail = computed % bm.block_size
    bm.free(rs.request.request_id, rs.token_ids(computed - tail, computed) if tail else ())


def _register(bm: BlockManager, rs: RequestState, computed: int) -> None:
    """Cache ``rs``'s full blocks below position ``computed``, whose K/V is computed (and below
    its first drop, see ``RequestState.first_drop``)."""
    if rs.first_drop is not None:
        computed = min(computed, rs.first_drop)
    bs = bm.block_size
    first = bm.num_registered(rs.request.request_id)
    if computed // bs > first:
        bm.register(rs.request.request_id, rs.token_ids(first * bs, computed // bs * bs))


def add_request(state: SchedulerState, request: Request,
                config: SchedulerConfig) -> SchedulerState:
    """Queue ``request``.

    Raises:
      ValueError: the id is already live; prompt + ``max_tokens`` exceeds ``max_model_len``;
        or the whole sequence could never fit the pool's usable blocks.
    """
    bm = state.block_manager
    if request.request_id in state.requests:
        raise ValueError(f"request_id={request.request_id!r} is already queued or running")
    total = len(request.prompt_token_ids) + request.stop.max_tokens
    if total > config.max_model_len:
        raise ValueError(
            f"request {request.request_id!r}: len(prompt_token_ids) + max_tokens = {total} "
            f"exceeds max_model_len={config.max_model_len}")
    need = state.cache.max_blocks(total, config.max_num_batched_tokens,
                                  len(request.prompt_token_ids))
    if need > bm.num_blocks - 1:
        raise ValueError(
            f"request {request.request_id!r}: len(prompt_token_ids) + max_tokens = {total} "
            f"tokens need {need} blocks at once but the pool has "
            f"num_blocks - 1 = {bm.num_blocks - 1} usable blocks")
    requests = dict(state.requests)
    requests[request.request_id] = RequestState(request, state.num_added)
    waiting = list(state.waiting)
    insert_by_key(waiting, request.request_id, requests, config.policy)
    return dataclasses.replace(state, requests=types.MappingProxyType(requests),
                               waiting=tuple(waiting), num_added=state.num_added + 1)


def decoding_ids(state: SchedulerState) -> tuple[Hashable, ...]:
    """Running requests whose next step computes only their last token (decodes: the ones
    that can carry draft tokens), most urgent first."""
    return tuple(i for i in state.running
                 if state.requests[i].num_tokens - state.requests[i].num_computed_tokens == 1)


def schedule(state: SchedulerState, config: SchedulerConfig,
             drafts: Mapping[Hashable, Sequence[int]] = types.MappingProxyType({})
             ) -> tuple[SchedulerState, StepPlan]:
    """Plan one step (see the module docstring); returns the new state and the plan.

    Args:
      drafts: proposed draft tokens by request id; a running decode takes what fits of its
        own (step 3), every other entry is ignored.
    """
    b = PlanBuilder(bm=state.block_manager.copy(),
                    host=None if state.host is None else state.host.copy(),
                    requests=dict(state.requests), waiting=list(state.waiting),
                    running=list(state.running), budget=config.max_num_batched_tokens)
    if b.host is not None:
        b.host.begin_plan()
    for request_id in b.running:   # 0. blocks no later query sees go back to the pool first
        b.requests[request_id] = retain(b.bm, state.cache.retention, b.requests[request_id])
    _schedule_running(b, state, config)                 # 1.
    if not b.preempted:                                 # 2. unless this step had to preempt
        admit_waiting(b, state, config)
    seqs, observe = _sequences(b, state, _take_drafts(b, drafts))   # 3.
    b.bm.release_copy_sources()   # no allocation of this plan is left to overwrite them
    if b.host is not None:   # cached blocks reused this step: their KV moves to the host tier
        b.swap_out.extend(host_tier.demote_evictions(b.bm, b.host))
    plan = b.plan(seqs, tuple(state.finished), observe)
    return dataclasses.replace(state, block_manager=b.bm,
                               requests=types.MappingProxyType(b.requests),
                               waiting=tuple(b.waiting), running=tuple(b.running),
                               finished=types.MappingProxyType({}), host=b.host), plan


def _schedule_running(b: PlanBuilder, state: SchedulerState, config: SchedulerConfig) -> None:
    """Step 1: running requests, most urgent first, each ``min(remaining, budget)`` tokens with
    budget first reserved for every decode; one whose blocks do not fit preempts from the
    least urgent end, itself last."""
    queue = deque(b.running)
    reserved = sum(b.remaining(i) == 1 for i in queue)  # budget kept for decodes not yet visited
    while queue and b.budget > 0:
        request_id = queue.popleft()
        left = b.remaining(request_id)
        if left == 1:
            reserved -= 1
            n = 1
        else:
            n = min(left, b.budget - reserved)
            if n <= 0:
                continue
        start = b.requests[request_id].num_computed_tokens
        while not b.bm.can_append_slots(request_id, start + n, write_from=start):
            victim = queue.pop() if queue else request_id
            if victim != request_id and b.remaining(victim) == 1:
                reserved -= 1
            _preempt(b, state, config, victim)
            if victim == request_id:
                break
        if request_id in b.preempted:
            continue
        b.copy_ops.extend(b.bm.copy_on_write(request_id, start))
        b.bm.append_slots(request_id, start + n)
        b.add(request_id, n)
        if left == 1:
            b.decodes.add(request_id)


def _preempt(b: PlanBuilder, state: SchedulerState, config: SchedulerConfig,
             request_id: Hashable) -> None:
    """Send a running request back to waiting: swapped out to the host tier, or to recompute
    from its prompt (and the prefix cache)."""
    rs = b.requests[request_id]
    rs = dataclasses.replace(rs, num_preemptions=rs.num_preemptions + 1)
    ops = _swap_out(state, b.bm, b.host, rs)
    _free(b.bm, rs)
    if ops is None:
        b.requests[request_id] = dataclasses.replace(rs, num_computed_tokens=0,
                                                     num_draft_tokens=0, block_scores=None,
                                                     first_drop=None)
    else:
        b.swap_out.extend(ops)
        b.swapped.append(request_id)
        b.requests[request_id] = dataclasses.replace(rs, num_computed_tokens=0,
                                                     swapped_tokens=rs.num_computed_tokens)
    b.running.remove(request_id)
    insert_by_key(b.waiting, request_id, b.requests, config.policy)
    b.preempted.append(request_id)


def _take_drafts(b: PlanBuilder, drafts: Mapping[Hashable, Sequence[int]]
                 ) -> dict[Hashable, tuple[int, ...]]:
    """Step 3: decodes take their drafts from the budget and blocks left, at most
    ``max_tokens - generated - 1`` (the decode token's slot is already there)."""
    taken: dict[Hashable, tuple[int, ...]] = {}
    for request_id in (i for i, _ in b.scheduled if i in b.decodes and drafts.get(i)):
        rs = b.requests[request_id]
        end = rs.num_tokens   # slots for positions < end exist; drafts go at end, end + 1, ...
        room = ((len(b.bm.block_table(request_id)) + b.bm.num_free_blocks // b.bm.num_groups)
                * b.bm.block_size - end)
        k = min(len(drafts[request_id]), b.budget, room,
                rs.request.stop.max_tokens - len(rs.output_token_ids) - 1)
        if k > 0:
            b.bm.append_slots(request_id, end + k)
            taken[request_id] = tuple(int(t) for t in drafts[request_id][:k])
            b.budget -= k
    return taken


def _sequences(b: PlanBuilder, state: SchedulerState, taken: Mapping[Hashable, tuple[int, ...]]
               ) -> tuple[tuple[ScheduledSeq, ...], bool]:
    """The step's sequences, in scheduling order, with the counters advanced past them; and
    whether the step must return attention mass (a sampling sequence's policy wants it)."""
    seqs, observe = [], False
    for request_id, n in b.scheduled:
        rs = b.requests[request_id]
        start = rs.num_computed_tokens
        draft = taken.get(request_id, ())
        sample = start + n == rs.num_tokens
        observe |= sample and state.cache.retention.wants_scores(
            len(rs.request.prompt_token_ids), rs.first_drop, b.bm.block_size)
        tables = b.bm.block_tables(request_id)
        seqs.append(ScheduledSeq(request_id, rs.token_ids(start, start + n) + draft, start,
                                 sample, tables[0], b.cached.get(request_id, 0), len(draft),
                                 tables[1:]))
        b.requests[request_id] = dataclasses.replace(
            rs, num_computed_tokens=start + n + len(draft), num_draft_tokens=len(draft))
    return tuple(seqs), observe


def _swap_out(state: SchedulerState, bm: BlockManager, host: HostTier | None,
              rs: RequestState) -> tuple[tuple[int, int, None], ...] | None:
    """The swap-outs preempting ``rs`` by swap, or None to recompute it: no host tier or room,
    a pool that cannot swap, ``preemption_mode="recompute"``, or under ``"auto"`` a cost
    model that does not estimate copying its kept blocks out and back faster than recomputing
    its tokens beyond the ones its registered blocks would give back as prefix hits."""
    if host is None or not state.cache.swap_supported or state.cache.preemption_mode == "recompute":
        return None
    request_id = rs.request.request_id
    table = bm.flat_table(request_id)
    if state.cache.preemption_mode == "auto":
        uncached = rs.num_computed_tokens - bm.num_registered(request_id) * bm.block_size
        kept = sum(b != NULL_BLOCK for b in table)
        if state.cost is None or not state.cost.prefers_swap(kept, uncached):
            return None
    return host.swap_out(request_id, table)


def _add_scores(rs: RequestState, mass: np.ndarray, num_blocks: int) -> RequestState:
    """``rs`` with one step's attention mass of its first ``num_blocks`` blocks added."""
    scores = np.zeros(num_blocks)
    if rs.block_scores is not None:
        scores[:len(rs.block_scores)] = rs.block_scores[:num_blocks]
    scores += np.asarray(mass[:num_blocks], np.float64)
    return dataclasses.replace(rs, block_scores=scores)


def _stop_reason(stop: StopSpec, token: int, n: int) -> str | None:
    """Why a request stops after generating ``token`` as its ``n``-th output token, or None."""
    if n >= stop.min_tokens and (token in stop.stop_token_ids or (
            not stop.ignore_eos and token in stop.eos_token_ids)):
        return FINISH_STOP
    if n >= stop.max_tokens:
        return FINISH_LENGTH
    return None


def accepted_tokens(rs: RequestState, tokens: Iterable[int]) -> tuple[int, ...]:
    """The tokens ``rs`` appends of a step's ``tokens``, in order: all of them, or those up to
    and including the first one that finishes it (a stop or eos token once ``min_tokens`` exist,
    the ``max_tokens``-th token); the rest are dropped. ``update`` appends exactly these, and
    the engine hands the same ones to its detokenizer."""
    out: list[int] = []
    n = len(rs.output_token_ids)
    for token in tokens:
        out.append(int(token))
        if _stop_reason(rs.request.stop, out[-1], n + len(out)) is not None:
            break
    return tuple(out)


def _finish(state: SchedulerState, reasons: Mapping[Hashable, str],
            requests: dict[Hashable, RequestState]) -> SchedulerState:
    """A state where the live requests in ``reasons`` are finished with those reasons."""
    bm = state.block_manager.copy()
    host = state.host
    finished = dict(state.finished)
    for request_id, reason in reasons.items():
        if request_id in bm:
            _free(bm, requests[request_id])
        elif requests[request_id].swapped_tokens:   # waiting swapped out: its host slots go
            host = host.copy() if host is state.host else host
            host.drop(request_id)
        finished[request_id] = dataclasses.replace(requests.pop(request_id),
                                                   finish_reason=reason)
    return dataclasses.replace(
        state, block_manager=bm, requests=types.MappingProxyType(requests), host=host,
        waiting=tuple(i for i in state.waiting if i not in reasons),
        running=tuple(i for i in state.running if i not in reasons),
        finished=types.MappingProxyType(finished))


def update(state: SchedulerState, plan: StepPlan,
           sampled_tokens: Sequence[int | Sequence[int]],
           finished_ids: frozenset[Hashable] = frozenset(),
           block_mass: np.ndarray | None = None) -> SchedulerState:
    """Append the step's accepted tokens and finish the requests that stop.

    Args:
      state: the state ``schedule`` returned with ``plan`` (or a later one: sequences whose
        request is no longer live, e.g. aborted meanwhile, are skipped).
      plan: the step's plan.
      sampled_tokens: ``[>= len(plan.seqs)]``; row ``i`` is read only where
        ``plan.seqs[i].sample`` is true: the token sampled for it (an int), or its accepted
        tokens in order (a sequence of 1 to ``1 + num_drafts`` ints: the drafts the step
        accepted, then its bonus or correction token). Each is checked against the stop rules
        in order (``accepted_tokens``); padding rows beyond ``len(plan.seqs)`` are ignored.
      finished_ids: live requests the engine declares finished (e.g. a stop string matched);
        they finish with reason ``"stop"`` after this step's tokens are appended (one that also
        stopped on a token this step keeps that reason).
      block_mass: f32 [>= len(plan.seqs), max_blocks] the step's attention mass per logical
        block of each sequence (``jaxkv.attention.mass``), added to its ``block_scores``; None
        when the retention policy needs no scores.

    A sequence that verified drafts has its counter rewound to the verified tokens
    (``num_tokens - 1``) and its blocks beyond them given back; the prefix cache registers the
    full blocks below the verified tokens only.
    """
    if len(sampled_tokens) < len(plan.seqs):
        raise ValueError(f"sampled_tokens has {len(sampled_tokens)} rows, "
                         f"the plan has {len(plan.seqs)} seqs")
    requests = dict(state.requests)
    bm = state.block_manager
    reasons: dict[Hashable, str] = {}
    computed: dict[Hashable, int] = {}   # request id -> its verified computed tokens
    for row, seq in enumerate(plan.seqs):
        if seq.request_id not in requests:
            continue
        rs = requests[seq.request_id]
        computed[seq.request_id] = seq.start_pos + len(seq.token_ids) - seq.num_drafts
        if block_mass is not None:
            rs = requests[seq.request_id] = _add_scores(rs, block_mass[row],
                                                        len(seq.block_table))
        if not seq.sample:
            continue
        row_tokens = sampled_tokens[row]
        row_tokens = tuple(row_tokens) if isinstance(row_tokens, Iterable) else (row_tokens,)
        if not 1 <= len(row_tokens) <= 1 + seq.num_drafts:
            raise ValueError(f"sampled_tokens[{row}] has {len(row_tokens)} tokens; seq "
                             f"{seq.request_id!r} takes 1 to 1 + num_drafts = "
                             f"{1 + seq.num_drafts}")
        tokens = accepted_tokens(rs, row_tokens)
        rs = dataclasses.replace(rs, output_token_ids=rs.output_token_ids + tokens)
        if seq.num_drafts:   # rewind over the rejected drafts
            computed[seq.request_id] += len(tokens) - 1
            rs = dataclasses.replace(rs, num_computed_tokens=computed[seq.request_id],
                                     num_draft_tokens=0)
        requests[seq.request_id] = rs
        reason = _stop_reason(rs.request.stop, tokens[-1], len(rs.output_token_ids))
        if reason is not None:
            reasons[seq.request_id] = reason
    bs = bm.block_size
    register = [i for i, n in computed.items() if bm.prefix_cache is not None and i in bm
                and n // bs > bm.num_registered(i)]
    truncate = [s.request_id for s in reversed(plan.seqs) if s.num_drafts
                and s.request_id in computed and s.request_id in bm
                and bm.blocks_for(computed[s.request_id]) < len(bm.block_table(s.request_id))]
    if register or truncate:   # copy the manager only then
        bm = bm.copy()
        for request_id in register:   # cache the blocks this step filled and verified
            _register(bm, requests[request_id], computed[request_id])
        for request_id in truncate:   # reverse plan order: the free queue as before the drafts
            bm.truncate(request_id, computed[request_id])
        state = dataclasses.replace(state, block_manager=bm)
    for request_id in finished_ids:
        if request_id not in requests:
            raise ValueError(f"finished_ids names request_id={request_id!r}, "
                             f"which is not queued or running")
        reasons.setdefault(request_id, FINISH_STOP)
    if not reasons:
        return dataclasses.replace(state, requests=types.MappingProxyType(requests))
    return _finish(state, reasons, requests)


def abort(state: SchedulerState, request_id: Hashable) -> SchedulerState:
    """Finish a queued or running request with reason ``"abort"``, freeing its blocks at once."""
    if request_id not in state.requests:
        raise ValueError(f"request_id={request_id!r} is not queued or running")
    return _finish(state, {request_id: FINISH_ABORT}, dict(state.requests))


def fork(state: SchedulerState, config: SchedulerConfig,
         forks: Sequence[tuple[Hashable, Hashable, int]],
         release: Sequence[Hashable] = ()) -> SchedulerState:
    """Beam-search step: new running requests that share their parents' blocks, then drop some.

    Call it after the step that computed the parents' tokens (their filled blocks are cached
    here, since ``update`` skips released requests).

    Args:
      forks: ``(parent_id, child_id, token)``: the child is the running parent (all of whose
        tokens are computed) with ``token`` appended, sharing every parent block; its next write
        into the shared last block copies it first (copy-on-write, in ``schedule``).
      release: running requests to drop afterwards (blocks freed, no ``finished`` entry);
        typically the parents.
    """
    bm = state.block_manager.copy()
    requests = dict(state.requests)
    running = list(state.running)
    for i, (parent_id, child_id, token) in enumerate(forks):
        prs = requests.get(parent_id)
        if parent_id not in state.running or prs.num_computed_tokens != prs.num_tokens:
            raise ValueError(f"fork parent_id={parent_id!r} is not running with every token "
                             f"computed")
        if child_id in requests:
            raise ValueError(f"fork child_id={child_id!r} is already queued or running")
        _register(bm, prs, prs.num_computed_tokens)
        bm.fork(parent_id, child_id)
        requests[child_id] = RequestState(
            dataclasses.replace(prs.request, request_id=child_id, fork_of=None),
            state.num_added + i, prs.output_token_ids + (int(token),), prs.num_computed_tokens)
        insert_by_key(running, child_id, requests, config.policy)
    for request_id in release:
        if request_id not in running:
            raise ValueError(f"release names request_id={request_id!r}, which is not running")
        _free(bm, requests.pop(request_id))
        running.remove(request_id)
    return dataclasses.replace(state, block_manager=bm, requests=types.MappingProxyType(requests),
                               running=tuple(running), num_added=state.num_added + len(forks))


def check_invariants(state: SchedulerState, config: SchedulerConfig) -> None:
    """Raise ``AssertionError`` unless ``state`` is consistent (block manager included).

    Checks: waiting and running partition the live requests; both are sorted by the policy key;
    exactly the running requests own block tables, each exactly ``cdiv(num_computed_tokens,
    block_size)`` blocks long, whose dropped (null) entries are all ones the retention policy
    allows to drop (no block a later query sees is gone); waiting requests have computed nothing; at
    most ``max_num_seqs`` run; running counters stay within ``[1, num_tokens + num_draft_tokens]``.
    """
    bm = state.block_manager
    bm.check_invariants()
    waiting, running = set(state.waiting), set(state.running)
    _check(len(waiting) == len(state.waiting), "duplicate id in waiting")
    _check(len(running) == len(state.running), "duplicate id in running")
    _check(not waiting & running, "a request is both waiting and running")
    _check(waiting | running == set(state.requests), "waiting + running != live requests")
    _check(set(bm.request_ids()) == running, "block tables != running requests")
    _check(len(running) <= config.max_num_seqs, "more than max_num_seqs running")
    _check(not set(state.finished) & set(state.requests), "a finished request is still live")
    for queue in (state.waiting, state.running):
        keys = [policy_key(state.requests[i], config.policy) for i in queue]
        _check(keys == sorted(keys), "queue not in policy order")
    for request_id in state.waiting:
        _check(state.requests[request_id].num_computed_tokens == 0
               and state.requests[request_id].num_draft_tokens == 0,
               f"waiting request {request_id!r} has computed tokens")
        swapped = state.host is not None and state.host.swapped(request_id) is not None
        _check(swapped == (state.requests[request_id].swapped_tokens > 0),
               f"waiting request {request_id!r}: swapped_tokens and the host tier disagree")
    if state.host is not None:
        state.host.check_invariants()
        _check(all(state.host.swapped(i) is None for i in state.running),
               "a running request still holds swapped host slots")
    for request_id in state.running:
        rs = state.requests[request_id]
        _check(1 <= rs.num_computed_tokens <= rs.num_tokens + rs.num_draft_tokens,
               f"request {request_id!r}: num_computed_tokens={rs.num_computed_tokens} "
               f"not in [1, num_tokens + num_draft_tokens = "
               f"{rs.num_tokens + rs.num_draft_tokens}]")
        table = bm.block_table(request_id)
        _check(len(table) == bm.blocks_for(rs.num_computed_tokens),
               f"request {request_id!r}: block table length != cdiv(num_computed_tokens, "
               f"block_size)")
        at = rs.num_computed_tokens - rs.num_draft_tokens
        for g, t in enumerate(bm.block_tables(request_id)):
            lo = bm.window_start(g, at)
            dropped = [j for j, b in enumerate(t) if b == 0 and j >= lo]
            _check(g == 0 and all(state.cache.retention.may_drop(at, j, bm.block_size)
                                  for j in dropped) or not dropped,
                   f"request {request_id!r}: group {g}'s dropped blocks {dropped} include "
                   f"one its policy or window keeps")


def _check(condition, message: str) -> None:
    """``assert`` that survives ``python -O``."""
    if not condition:
        raise AssertionError(message)
