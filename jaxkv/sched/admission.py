"""Admission, step 2 of ``schedule``: waiting requests enter with a prefill chunk while the
budget, ``max_num_seqs`` and the free blocks allow, each from where it can resume: a swapped-out
request from the host tier, a fork from its parent's blocks, any other from its longest cached
prefix (device, host tier, disk). Plus the retention rule both steps 0 and 2 apply."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxkv.blocks import host_tier
from jaxkv.blocks.block_manager import BlockManager
from jaxkv.blocks.host_tier import NO_SLOT
from jaxkv.config import SchedulerConfig
from jaxkv.retention import Retention
from jaxkv.sched.plan import PlanBuilder
from jaxkv.sched.state import RequestState, SchedulerState, policy_key


def retain(bm: BlockManager, retention: Retention, rs: RequestState) -> RequestState:
    """``rs`` after giving back the blocks ``retention`` drops before its next query (at
    ``num_computed_tokens``; the null block takes their table entries), and those that left
    a sliding group's window."""
    request_id, at = rs.request.request_id, rs.num_computed_tokens
    bm.release_window(request_id, at)
    if retention.history_dependent and at < len(rs.request.prompt_token_ids):
        return rs   # the prompt is computed with full attention first
    drops = retention.drops(at, bm.block_table(request_id), rs.block_scores, bm.block_size,
                            prompt_tokens=len(rs.request.prompt_token_ids))
    if not drops:
        return rs
    bm.release_blocks(request_id, drops)
    if retention.history_dependent and rs.first_drop is None:
        return dataclasses.replace(rs, first_drop=at)
    return rs


def sees_kept(table: Sequence[int], num_computed: int, retention: Retention,
              block_size: int) -> bool:
    """Whether every block of ``table`` a query at ``num_computed`` may still see is kept."""
    return all(b != 0 or retention.may_drop(num_computed, j, block_size)
               for j, b in enumerate(table))


def admit_waiting(b: PlanBuilder, state: SchedulerState, config: SchedulerConfig) -> None:
    """Admit waiting requests in queue order (``lpm``: longest cached prefix first), stopping at
    the first that does not fit (no overtaking; a fork whose parent is not ready lets others
    pass); then count, for ``lpm``'s age bound, the waiting requests the admitted overtook."""
    for request_id in _candidates(b, config):
        if b.budget <= 0 or len(b.running) >= config.max_num_seqs:
            break
        rs = b.requests[request_id]
        admitted = (_admit_swapped(b, state, config, rs) if rs.swapped_tokens
                    else _admit_prefix(b, state, config, rs))
        if admitted is False:
            break
    if b.admitted:
        last = max(policy_key(b.requests[i], config.policy) for i in b.admitted)
        for i in b.waiting:
            if policy_key(b.requests[i], config.policy) < last:
                b.requests[i] = dataclasses.replace(b.requests[i],
                                                    num_skipped=b.requests[i].num_skipped + 1)


def _candidates(b: PlanBuilder, config: SchedulerConfig) -> list:
    """The waiting ids in the order admission tries them: queue order, or under ``lpm`` the
    longest cached prefix first, except that one overtaken ``lpm_max_skips`` times goes first."""
    candidates = list(b.waiting)
    if config.policy == "lpm":
        def lpm_key(i):
            rs = b.requests[i]
            blocks, _, partial = b.bm.lookup(rs.token_ids(0, rs.num_tokens - 1),
                                             rs.request.cache_salt)
            hit = len(blocks) * b.bm.block_size + (partial[1] if partial else 0)
            return (rs.num_skipped < config.lpm_max_skips, -hit)
        candidates.sort(key=lpm_key)   # stable: FCFS among equals
    return candidates


def _reserve(b: PlanBuilder, state: SchedulerState, config: SchedulerConfig,
             rs: RequestState, chunk_end: int) -> int:
    """Free blocks to leave beyond the chunk's: none at a first admission; for a request
    coming back from a preemption, one of headroom per running request plus the blocks its
    known tokens hold at once (retention and windows applied) beyond the chunk's
    (docs/scheduling.md)."""
    if not rs.num_preemptions:
        return 0
    held = state.cache.max_blocks(rs.num_tokens, config.max_num_batched_tokens,
                                  len(rs.request.prompt_token_ids))
    return len(b.running) + max(0, held - b.bm.num_groups * b.bm.blocks_for(chunk_end))


def _admit_swapped(b: PlanBuilder, state: SchedulerState, config: SchedulerConfig,
                   rs: RequestState) -> bool:
    """A swapped-out request resumes where it stopped, its kept blocks back from the host."""
    request_id, bm = rs.request.request_id, b.bm
    n = min(rs.num_tokens - rs.swapped_tokens, b.budget)
    slots = b.host.swapped(request_id)
    kept = [slot != NO_SLOT for slot in slots]
    end = rs.swapped_tokens + n
    if not bm.can_allocate_layout(kept, end, reserve=_reserve(b, state, config, rs, end)):
        return False
    table = bm.allocate_layout(request_id, kept, rs.swapped_tokens + n,
                               salt=rs.request.cache_salt)
    b.host.swap_in(request_id)
    b.swap_in.extend((slot, block) for slot, block in zip(slots, table) if slot != NO_SLOT)
    rs = retain(bm, state.cache.retention, dataclasses.replace(
        rs, num_computed_tokens=rs.swapped_tokens, swapped_tokens=0))
    b.admit(rs, n, config.policy)
    return True


