"""The hybrid KV cache's layer groups: which layers share a block table (one attention kind per
group) and which pool slot holds each layer's pages. Every block id owns one page in every slot,
so groups overlay the same pool (vLLM's uniform-page grouping; docs/kv-cache.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def window_blocks(window: int | None, num_tokens: int, max_step_tokens: int,
                  block_size: int) -> int:
    """Most blocks one group's table holds at once for a ``num_tokens``-token request whose
    steps compute at most ``max_step_tokens`` tokens: all of them under full attention, else
    the ``W - 1`` positions before a step plus the step's, starting anywhere in a block."""
    full = cdiv(num_tokens, block_size)
    if window is None:
        return full
    return min(full, (window - 1 + max_step_tokens) // block_size + 2)


@dataclasses.dataclass(frozen=True)
class KVGroups:
    """The layer groups of a model's KV cache.

    Attributes:
      windows: per group, its sliding window W (a query sees itself and the W - 1 tokens
        before it; the group gives back blocks that leave it), or None for full attention.
        Full-attention groups come first.
      layers: per group, its layers; the i-th of them keeps its pages in pool slot i. Empty:
        one group of every layer, layer i in slot i (a model with one attention kind).
    """

    windows: tuple[int | None, ...] = (None,)
    layers: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        if any(w is not None and w < 1 for w in self.windows):
            raise ValueError(f"sliding_window={self.windows} must be >= 1")
        if self.layers and len(self.layers) != len(self.windows):
            raise ValueError(f"{len(self.layers)} layer groups for {len(self.windows)} windows")

    @classmethod
    def from_windows(cls, windows: Sequence[int | None]) -> KVGroups:
        """Groups for layers with these windows (None: full attention). One kind: one group,
        whose window only masks attention (no block is given back). Several: layers bucketed
        by window (full first, then by window), every bucket cut into groups of the same size
        ``n`` (the smallest bucket's, or the largest's when it is under 1.5x the smallest),
        taking every k-th layer so each group spans the depth::

            Gemma 3, 26 layers (5 sliding : 1 full): 1 full group [5 11 17 23] and 6 sliding
            groups of <= 4 layers ([0 7 14 21] [1 8 15 22] ...) over 4 pool slots
        """
        kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))
        if len(kinds) <= 1:
            return cls()
        buckets = [[i for i, w in enumerate(windows) if w == kind] for kind in kinds]
        sizes = [len(b) for b in buckets]
        n = max(sizes) if max(sizes) < 1.5 * min(sizes) else min(sizes)
        out_windows, out_layers = [], []
        for kind, bucket in zip(kinds, buckets):
            k = cdiv(len(bucket), n)
            for i in range(k):
                out_windows.append(kind)
                out_layers.append(tuple(bucket[i::k]))
        return cls(tuple(out_windows), tuple(out_layers))

    @classmethod
    def of_model(cls, config) -> KVGroups:
        """The groups of a ``jaxkv.model.config.ModelConfig``'s layers (by ``layer_window``)."""
        return cls.from_windows([config.layer_window(i) for i in range(config.num_layers)])

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def hybrid(self) -> bool:
        """Whether groups of different kinds share the pool (some give blocks back)."""
        return len(self.windows) > 1

    def num_slots(self, num_layers: int) -> int:
        """Pool slots: pages per block id (the largest group's layer count)."""
        return max(map(len, self.layers)) if self.layers else num_layers

    def place(self, layer: int) -> tuple[int, int]:
        """``(group, slot)`` of ``layer``."""
        for g, members in enumerate(self.layers):
            if layer in members:
                return g, members.index(layer)
        return 0, layer

    def describe(self) -> str:
        """One line per group: its kind and layers."""
        return "\n".join(f"group {g}: {'full' if w is None else f'sliding {w}'} "
                         f"attention, layers {list(ls)}"
                         for g, (w, ls) in enumerate(zip(self.windows, self.layers)))
