"""What the host side reads once the engine has resolved the user's arguments:
``SchedulerConfig`` (step limits, policy and padded shapes; also the user's ``scheduler``
argument group) and ``CacheConfig`` (the pool as planned, block count included)."""

from __future__ import annotations

import dataclasses

from jaxkv.config.kv_groups import KVGroups, window_blocks
from jaxkv.config.options import check_fields, option
from jaxkv.config.shapes import check_buckets, default_buckets, pad_step
from jaxkv.retention import FullRetention, Retention

SCHEDULING_POLICIES = ("fcfs", "priority", "lpm")
PREFIX_CACHING_MODES = ("hash", "radix")
PREEMPTION_MODES = ("auto", "recompute", "swap")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """Paged KV pool geometry.

    Attributes:
      block_size: tokens per block (page).
      num_blocks: blocks in the pool, *including* the reserved null block 0, so
        ``num_blocks - 1`` blocks are usable (see jaxkv/blocks/block_manager.py).
      prefix_caching: ``"hash"`` (full blocks, hash chain), ``"radix"`` (token granular) or
        None (off); see jaxkv/blocks/prefix_cache.py.
      residual_window_blocks: the KIVI residual window of an int4/int2 cache (0 otherwise);
        prefix hits stop before it (see ``BlockManager``).
      retention: which blocks of a sequence are kept (jaxkv/retention/); the scheduler gives
        back the ones no later query sees.
      host_blocks: blocks of the host KV tier (jaxkv/blocks/host_tier.py), 0 without one.
      preemption_mode: ``"recompute"``, ``"swap"`` (to the host tier, where it has room) or
        ``"auto"`` (per request, by ``host_tier.SwapCostModel``).
      swap_supported: False when a pool's blocks cannot be swapped exactly (KIVI): preemption
        then always recomputes.
      kv_groups: the hybrid cache's layer groups (jaxkv/config/kv_groups.py): each has a
        block table per request; sliding groups give back blocks leaving their window.
    """

    block_size: int = 16
    num_blocks: int
    prefix_caching: str | None = None
    residual_window_blocks: int = 0
    retention: Retention = FullRetention()
    host_blocks: int = 0
    preemption_mode: str = "recompute"
    swap_supported: bool = True
    kv_groups: KVGroups = KVGroups()

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
        if self.host_blocks < 0:
            raise ValueError(f"host_blocks={self.host_blocks} must be >= 0")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode={self.preemption_mode!r} is not one of "
                             f"{PREEMPTION_MODES}")
        if self.preemption_mode == "swap" and not self.host_blocks:
            raise ValueError("preemption_mode='swap' needs a host tier (host_blocks > 0)")
        if self.num_blocks * self.block_size > 2**31 - 1:
            raise ValueError(f"num_blocks * block_size = {self.num_blocks * self.block_size} "
                             f"slots overflow the int32 slot_mapping")

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can own: all but the null block 0."""
        return self.num_blocks - 1

    def max_blocks(self, num_tokens: int, max_step_tokens: int,
                   prompt_tokens: int | None = None) -> int:
        """Most blocks a request of ``num_tokens`` tokens holds at once over every group:
        group 0 as its retention policy allows, the others as their window does."""
        bs, (first, *rest) = self.block_size, self.kv_groups.windows
        held = (self.retention.max_blocks(num_tokens, max_step_tokens, bs, prompt_tokens)
                if first is None else window_blocks(first, num_tokens, max_step_tokens, bs))
        return held + sum(window_blocks(w, num_tokens, max_step_tokens, bs) for w in rest)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Limits of one engine step, the scheduling policy, and the padded step shapes.

    Attributes:
      max_num_seqs: most sequences in one step (and most requests running at once).
      max_num_batched_tokens: token budget of one step (decodes + prefill chunks).
      max_model_len: longest sequence (prompt + generated tokens) a request may reach; None
        until the engine resolves it from the model (``min(model context, 8192)``). The
        scheduler and the batch builder need it resolved.
      policy: ``"fcfs"`` (arrival order), ``"priority"`` (lower number first, ties by arrival) or
        ``"lpm"`` (longest cached prefix first, ties by arrival; needs prefix caching to matter).
      lpm_max_skips: under ``"lpm"``, a waiting request overtaken this many times is admitted
        before any request with a longer cached prefix (the age bound: nobody starves).
      token_buckets: padded sizes of the token axis ``T``; strictly increasing, the last one
        ``>= max_num_batched_tokens``. Default: powers of two from 8 closed by the maximum,
        from 256 up the midpoints 1.5 x 2^k as well, and 96 (``jaxkv/config/shapes.py``).
      seq_buckets: padded sizes of the sequence axis ``S``; strictly increasing, the last one
        ``>= max_num_seqs``. Default: powers of two from 8, and 96, closed by the maximum.
      decode_buckets: padded sizes of a decode-only step (one token per sequence), on both
        axes, where one fits it below its token bucket (``pad_step``); strictly increasing.
        Default, when both bucket lists are the defaults: 1, 2 and 4, and quarter octaves
        between 16 and 32 and from 64 to the smaller maximum (20, 24, 28, 80, 96, 112, 160,
        ...); else none.
    """

    max_num_seqs: int = option(256, "most sequences in one step", minimum=1)
    max_num_batched_tokens: int = option(2048, "token budget of one step", minimum=1)
    max_model_len: int | None = option(None, "longest prompt + output (default: min(model "
                                       "context, 8192))", minimum=1)
    policy: str = option("fcfs", "scheduling order", choices=SCHEDULING_POLICIES)
    lpm_max_skips: int = option(8, "lpm: admissions a waiting request may be overtaken by",
                                minimum=1)
    token_buckets: tuple[int, ...] | None = option(None, "padded token-axis sizes the step "
                                                   "compiles for (default: powers of two, and "
                                                   "1.5x midpoints from 256)")
    seq_buckets: tuple[int, ...] | None = option(None, "padded sequence-axis sizes the step "
                                                 "compiles for (default: powers of two)")
    decode_buckets: tuple[int, ...] | None = option(None, "padded sizes of a decode-only step "
                                                    "on both axes (default: 1, 2, 4 and "
                                                    "quarter octaves of 16-32 and above 64 "
                                                    "with the default buckets)")

    def __post_init__(self):
        check_fields(self)
        tokens, seqs, decode = default_buckets(
            self.max_num_batched_tokens, self.max_num_seqs,
            decode=self.token_buckets is None and self.seq_buckets is None)
        for name, default in (("token_buckets", tokens), ("seq_buckets", seqs),
                              ("decode_buckets", decode)):
            object.__setattr__(self, name, tuple(default if getattr(self, name) is None
                                                 else getattr(self, name)))
        check_buckets("token_buckets", self.token_buckets,
                      "max_num_batched_tokens", self.max_num_batched_tokens)
        check_buckets("seq_buckets", self.seq_buckets, "max_num_seqs", self.max_num_seqs)
        check_buckets("decode_buckets", self.decode_buckets)

    def padded_shape(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """The ``(T, S)`` a step of ``num_tokens`` tokens over ``num_seqs`` sequences pads
        to (``pad_step``)."""
        return pad_step(self.token_buckets, self.seq_buckets, self.decode_buckets,
                        num_tokens, num_seqs)

    def step_shapes(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The padded shapes the step compiles for: every bucket pair ``(T, S)`` a step can
        pad to (at least as many tokens as sequences: ``S``'s smallest count, one more than the
        bucket below it, is at most ``T``), and apart the decode-only steps' shapes that are
        not among them."""
        pairs = [(t, n) for t in self.token_buckets
                 for n, below in zip(self.seq_buckets, (0, *self.seq_buckets)) if below < t]
        return pairs, sorted(set(self.decode_shapes()) - set(pairs))

    def decode_shapes(self) -> list[tuple[int, int]]:
        """The padded shapes ``(T, S)`` of the decode-only steps (one token per sequence)."""
        most = min(self.max_num_seqs, self.max_num_batched_tokens)
        return sorted({self.padded_shape(n, n) for n in range(1, most + 1)})