def _admit_prefix(b: PlanBuilder, state: SchedulerState, config: SchedulerConfig,
                  rs: RequestState) -> bool | None:
    """A fork shares its parent's prompt blocks (None: the parent is not ready, wait); a fork
    whose parent dropped blocks it sees, and any other request, takes its cached prefix."""
    parent = rs.request.fork_of
    if parent in state.requests:
        prs = state.requests[parent]
        p = len(rs.request.prompt_token_ids)
        if parent not in state.running or prs.num_computed_tokens < p - 1:
            return None
        hit = b.bm.block_table(parent)[:b.bm.blocks_for(p - 1)]
        if (sees_kept(hit, p - 1, state.cache.retention, b.bm.block_size)
                and b.bm.window_kept(parent, p - 1, len(hit))):
            return _admit_fork(b, state, config, rs, prs, hit)
    return _admit_cached(b, state, config, rs)


def _admit_fork(b: PlanBuilder, state: SchedulerState, config: SchedulerConfig,
                rs: RequestState, prs: RequestState, hit: tuple[int, ...]) -> bool:
    """Share the parent's blocks below its last prompt token, copying the last one if partial;
    the fork starts from the parent's drops and scores."""
    request_id, bm = rs.request.request_id, b.bm
    num_cached = len(rs.request.prompt_token_ids) - 1
    n = min(rs.num_tokens - num_cached, b.budget)
    end = num_cached + n
    need = bm.num_groups * (bm.blocks_for(end) - len(hit) + (num_cached % bm.block_size > 0))
    if need + _reserve(b, state, config, rs, end) > bm.num_free_blocks:
        return False
    bm.fork(prs.request.request_id, request_id, len(hit))
    ops = bm.copy_on_write(request_id, num_cached)
    bm.append_slots(request_id, num_cached + n)
    b.num_lookup += rs.num_tokens
    scores = None if prs.block_scores is None else prs.block_scores[:len(hit)].copy()
    _enter(b, state, config, rs, num_cached, n, ops, first_drop=prs.first_drop,
           block_scores=scores)
    return True


def _admit_cached(b: PlanBuilder, state: SchedulerState, config: SchedulerConfig,
                  rs: RequestState) -> bool:
    """Take the longest cached prefix of the tokens before the last observed ones (the device
    pool, then the host tier and disk: those blocks are promoted into fresh device blocks)."""
    request_id, bm = rs.request.request_id, b.bm
    last = max(0, rs.num_tokens - max(1, state.cache.retention.observe))   # SnapKV's window computes
    hit, keys, partial, host_hits = host_tier.lookup(bm, b.host, rs.token_ids(0, last),
                                                     rs.request.cache_salt)
    b.disk_loads.extend((h.slot, h.row) for h in host_hits if h.row is not None)
    num_cached = (len(hit) * bm.block_size + sum(len(h.tokens) for h in host_hits)
                  + (partial[1] if partial else 0))
    n = min(rs.num_tokens - num_cached, b.budget)
    end = num_cached + n
    if not bm.can_allocate_cached(end, hit, partial, keys=keys[:len(hit)],
                                  reserve=_reserve(b, state, config, rs, end)):
        return False
    table, op = bm.allocate_cached(request_id, num_cached + n, hit, keys[:len(hit)], partial,
                                   salt=rs.request.cache_salt,
                                   promoted=len(host_hits) if bm.num_groups == 1 else 0)
    if host_hits:   # promoted: fresh blocks filled from the host, full ones cached
        b.swap_in.extend(host_tier.promotions(bm, request_id, len(hit), host_hits))
        b.num_host_hits += host_tier.hit_tokens(bm, host_hits)
        b.num_disk_hits += host_tier.hit_tokens(bm, host_hits, disk=True)
    if bm.prefix_cache is not None:
        b.num_lookup += rs.num_tokens
    _enter(b, state, config, rs, num_cached, n, () if op is None else (op,))
    return True


def _enter(b: PlanBuilder, state: SchedulerState, config: SchedulerConfig, rs: RequestState,
           num_cached: int, n: int, ops: Sequence[tuple[int, int]], **inherited) -> None:
    """Admit ``rs`` with ``num_cached`` tokens found and ``n`` new ones (``ops``: the copies its
    partial hit or shared last block needs first)."""
    b.copy_ops.extend(ops)
    b.cached[rs.request.request_id] = num_cached
    rs = retain(b.bm, state.cache.retention, dataclasses.replace(
        rs, num_computed_tokens=num_cached,
        num_cached_tokens=rs.num_cached_tokens or num_cached, **inherited))
    b.admit(rs, n, config.policy)
