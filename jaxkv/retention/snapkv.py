"""SnapKV retention (Li et al. 2024, "SnapKV: LLM Knows What You Are Looking for Before
Generation"), at block granularity.

Design notes: docs/retention.md."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv.attention.options import AttentionOptions
from jaxkv.retention.full import Retention
from jaxkv.retention.h2o import block_score, evict

POOLINGS = ("max", "avg")


def pool_blocks(scores: np.ndarray, radius: int, pooling: str = "max") -> np.ndarray:
    """1-D pooling of block scores over ``radius`` neighbouring blocks each side.

    Args:
      scores: f64 [n] one score per block.
      radius: neighbours on each side (0: no pooling).
      pooling: ``"max"`` (over the blocks that exist) or ``"avg"`` (the sum over the kernel
        divided by ``2 radius + 1``, missing neighbours counting 0, as ``avg_pool1d`` pads).

    Returns:
      f64 [n].
    """
    scores = np.asarray(scores, np.float64)
    n = len(scores)
    if pooling == "max":
        pad = np.pad(scores, radius, constant_values=-np.inf)
        return np.max([pad[i:i + n] for i in range(2 * radius + 1)], axis=0) if n else scores
    pad = np.pad(scores, radius)
    return np.sum([pad[i:i + n] for i in range(2 * radius + 1)], axis=0) / (2 * radius + 1)


@dataclasses.dataclass(frozen=True)
class SnapKVRetention(Retention):
    """Prompt compression by the observation window's attention, once, at the end of prefill.

    Attributes:
      budget_tokens: most prompt tokens of KV kept (whole blocks: ``budget_tokens //
        block_size``), sinks and observation window included.
      sink_tokens: first positions always kept (0 in the paper).
      window_tokens: w, the observation window: the prompt's last w tokens score the earlier
        blocks and are kept.
      pool_kernel: the paper's pooling kernel in tokens (odd, >= 1; 1: no pooling).
      pooling: ``"max"`` or ``"avg"``.
    """

    budget_tokens: int = 1024
    sink_tokens: int = 4
    window_tokens: int = 32
    pool_kernel: int = 7
    pooling: str = "max"
    name = "snapkv"
    history_dependent = True

    def __post_init__(self):
        if self.budget_tokens < 1:
            raise ValueError(f"kv_budget_tokens={self.budget_tokens} must be >= 1")
        if self.window_tokens < 1:
            raise ValueError(f"kv_observation_tokens={self.window_tokens} must be >= 1")
        if self.sink_tokens < 0:
            raise ValueError(f"kv_sink_tokens={self.sink_tokens} must be >= 0")
        if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ValueError(f"pool_kernel={self.pool_kernel} must be odd and >= 1")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling={self.pooling!r} is not one of {POOLINGS}")
        if self.budget_tokens <= self.sink_tokens + self.window_tokens:
            raise ValueError(f"kv_budget_tokens={self.budget_tokens} must exceed "
                             f"kv_sink_tokens={self.sink_tokens} + kv_observation_tokens="
                             f"{self.window_tokens}")

    @property
    def observe(self) -> int:
        return self.window_tokens

    @property
    def attention(self) -> AttentionOptions:
        return AttentionOptions(observe=self.window_tokens)

    def wants_scores(self, prompt_tokens: int, first_drop: int | None, block_size: int) -> bool:
        """Until the one compression (``first_drop`` None), and only for a prompt over the
        budget: ``drops`` reads the scores once, to compress the prompt, so the decode steps
        after it run without the mass (a preemption that recomputes resets both)."""
        return first_drop is None and (-(-prompt_tokens // block_size)
                                       > self.budget_tokens // block_size)

    def _protected(self, prompt_tokens: int, block_size: int) -> tuple[int, int]:
        """(sink blocks, first block of the observation window) of a prompt."""
        return (-(-self.sink_tokens // block_size),
                max(0, prompt_tokens - self.window_tokens) // block_size)

    def drops(self, num_computed: int, table, scores, block_size: int,
              prompt_tokens: int | None = None) -> tuple[int, ...]:
        """The prompt blocks outside the sinks and the observation window with the lowest
        pooled scores, until the prompt's kept blocks fit ``budget_tokens // block_size``; ()
        once they do (after the one compression, and for a prompt within the budget).

        Raises:
          ValueError: ``prompt_tokens`` is None (SnapKV compresses a prompt).
        """
        if prompt_tokens is None:
            raise ValueError("kv_retention='snapkv' compresses a prompt: drops needs "
                             "prompt_tokens (jaxkv.entrypoints.eval.retained_nll: pass "
                             "prompt_tokens)")
        sinks, window = self._protected(prompt_tokens, block_size)
        prompt_blocks = min(-(-prompt_tokens // block_size), len(table))
        kept = [j for j in range(prompt_blocks) if table[j]]
        excess = len(kept) - self.budget_tokens // block_size
        if excess <= 0:
            return ()
        radius = (self.pool_kernel // 2 + block_size // 2) // block_size
        raw = np.array([block_score(scores, j) for j in range(sinks, window)])
        pooled = pool_blocks(raw, radius, self.pooling)
        return evict([j for j in kept if sinks <= j < window], excess,
                     lambda j: (pooled[j - sinks], raw[j - sinks]))

    def may_drop(self, num_computed: int, logical: int, block_size: int) -> bool:
        """Blocks between the sinks and the window of a prompt that ends at or before
        ``num_computed`` (the prompt length is not known here: the bound of the longest one)."""
        sinks, window = self._protected(num_computed, block_size)
        return sinks <= logical < window

    def max_blocks(self, num_tokens: int, max_step_tokens: int, block_size: int,
                   prompt_tokens: int | None = None) -> int:
        """The whole prompt (computed before the compression), or the budget's blocks plus the
        blocks generation adds after the prompt's last one, whichever is more."""
        total = -(-num_tokens // block_size)
        prompt = total if prompt_tokens is None else -(-prompt_tokens // block_size)
        return min(total, max(prompt, self.budget_tokens // block_size + total - prompt))

    def check_block_size(self, block_size: int, residual_blocks: int) -> None:
        """The budget must hold the sink blocks and the blocks the window spans (up to
        ``cdiv(w, block_size) + 1``) plus one more; KIVI's full-precision residual blocks (the
        last ones) must lie inside the window, so a dropped block never owns a residual slot."""
        protected = -(-self.sink_tokens // block_size) + -(-self.window_tokens // block_size) + 1
        if self.budget_tokens // block_size <= protected:
            raise ValueError(f"kv_budget_tokens={self.budget_tokens} must hold more than the "
                             f"{protected} blocks of {block_size} tokens the sinks and the "
                             f"observation window can span")
        if residual_blocks and self.window_tokens < residual_blocks * block_size:
            raise ValueError(f"kv_observation_tokens={self.window_tokens} must cover the KIVI "
                             f"residual window, kv_residual_blocks x block_size = "
                             f"{residual_blocks * block_size} tokens")
