"""Which KV chunks an attention walk visits: with a sliding window the sinks' and the window's
logical chunks; without one only the kept (non-null) blocks, compacted first in each row, so a
sequence whose policy dropped blocks costs what its kept KV costs. Shared by the grouped CPU
path, the attention mass and the Pallas ragged kernel (docs/attention.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.attention.reference import kv_tile_range


def kept_blocks(tables: jax.Array, sliding_window: int | None = None
                ) -> tuple[jax.Array, jax.Array] | tuple[None, None]:
    """Each row's logical block indices with its kept (non-null) blocks first.

    Args:
      tables: int32 [..., W] block tables (0 = the null block: dropped or padding).
      sliding_window: with a window the walk is over logical chunks (``visited_chunks``), so
        nothing is compacted: ``(None, None)``.

    Returns:
      ``(order, kept_before)``: int32 [..., W] a stable permutation of ``0..W-1`` per row, the
      kept blocks' indices in increasing order then the null ones'; and int32 [..., W + 1]
      ``kept_before[..., j]``: kept entries among the row's first ``j``.
    """
    if sliding_window is not None:
        return None, None
    order = jnp.argsort(tables == 0, axis=-1, stable=True).astype(jnp.int32)
    kept = jnp.cumsum(tables != 0, axis=-1, dtype=jnp.int32)
    return order, jnp.pad(kept, [(0, 0)] * (tables.ndim - 1) + [(1, 0)])


def visited_chunks(q_first, kv_end, kept_before, *, chunk: int, block_size: int,
                   sliding_window: int | None, num_sinks: int):
    """The kv chunks that rows with positions in ``[q_first, kv_end)`` visit, as
    ``kv_tile_range``'s ``(sink_chunks, window_first, count)`` (loop step ``v`` visits chunk
    ``tile_index(v, sink_chunks, window_first)``).

    With a sliding window: logical chunks, the sinks' and the window's. Without one: chunks of
    the compacted list of ``kept_blocks``, as many as cover the kept blocks before
    ``cdiv(kv_end, block_size)``. ``q_first``, ``kv_end``: int32 [...]; ``kept_before``: int32
    [..., W + 1] (``kept_blocks``; unused with a window).
    """
    if sliding_window is not None:
        return kv_tile_range(q_first, kv_end, block_kv=chunk * block_size,
                             sliding_window=sliding_window, num_sinks=num_sinks)
    end_block = jnp.asarray(-(-kv_end // block_size))[..., None]                  # [..., 1]
    kept = jnp.take_along_axis(kept_before, end_block, axis=-1)[..., 0]
    return 0, 0, -(-kept // chunk)


def chunk_positions(order: jax.Array | None, c: jax.Array, chunk: int,
                    block_size: int) -> tuple[jax.Array, jax.Array]:
    """Logical blocks and kv positions of kv chunk ``c`` (``visited_chunks``).

    Args:
      order: int32 [..., W] from ``kept_blocks`` (chunks of the compacted list), or None
        (logical chunks: ``c * chunk`` onwards).
      c: int32 [...] chunk index of each row.

    Returns:
      logical int32 [..., chunk] and kv positions int32 [..., chunk * block_size].
    """
    logical = c[..., None] * chunk + jnp.arange(chunk, dtype=jnp.int32)
    if order is not None:
        logical = jnp.take_along_axis(order, logical, axis=-1)
    pos = logical[..., None] * block_size + jnp.arange(block_size, dtype=jnp.int32)
    return logical, pos.reshape(*logical.shape[:-1], chunk * block_size)
