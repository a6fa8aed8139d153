"""Engine configuration: frozen dataclasses validated in ``__post_init__``, and the one place
engine arguments are listed.

``EngineConfig`` groups what a user chooses, one frozen dataclass per concern::

    EngineConfig
      model     ModelArgs        which weights, dtype, engine seed
      cache     CacheArgs        KV format, block size, pool sizing, prefix caching
      scheduler SchedulerConfig  step limits, policy, buckets (max_model_len resolved later)
      parallel  ParallelArgs     tensor / data parallel sizes, an explicit mesh
      runtime   RuntimeArgs      attention implementation, warm-up, compilation cache
      speculative SpeculativeArgs  speculative decoding: proposer, draft length

Every field is declared once, with ``option(default, help, ...)``: its type (from the annotation),
range and choices are checked by ``check_fields``; ``EngineConfig.from_kwargs`` takes them as the
flat keyword arguments of ``LLM(...)`` / ``AsyncLLM(...)`` (with vLLM's names, plus a few
aliases), and ``add_cli_args`` / ``from_cli`` make them the command-line flags. Every invalid value
raises ``TypeError`` (wrong type) or ``ValueError`` (wrong value) naming the field, at
construction time, so a bad configuration never reaches the engine loop.

``CacheConfig`` (the pool as planned: block count included) and ``SchedulerConfig`` (with
``max_model_len`` resolved) are what the host-side block manager and scheduler read. The model's
own hyper-parameters live in ``jaxkv/model/config.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import types
import typing

from jaxkv.attention import ATTENTION_IMPLS
from jaxkv.config.checks import check_number, check_type
from jaxkv.kvcache.spec import KV_ALIASES, KV_FORMATS, LAYOUTS, MODEL_DTYPES
from jaxkv.retention import FullRetention, Retention
from jaxkv.retention.streaming import POSITIONS

SCHEDULING_POLICIES = ("fcfs", "priority", "lpm")
PREFIX_CACHING_MODES = ("hash", "radix")
SPECULATIVE_METHODS = ("ngram", "suffix", "draft")
RETENTION_MODES = ("full", "streaming", "h2o", "snapkv", "random")
OFFLOAD_POLICIES = ("lru",)
PREEMPTION_MODES = ("auto", "recompute", "swap")
SPARSE_ATTENTION_METHODS = ("quest",)
_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"80GiB"`` / ``"1.5e9"`` / ``"512MB"`` -> bytes (a CLI flag parser)."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 80GiB, 512MB or 1e9")
    return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])


def parse_none(text: str) -> str | None:
    """``"none"`` (any case) -> None, else the text: the CLI parser of an optional choice."""
    return None if text.lower() == "none" else text


def option(default, help: str, *, choices=None, minimum=None, maximum=None, aliases=(),
           flags=(), parse=None, cli: bool = True):
    """A config field declared once: default, help, checks and its CLI flag.

    Args:
      default: the default value.
      help: one line for the docs and ``--help``.
      choices: allowed values (``None`` is allowed iff the annotation is optional).
      minimum, maximum: inclusive bounds of a number.
      aliases: other keyword names ``EngineConfig.from_kwargs`` accepts for it.
      flags: extra CLI flags (the main one is ``--`` + the name with dashes).
      parse: CLI string parser (default: from the annotation).
      cli: False for fields that are not command-line flags (e.g. a mesh object).
    """
    return dataclasses.field(default=default, metadata=dict(
        help=help, choices=choices, minimum=minimum, maximum=maximum, aliases=tuple(aliases),
        flags=tuple(flags), parse=parse, cli=cli))


def _base_type(tp):
    """(type without ``| None``, whether None is allowed) of an annotation."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(tp))
    return tp, False


def _checked(name: str, value, tp, meta) -> object:
    """``value`` as the field's type (ints as int, tuples as tuple), within its bounds."""
    tp, optional = _base_type(tp)
    if value is None and optional:
        return None
    bounds = dict(low=meta.get("minimum"), high=meta.get("maximum"))
    if tp in (int, float):
        return check_number(name, value, tp, **bounds)
    if tp in (bool, str):
        return check_type(name, value, (tp,), f"a {tp.__name__}" + (" or None" if optional
                                                                      else ""))
    if typing.get_origin(tp) is tuple:
        check_type(name, value, (list, tuple), "a list or tuple" + (" or None" if optional
                                                                    else ""))
        return tuple(check_number(f"{name}[{i}]", v, typing.get_args(tp)[0], **bounds)
                     for i, v in enumerate(value))
    return value


