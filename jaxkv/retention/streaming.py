"""StreamingLLM retention (Xiao et al. 2023): attention sinks plus a rolling window.

Design notes: docs/retention.md."""

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
