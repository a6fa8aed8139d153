"""Engine configuration: frozen dataclasses validated in ``__post_init__``.

``CacheConfig`` sizes the paged KV pool; ``SchedulerConfig`` bounds one engine step and fixes the
padded shapes (buckets) the device step is compiled for. Every invalid value raises ``ValueError``
naming the field, at construction time, so a bad configuration never reaches the engine loop.
The model's own hyper-parameters live in ``jaxkv/model/config.py``.
"""

from __future__ import annotations

import dataclasses

SCHEDULING_POLICIES = ("fcfs", "priority", "lpm")
PREFIX_CACHING_MODES = ("hash", "radix")


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """``(lo, 2 lo, 4 lo, ...)`` up to ``hi``; ``hi`` itself always closes the tuple."""
    sizes = []
    size = lo
    while size < hi:
        sizes.append(size)
        size *= 2
    return (*sizes, hi)


def _check_buckets(name: str, buckets: tuple[int, ...], maximum_name: str, maximum: int) -> None:
    if not buckets:
        raise ValueError(f"{name} must not be empty")
    if any(b < 1 for b in buckets) or any(a >= b for a, b in zip(buckets, buckets[1:])):
        raise ValueError(f"{name}={buckets} must be positive and strictly increasing")
    if buckets[-1] < maximum:
        raise ValueError(f"{name}[-1]={buckets[-1]} must be >= {maximum_name}={maximum}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """Paged KV pool geometry.

    Attributes:
      block_size: tokens per block (page).
      num_blocks: blocks in the pool, *including* the reserved null block 0, so
        ``num_blocks - 1`` blocks are usable (see jaxkv/block_manager.py).
      prefix_caching: ``"hash"`` (full blocks, hash chain), ``"radix"`` (token granular) or
        None (off); see jaxkv/prefix_cache.py.
      residual_window_blocks: the KIVI residual window of an int4/int2 cache (0 otherwise);
        prefix hits stop before it (see ``BlockManager``).
    """

    block_size: int = 16
    num_blocks: int
    prefix_caching: str | None = None
    residual_window_blocks: int = 0

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be >= 1")
        if self.num_blocks < 2:
            raise ValueError(
                f"num_blocks={self.num_blocks} must be >= 2 (block 0 is the reserved null block)")
        if self.prefix_caching not in (None, *PREFIX_CACHING_MODES):
            raise ValueError(f"prefix_caching={self.prefix_caching!r} is not one of "
                             f"{PREFIX_CACHING_MODES} or None")
        if self.residual_window_blocks < 0:
            raise ValueError(f"residual_window_blocks={self.residual_window_blocks} must be >= 0")
        if self.num_blocks * self.block_size > 2**31 - 1:
            raise ValueError(f"num_blocks * block_size = {self.num_blocks * self.block_size} "
                             f"slots overflow the int32 slot_mapping")

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can own: all but the null block 0."""
        return self.num_blocks - 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Limits of one engine step, the scheduling policy, and the padded step shapes.

    Attributes:
      max_num_seqs: most sequences in one step (and most requests running at once).
      max_num_batched_tokens: token budget of one step (decodes + prefill chunks).
      max_model_len: longest sequence (prompt + generated tokens) a request may reach.
      policy: ``"fcfs"`` (arrival order), ``"priority"`` (lower number first, ties by arrival) or
        ``"lpm"`` (longest cached prefix first, ties by arrival; needs prefix caching to matter).
      lpm_max_skips: under ``"lpm"``, a waiting request overtaken this many times is admitted
        before any request with a longer cached prefix (the age bound: nobody starves).
      token_buckets: padded sizes of the token axis ``T``; strictly increasing, the last one
        ``>= max_num_batched_tokens``. Default: powers of two from 16, closed by the maximum.
      seq_buckets: padded sizes of the sequence axis ``S``; strictly increasing, the last one
        ``>= max_num_seqs``. Default: powers of two from 8, closed by the maximum (the same
        minima as vLLM's TPU backend: smaller buckets save little and add compilations).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int
    policy: str = "fcfs"
    lpm_max_skips: int = 8
    token_buckets: tuple[int, ...] | None = None
    seq_buckets: tuple[int, ...] | None = None

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "lpm_max_skips"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy={self.policy!r} is not one of {SCHEDULING_POLICIES}")
        if self.token_buckets is None:
            object.__setattr__(self, "token_buckets",
                               _powers_of_two(min(16, self.max_num_batched_tokens),
                                              self.max_num_batched_tokens))
        if self.seq_buckets is None:
            object.__setattr__(self, "seq_buckets",
                               _powers_of_two(min(8, self.max_num_seqs), self.max_num_seqs))
        object.__setattr__(self, "token_buckets", tuple(self.token_buckets))
        object.__setattr__(self, "seq_buckets", tuple(self.seq_buckets))
        _check_buckets("token_buckets", self.token_buckets,
                       "max_num_batched_tokens", self.max_num_batched_tokens)
        _check_buckets("seq_buckets", self.seq_buckets, "max_num_seqs", self.max_num_seqs)