def check_fields(obj) -> None:
    """Checks (and normalises) every ``option`` field of a frozen dataclass instance.

    Raises:
      TypeError: a value of the wrong type (a bool or float for an int, a str for a number...);
        a ``jaxkv.config.checks.ParamTypeError``.
      ValueError: a value out of its range or choices.
    """
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = _checked(f.name, getattr(obj, f.name), hints[f.name], f.metadata)
        object.__setattr__(obj, f.name, value)
        choices = f.metadata.get("choices")
        if value is not None and choices is not None and value not in choices:
            raise ValueError(f"{f.name}={value!r} is not one of: "
                             f"{', '.join(map(str, choices))}")


TOKEN_MIDPOINTS_FROM = 256     # default token buckets: 1.5 x 2^k between the powers from here
# and on both axes a bucket of 96 between 64 and 128: a decode step of 65-95 sequences ran on
# 128 token rows and 128 sequence rows (bench/step_mix.py: 322 -> 272 ms per such step, T's
# pass -2%), for 9 more (T, S) variants to compile (BENCHMARKS.md, session 32)
EXTRA_BUCKETS = (96,)
# where a decode-only step (one token per sequence) pads to a quarter of an octave on both
# axes (``decode_buckets``): the quarter octaves strictly between each (lo, hi), hi None for
# the smaller maximum; the spans where the step's dense products cost in proportion to rows.
# In T's pass interleaved with one without them (bench/pass_ab.py, BENCHMARKS.md session 33):
# 17-31 sequences on 20-28 rows (the small-row matmul) -14%, 65-127 sequences on 80 or 112
# rows -2 to -5%; but 33-63 on 40-56 rows +4% (XLA's GEMM no faster there than at 64 rows),
# so none between 32 and 64
DECODE_BUCKET_SPANS = ((16, 32), (64, None))


