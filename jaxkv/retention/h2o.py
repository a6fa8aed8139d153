"""H2O retention (Zhang et al. 2023, "Heavy-Hitter Oracle"), at block granularity.

Design notes: docs/retention.md."""

from __future__ import annotations

import dataclasses

from jaxkv.attention.options import AttentionOptions
from jaxkv.retention.full import Retention


def block_score(scores, j: int) -> float:
    """``scores[j]`` as a float; 0 where ``scores`` is None or shorter than ``j + 1``."""
    return 0.0 if scores is None or j >= len(scores) else float(scores[j])


def evict(candidates, excess: int, key) -> tuple[int, ...]:
    """The ``excess`` candidate blocks of lowest ``key`` (ties: the older block first), or ()
    when ``excess <= 0``: the eviction step H2O, SnapKV and random eviction share.

    Args:
      candidates: logical block ids that may go.
      excess: how many must go (capped at ``len(candidates)``).
      key: block id -> sortable rank.
    """
    if excess <= 0:
        return ()
    return tuple(sorted(candidates, key=lambda j: (key(j), j))[:excess])


@dataclasses.dataclass(frozen=True)
class H2ORetention(Retention):
    """Heavy hitters + a recent window in a budget of KV tokens.

    Attributes:
      budget_tokens: most tokens of KV a sequence keeps (rounded down to whole blocks).
      sink_tokens: first positions always kept (0 in the paper).
      recent_tokens: the recent window always kept; default half the budget (the paper's
        split).
    """

    budget_tokens: int = 512
    sink_tokens: int = 0
    recent_tokens: int | None = None
    observe = 1   # the sampling query of each sequence (see the module docstring)
    name = "h2o"
    history_dependent = True

    def __post_init__(self):
        if self.recent_tokens is None:
            object.__setattr__(self, "recent_tokens", self.budget_tokens // 2)
        if self.budget_tokens < 1:
            raise ValueError(f"kv_budget_tokens={self.budget_tokens} must be >= 1")
        if not 0 <= self.recent_tokens < self.budget_tokens - self.sink_tokens:
            raise ValueError(f"kv_budget_tokens={self.budget_tokens} must exceed the recent "
                             f"window {self.recent_tokens} + kv_sink_tokens={self.sink_tokens}")

    @property
    def attention(self) -> AttentionOptions:
        return AttentionOptions(observe=self.observe)

    def _protected(self, num_computed: int, block_size: int) -> tuple[int, int]:
        """(sink blocks, first block of the recent window) for the query at ``num_computed``."""
        return (-(-self.sink_tokens // block_size),
                max(0, num_computed - self.recent_tokens) // block_size)

    def drops(self, num_computed: int, table, scores, block_size: int,
              prompt_tokens: int | None = None) -> tuple[int, ...]:
        """The lowest-scoring kept blocks outside the sinks and the recent window, until the
        kept blocks fit ``budget_tokens // block_size`` (``scores`` None: all zero)."""
        sinks, recent = self._protected(num_computed, block_size)
        kept = [j for j, b in enumerate(table) if b]
        candidates = [j for j in kept if sinks <= j < recent]
        return evict(candidates, len(kept) - self.budget_tokens // block_size,
                     self._eviction_key(num_computed, candidates, scores))

    def _eviction_key(self, num_computed: int, candidates: list[int], scores):
        """Sort key of a candidate block: the lowest goes first (here its accumulated mass)."""
        return lambda j: block_score(scores, j)

    def may_drop(self, num_computed: int, logical: int, block_size: int) -> bool:
        sinks, recent = self._protected(num_computed, block_size)
        return sinks <= logical < recent

    def max_blocks(self, num_tokens: int, max_step_tokens: int, block_size: int,
                   prompt_tokens: int | None = None) -> int:
        """The whole prompt (computed before anything is dropped) plus the first decode's
        block, or the budget's blocks (the sink and recent blocks when they outgrow it) plus
        one step's new blocks, whichever is more."""
        prompt = num_tokens if prompt_tokens is None else prompt_tokens
        held = (max(self.budget_tokens // block_size,
                    -(-self.sink_tokens // block_size) + self.recent_tokens // block_size + 1)
                + max_step_tokens // block_size + 2)
        return min(-(-num_tokens // block_size), max(held, -(-prompt // block_size) + 1))
