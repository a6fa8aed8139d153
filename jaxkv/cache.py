"""PagedKVCache: the device-side KV page pool as a frozen-dataclass pytree, with pure write/gather/copy.

Layout (NHD pages, one array per layer, so a layer's pool is written in place when the cache
is donated and the kernels read one whole-array pool without slicing a stacked tensor):

    k[layer]: [num_blocks, block_size, num_kv_heads, head_dim]     (v the same)

A token's KV lives at a *slot* ``slot = block_id * block_size + offset``:

    block_table of a sequence (logical block -> physical block):  [7, 2, 9]
    token position p  ->  logical block p // bs, offset p % bs  ->  slot = table[p // bs] * bs + p % bs

        physical pool (block_size bs = 4)
        block 0 | . . . . |   <- reserved null block: padding tokens write here, nothing reads it
        block 2 | p4 p5 p6 p7 |
        block 7 | p0 p1 p2 p3 |
        block 9 | p8 . . . |   <- last block partially filled (seq_len 9)

Block 0 is the null block: ``slot_mapping`` of padding tokens points into it and padded block-table
entries are 0, so no index ever leaves the pool; sequence lengths mask whatever it holds.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp


@partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """Paged K/V pools of every layer.

    Attributes:
      k: one array per layer, each [num_blocks, block_size, num_kv_heads, head_dim].
      v: same as ``k``.
    """

    k: tuple[jax.Array, ...]  # L x [num_blocks, block_size, num_kv_heads, head_dim]
    v: tuple[jax.Array, ...]  # L x [num_blocks, block_size, num_kv_heads, head_dim]

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k[0].shape[2]

    @property
    def head_dim(self) -> int:
        return self.k[0].shape[3]

    @property
    def dtype(self):
        return self.k[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in self.k + self.v)


# Logical axis names of one layer's pool, for the sharding rules (kv heads split under TP).
CACHE_LOGICAL_AXES = (None, None, "kv_heads", "head_dim")


def init_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
               head_dim: int, dtype=jnp.float32) -> PagedKVCache:
    """Allocates a zeroed cache.

    Args:
      num_layers, num_blocks, block_size, num_kv_heads, head_dim: pool geometry; ``num_blocks``
        counts the reserved null block 0, so ``num_blocks - 1`` blocks are usable.
      dtype: element dtype of the pools.

    Returns:
      PagedKVCache with ``num_layers`` zero arrays [num_blocks, block_size, num_kv_heads, head_dim].
    """
    for name, val in (("num_layers", num_layers), ("num_blocks", num_blocks),
                      ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                      ("head_dim", head_dim)):
        if val < 1:
            raise ValueError(f"{name}={val} must be >= 1")
    if num_blocks < 2:
        raise ValueError(f"num_blocks={num_blocks} must be >= 2 (block 0 is the reserved null block)")
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
    return PagedKVCache(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)))


def write_layer(pool: jax.Array, new: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatters new K (or V) rows of one layer into its pool by slot.

    Args:
      pool: [num_blocks, block_size, num_kv_heads, head_dim].
      new: [T, num_kv_heads, head_dim], cast to the pool dtype.
      slot_mapping: int32 [T], ``block_id * block_size + offset``; padding tokens point into block 0.

    Returns:
      The updated pool (in place under donation).
    """
    block_size = pool.shape[1]
    return pool.at[slot_mapping // block_size, slot_mapping % block_size].set(new.astype(pool.dtype))


def write(cache: PagedKVCache, layer: int, k: jax.Array, v: jax.Array,
          slot_mapping: jax.Array) -> PagedKVCache:
    """Writes one layer's new K and V ([T, num_kv_heads, head_dim]) at ``slot_mapping`` (int32 [T])."""
    ks, vs = list(cache.k), list(cache.v)
    ks[layer] = write_layer(ks[layer], k, slot_mapping)
    vs[layer] = write_layer(vs[layer], v, slot_mapping)
    return PagedKVCache(k=tuple(ks), v=tuple(vs))


def gather(cache: PagedKVCache, layer: int, block_table: jax.Array,
           length: int) -> tuple[jax.Array, jax.Array]:
    """Reads the first ``length`` tokens of one sequence in position order.

    Args:
      cache: the cache.
      layer: layer index.
      block_table: int32 [max_blocks] physical block ids of the sequence.
      length: number of tokens (static).

    Returns:
      (k, v), each [length, num_kv_heads, head_dim].
    """
    pos = jnp.arange(length)
    blocks = block_table[pos // cache.block_size]
    off = pos % cache.block_size
    return cache.k[layer][blocks, off], cache.v[layer][blocks, off]


@partial(jax.jit, donate_argnums=0)
def copy_blocks(cache: PagedKVCache, src: jax.Array, dst: jax.Array) -> PagedKVCache:
    """Copies whole blocks ``src[i] -> dst[i]`` in every layer (copy-on-write, forking).

    Args:
      cache: the cache (donated).
      src, dst: int32 [N] physical block ids; ``dst`` entries must be distinct.

    Returns:
      The cache with ``dst`` blocks equal to the ``src`` blocks.
    """
    return PagedKVCache(k=tuple(p.at[dst].set(p[src]) for p in cache.k),
                        v=tuple(p.at[dst].set(p[src]) for p in cache.v))