def _powers_of_two(lo: int, hi: int, *, midpoints_from: int | None = None,
                   extra: tuple[int, ...] = ()) -> tuple[int, ...]:
    """``(lo, 2 lo, 4 lo, ...)`` up to ``hi``; ``hi`` itself always closes the tuple. With
    ``midpoints_from``, each power ``p >= midpoints_from`` is followed by ``1.5 p``; the sizes
    of ``extra`` between ``lo`` and ``hi`` join in order."""
    sizes = []
    size = lo
    while size < hi:
        sizes.append(size)
        if midpoints_from is not None and size >= midpoints_from and size * 3 // 2 < hi:
            sizes.append(size * 3 // 2)
        size *= 2
    return (*sorted({*sizes, *(e for e in extra if lo < e < hi)}), hi)


def _quarter_octaves(lo: int, hi: int) -> tuple[int, ...]:
    """The sizes ``p/2 + i p/8`` (i = 1, 2, 3) of each octave ``(p/2, p]``, strictly between
    ``lo`` and ``hi``: ..., 40, 48, 56, 80, 96, 112, 160, 192, 224, ..."""
    sizes, p = [], 16
    while p // 2 < hi:
        sizes += [p // 2 + i * p // 8 for i in (1, 2, 3)]
        p *= 2
    return tuple(x for x in sizes if lo < x < hi)


def _smallest(buckets: tuple[int, ...], n: int) -> int | None:
    """The smallest of ``buckets`` (increasing) that is ``>= n``; None when none is."""
    return next((b for b in buckets if b >= n), None)


def pad_step(token_buckets: tuple[int, ...], seq_buckets: tuple[int, ...],
             decode_buckets: tuple[int, ...], num_tokens: int, num_seqs: int) -> tuple[int, int]:
    """The padded shape ``(T, S)`` of a step of ``num_tokens`` tokens over ``num_seqs``
    sequences: the smallest token and sequence buckets that hold them (the largest ones where
    none does; the scheduler never exceeds them), except that a decode-only step
    (``num_tokens == num_seqs``) whose smallest fitting ``decode_buckets`` size ``d`` is below
    its token bucket runs on ``d`` token rows and ``min(d, S)`` sequence rows."""
    t = _smallest(token_buckets, num_tokens) or token_buckets[-1]
    s = _smallest(seq_buckets, num_seqs) or seq_buckets[-1]
    d = _smallest(decode_buckets, num_tokens) if num_tokens == num_seqs else None
    return (d, min(d, s)) if d is not None and d < t else (t, s)


def _check_buckets(name: str, buckets: tuple[int, ...], maximum_name: str | None = None,
                   maximum: int = 0) -> None:
    if not buckets and maximum_name is not None:
        raise ValueError(f"{name} must not be empty")
    if any(b < 1 for b in buckets) or any(a >= b for a, b in zip(buckets, buckets[1:])):
        raise ValueError(f"{name}={buckets} must be positive and strictly increasing")
    if maximum_name is not None and buckets[-1] < maximum:
        raise ValueError(f"{name}[-1]={buckets[-1]} must be >= {maximum_name}={maximum}")


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
        ``"auto"`` (per request, by ``offload.SwapCostModel``).
      swap_supported: False when a pool's blocks cannot be swapped exactly (KIVI): preemption
        then always recomputes.
    """

    block_size: int = 16
    num_blocks: int
    prefix_caching: str | None = None
    residual_window_blocks: int = 0
    retention: Retention = FullRetention()
    host_blocks: int = 0
    preemption_mode: str = "recompute"
    swap_supported: bool = True

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
        ``>= max_num_batched_tokens``. Default: powers of two from 8, closed by the maximum
        (8 decodes run on 8 token rows, not 16: the step's matmuls do ~15% less work,
        bench/decode_step.py), and from 256 tokens up the midpoints 1.5 x 2^k as well (384,
        768, 1536): a step that large costs in proportion to its padded tokens, and a batch of
        prompts just over a power of two (342 tokens: 512) would waste up to half of it.
        And 96 (``EXTRA_BUCKETS``, on both axes): a decode step of 65-95 sequences runs on 96
        rows, not 128.
      seq_buckets: padded sizes of the sequence axis ``S``; strictly increasing, the last one
        ``>= max_num_seqs``. Default: powers of two from 8, and 96, closed by the maximum (the
        same minima as vLLM's TPU backend: smaller buckets save little and add compilations).
      decode_buckets: padded sizes of a decode-only step (one token per sequence), on both
        axes, where one fits it below its token bucket (``pad_step``); strictly increasing.
        Each adds one compiled variant, not one per pair. Default, when both bucket lists are
        the defaults: the quarter octaves ``p/2 + i p/8`` between 16 and 32 and from 64 to the
        smaller maximum (``DECODE_BUCKET_SPANS``: 20, 24, 28, 80, 96, 112, 160, 192, 224, 320,
        ...), so a decode step of 100 sequences runs on 112 rows, not 128, where its dense
        products cost nearly in proportion to their rows (T's pass -1.4%, BENCHMARKS.md
        session 33). Otherwise none (the given buckets are the shapes).
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
                                                    "on both axes (default: quarter octaves "
                                                    "of 16-32 and above 64 with the default "
                                                    "buckets)")

    def __post_init__(self):
        check_fields(self)
        if self.decode_buckets is None:
            defaults = self.token_buckets is None and self.seq_buckets is None
            most = min(self.max_num_seqs, self.max_num_batched_tokens)
            object.__setattr__(self, "decode_buckets", tuple(
                size for lo, hi in DECODE_BUCKET_SPANS
                for size in _quarter_octaves(lo, min(most, hi or most))) if defaults else ())
        if self.token_buckets is None:
            object.__setattr__(self, "token_buckets",
                               _powers_of_two(min(8, self.max_num_batched_tokens),
                                              self.max_num_batched_tokens,
                                              midpoints_from=TOKEN_MIDPOINTS_FROM,
                                              extra=EXTRA_BUCKETS))
        if self.seq_buckets is None:
            object.__setattr__(self, "seq_buckets",
                               _powers_of_two(min(8, self.max_num_seqs), self.max_num_seqs,
                                              extra=EXTRA_BUCKETS))
        object.__setattr__(self, "token_buckets", tuple(self.token_buckets))
        object.__setattr__(self, "seq_buckets", tuple(self.seq_buckets))
        _check_buckets("token_buckets", self.token_buckets,
                       "max_num_batched_tokens", self.max_num_batched_tokens)
        _check_buckets("seq_buckets", self.seq_buckets, "max_num_seqs", self.max_num_seqs)
        object.__setattr__(self, "decode_buckets", tuple(self.decode_buckets))
        _check_buckets("decode_buckets", self.decode_buckets)

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
        most = min(self.max_num_seqs, self.max_num_batched_tokens)
        decode = sorted({self.padded_shape(n, n) for n in range(1, most + 1)} - set(pairs))
        return pairs, decode


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelArgs:
    """Which model the engine runs, and how."""

    model: str = option("SmolLM2-135M-Instruct", "store name, .gguf file, HF model directory "
                        "or orbax checkpoint")
    dtype: str = option("auto", "parameter, activation and default KV dtype (auto: bfloat16 on "
                        "GPU, float32 on CPU)", choices=("auto", *MODEL_DTYPES))
    seed: int = option(0, "engine seed of requests without their own")

    def __post_init__(self):
        check_fields(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheArgs:
    """The KV cache: its format, block size, pool size and prefix caching."""

    kv_cache_dtype: str = option("auto", "KV format (auto = the model dtype; formats and "
                                 "aliases: jaxkv/kvcache/spec.py)",
                                 choices=("auto", *KV_FORMATS, *KV_ALIASES))
    kv_layout: str = option("auto", "float KV pools' memory order: nhd [blocks, tokens, heads, "
                            "dim] or hnd [blocks, heads, tokens, dim] (auto: hnd for the CPU "
                            "paths, nhd for pallas and quantized formats)",
                            choices=("auto", *LAYOUTS))
    kv_residual_blocks: int = option(1, "int4/int2 (KIVI): residual window in blocks kept in "
                                     "full precision", minimum=1)
    kv_group_size: int | None = option(None, "int4/int2 (KIVI): channels per value scale/zero "
                                       "group (default: the largest divisor of head_dim <= 32)",
                                       minimum=1)
    block_size: int = option(16, "tokens per KV block", minimum=1)
    gpu_memory_utilization: float = option(
        0.9, "fraction of device memory the engine plans with (CPU: of half the available host "
        "memory, in steps of 1/16 of the total, and the pool at most 2 GiB or one "
        "max_model_len sequence: planner.CPU_KV_CACHE_BYTES)",
        minimum=1e-3, maximum=1.0, aliases=("memory_utilization",),
        flags=("--memory-utilization",))
    kv_cache_memory_bytes: int | None = option(
        None, "KV pool size in bytes (e.g. 8GiB), instead of the utilization sizing (and of "
        "the CPU default, 2 GiB)", minimum=1,
        aliases=("kv_cache_bytes",), flags=("--kv-cache-memory",), parse=parse_bytes)
    num_gpu_blocks_override: int | None = option(
        None, "KV pool size in blocks (including the null block), instead of both", minimum=2,
        aliases=("num_kv_blocks",), flags=("--num-kv-blocks",))
    prefix_caching: str | None = option("hash", "prefix caching: hash (full blocks), radix "
                                        "(token granular) or none",
                                        choices=PREFIX_CACHING_MODES,
                                        parse=parse_none)
    kv_retention: str = option("full", "which KV a sequence keeps: full, streaming "
                               "(attention sinks + a rolling window; blocks leaving the window "
                               "are freed, so a sequence may outgrow the model's context) or "
                               "h2o (heavy hitters by accumulated attention + a recent window, "
                               "in kv_budget_tokens), snapkv (the prompt compressed once, at the "
                               "end of prefill, to kv_budget_tokens by its last "
                               "kv_observation_tokens' attention) or random (h2o's budget, "
                               "random victims)", choices=RETENTION_MODES)
    kv_sink_tokens: int = option(4, "streaming, h2o, snapkv, random and quest: first positions "
                                 "every query attends to (attention sinks)", minimum=0)
    kv_budget_tokens: int | None = option(None, "h2o and random: KV tokens a sequence keeps "
                                          "(half recent window); snapkv: prompt KV tokens kept",
                                          minimum=1)
    kv_observation_tokens: int | None = option(None, "snapkv: the prompt's last tokens whose "
                                               "attention ranks its blocks (and that are "
                                               "kept); default 32", minimum=1)
    kv_window_tokens: int | None = option(None, "streaming: recent positions a query attends "
                                          "to, itself included", minimum=1)
    kv_positions: str = option("cache", "streaming: RoPE positions within the cache "
                               "(StreamingLLM) or the original positions",
                               choices=POSITIONS)
    sparse_attention: str | None = option(
        None, "query-aware sparse decode attention: quest (each decode token attends to the "
        "pages whose per-channel key bounds score highest, plus the sinks and the recent "
        "window; prefill stays dense) or none", choices=SPARSE_ATTENTION_METHODS,
        parse=parse_none)
    sparse_budget_tokens: int | None = option(
        None, "quest: KV positions each decode token attends to, in whole blocks (rounded up), "
        "sinks and recent window included", minimum=1)
    sparse_recent_tokens: int = option(
        32, "quest: most recent positions every decode token attends to, itself included",
        minimum=1)
    kv_offload_bytes: int | None = option(
        None, "host KV tier size in bytes (e.g. 8GiB): evicted prefix-cache blocks are demoted "
        "to it and promoted back on a hit, and preempted sequences may be swapped to it",
        minimum=1, aliases=("kv_offload_size",), flags=("--kv-offload-size",),
        parse=parse_bytes)
    kv_offload_policy: str = option("lru", "host tier eviction order", choices=OFFLOAD_POLICIES)
    kv_cache_dir: str | None = option(
        None, "directory of a persistent prefix cache: host-tier blocks are written there "
        "(content-addressed) and a restarted engine hits them; needs kv_offload_bytes")
    preemption_mode: str = option(
        "auto", "how a preempted sequence comes back: recompute, swap (its blocks to the host "
        "tier and back) or auto (per request, whichever the measured copy bandwidth and "
        "prefill rate say is faster; recompute without a host tier)", choices=PREEMPTION_MODES)

    def __post_init__(self):
        check_fields(self)
        if self.sparse_attention == "quest" and self.sparse_budget_tokens is None:
            raise ValueError("sparse_attention='quest' needs sparse_budget_tokens (the KV "
                             "positions each decode token attends to, e.g. 512)")
        if self.sparse_attention is None and self.sparse_budget_tokens is not None:
            raise ValueError(f"sparse_budget_tokens={self.sparse_budget_tokens} is used only "
                             f"with sparse_attention='quest'")
        if self.sparse_attention is not None and self.kv_retention != "full":
            raise ValueError(f"sparse_attention={self.sparse_attention!r} does not compose with "
                             f"kv_retention={self.kv_retention!r} (its selection and sparse "
                             f"kernels know no window); use kv_retention='full'")
        if self.kv_retention == "streaming" and self.kv_window_tokens is None:
            raise ValueError("kv_retention='streaming' needs kv_window_tokens (the rolling "
                             "window, e.g. 1020 with kv_sink_tokens=4 for a 1024-token cache)")
        if self.kv_retention != "streaming" and self.kv_window_tokens is not None:
            raise ValueError(f"kv_window_tokens={self.kv_window_tokens} is used only with "
                             f"kv_retention='streaming'")
        budgeted = ("h2o", "snapkv", "random")
        if self.kv_retention in budgeted and self.kv_budget_tokens is None:
            raise ValueError(f"kv_retention={self.kv_retention!r} needs kv_budget_tokens (the "
                             f"KV tokens a sequence keeps, e.g. 20% of its length)")
        if self.kv_retention not in budgeted and self.kv_budget_tokens is not None:
            raise ValueError(f"kv_budget_tokens={self.kv_budget_tokens} is used only with "
                             f"kv_retention in {budgeted}")
        if self.kv_retention != "snapkv" and self.kv_observation_tokens is not None:
            raise ValueError(f"kv_observation_tokens={self.kv_observation_tokens} is used only "
                             f"with kv_retention='snapkv'")
        if self.kv_cache_dir is not None and self.kv_offload_bytes is None:
            raise ValueError(f"kv_cache_dir={self.kv_cache_dir!r} needs kv_offload_bytes (the "
                             f"host tier the persistent cache is written from)")
        if self.preemption_mode == "swap" and self.kv_offload_bytes is None:
            raise ValueError("preemption_mode='swap' needs kv_offload_bytes (the host tier "
                             "preempted sequences are swapped to)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelArgs:
    """How the model is split over devices."""

    tensor_parallel_size: int = option(1, "devices the model is split over", minimum=1,
                                       flags=("-tp",))
    data_parallel_size: int = option(1, "independent replicas, each over tensor_parallel_size "
                                     "devices (jaxkv.DataParallelLLM)", minimum=1, flags=("-dp",))
    mesh: object = option(None, "an explicit jax.sharding.Mesh {'dp': 1, 'tp': N}", cli=False)

    def __post_init__(self):
        check_fields(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuntimeArgs:
    """How the device step runs and compiles."""

    attention_impl: str | None = option(None, "attention implementation (default: pallas on "
                                        "GPU, grouped on CPU)", choices=ATTENTION_IMPLS)
    interpret: bool = option(False, "run Pallas kernels in interpret mode (CPU)")
    warmup: bool = option(False, "compile every (tokens, sequences) bucket at start")
    compilation_cache: bool = option(True, "use JAX's persistent compilation cache")
    compilation_cache_dir: str | None = option(None, "its directory (default: under the user "
                                               "cache dir, or $JAXKV_COMPILATION_CACHE_DIR)")

    def __post_init__(self):
        check_fields(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeArgs:
    """Speculative decoding: the draft proposer and how many tokens it drafts (vLLM's names)."""

    speculative: str | None = option(
        None, "draft proposer: ngram (prompt lookup in the request's own prompt + output), "
        "suffix (lookup in every request's prompt + output, running or recent: SuffixDecoding), "
        "draft (a small model with the same tokenizer: speculative_model) or none",
        choices=SPECULATIVE_METHODS, parse=parse_none)
    speculative_model: str | None = option(
        None, "draft: the draft model (store name, .gguf file, HF model directory or orbax "
        "checkpoint, loaded like model), with the target's vocabulary")
    num_speculative_tokens: int = option(4, "most draft tokens a sequence carries per step",
                                         minimum=1)
    prompt_lookup_max: int = option(4, "ngram: longest suffix of the tokens looked up",
                                    minimum=1)
    prompt_lookup_min: int = option(1, "ngram: shortest suffix of the tokens looked up",
                                    minimum=1)
    suffix_max_depth: int = option(16, "suffix: longest substring counted (the longest suffix "
                                   "matched is one shorter)", minimum=2)
    suffix_cache_tokens: int = option(16384, "suffix: most tokens of requests no longer running "
                                      "kept indexed (oldest out)", minimum=0)
    suffix_min_probability: float = option(
        0.1, "suffix: drafting stops where the draft's estimated probability (the product of its "
        "tokens' observed continuation frequencies) falls below this", minimum=0.0, maximum=1.0)
    speculative_adaptive: bool = option(
        True, "choose each step's draft lengths (0 included) from the measured acceptance, the "
        "measured step time by padded shape and (draft) the draft's measured forwards")

    def __post_init__(self):
        check_fields(self)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} must be <= "
                             f"prompt_lookup_max={self.prompt_lookup_max}")
        if self.speculative == "draft" and not self.speculative_model:
            raise ValueError('speculative="draft" needs speculative_model (the draft model: '
                             'a small model with the target\'s tokenizer)')

    @property
    def max_drafts(self) -> int:
        """Draft tokens a sequence may carry: ``num_speculative_tokens``, 0 when off."""
        return self.num_speculative_tokens if self.speculative else 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Everything a user chooses about an engine, grouped (see the module docstring)."""

    model: ModelArgs = dataclasses.field(default_factory=ModelArgs)
    cache: CacheArgs = dataclasses.field(default_factory=CacheArgs)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    parallel: ParallelArgs = dataclasses.field(default_factory=ParallelArgs)
    runtime: RuntimeArgs = dataclasses.field(default_factory=RuntimeArgs)
    speculative: SpeculativeArgs = dataclasses.field(default_factory=SpeculativeArgs)

    @classmethod
    def groups(cls) -> dict[str, type]:
        """Group name -> its dataclass, in declaration order."""
        return {f.name: f.default_factory for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """The config of flat keyword arguments (``LLM(model=..., max_num_seqs=...)``).

        Raises:
          TypeError: an unknown argument (with the closest names), an argument given twice
            (under a name and an alias), or a value of the wrong type.
          ValueError: a value out of range, naming the argument as given (its alias, if the
            value came under one).
        """
        return cls._of(kwargs, {})

    @classmethod
    def _of(cls, kwargs: dict, labels: dict[str, str]) -> "EngineConfig":
        """``from_kwargs``, where an error names a value ``labels[key]`` (a CLI flag) or the
        keyword it came under."""
        names = _argument_names()
        grouped: dict[str, dict] = {g: {} for g in cls.groups()}
        given: dict[str, str] = {}   # field -> what the user called it
        for key, value in kwargs.items():
            if key not in names:
                close = difflib.get_close_matches(key, names, n=3)
                raise TypeError(f"unknown engine argument {key!r}"
                                + (f"; did you mean {', '.join(close)}?" if close else ""))
            group, field = names[key]
            if field in grouped[group]:
                raise TypeError(f"engine argument {field!r} given twice (as {key!r})")
            grouped[group][field] = value
            given[field] = labels.get(key, key)
        try:
            return cls(**{g: t(**grouped[g]) for g, t in cls.groups().items()})
        except (TypeError, ValueError) as e:
            e.args = (_as_given(str(e), given),)
            raise

    def to_kwargs(self) -> dict:
        """The flat keyword arguments that rebuild this config (``from_kwargs`` inverse)."""
        return {f.name: getattr(getattr(self, g), f.name)
                for g, t in self.groups().items() for f in dataclasses.fields(t)}

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, **defaults) -> None:
        """Adds one flag per field, grouped; ``defaults`` overrides a field's default."""
        for group, t in cls.groups().items():
            g = parser.add_argument_group(f"engine: {group}", _summary(t))
            hints = typing.get_type_hints(t)
            for f in dataclasses.fields(t):
                if not f.metadata.get("cli", True):
                    continue
                meta, (tp, _) = f.metadata, _base_type(hints[f.name])
                flags = ["--" + f.name.replace("_", "-"), *meta["flags"]]
                kw = dict(dest=f.name, default=defaults.get(f.name, f.default), help=meta["help"])
                if tp is bool:
                    kw["action"] = argparse.BooleanOptionalAction
                elif typing.get_origin(tp) is tuple:
                    kw.update(action=_TypedFlag, nargs="+", type=int)
                else:
                    kw.update(action=_TypedFlag, type=meta["parse"] or tp, metavar=_metavar(meta))
                g.add_argument(*flags, **kw)

    @classmethod
    def from_cli(cls, namespace: argparse.Namespace) -> "EngineConfig":
        """The config of parsed ``add_cli_args`` flags (other attributes are ignored); an
        error names the flag as typed (``--num-kv-blocks=1 must be >= 2``)."""
        names = {field for key, (_, field) in _argument_names().items() if key == field}
        return cls._of({k: v for k, v in vars(namespace).items() if k in names},
                       vars(namespace).get(_TypedFlag.RECORD, {}))


class _TypedFlag(argparse.Action):
    """Stores a flag's value and which of its spellings was typed, for ``from_cli``'s errors."""

    RECORD = "_typed_engine_flags"   # namespace attribute: field -> the flag typed

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        vars(namespace).setdefault(self.RECORD, {})[self.dest] = option_string


def _metavar(meta) -> str | None:
    """``{a,b,c}`` of a field with choices (and ``none`` where the flag parses it), else None
    (argparse's default)."""
    if meta["choices"] is None:
        return None
    none = ("none",) if meta["parse"] is parse_none else ()
    return "{" + ",".join(map(str, (*meta["choices"], *none))) + "}"


def _as_given(text: str, given: dict[str, str]) -> str:
    """An error ``text`` with each ``field=value`` (or ``field[i]=value``) named as the user
    gave it (an alias or a flag)."""
    for field, name in given.items():
        if name != field:
            text = re.sub(rf"\b{field}(?=[=\[])", name, text)
    return text


def _summary(t: type) -> str:
    """The first line of a class's docstring."""
    return t.__doc__.strip().splitlines()[0]


def describe_arguments(indent: int = 0) -> str:
    """One line per engine argument (``name (default): help``), by group, for docstrings."""
    pad = " " * indent
    lines = []
    for group, t in EngineConfig.groups().items():
        lines.append(f"{pad}{group}: {_summary(t)}")
        for f in dataclasses.fields(t):
            aliases = f.metadata.get("aliases", ())
            also = f"; also {', '.join(aliases)}" if aliases else ""
            lines.append(f"{pad}  {f.name} (default {f.default!r}{also}): {f.metadata['help']}")
    return "\n".join(lines) + "\n"


def _argument_names() -> dict[str, tuple[str, str]]:
    """Every accepted keyword (field names and aliases) -> (group, field)."""
    out = {}
    for group, t in EngineConfig.groups().items():
        for f in dataclasses.fields(t):
            for key in (f.name, *f.metadata.get("aliases", ())):
                out[key] = (group, f.name)
    return out
