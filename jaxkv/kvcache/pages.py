"""``PagedKVCache``: the device-side KV cache as a frozen-dataclass pytree, one pool per layer
for K and V (jaxkv/kvcache/pools.py) and Quest's key bounds, with its constructor from a
``KVCacheSpec``, cache-level writes and reads, and the block copies of copy-on-write. Block 0
is the null block: padding writes there and nothing reads it (docs/kv-cache.md)."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jaxkv.kvcache.key_bounds import KeyBounds, copy_key_bounds, refresh_key_bounds
from jaxkv.kvcache.metadata import AttentionMetadata
from jaxkv.kvcache.pools import (HNDPages, Pages, QuantizedPages, copy_pool, float_tokens,
                                 read_pages, write_layer, zeros_pool)
from jaxkv.kvcache.spec import KV_ALIASES, KVCacheSpec


@partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "bounds"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """Paged K/V pools of every layer.

    Attributes:
      k: one pool per layer: an array [num_blocks, block_size, num_kv_heads, head_dim] (or an
        ``HNDPages``) for a float cache, a ``QuantizedPages`` for a quantized one.
      v: same as ``k``.
      bounds: one ``KeyBounds`` per layer (Quest sparse attention over a float/fp8/int8 pool,
        ``KVCacheSpec.key_bounds``), or empty.
    """

    k: tuple[Pages, ...]  # L x [num_blocks, block_size, num_kv_heads, head_dim]
    v: tuple[Pages, ...]  # L x [num_blocks, block_size, num_kv_heads, head_dim]
    bounds: tuple[KeyBounds, ...] = ()   # L x KeyBounds [num_blocks, num_kv_heads, head_dim], or ()

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
        """Element dtype of a float cache; the stored code dtype of a quantized one."""
        pool = self.k[0]
        return pool.data.dtype if isinstance(pool, QuantizedPages) else pool.dtype

    @property
    def kv_cache_dtype(self) -> str:
        """The canonical ``jaxkv.kvcache.spec.KV_FORMATS`` name of the pools."""
        pool = self.k[0]
        if isinstance(pool, QuantizedPages):
            return pool.fmt
        return KV_ALIASES[jnp.dtype(pool.dtype).name]

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(self))


# Logical axis names of a pool-shaped cache array (codes, scales, zero points, residual:
# [blocks or residual slots, tokens or 1, kv_heads, channels]), for the sharding rules.
CACHE_LOGICAL_AXES = (None, None, "kv_heads", "head_dim")


HND_LOGICAL_AXES = (None, "kv_heads", None, "head_dim")   # an HNDPages' data


def logical_axes(leaf) -> tuple[str | None, ...]:
    """Logical axis names of one cache array (an array, tracer or ``jax.ShapeDtypeStruct``).

    The pool-shaped (4-D) arrays split over their kv heads (``CACHE_LOGICAL_AXES``; an
    ``HNDPages`` passed whole: ``HND_LOGICAL_AXES`` of its data), as do
    Quest's key bounds (3-D: [num_blocks, kv_heads, head_dim]); the KIVI bookkeeping (``res_slot``,
    ``sealed`` [num_blocks], ``res_owner``, ``res_stamp`` [num_res], ``clock`` []) describes
    whole blocks, shared by all heads, and is replicated.
    """
    if isinstance(leaf, HNDPages):
        return HND_LOGICAL_AXES
    if leaf.ndim == 4:
        return CACHE_LOGICAL_AXES
    return CACHE_LOGICAL_AXES[1:] if leaf.ndim == 3 else (None,) * leaf.ndim


def _zeros(spec: KVCacheSpec) -> PagedKVCache:
    k_axis, v_axis = spec.axes
    bounds = spec.bounds_arrays()
    return PagedKVCache(k=tuple(zeros_pool(spec, k_axis) for _ in range(spec.num_layers)),
                        v=tuple(zeros_pool(spec, v_axis, value=True)
                                for _ in range(spec.num_layers)),
                        bounds=tuple(KeyBounds(**{n: jnp.zeros(shape, dt)
                                                  for n, (shape, dt) in bounds.items()})
                                     for _ in range(spec.num_layers)) if bounds else ())


def init_cache(spec: KVCacheSpec, shardings: PagedKVCache | None = None) -> PagedKVCache:
    """Allocates the zeroed cache ``spec`` describes, on one device or straight into shardings.

    Args:
      spec: the cache (geometry, format, KIVI options; validated on creation).
      shardings: None (the default device), or a ``PagedKVCache`` of ``NamedSharding``s shaped
        like this cache (``jaxkv.runner.sharding.cache_shardings(spec, mesh)``): every array is
        created in place on its devices, nothing is allocated whole first.

    Returns:
      PagedKVCache with ``num_layers`` K and V pools of logical shape
      [num_blocks, block_size, num_kv_heads, head_dim]: arrays in the format's storage dtype for
      a float format, ``QuantizedPages`` (the arrays of ``spec.block_arrays`` and
      ``spec.residual_arrays``) for a quantized one, plus the ``KeyBounds`` of
      ``spec.bounds_arrays`` per layer; ``nbytes == spec.nbytes``.
    """
    return jax.jit(_zeros, static_argnums=0, out_shardings=shardings)(spec)


def abstract_cache(spec: KVCacheSpec) -> PagedKVCache:
    """The cache ``init_cache(spec)`` returns, as ``jax.ShapeDtypeStruct`` leaves (nothing is
    allocated)."""
    return jax.eval_shape(partial(_zeros, spec))


def write(cache: PagedKVCache, layer: int, k: jax.Array, v: jax.Array,
          slot_mapping: jax.Array, md: AttentionMetadata | None = None) -> PagedKVCache:
    """Writes one layer's new K and V ([T, num_kv_heads, head_dim]) at ``slot_mapping`` (int32
    [T]); ``md`` as in ``write_layer``."""
    ks, vs, bs = list(cache.k), list(cache.v), list(cache.bounds)
    ks[layer] = write_layer(ks[layer], k, slot_mapping, md)
    vs[layer] = write_layer(vs[layer], v, slot_mapping, md)
    if bs:
        bs[layer] = refresh_key_bounds(bs[layer], ks[layer], slot_mapping,
                                       None if md is None else md.seq_lens.shape[0])
    return PagedKVCache(k=tuple(ks), v=tuple(vs), bounds=tuple(bs))


def gather(cache: PagedKVCache, layer: int, block_table: jax.Array,
           length: int) -> tuple[jax.Array, jax.Array]:
    """Reads the first ``length`` tokens of one sequence in position order.

    Args:
      cache: the cache.
      layer: layer index.
      block_table: int32 [max_blocks] physical block ids of the sequence.
      length: number of tokens (static).

    Returns:
      (k, v), each [length, num_kv_heads, head_dim]: the pool dtype for a float cache, f32
      (dequantized) for a quantized one.
    """
    pos = jnp.arange(length)
    blocks = block_table[pos // cache.block_size]
    off = pos % cache.block_size
    if not isinstance(cache.k[layer], QuantizedPages):
        return tuple(float_tokens(p[layer], blocks, off) for p in (cache.k, cache.v))
    nb = -(-length // cache.block_size)
    ids = block_table[:nb]
    k, v = (read_pages(p, ids).reshape(nb * cache.block_size, *p.shape[2:])[:length]
            for p in (cache.k[layer], cache.v[layer]))
    return k, v


@partial(jax.jit, donate_argnums=0)
def copy_blocks(cache: PagedKVCache, src: jax.Array, dst: jax.Array) -> PagedKVCache:
    """Copies whole blocks ``src[i] -> dst[i]`` in every layer (copy-on-write, forking).

    Quantized pools copy codes, scales and zero points; an unsealed KIVI block gets its own
    residual slot holding a copy of the source's full-precision tokens; Quest's key bounds are
    copied with their blocks.

    Args:
      cache: the cache (donated).
      src, dst: int32 [N] physical block ids; ``dst`` entries must be distinct.

    Returns:
      The cache with ``dst`` blocks equal to the ``src`` blocks.
    """
    return PagedKVCache(k=tuple(copy_pool(p, src, dst) for p in cache.k),
                        v=tuple(copy_pool(p, src, dst) for p in cache.v),
                        bounds=tuple(copy_key_bounds(b, src, dst) for b in cache.bounds))
