"""The kv walk shared by the Pallas kernels (ragged.py, decode.py, sparse.py).

Design notes: docs/attention.md."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv.attention.pallas.kv_format import KvLayout, load_chunk, split_refs
from jaxkv.attention.reference import kv_tile_range, tile_index

# Finite "minus infinity" for masked logits: exp(MASK - m) underflows to 0 without inf - inf NaNs.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


# --------------------------------------------------------------------------------------------
# tile maps: loop step v -> (logical int32 [block_kv], kv_pos int32 [block_kv], in_run)
# --------------------------------------------------------------------------------------------


def logical_tiles(sink_tiles, window_first, *, block_kv: int, block_size: int,
                  max_blocks: int):
    """Tile map of the logical kv axis: step v visits tile ``tile_index(v, sink_tiles,
    window_first)`` (``kv_tile_range``); ``in_run`` is None (null blocks are masked by page)."""
    offsets = jnp.arange(block_kv, dtype=jnp.int32)                              # [block_kv]

    def at(v):
        kv_pos = tile_index(v, sink_tiles, window_first) * block_kv + offsets   # [block_kv]
        return jnp.minimum(lax.div(kv_pos, block_size), max_blocks - 1), kv_pos, None

    return at


def run_tiles(entry_at, count, *, block_kv: int, block_size: int, max_blocks: int):
    """Tile map of a run of ``count`` logical blocks laid end to end (module docstring).

    Args:
      entry_at: e (int32 [block_kv], in ``[0, count)`` when count > 0) -> int32 [block_kv], the
        logical block of run entry e (gathered from a whole-array ref).
      count: int32 scalar, the run's entries.

    Returns:
      ``at(v) -> (logical, kv_pos, in_run)``, int32/int32/bool [block_kv]; ``in_run`` is False
      for the positions past the run.
    """
    offsets = jnp.arange(block_kv, dtype=jnp.int32)                              # [block_kv]
    last = jnp.maximum(count - 1, 0)

    def at(v):
        rank = v * block_kv + offsets                                            # [block_kv]
        entry = lax.div(rank, block_size)
        logical = jnp.clip(entry_at(jnp.minimum(entry, last)), 0, max_blocks - 1)
        return logical, logical * block_size + lax.rem(rank, block_size), entry < count

    return at


def kept_run(kept_at, kv_end, *, block_size: int, block_kv: int):
    """The kept walk of the positions ``< kv_end``: (kept blocks in the run, kv tiles to visit).

    The run is the row's kept blocks before ``cdiv(kv_end, block_size)`` (the first entries of
    ``kept_blocks``' order); if the block holding position ``kv_end - 1`` is kept, only its
    positions ``< kv_end`` count, so a table without drops walks ``cdiv(kv_end, block_kv)``
    tiles, as ``logical_tiles`` does. Elementwise: int32 scalars or arrays of one shape.

    Args:
      kept_at: j -> int32, the kept entries among the row's first j logical blocks (a row of
        ``kept_blocks``' ``kept_before``, j in ``[0, max_blocks]``).
      kv_end: int32, the causal end of the rows (one past the last row's position).

    Returns:
      ``(kept, num_tiles)``: int32 run entries and ``cdiv(run positions, block_kv)``.
    """
    end_block = lax.div(kv_end + block_size - 1, block_size)
    kept = kept_at(end_block)
    last_kept = kept - kept_at(jnp.maximum(end_block - 1, 0))    # 1 if kv_end - 1's block is kept
    run = kept * block_size - last_kept * (end_block * block_size - kv_end)
    return kept, lax.div(run + block_kv - 1, block_kv)


def kv_walk(seq, q_first, kv_end, kept_refs, *, block_kv: int, block_size: int,
            max_blocks: int, sliding_window: int | None, num_sinks: int):
    """The kv tiles that rows of sequence ``seq`` at positions ``[q_first, kv_end)`` visit.

    Args:
      seq, q_first, kv_end: int32 scalars.
      kept_refs: ``()`` with a sliding window (the logical walk of the sink and window tiles),
        else (order int32 [S, max_blocks], kept_before int32 [S, max_blocks + 1]) whole-array
        refs of ``kept_blocks`` (the kept walk).

    Returns:
      ``(tile_at, sink_tiles, count)``: loop step ``v in [0, count)`` visits ``tile_at(v)``
      (``logical_tiles`` / ``run_tiles``); the steps ``< sink_tiles`` are the sink tiles.
    """
    if not kept_refs:
        sink_tiles, window_first, count = kv_tile_range(
            q_first, kv_end, block_kv=block_kv, sliding_window=sliding_window,
            num_sinks=num_sinks)
        return (logical_tiles(sink_tiles, window_first, block_kv=block_kv,
                              block_size=block_size, max_blocks=max_blocks), sink_tiles, count)
    order_ref, kept_ref = kept_refs
    kept, count = kept_run(lambda j: kept_ref[seq, jnp.minimum(j, max_blocks)], kv_end,
                           block_size=block_size, block_kv=block_kv)
    return (run_tiles(lambda e: order_ref[seq, e], kept, block_kv=block_kv,
                      block_size=block_size, max_blocks=max_blocks), 0, count)


# --------------------------------------------------------------------------------------------
# the online softmax over the walk
# --------------------------------------------------------------------------------------------


def attend_tiles(q, q_pos, seq, kv_len, head, kv_refs, tables_ref, carry, v_start, v_stop,
                 tile_at, sink_tiles, *, sm_scale: float, sliding_window: int | None,
                 num_sinks: int, soft_cap: float | None, layout: KvLayout, q_sinks=None):
    """Online softmax of q rows over loop steps ``[v_start, v_stop)`` of the kv walk.

    Args:
      q: tuple of [rows, width] queries (kernel dtype), one per head-dim chunk of ``layout``.
      q_pos: int32 [rows] kv position of each row's token (rows see positions ``<= q_pos``).
      seq, head: int32 scalars, the sequence (block-table row) and the kv head.
      kv_len: int32 scalar, the sequence's kv length (places the KIVI residual window).
      kv_refs: the refs of ``kv_format.kv_operands`` (whole pools, plus scales, zeros and the KIVI
        residual for quantized ones); tiles are dequantized in registers to q's dtype.
      tables_ref: int32 [S, max_blocks] whole block table.
      carry: (m f32 [rows], l f32 [rows], acc tuple of f32 [rows, width] per chunk) running max,
        sum and output.
      v_start, v_stop: the loop steps of this program.
      tile_at, sink_tiles: the tile map and sink steps of ``kv_walk`` (or ``run_tiles``).
      q_sinks: None, or like q: the queries that score positions ``< num_sinks`` (StreamingLLM's
        positions within the cache); the sink steps ``[0, sink_tiles)`` then compute both
        scores, the others only q's.
      layout: the pools' ``KvLayout``.

    Returns:
      The updated carry.
    """
    k_refs, v_refs = split_refs(kv_refs, layout)
    k_axis, v_axis = layout.axes
    num_blocks, block_size = kv_refs[0].shape[0], kv_refs[0].shape[1]
    dtype = q[0].dtype
    first_window = lax.div(kv_len, block_size) - (layout.residual_blocks - 1)

    def body(v, carry, rescore: bool):
        logical, kv_pos, in_run = tile_at(v)                                     # [block_kv]
        page = jnp.clip(tables_ref[seq, logical], 0, num_blocks - 1)             # [block_kv]
        slot = lax.rem(kv_pos, block_size)
        in_window = logical >= first_window                                      # [block_kv]
        keys = [load_chunk(k_refs, layout, k_axis, chunk, page, slot, head, dtype, in_window)
                for chunk in layout.chunks]                                      # [bkv, w] each
        s = tile_scores(q, keys, sm_scale)
        if rescore:
            s = jnp.where(kv_pos[None, :] < num_sinks, tile_scores(q_sinks, keys, sm_scale), s)
        values = [load_chunk(v_refs, layout, v_axis, chunk, page, slot, head, dtype, in_window)
                  for chunk in layout.chunks]                                    # [bkv, w] each
        # a logical tile masks the null blocks it meets; a run holds only the blocks it walks
        walked = page != 0 if in_run is None else in_run                         # [block_kv]
        seen = (kv_pos[None, :] <= q_pos[:, None]) & walked[None, :]             # [rows, block_kv]
        if sliding_window is not None:
            in_window = q_pos[:, None] - kv_pos[None, :] < sliding_window
            if num_sinks:
                in_window = in_window | (kv_pos[None, :] < num_sinks)
            seen = seen & in_window
        return softmax_tile(carry, s, seen, values, soft_cap=soft_cap)

    if q_sinks is None or sliding_window is None or not num_sinks:
        return lax.fori_loop(v_start, v_stop, functools.partial(body, rescore=False), carry)
    split = jnp.clip(sink_tiles, v_start, v_stop)      # the sink steps come first in the walk
    carry = lax.fori_loop(v_start, split, functools.partial(body, rescore=True), carry)
    return lax.fori_loop(split, v_stop, functools.partial(body, rescore=False), carry)


def tile_scores(queries, keys, sm_scale: float):
    """f32 [rows, bkv] scaled logits of query chunks [rows, w] against key chunks [bkv, w]."""
    s = None
    for qc, k in zip(queries, keys):
        part = lax.dot_general(qc, k, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)
        s = part if s is None else s + part
    return s * sm_scale


def softmax_tile(carry, s, seen, values, *, soft_cap: float | None):
    """One kv tile of the online softmax (f32 accumulators) in a kernel.

    Args:
      carry: (m f32 [rows], l f32 [rows], acc tuple of f32 [rows, w] per chunk).
      s: f32 [rows, bkv] scaled logits (``tile_scores``); soft-capped here.
      seen: bool, broadcastable to ``s``: the positions each row sees.
      values: [bkv, w] per chunk, in the kernel dtype.

    Returns:
      The updated carry.
    """
    m, l, acc = carry
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(seen, s, MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=1))
    p = jnp.where(seen, jnp.exp(s - m_new[:, None]), 0.0)
    alpha = jnp.exp(m - m_new)
    p_kernel = p.astype(values[0].dtype)
    acc = tuple(alpha[:, None] * a + lax.dot_general(p_kernel, val, (((1,), (0,)), ((), ())),
                                                     preferred_element_type=jnp.float32)
                for a, val in zip(acc, values))
    return m_new, alpha * l + p.sum(axis=1), acc


def init_carry(rows: int, layout: KvLayout):
    """Empty online-softmax state: (m [rows], l [rows], acc: [rows, width] per chunk), all f32."""
    return (jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32),
            tuple(jnp.zeros((rows, c[1]), jnp.float32) for c in layout.chunks))


def finalize(carry):
    """Normalized output chunks f32 [rows, width] (0 where nothing was seen) and lse f32 [rows]
    (-inf there)."""
    m, l, acc = carry
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    return (tuple(a / l_safe[:, None] for a in acc),
            jnp.where(seen, m + jnp.log(l_safe), -jnp.inf))


def split_steps(count, split, num_splits: int):
    """Loop steps ``[v_start, v_stop)`` of split ``split`` (int32 scalar) when ``count`` steps
    are cut into ``num_splits`` contiguous runs of ``cdiv(count, num_splits)`` (split-K)."""
    per_split = lax.div(count + num_splits - 1, num_splits)
    v_start = jnp.minimum(split * per_split, count)
    return v_start, jnp.minimum(v_start + per_split, count)
