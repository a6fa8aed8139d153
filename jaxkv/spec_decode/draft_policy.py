"""The adaptive draft-length policy of speculative decoding: each request's acceptance estimate
(its proposals compared with the emitted tokens, decayed, from the engine's pooled rate) and the
rule that turns the estimates into draft lengths: always ``k``, the fixed-cost rule, or the
step-time rule over measured step shapes, with paid-for exploration and a probe budget
(docs/speculative-decoding.md; the arithmetic is draft_lengths.py)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from jaxkv.sched import scheduler
from jaxkv.sched.plan import StepPlan
from jaxkv.sched.state import SchedulerState
from jaxkv.sched.step_cost import StepCostModel
from jaxkv.spec_decode.draft_lengths import (allocate_drafts, allocate_drafts_closed,
                                             best_num_drafts, fill_drafts)

_DECAY = 0.8            # per step, of a request's acceptance counts
_PRIOR_TRIALS = 2.0     # the weight, in trials, of a new request's prior (the pooled rate)
_POOL_DECAY = 0.9       # per comparison, of the engine's pooled acceptance counts
_HALF = (1.0, 2.0)      # (accepted, trials) of acceptance 1/2: the pool's start, a free
                        # proposer's prior under the step-time rule
EXPLORE_SHARE = 0.05    # most exploration (and probe) time, as a share of all measured step time
VERIFY_COST = 0.1       # the fixed-cost rule's c of an adaptive speculator without step times


class DraftPolicy:
    """How long each request's drafts are.

    Args:
      num_speculative_tokens: most drafts per sequence and step.
      draft_cost: the fixed-cost rule's cost of one more draft (a fraction of a decode step);
        None: not adaptive, always ``num_speculative_tokens``.
      step_cost: the target's step-time model (the step-time rule); None: the fixed-cost rule.
      max_num_batched_tokens: the step's token budget (with ``step_cost``).
      forward_cost: () -> the proposer's own forward-time model (a draft model's), or None
        for free proposals.
    """

    def __init__(self, num_speculative_tokens: int, draft_cost: float | None = None,
                 step_cost: StepCostModel | None = None,
                 max_num_batched_tokens: int | None = None,
                 forward_cost: Callable[[], StepCostModel | None] = lambda: None):
        self.num_speculative_tokens = num_speculative_tokens
        self.draft_cost = draft_cost
        self.step_cost = step_cost
        self._budget = max_num_batched_tokens
        self._forward_cost_of = forward_cost
        self._pool = _HALF   # every request's comparisons, decayed: (accepted, trials)
        self._acceptance: dict[Hashable, tuple[float, float]] = {}   # (accepted, trials)
        self._measured_s = 0.0   # kept step durations, summed (exploration and probe budgets)
        self._charged_s = 0.0    # kept exploration steps' time above the plain step's
        # this step explores: the time it is charged above (the plain step's, less the
        # exploration's proposal time)
        self._exploring: float | None = None
        self._probe_s = 0.0   # time of the proposals of steps that drafted nothing (probes)

    @property
    def by_step_time(self) -> bool:
        """Whether the draft lengths follow the step-time rule (else the fixed-cost rule)."""
        return self.step_cost is not None and self.draft_cost is not None

    @property
    def _forward_cost(self) -> StepCostModel | None:
        """The proposer's own forward-time model, read at each use (tests swap the proposer)."""
        return self._forward_cost_of()

    def acceptance(self, request_id: Hashable) -> float:
        """The request's estimated draft acceptance (before any measurement of its own:
        ``_prior``)."""
        accepted, trials = self._acceptance.get(request_id, self._prior())
        return accepted / trials

    def _prior(self) -> tuple[float, float]:
        """A new request's (accepted, trials): the pooled rate (1/2 for a free proposer under
        the step-time rule), weighing ``_PRIOR_TRIALS``."""
        accepted, trials = (_HALF if self.by_step_time and self._forward_cost is None
                            else self._pool)
        return _PRIOR_TRIALS * accepted / trials, _PRIOR_TRIALS

    def start_step(self, live: set[Hashable]) -> None:
        """Forget the estimates of requests no longer live; nothing explores yet."""
        self._acceptance = {i: a for i, a in self._acceptance.items() if i in live}
        self._exploring = None

    def is_cold(self, request_id: Hashable) -> bool:
        """Whether no proposal of the request has been compared with emitted tokens yet."""
        return request_id not in self._acceptance

    @property
    def probes_over_budget(self) -> bool:
        """Whether probes have cost more than their share: always without step times (the
        fixed-cost rule: a probe that does not pay backs off), else when the proposals of the
        steps that drafted nothing took more than ``EXPLORE_SHARE`` of the measured step
        time."""
        return self.step_cost is None or self._probe_s > EXPLORE_SHARE * self._measured_s

    def chosen_lengths(self, state: SchedulerState, ids: Sequence[Hashable], rooms: Sequence[int],
                       proposal_time: Callable[[int, int], float]
                       ) -> tuple[dict[Hashable, int], bool] | None:
        """The draft length of each decode in ``ids`` chosen before proposing (those with
        room for a draft: ``rooms`` int [N], each one's ``_room``), before anything is
        proposed, and whether its ``k = 0`` requests may be probed: always under the
        fixed-cost rule; under the step-time rule while the probes are within their budget
        and a draft forward over the step's decodes takes less than the target's plain step
        (else no draft could pay, were every one accepted and its verification free);
        ``proposal_time(num_decodes, longest)``: seconds of proposing. None
        while the step-time rule's plain step is unmeasured (no proposals at all then)."""
        if self.draft_cost is None:
            return {i: self.num_speculative_tokens for i in ids}, True
        if self.step_cost is None:
            return {i: best_num_drafts(self.acceptance(i), self.num_speculative_tokens,
                                       self.draft_cost) for i in ids}, True
        caps = [min(self.num_speculative_tokens, r) for r in rooms]
        ks = self.step_lengths(state, ids, [self.acceptance(i) for i in ids], caps,
                                [False] * len(ids),
                                lambda longest: proposal_time(len(ids), longest))
        if ks is None:
            return None
        plain = self.step_cost.predict(*self.step_shape(state), False)
        probe = not self.probes_over_budget and proposal_time(len(ids), 1) < plain
        return dict(zip(ids, ks)), probe

    def step_shape(self, state: SchedulerState) -> tuple[int, int]:
        """The estimated ``(tokens, sequences)`` of the next step without drafts: its decodes
        and the running prefills' next chunks (within the token budget; requests the
        scheduler will admit from the queue are not foreseen)."""
        decoding = set(scheduler.decoding_ids(state))
        prefill = sum(state.requests[i].num_tokens - state.requests[i].num_computed_tokens
                      for i in state.running if i not in decoding)
        return min(self._budget, len(decoding) + prefill), len(state.running)

    def step_lengths(self, state: SchedulerState, ids: Sequence[Hashable],
                      acceptance: Sequence[float], caps: Sequence[int], cold: Sequence[bool],
                      proposal_time: Callable[[int], float] | None = None) -> list[int] | None:
        """The step-time rule's draft lengths (int [N]) of the decodes ``ids`` (acceptance
        float [N], at most caps int [N] drafts each) from the step's estimated shape (its
        decodes and the running prefills' next chunks; requests the scheduler will admit from
        the queue are not foreseen), by the step-time rule's guards (docs/speculative-decoding.md):

        * None while the plain step is unmeasured or stale (this step measures it);
        * else a paid-for exploration of a shape at most one bucket above it (with costly
          proposals, only of a shape where they would pay if it took no longer than the plain
          step);
        * else ``allocate_drafts`` (``allocate_drafts_closed`` for a closed batch) with
          ``proposal_time`` (longest draft -> seconds; None: free) over the measured shapes
          among the requests not ``cold``, the cold ones filling the chosen bucket's room.
        """
        model, budget = self.step_cost, self._budget
        base, num_seqs = self.step_shape(state)
        decoding_order = scheduler.decoding_ids(state)
        prefill = len(decoding_order) < num_seqs   # a running request is not decoding
        plain = model.predict(base, num_seqs, False)
        if plain is None or model.wants(base, num_seqs, False):
            model.tried(base, num_seqs, False)
            return None
        explore = self._exploration(base, num_seqs, sum(caps))
        if explore is not None and proposal_time is not None and not sum(allocate_drafts(
                acceptance, caps, base, min(explore, budget), model.token_buckets,
                lambda t, d: plain, proposal_time)):
            explore = None   # costly proposals that would not pay even at the plain step's time
        if explore is not None:
            model.tried(explore, num_seqs, True)
            self._exploring = plain
            return fill_drafts(   # the most drafts that fit it (they pad to it)
                acceptance, caps, min(explore, budget) - base)
        warm_caps = [0 if c else cap for c, cap in zip(cold, caps)]
        step_time = lambda t, d: model.predict(t, num_seqs, d)   # noqa: E731
        if not state.waiting and not prefill:   # a closed batch: the longest sets the end
            # every decode counts, those without a proposal (no drafts) first
            acc, cap = dict(zip(ids, acceptance)), dict(zip(ids, warm_caps))
            every = [i for i in decoding_order if i not in acc] + list(ids)
            remaining = [state.requests[i].request.stop.max_tokens
                         - len(state.requests[i].output_token_ids) for i in every]
            ks = allocate_drafts_closed(
                [acc.get(i, 0.0) for i in every], [cap.get(i, 0) for i in every], remaining,
                base, budget, model.token_buckets, step_time, proposal_time)
            ks = ks[len(every) - len(ids):]
        else:
            ks = allocate_drafts(acceptance, warm_caps, base, budget, model.token_buckets,
                                 step_time, proposal_time)
        if sum(ks):   # cold requests fill the room of the bucket the step pads to anyway
            room = min(model.key(base + sum(ks), num_seqs, True)[0], budget) - base - sum(ks)
            ks = [k + f for k, f in zip(ks, fill_drafts(
                [a if c else 0.0 for a, c in zip(acceptance, cold)],
                [cap - k for cap, k in zip(caps, ks)], room))]
        return ks

    def _exploration(self, base: int, num_seqs: int, num_proposed: int) -> int | None:
        """The token bucket of the draft step to explore now, or None: the smallest unmeasured
        (or stale) one that ``num_proposed`` drafts over ``base`` tokens pad to, among the
        plain step's own token bucket and the next one up, while the exploration charges are
        at most ``EXPLORE_SHARE`` of the measured step time. (The plain step's own bucket:
        the one ``base`` tokens pad to in a step with drafts, not a decode bucket.)"""
        model = self.step_cost
        if self._charged_s > EXPLORE_SHARE * self._measured_s:
            return None
        plain_bucket = model.key(base, num_seqs, True)[0]
        candidates = ([plain_bucket] if base < plain_bucket else []) + [
            t for t in model.token_buckets if t > plain_bucket][:1]
        reach = min(base + num_proposed, self._budget)
        return next((t for t, below in zip(candidates, [base] + candidates)
                     if reach > below and model.wants(t, num_seqs, True)), None)

    def charge_proposals(self, seconds: float, drafted: bool) -> None:
        """Counts a step's proposal time: against the probes' budget when it drafted nothing,
        and against an exploration's charge."""
        if not drafted:
            self._probe_s += seconds
        if self._exploring is not None:
            self._exploring -= seconds

    def observe_step(self, plan: StepPlan, seconds: float) -> None:
        """A step's measured device time, into the step-time model and the budgets."""
        if self.step_cost.observe(plan.num_tokens, len(plan.seqs), plan.num_drafts > 0, seconds):
            self._measured_s += seconds
            if self._exploring is not None:   # charged: its time above the plain step's
                self._charged_s += max(0.0, seconds - self._exploring)

    def observe_proposal(self, request_id: Hashable, proposal: Sequence[int],
                         emitted: Sequence[int]) -> None:
        """Compares a proposal with the tokens the step emitted (verified or not): its positions
        up to the first mismatch are trials, the matches successes, into the request's estimate
        and the engine's pool."""
        matched = next((j for j, (p, e) in enumerate(zip(proposal, emitted)) if p != e), None)
        trials = min(len(proposal), len(emitted)) if matched is None else matched + 1
        accepted, total = self._acceptance.get(request_id, self._prior())
        successes = trials if matched is None else matched
        self._acceptance[request_id] = (_DECAY * accepted + successes, _DECAY * total + trials)
        self._pool = (_POOL_DECAY * self._pool[0] + successes,
                      _POOL_DECAY * self._pool[1] + trials)
