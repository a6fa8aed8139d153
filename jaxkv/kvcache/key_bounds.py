"""Quest's key bounds: per block, kv head and channel, the min and max of the keys a K pool
holds, refreshed after every write and copied with their blocks (KIVI pools keep none: their
per-channel scale and zero bound the keys; jaxkv/attention/quest.py)."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jaxkv.kvcache import quant
from jaxkv.kvcache.pools import Pages, QuantizedPages, float_tokens, read_pages


@partial(jax.tree_util.register_dataclass, data_fields=["kmin", "kmax"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KeyBounds:
    """Per-block, per-kv-head, per-channel bounds of the keys of one layer's K pool (Quest).

    Attributes:
      kmin: f32 [num_blocks, num_kv_heads, head_dim] the smallest key value of each channel over
        the block's written tokens (0 for a block never written).
      kmax: f32 [num_blocks, num_kv_heads, head_dim] the largest.
    """

    kmin: jax.Array   # [num_blocks, num_kv_heads, head_dim]
    kmax: jax.Array   # [num_blocks, num_kv_heads, head_dim]


def init_key_bounds(num_blocks: int, num_kv_heads: int, head_dim: int) -> KeyBounds:
    """Bounds of an empty pool: zeros (a block's first write, at offset 0, replaces them)."""
    zeros = jnp.zeros((num_blocks, num_kv_heads, head_dim), jnp.float32)
    return KeyBounds(kmin=zeros, kmax=zeros)


def written_keys(k_pages: Pages, slot_mapping: jax.Array) -> jax.Array:
    """The keys a float, fp8 or int8 pool holds at ``slot_mapping``, as attention reads them.

    Call it after ``write_layer`` so the bounds cover the stored (rounded or dequantized) keys,
    not the model's: every score then bounds the logits attention computes.

    Args:
      k_pages: [num_blocks, block_size, Hkv, D] float pool (or ``HNDPages``), or an fp8/int8
        ``QuantizedPages``.
      slot_mapping: int32 [T] ``block_id * block_size + offset``.

    Returns:
      f32 [T, Hkv, D].

    Raises:
      ValueError: for a KIVI pool (its bounds come from its statistics:
        ``jaxkv.attention.quest.page_bounds``).
    """
    bs = k_pages.shape[1]
    blk, off = slot_mapping // bs, slot_mapping % bs
    if not isinstance(k_pages, QuantizedPages):
        return float_tokens(k_pages, blk, off).astype(jnp.float32)
    if k_pages.format.kivi:
        raise ValueError(f"{k_pages.fmt} pools need no KeyBounds: pass the pool to page_bounds")
    scale = None if k_pages.scale is None else k_pages.scale[blk, off]          # [T, Hkv, 1]
    return quant.dequantize(k_pages.data[blk, off], scale, None, k_pages.format,
                            static_scale=k_pages.static_scale)


def update_key_bounds(bounds: KeyBounds, keys: jax.Array, slot_mapping: jax.Array,
                      block_size: int) -> KeyBounds:
    """The bounds after a step wrote ``keys`` at ``slot_mapping`` (in place under donation).

    A block written at offset 0 in this step restarts from this step's keys alone (it was
    (re)allocated: blocks fill in order from offset 0); every other written block widens its
    bounds by its new keys. Padding tokens (slots in the null block 0) only touch block 0.

    Args:
      bounds: the pool's bounds before the step.
      keys: f32 [T, Hkv, D] the keys as stored (``written_keys``).
      slot_mapping: int32 [T] ``block_id * block_size + offset`` of each key.
      block_size: tokens per block (static).

    Returns:
      The updated ``KeyBounds``.
    """
    blk, off = slot_mapping // block_size, slot_mapping % block_size
    n = bounds.kmin.shape[0]
    restart = jnp.zeros(n, bool).at[blk].max(off == 0)[:, None, None]         # [N, 1, 1]
    keys = keys.astype(jnp.float32)
    kmin = jnp.where(restart, jnp.inf, bounds.kmin).at[blk].min(keys)
    kmax = jnp.where(restart, -jnp.inf, bounds.kmax).at[blk].max(keys)
    return KeyBounds(kmin=kmin, kmax=kmax)


def refresh_key_bounds(bounds: KeyBounds, k_pages: Pages, slot_mapping: jax.Array,
                       num_seqs: int | None = None) -> KeyBounds:
    """The exact bounds after a step wrote its keys at ``slot_mapping`` (what the engine uses).

    Blocks fill in order, so after a step a written block holds its owner's keys at offsets
    ``0 .. b``, ``b`` the highest offset written in the step; whatever lies past ``b`` is stale
    (the tail of a radix partial copy, rejected drafts being rewritten, a freed block's old
    tokens). Each written block's bounds are recomputed from the pool over offsets ``<= b``, so
    they always equal ``jaxkv.attention.quest.key_bounds`` (no over-approximation, unlike
    ``update_key_bounds``). A sequence's tokens are contiguous in the step, so the written
    blocks are the runs of equal block ids in ``slot_mapping``: at most ``T // bs + 2 S + 1``
    of them (each sequence adds a partial block at either end, padding one run of block 0),
    and only those blocks are read: about the step's own K bytes again.

    Args:
      bounds: the pool's bounds before the step.
      k_pages: the K pool after the step's write (float, fp8 or int8).
      slot_mapping: int32 [T] slots the step wrote.
      num_seqs: S, sequences of the step (static; bounds the written blocks), or None: as many
        written blocks as tokens (no bound assumed).

    Returns:
      The updated ``KeyBounds``.
    """
    bs = k_pages.shape[1]
    blk, off = slot_mapping // bs, slot_mapping % bs
    t, n = slot_mapping.shape[0], bounds.kmin.shape[0]
    last = jnp.full(n, -1, jnp.int32).at[blk].max(off)                 # [N] highest offset
    run = jnp.concatenate([jnp.ones(1, bool), blk[1:] != blk[:-1]])    # [T] a run's first token
    size = t if num_seqs is None else min(t, t // bs + 2 * num_seqs + 1)
    (first,) = jnp.nonzero(run, size=size, fill_value=0)
    ids = blk[first]                                                   # [M] written blocks
    x = read_pages(k_pages, ids)                                       # [M, bs, Hkv, D]
    valid = (jnp.arange(bs) <= last[ids][:, None])[..., None, None]    # [M, bs, 1, 1]
    return KeyBounds(kmin=bounds.kmin.at[ids].set(jnp.where(valid, x, jnp.inf).min(axis=1)),
                     kmax=bounds.kmax.at[ids].set(jnp.where(valid, x, -jnp.inf).max(axis=1)))


def copy_key_bounds(bounds: KeyBounds, src: jax.Array, dst: jax.Array) -> KeyBounds:
    """Bounds of blocks copied ``src[i] -> dst[i]`` (int32 [M], ``dst`` distinct), beside
    ``copy_blocks``."""
    return KeyBounds(kmin=bounds.kmin.at[dst].set(bounds.kmin[src]),
                     kmax=bounds.kmax.at[dst].set(bounds.kmax[src]))
