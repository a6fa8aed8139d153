"""How many drafts each request carries: the arithmetic of adaptive draft lengths.

Design notes: docs/speculative-decoding.md."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import numpy as np


def best_num_drafts(acceptance: float, max_drafts: int, draft_cost: float) -> int:
    """The draft length in ``[0, max_drafts]`` that maximises ``E(k) / (1 + draft_cost k)``
    (the fixed-cost rule of the module docstring), the shortest among equals."""
    best, best_value, expected = 0, 1.0, 1.0
    for k in range(1, max_drafts + 1):
        expected += acceptance ** k
        if expected / (1 + draft_cost * k) > best_value:
            best, best_value = k, expected / (1 + draft_cost * k)
    return best


def allocate_drafts(acceptance: Sequence[float], caps: Sequence[int], base_tokens: int,
                    max_tokens: int, token_buckets: Sequence[int],
                    step_time: Callable[[int, bool], float | None],
                    proposal_time: Callable[[int], float] | None = None) -> list[int] | None:
    """The draft lengths of a whole step that maximise its expected emitted tokens per second.

    Request ``i`` (acceptance ``a_i``) with ``k_i`` drafts emits ``E_i(k_i) = 1 + a_i + ... +
    a_i^k_i`` tokens in expectation; the step of ``base_tokens + sum(k)`` tokens takes
    ``step_time(tokens, sum(k) > 0)`` seconds, a function of the token bucket the step pads to.
    Maximised: ``sum_i E_i(k_i) / step_time``. For a fixed total ``c`` the best ``k`` takes the
    ``c`` largest marginal gains ``a_i^j`` (each ``E_i`` is concave), and ``step_time`` only
    changes where the total crosses a bucket, so the candidates are ``c = 0`` and, per bucket,
    the most drafts that still fit it: exact, in O(sum(caps) log sum(caps) + buckets).

    Proposals that cost time (a draft model's forwards, one per draft position) add
    ``proposal_time(max_i k_i)`` to a drafting step's time. Then the same search runs once per
    longest draft ``m`` (every cap cut to ``m``), and the best of them is exact too: for a given
    ``m`` and total, the largest marginal gains under the cut caps are best, and the step costs
    at most ``proposal_time(m)``, exactly that at its own longest draft's candidate.

    Args:
      acceptance: float [N], each decoding request's estimated acceptance in ``[0, 1]``.
      caps: int [N], the most drafts each may carry (its proposal's length).
      base_tokens: tokens of the step without drafts (``>= N``).
      max_tokens: the step's token budget (drafts beyond it are not scheduled).
      token_buckets: the sizes a step pads to (strictly increasing).
      step_time: ``(num_tokens, has_drafts) -> seconds``, or None for an unmeasured shape
        (not a candidate).
      proposal_time: ``longest draft -> seconds`` of proposing the drafts (non-decreasing), or
        None: proposals are free.

    Returns:
      int [N] draft lengths (all 0 when drafting does not pay; between candidates of equal
      value, the shorter longest draft, then the fewer drafts); None when the step without
      drafts has no time.
    """
    n = len(acceptance)
    base_time = step_time(base_tokens, False)
    if base_time is None:
        return None
    best, best_value = [0] * n, n / base_time
    for longest, proposing in _longest_drafts(caps, proposal_time):
        gains = _gains(acceptance, [min(cap, longest) for cap in caps])
        prefix = np.concatenate([[0.0], np.cumsum([g for g, _, _ in gains])])
        for bucket in token_buckets:
            c = min(bucket, max_tokens) - base_tokens
            if c < 1 or not gains:
                continue
            c = min(c, len(gains))
            seconds = step_time(base_tokens + c, True)
            if seconds is not None and (n + prefix[c]) / (seconds + proposing) > best_value:
                best, best_value = _take(gains, n, c), (n + prefix[c]) / (seconds + proposing)
            if c == len(gains) or bucket >= max_tokens:
                break
    return best


def allocate_drafts_closed(acceptance: Sequence[float], caps: Sequence[int],
                           remaining: Sequence[int], base_tokens: int, max_tokens: int,
                           token_buckets: Sequence[int],
                           step_time: Callable[[int, bool], float | None],
                           proposal_time: Callable[[int], float] | None = None
                           ) -> list[int] | None:
    """The draft lengths of a step of a closed batch: one that ends when its longest request
    does (nothing waits, every running request decodes), so a token emitted early by a request
    that still has to wait for the others buys nothing.

    Request ``i`` may emit ``remaining[i]`` more tokens; the batch needs ``M = max_i
    remaining[i]`` more plain steps. After this step, taken with drafts ``k`` and then plain
    steps, the rest costs ``T(base + sum(k), sum(k) > 0) + T_plain * max_i (remaining[i] -
    E_i(k_i))`` against ``T_plain * M`` for the plain step: minimised, a one-step lookahead.
    Per bucket the drafts go one at a time to the request furthest from done (the minimax of
    ``remaining[i] - E_i(k_i)``, exact because each ``E_i`` rises), until the bucket is full or
    that request can take no more (then no draft lowers the maximum): the minimum over every
    ``k`` when a step padded to a larger bucket is not faster. In a lockstep batch of
    equal budgets a draft step thus pays only when every request's expected tokens beat the
    step's cost ratio: the slowest request sets the pace. Costly proposals: as
    ``allocate_drafts``, the search runs once per longest draft ``m``, its drafting steps
    costing ``proposal_time(m)`` more.

    Args: as ``allocate_drafts``, and ``remaining``: int [N], each request's tokens left
      (``max_tokens`` minus its output: an upper bound, as a stop token may end it sooner).

    Returns:
      int [N] draft lengths (all 0 when drafting does not shorten the batch's expected time);
      None when the step without drafts has no time.
    """
    n = len(acceptance)
    plain = step_time(base_tokens, False)
    if plain is None:
        return None
    best_ks, best_cost = [0] * n, plain * max(remaining, default=0)
    for longest, proposing in _longest_drafts(caps, proposal_time):
        ks, used = [0] * n, 0
        # (E_i(k_i) - remaining[i], i): the heap's top is the request furthest from done (the
        # lowest index among ties); a draft raises its E by a^k. O(log N) a draft: this runs
        # on the host before every step.
        behind = [(1.0 - r, i) for i, r in enumerate(remaining)]
        heapq.heapify(behind)
        for bucket in token_buckets:
            room = min(bucket, max_tokens) - base_tokens
            if room < 1:
                continue
            stuck = False
            while used < room:
                gap, i = behind[0]
                if ks[i] >= min(caps[i], longest) or acceptance[i] <= 0:
                    stuck = True
                    break
                ks[i] += 1
                used += 1
                heapq.heapreplace(behind, (gap + acceptance[i] ** ks[i], i))
            seconds = step_time(base_tokens + used, True) if used else None
            if seconds is not None:
                cost = seconds + proposing - plain * behind[0][0]
                if cost < best_cost:
                    best_ks, best_cost = list(ks), cost
            if stuck or bucket >= max_tokens:
                break
    return best_ks


def _longest_drafts(caps: Sequence[int], proposal_time: Callable[[int], float] | None
                    ) -> list[tuple[int, float]]:
    """The candidate longest draft lengths ``m`` of a step and what proposing them costs:
    ``[(max(caps), 0.0)]`` for free proposals, else ``(m, proposal_time(m))`` for every ``m`` in
    ``[1, max(caps)]``."""
    longest = max(caps, default=0)
    if proposal_time is None:
        return [(longest, 0.0)]
    return [(m, proposal_time(m)) for m in range(1, longest + 1)]


def _gains(acceptance: Sequence[float], caps: Sequence[int]) -> list[tuple[float, int, int]]:
    """Every draft's marginal gain ``(a_i^j, -i, j)``, most valuable first (ties: lower i)."""
    return sorted(((a ** j, -i, j) for i, (a, cap) in enumerate(zip(acceptance, caps))
                   for j in range(1, cap + 1) if a > 0), reverse=True)


def _take(gains: list[tuple[float, int, int]], n: int, c: int) -> list[int]:
    """The draft lengths of the ``c`` first ``gains`` over ``n`` requests."""
    ks = [0] * n
    for _, i, _ in gains[:c]:
        ks[-i] += 1
    return ks


def fill_drafts(acceptance: Sequence[float], caps: Sequence[int], num_drafts: int) -> list[int]:
    """The draft lengths (int [N]) of at most ``num_drafts`` drafts in all that maximise the
    expected emitted tokens (``allocate_drafts``'s order: the largest marginal gains)."""
    return _take(_gains(acceptance, caps), len(acceptance), max(num_drafts, 0))
