"""What one step computes (``StepPlan``: its ``ScheduledSeq``s and the block transfers to
apply first) and ``PlanBuilder``, the working copy one ``schedule`` call fills: created, mutated
and dropped inside that call, so the states it returns stay immutable."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import numpy as np

from jaxkv.blocks.block_manager import BlockManager
from jaxkv.blocks.host_tier import HostTier
from jaxkv.sched.state import RequestState, insert_by_key


@dataclasses.dataclass(frozen=True)
class ScheduledSeq:
    """One sequence of a step.

    Attributes:
      request_id: whose tokens these are.
      token_ids: tokens to compute this step (>= 1), draft tokens last.
      start_pos: position of ``token_ids[0]`` in the sequence (= tokens already computed).
      sample: whether a token is sampled after the last one (the chunk reaches the known end).
      block_table: the request's physical blocks; they cover every position up to
        ``start_pos + len(token_ids) - 1``.
      num_cached_tokens: at an admission, the tokens ``[0, start_pos)`` taken from the prefix
        cache or a fork (0 otherwise).
      num_drafts: the last ``num_drafts`` of ``token_ids`` are proposed draft tokens, not yet
        part of the request (only on a decode: then ``sample`` is true and the step samples
        ``1 + num_drafts`` rows for this sequence).
      group_tables: a hybrid cache's tables of groups 1, 2, ... (``block_table`` is group
        0's), each as long; empty with one group.
    """

    request_id: Hashable
    token_ids: tuple[int, ...]
    start_pos: int
    sample: bool
    block_table: tuple[int, ...]
    num_cached_tokens: int = 0
    num_drafts: int = 0
    group_tables: tuple[tuple[int, ...], ...] = ()


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one engine step computes.

    Attributes:
      seqs: scheduled sequences, in scheduling order (row ``i`` of the step's outputs).
      preempted_ids: requests preempted (blocks freed, back to waiting) by this schedule.
      finished_ids: requests finished or aborted since the previous schedule.
      copy_ops: ``(src, dst)`` block copies to apply, all at once, before the step.
      num_lookup_tokens: tokens of the requests admitted this step with a prefix-cache lookup
        or a fork.
      num_hit_tokens: of those, tokens found in the prefix cache (or shared by a fork), on any
        tier.
      swap_out: ``(block, slot, key)`` device block -> host slot copies, applied first (``key``:
        the prefix key of a demoted cached block, also written to the persistent cache; None
        for a swapped sequence's block or a radix partial block).
      disk_loads: ``(slot, row)`` persistent-cache rows (uint8 [block_bytes]) to put in host
        slots, after the swap-outs.
      swap_in: ``(slot, block)`` host slot -> device block copies, after the disk loads and
        before ``copy_ops``.
      swapped_ids: of ``preempted_ids``, those swapped out (the others recompute).
      num_host_hit_tokens: of ``num_hit_tokens``, tokens promoted from the host tier (disk
        included).
      num_disk_hit_tokens: of those, tokens read from the persistent cache.
      observe: whether the step returns the attention mass per block: some sampling
        sequence's retention policy wants it (``Retention.wants_scores``); the engine runs
        the step without computing it otherwise.
    """

    seqs: tuple[ScheduledSeq, ...]
    preempted_ids: tuple[Hashable, ...] = ()
    finished_ids: tuple[Hashable, ...] = ()
    copy_ops: tuple[tuple[int, int], ...] = ()
    num_lookup_tokens: int = 0
    num_hit_tokens: int = 0
    swap_out: tuple[tuple[int, int, Hashable], ...] = ()
    disk_loads: tuple[tuple[int, np.ndarray], ...] = ()
    swap_in: tuple[tuple[int, int], ...] = ()
    swapped_ids: tuple[Hashable, ...] = ()
    num_host_hit_tokens: int = 0
    num_disk_hit_tokens: int = 0
    observe: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def num_drafts(self) -> int:
        """Draft tokens the step verifies."""
        return sum(s.num_drafts for s in self.seqs)


@dataclasses.dataclass
class PlanBuilder:
    """One ``schedule`` call's working copies (block manager, host tier, request table, queues:
    copied from the state, mutated, put in the new state) and the plan it accumulates.

    Attributes:
      budget: tokens the step may still take.
      scheduled: ``(request id, new tokens)`` in scheduling order (row order of the step).
      decodes: running requests scheduled their one last token (the ones that take drafts).
      admitted: requests admitted from the waiting queue this step.
      cached: of those, tokens each took from the prefix cache or a fork.
      The other fields are ``StepPlan``'s, being built.
    """

    bm: BlockManager
    host: HostTier | None
    requests: dict[Hashable, RequestState]
    waiting: list[Hashable]
    running: list[Hashable]
    budget: int
    scheduled: list[tuple[Hashable, int]] = dataclasses.field(default_factory=list)
    decodes: set[Hashable] = dataclasses.field(default_factory=set)
    admitted: list[Hashable] = dataclasses.field(default_factory=list)
    cached: dict[Hashable, int] = dataclasses.field(default_factory=dict)
    preempted: list[Hashable] = dataclasses.field(default_factory=list)
    swapped: list[Hashable] = dataclasses.field(default_factory=list)
    copy_ops: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    swap_out: list[tuple[int, int, Hashable]] = dataclasses.field(default_factory=list)
    swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    disk_loads: list[tuple[int, np.ndarray]] = dataclasses.field(default_factory=list)
    num_lookup: int = 0
    num_host_hits: int = 0
    num_disk_hits: int = 0

    def remaining(self, request_id: Hashable) -> int:
        """Known tokens of ``request_id`` not yet computed (or planned)."""
        rs = self.requests[request_id]
        return rs.num_tokens - rs.num_computed_tokens

    def add(self, request_id: Hashable, n: int) -> None:
        """Schedule ``n`` new tokens of ``request_id`` (its blocks already cover them)."""
        self.scheduled.append((request_id, n))
        self.budget -= n

    def admit(self, rs: RequestState, n: int, policy: str) -> None:
        """Move the waiting ``rs`` (its blocks allocated) to running with ``n`` new tokens."""
        request_id = rs.request.request_id
        self.requests[request_id] = rs
        self.waiting.remove(request_id)
        self.admitted.append(request_id)
        insert_by_key(self.running, request_id, self.requests, policy)
        self.add(request_id, n)

    def plan(self, seqs: tuple[ScheduledSeq, ...], finished_ids: tuple[Hashable, ...],
             observe: bool) -> StepPlan:
        return StepPlan(seqs, preempted_ids=tuple(self.preempted), finished_ids=finished_ids,
                        copy_ops=tuple(self.copy_ops), num_lookup_tokens=self.num_lookup,
                        num_hit_tokens=sum(self.cached.values()),
                        swap_out=tuple(self.swap_out), disk_loads=tuple(self.disk_loads),
                        swap_in=tuple(self.swap_in), swapped_ids=tuple(self.swapped),
                        num_host_hit_tokens=self.num_host_hits,
                        num_disk_hit_tokens=self.num_disk_hits, observe=observe)
