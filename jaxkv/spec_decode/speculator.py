"""Speculative decoding on the host: the draft proposers and the engine's seam for them.

    speculator = Speculator.from_args(config.speculative, config, runner)   # EngineCore.__init__
    drafts = speculator.drafts(state)                           # {request id: draft tokens}
    state, plan = scheduler.schedule(state, sched_config, drafts)
    result = runner.execute(plan, rows)                         # verifies them (jitted)
    speculator.record(plan, result.tokens, result.num_accepted, seconds)  # acceptance,
                                                # step times, stats()
    speculator.forget(state)                                    # after update / abort

The seam is the one call before ``schedule``. A proposer sees only a request's tokens (prompt +
output so far) and returns up to ``k`` guesses of what follows; the scheduler alone decides how
many of them fit the step (the budget and free blocks its own work leaves, ``max_tokens``), the
jitted step verifies them (jaxkv/sample/rejection.py) and ``scheduler.update`` keeps the
accepted ones and rewinds over the rest. So the scheduler stays pure and model-free, proposing
needs no scheduler internals, and a new proposer is one class. The alternative seam, the
scheduler calling the proposer while it plans, would put proposer state (and for a draft model,
device work) inside the pure scheduler. The cost of this seam: drafts are proposed for every
running decode, also those the step will not have room for (an n-gram lookup is microseconds;
a draft model's forwards for them are wasted when a step's budget or the free blocks are short).

Proposers:

* ``"ngram"`` (prompt lookup, jaxkv/spec_decode/ngram.py): the ``k`` tokens that followed the most
  recent earlier occurrence of the longest suffix of the tokens, ``n`` from
  ``prompt_lookup_max`` down to ``prompt_lookup_min``. Host-side numpy, no model.
* ``"suffix"`` (SuffixDecoding, jaxkv/spec_decode/suffix.py): the same lookup over a suffix trie of
  every running request's tokens and of recent requests' (a bounded cache), continued by the
  most frequent next tokens while their estimated probability holds. Host-side, no model.
* ``"draft"`` (``speculative_model=...``, jaxkv/spec_decode/draft_model.py): a small model with the
  target's tokenizer, run by the engine's own ``ModelRunner`` over its own paged KV cache; greedy
  drafts (point masses, verified exactly as the n-gram ones), batched across requests.

Two kinds of proposer fit the seam. A ``Proposer`` (``propose(token_ids, k)``) is per request and
stateless, like the n-gram lookup. A ``BatchProposer`` (``propose_batch({id: (token_ids, k)})``
and ``release(id)``) sees every request that wants drafts at once and may keep per-request
state (the draft model's KV cache); the speculator calls ``release`` for each request it
proposed for once that request is no longer running (finished, aborted, failed or
preempted), from ``forget``, which the engine calls after every step and abort, and from
``drafts``. A plain ``Proposer`` is adapted with a loop.

Adaptive draft length (``speculative_adaptive``, on by default). Each request keeps an estimate
``a`` of the probability that a draft is accepted given the ones before it were; ``k`` drafts
then emit ``E(k) = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)`` tokens in expectation
(Leviathan et al.). (The arithmetic of the rules below, pure functions, is
jaxkv/spec_decode/draft_lengths.py.) The estimate needs no verification: the proposer is asked every
step (a costly one less often: probes, below), and its proposal is compared with the tokens the
step emitted, verified or not; a comparison counts
its positions up to and including the first mismatch (trials) and the matches (successes), both
decayed by ``_DECAY`` per comparison from a prior (the engine's pooled rate, below, with the
weight of ``_PRIOR_TRIALS`` trials). A
request whose proposals stopped being accepted stops drafting at once, and starts again when its
proposals start matching. Two rules turn the estimates into draft lengths:

* The step-time rule (every adaptive speculator of an engine). What a step costs depends on
  the shape it pads to, not on its tokens one by one: ``B`` decodes with ``k`` drafts each are
  ``B (1 + k)`` tokens, padded to the next token bucket, and verifying widens the sampled rows
  from 1 to ``1 + num_speculative_tokens`` per sequence (jaxkv/runner/batch.py). A ``StepCostModel``
  (jaxkv/sched/step_cost.py), fitted online to the engine's measured step times by padded shape,
  gives ``T(tokens, drafts?)``, and ``allocate_drafts`` chooses the whole step's lengths, each in
  ``[0, its proposal's length]``, to maximise expected emitted tokens per second::

      sum_i E_i(k_i) / (T(base + sum_i k_i, sum_i k_i > 0) + P(max_i k_i))

  exactly (the largest marginal gains ``a_i^j`` first, one candidate per bucket and longest
  draft, and ``k = 0`` everywhere, the plain step, is always a candidate: by the model's
  measurements speculation is never chosen when it is slower). ``P(m)`` is what proposing
  costs: 0 for the n-gram and suffix lookups (microseconds on the host), ``m`` forwards of the
  draft model (below). That is the throughput of a batch that stays full (a request
  that finishes early makes room for a waiting one). A closed batch (nothing waits, every
  running request decodes) ends when its longest request does, and a token emitted early by
  a request that then waits for the others buys nothing: there ``allocate_drafts_closed``
  minimises the batch's expected remaining time instead (a one-step lookahead over the
  request with the most tokens left). At batch 4 the tokens-per-second rule drafted for the
  requests whose proposals matched while the one whose did not set the pace: every step cost
  13% more for the same number of steps, 0.85x (BENCHMARKS.md). Drafts inside the bucket the
  step pads to anyway are nearly free; the one that pushes the step into the next bucket pays
  the whole jump. A free proposer is asked for ``num_speculative_tokens`` drafts for every
  decode first, so a proposal's real length caps its ``k``. Three guards keep an unmeasured
  shape from costing more than no speculation would:

  - While the plain step's shape is unmeasured (or stale) the step is plain (k = 0
    everywhere): what no speculation does anyway. There is no fixed-cost guess in this rule.
  - An unmeasured (or stale) draft shape is explored, by the best drafts that fill its bucket,
    only when it is at most one bucket above the plain step's bucket (drafts inside the plain
    bucket, or the next bucket up; larger jumps are never tried, so never chosen), and only
    while the exploration spending is paid for: each kept exploration's time above the plain
    step's (its proposals' time included) is charged, and a new one is planned only while the
    charges are at most ``_EXPLORE_SHARE`` of all measured step time (a shape's first,
    compiling, step is neither charged nor counted). So exploring costs at most that share of
    the device time, plus one exploration step and each shape's first visit.
  - A cold request of a free proposer (no proposal of its compared with emitted tokens yet:
    its acceptance is the prior 1/2) does not take part in choosing the step's shape; it only
    fills the room the chosen draft step pads to anyway. So the priors of a batch of new
    requests cannot push the step into a larger bucket.

  At batch 64 on a 512-token context (BENCHMARKS.md) the earlier rule explored the 1024-token
  bucket from a 64-token plain step (12x its time) and, with the plain step unmeasured,
  proposed the fixed-cost rule's k = 2 for all 64 cold requests (256 tokens, 4x): 0.63x.

  Costly proposals (a proposer with a ``forward_cost``, its own ``StepCostModel``: the draft
  model, whose every draft position is a forward over the requests it drafts for). The
  lengths are chosen before anything is proposed, from the estimates alone, and the proposer
  is then asked for exactly those. ``P(m) = m t_draft``, ``t_draft`` the draft's measured
  forward over the step's decodes (0 while unmeasured, so it drafts and gets measured); the
  search runs over every longest draft ``m`` (jaxkv/spec_decode/draft_lengths.py). A draft as
  costly as the target then never drafts, whatever its acceptance, without the user having to know
  what it costs; and in a lockstep batch the draft's forwards for requests that finish early are
  weighed against the request that sets the end. A draft shape is explored only where the
  drafts would pay if it cost no more than the plain step (a proposal costs a forward), and
  its charge includes the exploration's proposal time. (In a server whose every step at a
  batch size carries a prefill chunk, that batch's plain decode step is never measured, so the
  draft model does not draft there: the conservative side.) The previous rule for the draft
  model, the fixed-cost rule below with ``c = 0.1 + t_draft / t_plain`` per request, drafted
  at batch 4 on stories (acceptance 0.28 > c = 0.18) where the draft steps' larger bucket and
  the lockstep made it 0.79x (BENCHMARKS.md).
* The fixed-cost rule (a speculator without a step-time model, as built without an engine
  config): per request, the ``k`` in ``[0, num_speculative_tokens]`` that maximises ``E(k) /
  (1 + c k)``, ``c = draft_cost`` (``_VERIFY_COST`` from the options alone) the cost of one
  more draft as a fraction of a decode step. So ``k = 0`` exactly when ``a <= c`` (Leviathan et
  al.'s condition for a gain is ``a > c``). It is wrong at large batch, where a step of ``B (1
  + k)`` tokens costs much more than one of ``B``: the reason for the step-time rule.

Probes. When the lengths are chosen before proposing (costly proposals, and the fixed-cost
rule), a ``k = 0`` request is still asked for one token, so it keeps measuring (two while the
draft's decode forward is unmeasured: a probe's catch-up forward alone would never measure it);
a proposer whose proposals cost a forward pass (the draft model) sets ``probe_interval``: a
``k = 0`` request is then asked for its one token only once per that many steps (its draft
cache catches up then, in one chunk). Each probe after which the request still does not draft
doubles its interval, up to ``_MAX_PROBE_BACKOFF`` times ``probe_interval``; a step that drafts
resets it. So a request the draft cannot help costs O(log n) draft forwards over n tokens
instead of n / ``probe_interval`` (also when its probes match: a draft as costly as the target
that agrees with it never pays), and one whose proposals start matching drafts after the probes
that lift its estimate enough (two, from an estimate near 0, at ``c = 0.3``). With measured
step times probes have a budget: the time of the proposals of steps that drafted nothing
(probes alone) is held to ``_EXPLORE_SHARE`` of the measured step time (plus one probe: none is
made while it is over), and the back-off applies only while it is over. Nor is any made while a
draft forward over the step's decodes takes at least the target's plain step: then no draft
could pay, were every one accepted and its verification free (skip12-18, a 24-layer draft, at
350 ms against 58). A cheap draft (the 2-layer trained3-v4096: a 4 ms forward against a 55 ms
target step at batch 1) thus keeps probing every ``probe_interval`` steps, and a request whose
estimate fell on a run of misses (at acceptance 0.3, four in a row a quarter of the time)
drafts again after its next matching probe instead of backing off for the rest of its life.

For such proposers what the engine learned carries over to new requests (the step-time rule
of a free proposer keeps the prior 1/2: a cold request never chooses its step's shape there,
and its prior only orders the drafts that fill the room). A request's estimate starts from the
engine's pooled acceptance (every comparison of every request, decayed by ``_POOL_DECAY`` per
comparison, from 1/2; it weighs as ``_PRIOR_TRIALS`` trials) instead of a fixed 1/2, and a new
request of a costly proposer starts at the probe interval the engine's latest probe outcome
left (the base once any request drafts). So once a draft has been found not to pay, new
requests neither draft at once on an optimistic prior nor pay a draft prefill of their prompt
at their first probe; with every request shorter than the interval no request would probe
again, so when no request has been asked for ``_MAX_PROBE_BACKOFF`` times ``probe_interval``
steps, the one left unasked longest is, and the engine notices a workload the draft does help.
Such a probe catches the draft up on that request's whole history (for a draft as large as
skip12-18, a second or more: 13% of the device time at one per 128 steps, BENCHMARKS.md), so
with measured step times it is also held to the probes' budget: it is made only while the
probes' wall time is at most ``_EXPLORE_SHARE`` of the measured target step time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Protocol

import numpy as np

from jaxkv.config import EngineConfig, SpeculativeArgs
from jaxkv.sched import scheduler
from jaxkv.sched.plan import StepPlan
from jaxkv.sched.state import RequestState, SchedulerState
from jaxkv.sched.step_cost import StepCostModel
from jaxkv.spec_decode.draft_lengths import (allocate_drafts, allocate_drafts_closed,
                                             best_num_drafts, fill_drafts)
from jaxkv.spec_decode.ngram import NgramProposer
from jaxkv.spec_decode.suffix import SuffixProposer

_DECAY = 0.8            # per step, of a request's acceptance counts
_PRIOR_TRIALS = 2.0     # the weight, in trials, of a new request's prior (the pooled rate)
_POOL_DECAY = 0.9       # per comparison, of the engine's pooled acceptance counts
_HALF = (1.0, 2.0)      # (accepted, trials) of acceptance 1/2: the pool's start, a free
                        # proposer's prior under the step-time rule
_EXPLORE_SHARE = 0.05   # most exploration charges, as a share of all measured step time
_MAX_PROBE_BACKOFF = 16  # a k = 0 request's probe interval grows to this many base intervals
_VERIFY_COST = 0.1      # the fixed-cost rule's c of an adaptive speculator without step times


class Proposer(Protocol):
    """Proposes draft tokens from a request's tokens alone."""

    def propose(self, token_ids: np.ndarray, num_drafts: int) -> Sequence[int]:
        """Up to ``num_drafts`` guesses of the tokens after ``token_ids`` (int32 [L], prompt +
        output so far); empty when it has none."""


