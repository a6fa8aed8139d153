"""The padded step shapes: the bucket sizes of the token axis ``T`` and the sequence axis ``S``
the step compiles for, and ``pad_step``, the shape a step of a given size pads to (a decode-only
step on its own, smaller buckets where one fits)."""

from __future__ import annotations


TOKEN_MIDPOINTS_FROM = 256   # default token buckets: also 1.5 x 2^k between the powers from here
# on both axes, a bucket of 96 between 64 and 128: a decode step of 65-95 sequences runs on 96
# rows, not 128 (bench/step_mix.py)
EXTRA_BUCKETS = (96,)
# a decode-only step pads to a quarter octave on both axes (``decode_buckets``) strictly inside
# these (lo, hi) spans (hi None: the smaller maximum), where the step's dense products cost in
# proportion to their rows; none between 32 and 64, where XLA's GEMM is no faster than at 64
DECODE_BUCKET_SPANS = ((16, 32), (64, None))
# and below the smallest token bucket (8), a decode step of 1, 2 or 4 sequences runs on that
# many rows: the fused-dequant matmuls of weights kept quantized work per row (the default
# model's batch-1 decode step, 8 rows -> 1: 47.5 -> 27.0 ms of CPU, bench/decode_step.py)
SMALL_DECODE_BUCKETS = (1, 2, 4)


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


def check_buckets(name: str, buckets: tuple[int, ...], maximum_name: str | None = None,
                   maximum: int = 0) -> None:
    if not buckets and maximum_name is not None:
        raise ValueError(f"{name} must not be empty")
    if any(b < 1 for b in buckets) or any(a >= b for a, b in zip(buckets, buckets[1:])):
        raise ValueError(f"{name}={buckets} must be positive and strictly increasing")
    if maximum_name is not None and buckets[-1] < maximum:
        raise ValueError(f"{name}[-1]={buckets[-1]} must be >= {maximum_name}={maximum}")


def default_buckets(max_num_batched_tokens: int, max_num_seqs: int, *,
                    decode: bool) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The default ``(token_buckets, seq_buckets, decode_buckets)``: powers of two from 8 (and
    96) closed by each maximum, the token axis with 1.5x midpoints from 256; with ``decode``,
    ``SMALL_DECODE_BUCKETS`` below the smallest token bucket and the quarter octaves of
    ``DECODE_BUCKET_SPANS`` up to the smaller maximum, else none."""
    most = min(max_num_seqs, max_num_batched_tokens)
    tokens = _powers_of_two(min(8, max_num_batched_tokens), max_num_batched_tokens,
                            midpoints_from=TOKEN_MIDPOINTS_FROM, extra=EXTRA_BUCKETS)
    decode_buckets = () if not decode else (
        *(size for size in SMALL_DECODE_BUCKETS if size < tokens[0] and size <= most),
        *(size for lo, hi in DECODE_BUCKET_SPANS
          for size in _quarter_octaves(lo, min(most, hi or most))))
    seqs = _powers_of_two(min(8, max_num_seqs), max_num_seqs, extra=EXTRA_BUCKETS)
    return tokens, seqs, decode_buckets
