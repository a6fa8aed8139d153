"""Full retention (the default): every block of a sequence stays until the sequence ends."""

from __future__ import annotations

import dataclasses

from jaxkv.attention.options import AttentionOptions


@dataclasses.dataclass(frozen=True)
class Retention:
    """The policy interface (see jaxkv/retention/__init__.py); keeps everything.

    Class attributes:
      name: the ``kv_retention`` value.
      observe: query tokens per sequence whose attention mass per block the step returns for
        ``drops`` (0: the policy needs no scores).
      history_dependent: whether a block's KV depends on what the sequence dropped before it
        was computed (H2O: yes; a window: no, it is a function of the tokens). Such a policy
        drops nothing before the prompt is computed, and the prefix cache registers only blocks
        computed before the sequence's first drop, so hits stay exact.
    """

    name = "full"
    observe = 0
    history_dependent = False

    @property
    def attention(self) -> AttentionOptions:
        return AttentionOptions()

    def wants_scores(self, prompt_tokens: int, first_drop: int | None, block_size: int) -> bool:
        """Whether a request's sampling chunk needs the step's attention mass per block (a step
        none of whose sampling chunks does runs without computing it). ``prompt_tokens``: the
        request's prompt length; ``first_drop``: where it first gave a block back (None before
        that). By default: every one, for a policy with ``observe`` (H2O's scores accumulate
        over the whole generation)."""
        return self.observe > 0

    def droppable(self, num_computed: int, block_size: int) -> tuple[int, int]:
        """Logical blocks ``[first, stop)`` no query at position ``>= num_computed`` sees."""
        return 0, 0

    def drops(self, num_computed: int, table, scores, block_size: int,
              prompt_tokens: int | None = None) -> tuple[int, ...]:
        """Logical blocks of ``table`` (kept entries, not the null block) to give back before
        the step whose first query sits at ``num_computed``. ``scores``: f64 [len(table)], the
        block's accumulated attention mass (for policies with ``observe``). ``prompt_tokens``:
        the request's prompt length (None: no prompt phase, as in ``jaxkv.entrypoints.eval.retained_nll``
        without one). By default the kept blocks of ``droppable``, found walking down from its
        end to the first entry already dropped (O(newly dropped) per step)."""
        first, stop = self.droppable(num_computed, block_size)
        out = []
        for j in range(min(stop, len(table)) - 1, first - 1, -1):
            if table[j] == 0:
                break
            out.append(j)
        return tuple(out)

    def may_drop(self, num_computed: int, logical: int, block_size: int) -> bool:
        """Whether logical block ``logical`` may be gone when the next query sits at
        ``num_computed`` (the invariant ``scheduler.check_invariants`` checks)."""
        first, stop = self.droppable(num_computed, block_size)
        return first <= logical < stop

    def max_blocks(self, num_tokens: int, max_step_tokens: int, block_size: int,
                   prompt_tokens: int | None = None) -> int:
        """Most blocks a request of ``num_tokens`` tokens (``prompt_tokens`` of them its
        prompt; None: as many as ``num_tokens``) holds at once, when a step computes at most
        ``max_step_tokens`` of its tokens."""
        return -(-num_tokens // block_size)

    def check_block_size(self, block_size: int, residual_blocks: int) -> None:
        """Raises ValueError when the policy cannot work with this pool geometry."""


@dataclasses.dataclass(frozen=True)
class FullRetention(Retention):
    """Every block is kept. The model's own sliding window (if any) still masks attention."""

    sliding_window: int | None = None

    @property
    def attention(self) -> AttentionOptions:
        return AttentionOptions(sliding_window=self.sliding_window)