class BatchProposer(Protocol):
    """Proposes draft tokens for several requests at once, possibly keeping per-request state."""

    def propose_batch(self, requests: Mapping[Hashable, tuple[np.ndarray, int]]
                      ) -> Mapping[Hashable, Sequence[int]]:
        """``{request_id: up to k guesses}`` for ``{request_id: (token_ids, k)}`` (int32 [L],
        prompt + output so far; most urgent first); a request may be missing from the result."""

    def release(self, request_id: Hashable) -> None:
        """Forgets ``request_id``'s state (it is no longer running)."""


def propose_batch(proposer: Proposer | BatchProposer,
                  requests: Mapping[Hashable, tuple[np.ndarray, int]]
                  ) -> Mapping[Hashable, Sequence[int]]:
    """``proposer.propose_batch(requests)``, or a loop over ``proposer.propose`` for a plain
    ``Proposer``."""
    if hasattr(proposer, "propose_batch"):
        return proposer.propose_batch(requests)
    return {i: proposer.propose(tokens, k) for i, (tokens, k) in requests.items()}


def _room(rs: RequestState) -> int:
    """The most drafts a request can use this step: its tokens left before ``max_tokens``,
    less the one the step emits anyway (<= 0: none)."""
    return rs.request.stop.max_tokens - len(rs.output_token_ids) - 1


