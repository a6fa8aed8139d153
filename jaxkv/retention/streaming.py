"""StreamingLLM retention (Xiao et al. 2023): attention sinks plus a rolling window.

Each query sees the first ``S = sink_tokens`` positions of its sequence and the last ``W =
window_tokens`` positions up to itself (``jaxkv.attention.reference.visible``). A block none of
whose positions any later query can see is given back to the pool, so a sequence holds at most the
sink blocks, the window's blocks and one step's new blocks, however long it grows (and may grow
past the model's context: ``max_model_len`` then bounds only positions, not memory):

    block_size 4, S = 2, W = 6, next query at position 13 (sees 0, 1 and 8..13):

        logical   0          1          2          3
        table   [ b5 ] [ 0 (dropped) ] [ b9 ]    [ b2 ]      0 = the null block
        held      p0 p1 (sinks) p2 p3    p8..p11    p12 p13..
                  the sink block stays whole; block 1 (p4..p7) left the window

Positions (``positions``):

* ``"cache"`` (StreamingLLM's choice, needed past the model's context): a token's position is
  its index in the cache ``[sinks | window]``, so a query sits at ``min(p, S + W - 1)``. Keys
  are stored rotated at their original positions, and only the sinks are rescored: RoPE's score
  depends on ``query position - key position`` alone, a window key's distance to its query is
  ``p_q - p_k`` in both numberings, and a sink key ``i`` stored at position ``i`` gets distance
  ``min(p_q, S + W - 1) - i`` by rotating the *query* to ``min(p_q, S + W - 1)`` for the sink
  scores (``AttentionOptions.sink_position_cap``). This is exactly the in-cache numbering with
  no key re-rotated on eviction and no pre-RoPE keys stored, so it works unchanged for every KV
  format (a quantized key is never dequantized and requantized).
* ``"original"``: every token keeps its position in the text (sinks drift ever further away).
"""

from __future__ import annotations

import dataclasses

from jaxkv.attention.options import AttentionOptions
from jaxkv.retention.full import Retention

POSITIONS = ("cache", "original")


@dataclasses.dataclass(frozen=True)
class StreamingRetention(Retention):
    """Attention sinks + a rolling window, out-of-window blocks freed.

    Attributes:
      sink_tokens: S, the first positions every query sees (>= 0).
      window_tokens: W, the recent positions a query sees, itself included (>= 1).
      positions: ``"cache"`` or ``"original"`` (see the module docstring).
    """

    sink_tokens: int = 4
    window_tokens: int = 1024
    positions: str = "cache"
    name = "streaming"

    def __post_init__(self):
        if self.sink_tokens < 0:
            raise ValueError(f"kv_sink_tokens={self.sink_tokens} must be >= 0")
        if self.window_tokens is None or self.window_tokens < 1:
            raise ValueError(f"kv_retention='streaming' needs kv_window_tokens >= 1, got "
                             f"{self.window_tokens}")
        if self.positions not in POSITIONS:
            raise ValueError(f"kv_positions={self.positions!r} is not one of {POSITIONS}")

    @property
    def attention(self) -> AttentionOptions:
        cap = self.sink_tokens + self.window_tokens - 1
        return AttentionOptions(
            sliding_window=self.window_tokens, num_sinks=self.sink_tokens,
            sink_position_cap=cap if self.positions == "cache" and self.sink_tokens else None)

    def droppable(self, num_computed: int, block_size: int) -> tuple[int, int]:
        """Blocks after the sink blocks that end before the first position the query at
        ``num_computed`` sees (``num_computed - W + 1``)."""
        first = -(-self.sink_tokens // block_size)
        return first, max(first, (num_computed - self.window_tokens + 1) // block_size)

    def max_blocks(self, num_tokens: int, max_step_tokens: int, block_size: int,
                   prompt_tokens: int | None = None) -> int:
        """The sink blocks, plus the blocks spanned by the window before a step and the step's
        tokens (``W - 1 + max_step_tokens`` positions, starting anywhere in a block)."""
        held = (-(-self.sink_tokens // block_size)
                + (self.window_tokens - 1 + max_step_tokens) // block_size + 2)
        return min(-(-num_tokens // block_size), held)

    def check_block_size(self, block_size: int, residual_blocks: int) -> None:
        """KIVI keeps its last ``residual_blocks`` blocks in full precision: they must lie in
        the window, so a dropped block never owns a residual slot."""
        if residual_blocks and self.window_tokens < residual_blocks * block_size:
            raise ValueError(f"kv_window_tokens={self.window_tokens} must cover the KIVI "
                             f"residual window, kv_residual_blocks x block_size = "
                             f"{residual_blocks * block_size} tokens")
