"""The weights on 2 MiB pages (Linux transparent huge pages), for the CPU backend.

A decode step on the CPU streams every weight once from memory; at a few rows its matmuls are
bound by that stream (bench/decode_step.py). On 4 KiB pages the weights of SmolLM2-135M span
~130,000 pages, so the stream also walks the page tables: every 4 KiB of a weight is a TLB miss.
On 2 MiB pages a weight of 3.5 MB is two. Linux backs an anonymous range with 2 MiB pages after
``madvise(MADV_HUGEPAGE)`` where transparent huge pages are ``madvise`` or ``always``, but only
for memory faulted in after the call; the weights are already written, so ``MADV_COLLAPSE``
(Linux 6.1) moves them onto huge pages at once, their contents unchanged. Each array's range is
widened to whole 2 MiB pages (an array's first and last bytes rarely sit on a page boundary; the
neighbours that share those pages are moved with it, which they do not notice), then cut to the
process's mappings: a 2 MiB page must lie inside one mapping, so an edge that reaches past the
allocation stays on small pages.

Advice only: where the kernel is older, transparent huge pages are off, or the platform is not
Linux, nothing happens and nothing fails. What it gains: BENCHMARKS.md.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
import threading
import time

import jax

logger = logging.getLogger("jaxkv")

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_ATTEMPTS = 4

ENABLED = True       # read when an engine loads its weights (bench/experiments/step_ab.py switches it)


@functools.cache
def _madvise():
    """libc's ``madvise(addr, length, advice)``, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def page_range(address: int, nbytes: int) -> tuple[int, int]:
    """The whole 2 MiB pages ``[start, end)`` that hold bytes ``[address, address + nbytes)``."""
    start = address // HUGE_PAGE * HUGE_PAGE
    end = -(-(address + nbytes) // HUGE_PAGE) * HUGE_PAGE
    return start, end


def collapse(arrays) -> int:
    """Moves the memory of every CPU array in ``arrays`` (a pytree) onto 2 MiB pages.

    Args:
      arrays: a pytree of ``jax.Array`` (e.g. the model's params; a layer's k and v weights
        are a fraction of a 2 MiB page each, so it is their neighbours that fill it); arrays on
        other platforms are left alone.

    Returns:
      the bytes now on 2 MiB pages: the whole pages inside each array's mapping that the
      kernel collapsed (0 where it cannot: not Linux, an older kernel, transparent huge pages
      off, or ``ENABLED`` False).
    """
    return _collapse(_ranges(arrays)) if ENABLED and _madvise() is not None else 0


def _ranges(arrays) -> list[tuple[int, int]]:
    """The 2 MiB-widened address ranges of the CPU arrays in ``arrays``, sorted."""
    ranges = set()
    for x in jax.tree_util.tree_leaves(arrays):
        if not isinstance(x, jax.Array):
            continue
        for shard in x.addressable_shards:
            if shard.device.platform == "cpu":
                ranges.add(page_range(shard.data.unsafe_buffer_pointer(), shard.data.nbytes))
    return sorted(ranges)


def _collapse(ranges: list[tuple[int, int]]) -> int:
    madvise = _madvise()
    done = 0
    for start, end in _mapped_pieces(ranges):
        whole = end // HUGE_PAGE * HUGE_PAGE - -(-start // HUGE_PAGE) * HUGE_PAGE
        if whole <= 0:                 # no whole 2 MiB page inside (a guard page, a neighbour)
            continue
        madvise(start, end - start, _MADV_HUGEPAGE)
        # a collapse of freshly written memory can fail for a moment (pages the kernel has not
        # settled yet); what it did collapse stays, and a retry a little later takes the rest
        for attempt in range(_ATTEMPTS):
            if madvise(start, end - start, _MADV_COLLAPSE) == 0:
                done += whole
                break
            time.sleep(0.01 * (attempt + 1))
    return done


def collapse_in_background(arrays) -> threading.Thread | None:
    """``collapse(arrays)`` on a daemon thread, which logs what it moved (INFO); None where
    ``collapse`` would do nothing (``ENABLED`` is read now, not by the thread). The kernel copies
    every page it collapses (~0.8 s for SmolLM2-135M's weights on this machine's VM), and
    nothing needs to wait for it: the arrays can be read (the engine starts, compiles and
    steps) while their pages move. The arrays' addresses are read here: an engine closed
    before the thread runs has freed them (the advice then lands on whatever the memory holds,
    which a collapse leaves unchanged)."""
    if not ENABLED or _madvise() is None:
        return None
    ranges = _ranges(arrays)

    def run():
        done = _collapse(ranges)
        if done:
            logger.info("weights on 2 MiB pages: %.0f MB", done / 1e6)

    thread = threading.Thread(target=run, name="jaxkv-huge-pages", daemon=True)
    thread.start()
    return thread


def _mapped_pieces(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``ranges`` (sorted) inside this process's mappings (/proc/self/maps), one
    piece per mapping, overlaps merged: madvise fails on a range with an unmapped hole, and a
    widened range reaches past the allocation it came from."""
    maps = []
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = line.split(None, 1)[0].split("-")
            maps.append((int(lo, 16), int(hi, 16)))
    pieces: list[tuple[int, int]] = []
    for start, end in ranges:
        for lo, hi in maps:
            a, b = max(start, lo), min(end, hi)
            if a >= b:
                continue
            if pieces and a <= pieces[-1][1] and pieces[-1][0] >= lo:
                pieces[-1] = (pieces[-1][0], max(pieces[-1][1], b))
            else:
                pieces.append((a, b))
    return pieces
