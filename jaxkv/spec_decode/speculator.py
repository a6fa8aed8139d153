"""Speculative decoding on the host: the engine's seam for draft proposers. Before each
``schedule`` the engine asks ``Speculator.drafts(state)``; the scheduler fits what it can, the
jitted step verifies them (jaxkv/sample/rejection.py), and ``record`` measures what the step
accepted. Proposers: ngram.py, suffix.py, draft_model.py; how long each request's drafts are:
draft_policy.py. The design: docs/speculative-decoding.md.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping, Sequence
from typing import Protocol

import numpy as np

from jaxkv.config import EngineConfig, SpeculativeArgs
from jaxkv.sched import scheduler
from jaxkv.sched.plan import StepPlan
from jaxkv.sched.state import RequestState, SchedulerState
from jaxkv.sched.step_cost import StepCostModel
from jaxkv.spec_decode.draft_policy import VERIFY_COST, DraftPolicy
from jaxkv.spec_decode.ngram import NgramProposer
from jaxkv.spec_decode.suffix import SuffixProposer

_MAX_PROBE_BACKOFF = 16  # a k = 0 request's probe interval grows to this many base intervals


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
    """The engine's speculative decoding: proposes drafts before each schedule, each as long as
    its ``DraftPolicy`` says, and measures and counts what the step accepted.

    Args:
      proposer: a ``Proposer`` or ``BatchProposer``, or None (speculation off: no drafts).
      num_speculative_tokens: most drafts proposed per sequence and step.
      draft_cost: the fixed-cost rule's cost of one more draft token (a fraction of a decode
        step); None: not adaptive, always propose ``num_speculative_tokens``.
      step_cost: the target's step-time model: the adaptive draft lengths maximise emitted
        tokens per second with it (the step-time rule). None: the fixed-cost rule.
      max_num_batched_tokens: the step's token budget (with ``step_cost``).

    Attributes:
      proposer: as given (a public seam: tests swap in their own).
      policy: the draft-length policy (jaxkv/spec_decode/draft_policy.py).
    """

    def __init__(self, proposer: Proposer | BatchProposer | None, num_speculative_tokens: int,
                 draft_cost: float | None = None, step_cost: StepCostModel | None = None,
                 max_num_batched_tokens: int | None = None):
        self.proposer = proposer
        self.policy = DraftPolicy(num_speculative_tokens, draft_cost, step_cost,
                                  max_num_batched_tokens, forward_cost=lambda: self._forward_cost)
        self._held: set[Hashable] = set()   # requests proposed for since their last release
        self._idle: dict[Hashable, int] = {}  # k = 0 steps since a request was last asked
        self._probe_every: dict[Hashable, int] = {}   # a k = 0 request's interval, if not the base
        self._probes: set[Hashable] = set()   # this step's k = 0 requests asked for one token
        self._pool_probe_every: int | None = None   # a new request's interval (None: the base)
        self._quiet = 0   # steps since any request was asked for a proposal (fixed-cost rule)
        self.num_speculative_tokens = num_speculative_tokens
        self._proposals: dict[Hashable, tuple[int, ...]] = {}   # this step's, by request
        self._proposed = 0   # draft tokens proposed
        self._drafts = 0     # sequences that verified drafts
        self._verified = 0   # draft tokens verified (scheduled)
        self._accepted = 0   # draft tokens accepted

    @property
    def step_cost(self) -> StepCostModel | None:
        """The target's step-time model (the step-time rule), or None."""
        return self.policy.step_cost

    @property
    def draft_cost(self) -> float | None:
        """The fixed-cost rule's cost of one more draft, or None (not adaptive)."""
        return self.policy.draft_cost

    @draft_cost.setter
    def draft_cost(self, value: float | None) -> None:
        self.policy.draft_cost = value

    def acceptance(self, request_id: Hashable) -> float:
        """The request's estimated draft acceptance (``DraftPolicy.acceptance``)."""
        return self.policy.acceptance(request_id)

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
                   VERIFY_COST if args.speculative_adaptive else None, step_cost, budget)

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
        self.policy.start_step(set(state.requests))
        self._idle = {i: n for i, n in self._idle.items() if i in state.requests}
        self._probe_every = {i: n for i, n in self._probe_every.items() if i in state.requests}
        if self.policy.by_step_time and self._forward_cost is None:
            return self._drafts_of_free_proposals(state)
        return self._drafts_of_chosen_lengths(state)

    def _drafts_of_chosen_lengths(self, state: SchedulerState
                                  ) -> dict[Hashable, tuple[int, ...]]:
        """``drafts`` with the lengths chosen before proposing (for a proposer whose proposals
        cost a forward, and any speculator without step times): by the step-time rule with the
        proposer's forwards in the step's time, by the fixed-cost rule, or every request
        ``num_speculative_tokens`` when not adaptive; a ``k = 0`` request asked for one token
        once per its probe interval, and the engine's own probe of the longest-unasked request
        when none has been asked for ``_MAX_PROBE_BACKOFF`` intervals
        (docs/speculative-decoding.md)."""
        probe_interval = getattr(self.proposer, "probe_interval", 1)
        most = _MAX_PROBE_BACKOFF * probe_interval
        probed, self._proposals, self._probes, out = self._probes, {}, set(), {}
        wanted, lengths, unasked = {}, {}, []
        decoding = scheduler.decoding_ids(state)
        room = {i: _room(state.requests[i]) for i in decoding}
        ids = [i for i in decoding if room[i] > 0]
        chosen = self.policy.chosen_lengths(state, ids, [room[i] for i in ids], self.proposal_time)
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
                if request_id in probed and probe_interval > 1 and self.policy.probes_over_budget:
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
        self.policy.charge_proposals(seconds, drafted=bool(out))   # nothing drafted: probes
        return out

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
        step-time rule: every decode is asked for its full length, then ``step_lengths`` cuts
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
        ks = self.policy.step_lengths(state, ids, [self.acceptance(i) for i in ids],
                                [len(self._proposals[i]) for i in ids],
                                [self.policy.is_cold(i) for i in ids])
        out = {i: self._proposals[i][:k] for i, k in zip(ids, ks or []) if k}
        self._proposed += sum(ks or [])
        return out

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
            self.policy.observe_step(plan, seconds)
        for row, seq in enumerate(plan.seqs):
            n = int(num_accepted[row])
            if seq.num_drafts:
                self._drafts += 1
                self._verified += seq.num_drafts
                self._accepted += n - 1
            proposal = self._proposals.get(seq.request_id)
            if seq.sample and proposal:   # how much of the whole proposal the step confirmed
                self.policy.observe_proposal(seq.request_id, proposal, tokens[row, :n].tolist())

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