def _history(rs: RequestState) -> np.ndarray:
    """int32 [L]: a request's prompt and output so far (what a proposer sees)."""
    return np.asarray(rs.token_ids(0, rs.num_tokens), np.int32)


class Speculator:
    """The engine's speculative decoding: proposes drafts before each schedule, measures and
    counts what the step accepted.

    Args:
      proposer: a ``Proposer`` or ``BatchProposer``, or None (speculation off: no drafts).
      num_speculative_tokens: most drafts proposed per sequence and step.
      draft_cost: the fixed-cost rule's cost of one more draft token (a fraction of a decode
        step); None: not adaptive, always propose ``num_speculative_tokens``.
      step_cost: the target's step-time model: the adaptive draft lengths maximise emitted
        tokens per second with it (``allocate_drafts`` over the shapes it has measured, with
        bounded exploration, a costly proposer's measured forwards added: the module
        docstring). None: the fixed-cost rule with ``c = draft_cost``.
      max_num_batched_tokens: the step's token budget (with ``step_cost``).

    Attributes:
      proposer: as given (a public seam: tests swap in their own).
      num_speculative_tokens, draft_cost, step_cost: as given.
    """

    def __init__(self, proposer: Proposer | BatchProposer | None, num_speculative_tokens: int,
                 draft_cost: float | None = None, step_cost: StepCostModel | None = None,
                 max_num_batched_tokens: int | None = None):
        self.proposer = proposer
        self._held: set[Hashable] = set()   # requests proposed for since their last release
        self._idle: dict[Hashable, int] = {}  # k = 0 steps since a request was last asked
        self._probe_every: dict[Hashable, int] = {}   # a k = 0 request's interval, if not the base
        self._probes: set[Hashable] = set()   # this step's k = 0 requests asked for one token
        self._pool_probe_every: int | None = None   # a new request's interval (None: the base)
        self._quiet = 0   # steps since any request was asked for a proposal (fixed-cost rule)
        self._probe_s = 0.0   # time of the proposals of steps that drafted nothing (probes)
        self._pool = _HALF   # every request's comparisons, decayed: (accepted, trials)
        self.num_speculative_tokens = num_speculative_tokens
        self.draft_cost = draft_cost
        self.step_cost = step_cost
        self._budget = max_num_batched_tokens
        self._measured_s = 0.0   # kept step durations, summed (exploration and probe budgets)
        self._charged_s = 0.0    # kept exploration steps' time above the plain step's
        # this step explores: the time it is charged above (the plain step's, less the
        # exploration's proposal time)
        self._exploring: float | None = None
        self._proposals: dict[Hashable, tuple[int, ...]] = {}   # this step's, by request
        self._acceptance: dict[Hashable, tuple[float, float]] = {}   # (accepted, trials)
        self._proposed = 0   # draft tokens proposed
        self._drafts = 0     # sequences that verified drafts
        self._verified = 0   # draft tokens verified (scheduled)
        self._accepted = 0   # draft tokens accepted

    @classmethod
    def from_args(cls, args: SpeculativeArgs, config: EngineConfig | None = None,
                  target=None) -> Speculator:
        """The speculator of an engine config's ``speculative`` group.

        Args:
          config, target: the whole engine config and the engine's ``ModelRunner``, which
            ``speculative="draft"`` needs (``DraftModelProposer.from_config``); with
            ``config``, an adaptive n-gram speculator gets a ``StepCostModel`` over its
            scheduler's buckets.

        Raises:
          ValueError: naming ``speculative_model`` (missing, or a vocabulary other than the
            target's), before anything is served.
        """
        proposer = step_cost = budget = None
        if args.speculative == "ngram":
            proposer = NgramProposer(args.prompt_lookup_min, args.prompt_lookup_max)
        elif args.speculative == "suffix":
            proposer = SuffixProposer(args.suffix_max_depth, args.suffix_cache_tokens,
                                      args.suffix_min_probability)
        elif args.speculative == "draft":
            if config is None or target is None:
                raise ValueError('speculative="draft" needs the engine config and its target '
                                 'runner (Speculator.from_args(args, config, target))')
            from jaxkv.spec_decode.draft_model import DraftModelProposer

            proposer = DraftModelProposer.from_config(config, target)
        if args.speculative and args.speculative_adaptive and config is not None:
            sc = config.scheduler
            step_cost = StepCostModel.for_scheduler(sc)
            budget = sc.max_num_batched_tokens
        return cls(proposer, args.num_speculative_tokens,
                   _VERIFY_COST if args.speculative_adaptive else None, step_cost, budget)

    def acceptance(self, request_id: Hashable) -> float:
        """The request's estimated draft acceptance (before any measurement of its own:
        ``_prior``)."""
        accepted, trials = self._acceptance.get(request_id, self._prior())
        return accepted / trials

    def _prior(self) -> tuple[float, float]:
        """A new request's (accepted, trials): the pooled rate (1/2 for a free proposer under
        the step-time rule), weighing ``_PRIOR_TRIALS``."""
        accepted, trials = (_HALF if self._by_step_time and self._forward_cost is None
                            else self._pool)
        return _PRIOR_TRIALS * accepted / trials, _PRIOR_TRIALS

    @property
    def _by_step_time(self) -> bool:
        """Whether the draft lengths follow the step-time rule (else the fixed-cost rule)."""
        return self.step_cost is not None and self.draft_cost is not None

    @property
    def _forward_cost(self) -> StepCostModel | None:
        """The proposer's own forward-time model (the draft model's: its proposals cost
        forwards), read from the proposer (tests swap it) rather than kept."""
        return getattr(self.proposer, "forward_cost", None)

    def drafts(self, state: SchedulerState) -> dict[Hashable, tuple[int, ...]]:
        """Draft tokens for the running decodes of ``state`` (``scheduler.schedule``'s
        ``drafts``), each as long as its adaptive draft length; empty when speculation is
        off."""
        if self.proposer is None:
            return {}
        self.forget(state)
        self._acceptance = {i: a for i, a in self._acceptance.items() if i in state.requests}
        self._idle = {i: n for i, n in self._idle.items() if i in state.requests}
        self._probe_every = {i: n for i, n in self._probe_every.items() if i in state.requests}
        self._exploring = None
        if self._by_step_time and self._forward_cost is None:
            return self._drafts_of_free_proposals(state)
        return self._drafts_of_chosen_lengths(state)

    def _drafts_of_chosen_lengths(self, state: SchedulerState
                                  ) -> dict[Hashable, tuple[int, ...]]:
        """``drafts`` with the lengths chosen before proposing (for a proposer whose proposals
        cost a forward, and any speculator without step times): by the step-time rule with the
        proposer's forwards in the step's time, by the fixed-cost rule, or every request
        ``num_speculative_tokens`` when not adaptive; a ``k = 0`` request asked for one token
        once per its probe interval, and the engine's own probe of the longest-unasked request
        when none has been asked for ``_MAX_PROBE_BACKOFF`` intervals (the module
        docstring)."""
        probe_interval = getattr(self.proposer, "probe_interval", 1)
        most = _MAX_PROBE_BACKOFF * probe_interval
        probed, self._proposals, self._probes, out = self._probes, {}, set(), {}
        wanted, lengths, unasked = {}, {}, []
        decoding = scheduler.decoding_ids(state)
        room = {i: _room(state.requests[i]) for i in decoding}
        ids = [i for i in decoding if room[i] > 0]
        chosen = self._chosen_lengths(state, ids, [room[i] for i in ids])
        if chosen is None:   # measure the plain step first
            return out
        chosen, probe = chosen
        # a probe asks for 2 tokens (a catch-up and a decode forward) until the draft's decode
        # forward is measured: the catch-up alone never measures what a draft costs
        forward = self._forward_cost
        probe_len = 2 if forward is not None and forward.predict(
            len(ids), len(ids), False) is None else 1
        for request_id in decoding:
            if request_id not in self._idle and self._pool_probe_every is not None:
                self._probe_every[request_id] = self._pool_probe_every   # a new request
            k = chosen.get(request_id, 0)
            if k == 0:   # asked for one token to keep measuring, once per its interval
                every = self._probe_every.get(request_id, probe_interval)
                # the probe did not pay: back off, once probes cost more than their share
                if request_id in probed and probe_interval > 1 and self._probes_over_budget:
                    every = self._probe_every[request_id] = self._pool_probe_every = min(
                        2 * every, most)
                self._idle[request_id] = self._idle.get(request_id, 0) + 1
                if self._idle[request_id] < every or not probe:
                    if room[request_id] > 0:
                        unasked.append(request_id)
                    continue
                self._probes.add(request_id)
            else:
                self._probe_every.pop(request_id, None)
                if probe_interval > 1:
                    self._pool_probe_every = None
            self._idle[request_id] = 0
            n = min(max(k, probe_len), room[request_id])
            if n > 0:
                wanted[request_id] = (_history(state.requests[request_id]), n)
                lengths[request_id] = min(k, n)
        self._quiet = 0 if wanted else self._quiet + 1
        engine_probe = bool(unasked) and self._quiet >= most and probe
        if engine_probe:   # the engine's own probe: the longest unasked
            request_id = max(unasked, key=lambda i: self._idle[i])
            self._probes.add(request_id)
            self._idle[request_id], self._quiet = 0, 0
            wanted[request_id] = (_history(state.requests[request_id]),
                                  min(probe_len, room[request_id]))
            lengths[request_id] = 0
        self._held |= wanted.keys()
        start = time.perf_counter()
        forwards_before = None if self._forward_cost is None else self._forward_cost.total_s
        for request_id, proposal in propose_batch(self.proposer, wanted).items():
            proposal = tuple(int(t) for t in proposal[:wanted[request_id][1]])
            self._proposals[request_id] = proposal
            k = min(lengths[request_id], len(proposal))
            if k:
                out[request_id] = proposal[:k]
                self._proposed += k
        # what proposing took: the proposer's own measured forwards, else the wall time
        seconds = (time.perf_counter() - start if forwards_before is None
                   else self._forward_cost.total_s - forwards_before)
        if not out:   # nothing drafted: the proposals were probes
            self._probe_s += seconds
        if self._exploring is not None:   # an exploration is charged its proposals' time too
            self._exploring -= seconds
        return out

    @property
    def _probes_over_budget(self) -> bool:
        """Whether probes have cost more than their share: always without step times (the
        fixed-cost rule: a probe that does not pay backs off), else when the proposals of the
        steps that drafted nothing took more than ``_EXPLORE_SHARE`` of the measured step
        time."""
        return self.step_cost is None or self._probe_s > _EXPLORE_SHARE * self._measured_s

    def _chosen_lengths(self, state: SchedulerState, ids: Sequence[Hashable],
                        rooms: Sequence[int]) -> tuple[dict[Hashable, int], bool] | None:
        """``_drafts_of_chosen_lengths``'s draft length of each decode in ``ids`` (those with
        room for a draft: ``rooms`` int [N], each one's ``_room``), before anything is
        proposed, and whether its ``k = 0`` requests may be probed: always under the
        fixed-cost rule; under the step-time rule while the probes are within their budget
        and a draft forward over the step's decodes takes less than the target's plain step
        (else no draft could pay, were every one accepted and its verification free). None
        while the step-time rule's plain step is unmeasured (no proposals at all then)."""
        if self.draft_cost is None:
            return {i: self.num_speculative_tokens for i in ids}, True
        if self.step_cost is None:
            return {i: best_num_drafts(self.acceptance(i), self.num_speculative_tokens,
                                       self.draft_cost) for i in ids}, True
        caps = [min(self.num_speculative_tokens, r) for r in rooms]
        ks = self._step_lengths(state, ids, [self.acceptance(i) for i in ids], caps,
                                [False] * len(ids),
                                lambda longest: self.proposal_time(len(ids), longest))
        if ks is None:
            return None
        plain = self.step_cost.predict(*self._step_shape(state), False)
        probe = not self._probes_over_budget and self.proposal_time(len(ids), 1) < plain
        return dict(zip(ids, ks)), probe

    def _step_shape(self, state: SchedulerState) -> tuple[int, int]:
        """The estimated ``(tokens, sequences)`` of the next step without drafts: its decodes
        and the running prefills' next chunks (within the token budget; requests the
        scheduler will admit from the queue are not foreseen)."""
        decoding = set(scheduler.decoding_ids(state))
        prefill = sum(state.requests[i].num_tokens - state.requests[i].num_computed_tokens
                      for i in state.running if i not in decoding)
        return min(self._budget, len(decoding) + prefill), len(state.running)

    def proposal_time(self, num_decodes: int, longest: int) -> float:
        """Seconds of proposing drafts at most ``longest`` long for ``num_decodes`` decodes:
        ``longest`` forwards of the proposer's ``forward_cost`` over them (the catch-up of each
        request's new tokens and the draft decodes), each at its measured time for that many
        decodes; 0 while that is unmeasured (so it drafts, and gets measured) and for a
        proposer without a ``forward_cost``."""
        model = self._forward_cost
        forward = None if model is None else model.predict(num_decodes, num_decodes, False)
        return longest * (forward or 0.0)

    def _drafts_of_free_proposals(self, state: SchedulerState
                                  ) -> dict[Hashable, tuple[int, ...]]:
        """``drafts`` of a proposer whose proposals are free (no ``forward_cost``) under the
        step-time rule: every decode is asked for its full length, then ``_step_lengths`` cuts
        the proposals, requests without a measured acceptance only filling the room of the
        chosen bucket."""
        wanted = {}
        for request_id in scheduler.decoding_ids(state):
            rs = state.requests[request_id]
            n = min(self.num_speculative_tokens, _room(rs))
            if n > 0:
                wanted[request_id] = (_history(rs), n)
        self._held |= wanted.keys()
        self._proposals = {i: tuple(int(t) for t in p[:wanted[i][1]])
                           for i, p in propose_batch(self.proposer, wanted).items()}
        ids = [i for i in wanted if self._proposals.get(i)]
        if not ids:
            return {}
        ks = self._step_lengths(state, ids, [self.acceptance(i) for i in ids],
                                [len(self._proposals[i]) for i in ids],
                                [i not in self._acceptance for i in ids])
        out = {i: self._proposals[i][:k] for i, k in zip(ids, ks or []) if k}
        self._proposed += sum(ks or [])
        return out

    def _step_lengths(self, state: SchedulerState, ids: Sequence[Hashable],
                      acceptance: Sequence[float], caps: Sequence[int], cold: Sequence[bool],
                      proposal_time: Callable[[int], float] | None = None) -> list[int] | None:
        """The step-time rule's draft lengths (int [N]) of the decodes ``ids`` (acceptance
        float [N], at most caps int [N] drafts each) from the step's estimated shape (its
        decodes and the running prefills' next chunks; requests the scheduler will admit from
        the queue are not foreseen), by the module docstring's guards:

        * None while the plain step is unmeasured or stale (this step measures it);
        * else a paid-for exploration of a shape at most one bucket above it (with costly
          proposals, only of a shape where they would pay if it took no longer than the plain
          step);
        * else ``allocate_drafts`` (``allocate_drafts_closed`` for a closed batch) with
          ``proposal_time`` (longest draft -> seconds; None: free) over the measured shapes
          among the requests not ``cold``, the cold ones filling the chosen bucket's room.
        """
        model, budget = self.step_cost, self._budget
        base, num_seqs = self._step_shape(state)
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
        at most ``_EXPLORE_SHARE`` of the measured step time. (The plain step's own bucket:
        the one ``base`` tokens pad to in a step with drafts, not a decode bucket.)"""
        model = self.step_cost
        if self._charged_s > _EXPLORE_SHARE * self._measured_s:
            return None
        plain_bucket = model.key(base, num_seqs, True)[0]
        candidates = ([plain_bucket] if base < plain_bucket else []) + [
            t for t in model.token_buckets if t > plain_bucket][:1]
        reach = min(base + num_proposed, self._budget)
        return next((t for t, below in zip(candidates, [base] + candidates)
                     if reach > below and model.wants(t, num_seqs, True)), None)

    def forget(self, state: SchedulerState) -> None:
        """Releases the proposer's state of the requests proposed for that are no longer
        running in ``state`` (finished, aborted, failed, preempted)."""
        gone = {i for i in self._held if i not in state.running}
        self._held -= gone
        if hasattr(self.proposer, "release"):
            for request_id in gone:
                self.proposer.release(request_id)

    def record(self, plan: StepPlan, tokens: np.ndarray,
               num_accepted: np.ndarray, seconds: float | None = None) -> None:
        """Measures and counts a step's drafts.

        Args:
          plan: the step's plan (scheduled from the state ``drafts`` last saw).
          tokens: int32 [>= len(plan.seqs), W], the step's sampled tokens.
          num_accepted: int32 [>= len(plan.seqs)], how many of them each sequence emitted (1 +
            its accepted drafts).
          seconds: the step's measured device time, for the step-time model (None: not timed).
        """
        if self.step_cost is not None and seconds is not None:
            if self.step_cost.observe(plan.num_tokens, len(plan.seqs), plan.num_drafts > 0,
                                      seconds):
                self._measured_s += seconds
                if self._exploring is not None:   # charged: its time above the plain step's
                    self._charged_s += max(0.0, seconds - self._exploring)
        for row, seq in enumerate(plan.seqs):
            n = int(num_accepted[row])
            if seq.num_drafts:
                self._drafts += 1
                self._verified += seq.num_drafts
                self._accepted += n - 1
            proposal = self._proposals.get(seq.request_id)
            if seq.sample and proposal:   # how much of the whole proposal the step confirmed
                emitted = tokens[row, :n].tolist()
                matched = next((j for j, (p, e) in enumerate(zip(proposal, emitted)) if p != e),
                               None)
                trials = min(len(proposal), n) if matched is None else matched + 1
                accepted, total = self._acceptance.get(seq.request_id, self._prior())
                successes = trials if matched is None else matched
                self._acceptance[seq.request_id] = (_DECAY * accepted + successes,
                                                    _DECAY * total + trials)
                self._pool = (_POOL_DECAY * self._pool[0] + successes,
                              _POOL_DECAY * self._pool[1] + trials)

    def stats(self) -> dict:
        """Counters since start (vLLM's ``spec_decode`` names).

        Returns:
          dict with ``spec_num_proposed_tokens`` (drafts offered to the scheduler, after the
          adaptive draft length), ``spec_num_draft_tokens``
          (drafts verified: those the scheduler fit into a step), ``spec_num_drafts`` (sequences
          that verified drafts, once per step), ``spec_num_accepted_tokens``,
          ``spec_acceptance_rate`` (accepted / verified) and ``spec_mean_acceptance_length``
          (tokens emitted per verifying sequence and step: 1 + accepted / drafts); and the
          proposer's own counters when it has ``stats()`` (the draft model's
          ``spec_draft_num_steps``, ``spec_draft_device_time_s``, ``spec_draft_blocks_used``).
        """
        return {
            "spec_num_proposed_tokens": self._proposed,
            "spec_num_draft_tokens": self._verified,
            "spec_num_drafts": self._drafts,
            "spec_num_accepted_tokens": self._accepted,
            "spec_acceptance_rate": self._accepted / self._verified if self._verified else 0.0,
            "spec_mean_acceptance_length": (1 + self._accepted / self._drafts
                                            if self._drafts else 0.0),
        } | (self.proposer.stats() if hasattr(self.proposer, "stats") else {})

    def close(self) -> None:
        """Frees the proposer's device memory (a draft model's)."""
        if hasattr(self.proposer, "close"):
            self.proposer.close()
