"""Random eviction: the baseline of the scoring policies (H2O, SnapKV) at the same budget.

A sequence keeps its sink blocks and its recent window as under H2O (``h2o.py``: the same budget
of ``budget_tokens``, half of it the recent window by default), but the blocks that go when it
outgrows the budget are drawn at random among the others instead of by attention mass. The
draw is seeded by ``(seed, num_computed)``: a function of the request's own state only, so a
request's drops do not depend on what it is batched with, and a rerun drops the same blocks.
Like H2O the prompt is computed in full first, and what a later block's KV holds depends on
what was dropped before it (``history_dependent``), so the prefix cache registers only blocks
computed before the first drop and hits stay exact. No attention statistics are needed
(``observe = 0``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv.retention.h2o import H2ORetention


@dataclasses.dataclass(frozen=True)
class RandomRetention(H2ORetention):
    """Sinks + a recent window + random other blocks, in a budget of KV tokens.

    Attributes:
      budget_tokens, sink_tokens, recent_tokens: as ``H2ORetention``'s.
      seed: seeds the draws (with the position of the query they are made for).
    """

    seed: int = 0
    observe = 0
    name = "random"

    def _eviction_key(self, num_computed: int, candidates: list[int], scores):
        """A uniformly random order of ``candidates`` from ``(seed, num_computed)``."""
        rank = np.random.default_rng((self.seed, num_computed)).permutation(len(candidates))
        order = dict(zip(candidates, rank.tolist()))
        return order.__getitem__
