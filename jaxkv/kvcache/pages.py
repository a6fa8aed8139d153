"""PagedKVCache: the device-side KV page pool as a frozen-dataclass pytree, with pure write/gather/copy.

Layout (NHD pages, one array per layer, so a layer's pool is written in place when the cache
is donated and the kernels read one whole-array pool without slicing a stacked tensor):

    k[layer]: [num_blocks, block_size, num_kv_heads, head_dim]     (v the same)

or, for a float cache with ``KVCacheSpec.layout = "hnd"`` (the CPU path's default), an
``HNDPages`` holding [num_blocks, num_kv_heads, block_size, head_dim]: each kv head's tokens of
a block contiguous, which is how the grouped path's dots read a gathered block. Every pool's
``shape`` is the logical NHD shape; only this module's writes, reads and block copies (and
jaxkv/kvcache/host_pool.py's block units) index the stored order.

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

``init_cache(spec, shardings=None)`` is the one constructor: a ``jaxkv.kvcache.spec.KVCacheSpec``
fixes every array (the arrays and their byte counts are listed there), ``shardings`` places them on a mesh.

Quantized caches (``kv_cache_dtype`` fp8_e4m3, fp8_e5m2, int8, int4, int2) hold a ``QuantizedPages``
per layer and K/V instead of the plain array; its codes keep the NHD page layout, with the last
axis packed for int4/int2 (see jaxkv/kvcache/quant.py for the bit layout):

    data   [num_blocks, block_size, kv_heads, head_dim * bits / 8]     codes
    scale  per token:   [num_blocks, block_size, kv_heads, head_dim / G]  (fp8, int8, KIVI values)
           per channel: [num_blocks, 1,          kv_heads, head_dim]      (KIVI keys: one group =
                                                                           the tokens of a block)

KIVI residual (int4/int2): a block is quantized when it *seals* (its last slot is written), so
its per-channel key statistics cover all its tokens. Its tokens also live in full precision in a
residual pool while the block is inside the sequence's *residual window*: the unsealed block plus
the last ``R - 1`` sealed blocks (``residual_blocks = R``, KIVI's residual length in blocks):

    sequence of 5 blocks, R = 3:   | q | q | r | r | r. |    q = read as codes (sealed, left the
                                                             window), r = read from the residual

    res_slot[block] = r > 0   ->  residual[r] holds the block (inside its sequence's window)
    res_slot[block] = 0       ->  read data/scale/zero
    res_owner[r] = block (0 = free),  res_stamp[r] = clock of the last write or window refresh

Readers decide by position, not by the slot alone: logical block j of a sequence of length L reads
the residual iff it holds a slot and ``j >= L // block_size - (R - 1)`` (``residual_window``), so
a stale slot (a finished sequence's window) or one of another sequence sharing the block never
changes what a sequence reads. Prefix-cache hits stop before a new request's window
(``BlockManager``), so every block inside a window was written by its own sequence (or a fork).

When the token that seals logical block j is written, block ``j + 1 - R`` leaves the window and
its slot is freed (for R = 1 that is block j itself). A block that needs a slot takes a free one,
else the least recently stamped slot not touched in this step (a stale window of a finished or
preempted sequence; the live windows of the step's sequences are re-stamped every step). Slot 0
is a null slot. With at least ``R * max_num_seqs + 1`` slots every running sequence's window
fits as long as each running sequence is scheduled in every step (the engine's continuous
batching does this).

Quest key bounds (``KVCacheSpec.key_bounds``, float/fp8/int8 formats): ``bounds[layer]`` is a
``KeyBounds`` (per block, kv head and channel, the min/max of the keys as stored), refreshed by
``refresh_key_bounds`` after every K write and copied by ``copy_blocks`` with the blocks; KIVI
pools keep none (their per-channel scale/zero bound the keys, jaxkv/attention/quest.py).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jaxkv.kvcache import quant
from jaxkv.kvcache.metadata import AttentionMetadata
from jaxkv.kvcache.spec import KV_ALIASES, KVCacheSpec, KVFormat, get_format

# The array fields of a QuantizedPages (jaxkv.kvcache.spec.KVCacheSpec.block_arrays + residual_arrays).
_POOL_FIELDS = ("data", "scale", "zero", "residual", "res_slot", "res_owner", "res_stamp",
                "clock", "sealed")


@partial(jax.tree_util.register_dataclass, data_fields=list(_POOL_FIELDS),
         meta_fields=["fmt", "axis", "group_size", "residual_full_precision", "static_scale",
                      "head_dim", "residual_blocks"])
@dataclasses.dataclass(frozen=True)
class QuantizedPages:
    """One layer's quantized K (or V) pool; see the module docstring for the layout.

    Attributes:
      data: codes [num_blocks, block_size, kv_heads, head_dim * bits / 8] (fp8/int8/uint8).
      scale: bf16 [num_blocks, block_size, kv_heads, head_dim / G] (``axis="token"``) or
        [num_blocks, 1, kv_heads, head_dim] (``axis="channel"``); None with a static scale.
      zero: like ``scale`` (asymmetric int4/int2), else None.
      residual: [num_res, block_size, kv_heads, head_dim] full precision (int4/int2), else None.
      res_slot: int32 [num_blocks] residual slot of each unsealed block, 0 if sealed.
      res_owner: int32 [num_res] block held by each residual slot, 0 if free.
      res_stamp: int32 [num_res] ``clock`` of the last write into each slot.
      clock: int32 [] writes so far.
      sealed: bool [num_blocks] the block's codes are final (its last slot was written); writes
        into a sealed block (the recomputed last token of a cached prompt) are dropped.
      fmt: the ``jaxkv.kvcache.spec.KV_FORMATS`` name.
      axis: ``"token"`` (groups along head_dim within a token) or ``"channel"`` (per channel over
        the tokens of one block).
      group_size: channels per group for ``axis="token"``.
      residual_full_precision: False only for the residual-off ablation: unsealed blocks are
        read fake-quantized too.
      static_scale: fixed per-tensor scale (fp8 only), or None for per-token scales.
      head_dim: unpacked channels per vector.
      residual_blocks: KIVI residual window R: the unsealed block plus the last R - 1 sealed
        blocks of each sequence are read from the full-precision residual.
    """

    data: jax.Array               # [N, bs, Hkv, D * bits / 8]
    scale: jax.Array | None       # [N, bs, Hkv, D / G] | [N, 1, Hkv, D]
    zero: jax.Array | None        # like scale
    residual: jax.Array | None    # [R, bs, Hkv, D]
    res_slot: jax.Array | None    # [N]
    res_owner: jax.Array | None   # [R]
    res_stamp: jax.Array | None   # [R]
    clock: jax.Array | None       # []
    sealed: jax.Array | None      # [N] bool
    fmt: str
    axis: str
    group_size: int
    residual_full_precision: bool
    static_scale: float | None
    head_dim: int
    residual_blocks: int = 1

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Logical (unpacked) pool shape [num_blocks, block_size, kv_heads, head_dim]."""
        return (*self.data.shape[:3], self.head_dim)

    ndim = 4

    @property
    def format(self) -> KVFormat:
        """The pool's ``KVFormat``."""
        return get_format(self.fmt)


@partial(jax.tree_util.register_dataclass, data_fields=["data"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class HNDPages:
    """One layer's float K (or V) pool laid out head-major (``KVCacheSpec.layout = "hnd"``).

    A block's tokens of one kv head are contiguous, so a gathered block ``[Hkv, bs, D]`` is
    already in the order of dots batched over (sequence, block, kv head) (the CPU path,
    ``read_pages(..., heads_first=True)``). ``shape`` is the logical NHD shape, like every pool's.

    Attributes:
      data: [num_blocks, num_kv_heads, block_size, head_dim] in the format's storage dtype.
    """

    data: jax.Array   # [N, Hkv, bs, D]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Logical pool shape [num_blocks, block_size, kv_heads, head_dim]."""
        n, h, bs, d = self.data.shape
        return (n, bs, h, d)

    ndim = 4

    @property
    def dtype(self):
        return self.data.dtype


Pages = jax.Array | QuantizedPages | HNDPages


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
    ``sealed`` [num_blocks], ``res_owner``, ``res_stamp`` [num_res], ``clock`` []) describes whole blocks, shared by all heads, and is replicated.
    """
    if isinstance(leaf, HNDPages):
        return HND_LOGICAL_AXES
    if leaf.ndim == 4:
        return CACHE_LOGICAL_AXES
    return CACHE_LOGICAL_AXES[1:] if leaf.ndim == 3 else (None,) * leaf.ndim


def _zeros_pool(spec: KVCacheSpec, axis: str) -> Pages:
    """One layer's zeroed K (``axis = spec.axes[0]``) or V (``spec.axes[1]``) pool: the arrays
    ``spec.block_arrays(axis)`` and ``spec.residual_arrays()`` list."""
    arrays = {name: jnp.zeros(shape, dtype) for name, (shape, dtype)
              in {**spec.block_arrays(axis), **spec.residual_arrays()}.items()}
    if not spec.format.quantized:
        return HNDPages(arrays["data"]) if spec.layout == "hnd" else arrays["data"]
    return QuantizedPages(**{f: arrays.get(f) for f in _POOL_FIELDS}, fmt=spec.kv_cache_dtype,
                          axis=axis, group_size=spec.token_group_size,
                          residual_full_precision=spec.residual_full_precision,
                          static_scale=spec.static_scale, head_dim=spec.head_dim,
                          residual_blocks=spec.residual_blocks)


def _zeros(spec: KVCacheSpec) -> PagedKVCache:
    k_axis, v_axis = spec.axes
    bounds = spec.bounds_arrays()
    return PagedKVCache(k=tuple(_zeros_pool(spec, k_axis) for _ in range(spec.num_layers)),
                        v=tuple(_zeros_pool(spec, v_axis) for _ in range(spec.num_layers)),
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


def quantize_pages(pool: jax.Array, kv_cache_dtype: str, *, axis: str = "token",
                   group_size: int | None = None) -> QuantizedPages:
    """A ``QuantizedPages`` holding a float pool [num_blocks, block_size, Hkv, D] quantized as if
    every block had been written and sealed (fp8/int8: per token and head; int4/int2: per
    ``axis``, KIVI keys ``"channel"``, values ``"token"``, groups of ``group_size`` channels,
    default ``default_group_size(D)``, with an empty one-slot residual); for benchmarks.
    """
    n, bs, h, d = pool.shape
    spec = KVCacheSpec(num_layers=1, num_blocks=n, block_size=bs, num_kv_heads=h, head_dim=d,
                       dtype=jnp.dtype(pool.dtype).name, kv_cache_dtype=kv_cache_dtype,
                       group_size=group_size, num_residual_slots=1, key_axis=axis,
                       value_axis=axis)
    empty = _zeros_pool(spec, spec.axes[0])
    data, scale, zero = _quantize_blocks(empty, pool)
    out = dataclasses.replace(empty, data=data, scale=scale, zero=zero)
    return dataclasses.replace(out, sealed=jnp.ones(n, bool)) if spec.format.kivi else out


def _quantize_blocks(p: QuantizedPages, x: jax.Array):
    """Codes (packed), scale, zero of whole blocks ``x`` [M, block_size, Hkv, D] (or tokens
    [T, Hkv, D] for ``axis="token"``) in ``p``'s format."""
    fmt = p.format
    axis = 1 if p.axis == "channel" else -1
    codes, scale, zero = quant.quantize(x, fmt, axis=axis, group_size=p.group_size,
                                        static_scale=p.static_scale)
    return quant.pack(codes, fmt.bits), scale, zero


def _dequantize(p: QuantizedPages, data, scale, zero) -> jax.Array:
    """f32 values of gathered codes ``data`` [..., bs, Hkv, D * bits / 8] with their scales."""
    fmt = p.format
    return quant.dequantize(quant.unpack(data, fmt.bits), scale, zero, fmt,
                            axis=-1 if p.axis == "token" else 0, static_scale=p.static_scale)


def take_blocks(a: jax.Array, ids: jax.Array) -> jax.Array:
    """``a[ids]`` for an array of whole blocks ``a`` [N, ...] and int32 ``ids`` [...]: rows of
    its flat [N, -1] view, which XLA CPU copies row by row (indexing ``a`` itself gathers it
    element by element, about twice as slow)."""
    return a.reshape(a.shape[0], -1)[ids].reshape(*ids.shape, *a.shape[1:])


def read_pages(pages: Pages, ids: jax.Array, in_window: jax.Array | None = None, *,
               heads_first: bool = False) -> jax.Array:
    """Whole blocks ``ids`` of one pool as f32 values (dequantized; KIVI blocks that hold a
    residual slot from the full-precision residual).

    Args:
      pages: one layer's K or V pool (array, ``HNDPages`` or ``QuantizedPages``).
      ids: int32 [...] block ids.
      in_window: bool like ``ids``: the block is inside its reader's residual window
        (``residual_window``); a block outside it is read as codes even if it still holds a slot
        (a stale or shared one). None: every block with a slot reads the residual.
      heads_first: return each block head-major (free for an ``HNDPages`` pool, a transpose of
        the gathered blocks for the others).

    Returns:
      f32 [..., block_size, num_kv_heads, head_dim], or with ``heads_first``
      [..., num_kv_heads, block_size, head_dim].
    """
    if isinstance(pages, HNDPages):
        out = take_blocks(pages.data, ids).astype(jnp.float32)
        return out if heads_first else out.swapaxes(-3, -2)
    out = _read_nhd(pages, ids, in_window)
    return out.swapaxes(-3, -2) if heads_first else out


def _read_nhd(pages: jax.Array | QuantizedPages, ids: jax.Array,
              in_window: jax.Array | None) -> jax.Array:
    """``read_pages`` of an NHD pool: f32 [..., block_size, num_kv_heads, head_dim]."""
    if not isinstance(pages, QuantizedPages):
        return take_blocks(pages, ids).astype(jnp.float32)
    sc = None if pages.scale is None else take_blocks(pages.scale, ids)
    zr = None if pages.zero is None else take_blocks(pages.zero, ids)
    out = _dequantize(pages, take_blocks(pages.data, ids), sc, zr)
    if pages.residual is None:
        return out
    slot = pages.res_slot[ids]
    res = take_blocks(pages.residual, slot).astype(jnp.float32)
    if not pages.residual_full_precision:
        res = _dequantize(pages, *_quantize_blocks(pages, res.reshape(-1, *res.shape[-3:])))
        res = res.reshape(out.shape)
    use = slot > 0 if in_window is None else (slot > 0) & in_window
    return jnp.where(use.reshape(*slot.shape, 1, 1, 1), res, out)


def residual_window(seq_lens: jax.Array, logical: jax.Array, block_size: int,
                    residual_blocks: int) -> jax.Array:
    """bool [S, N]: logical block ``logical[n]`` of sequence s lies in its KIVI residual window,
    the unsealed block and the last ``residual_blocks - 1`` sealed ones (int32 [S] lengths,
    int32 [N] logical block indices)."""
    return logical[None, :] >= window_first(seq_lens, block_size, residual_blocks)[:, None]


def window_first(seq_lens: jax.Array, block_size: int, residual_blocks: int) -> jax.Array:
    """int32 like ``seq_lens``: the first logical block of each sequence's residual window."""
    return seq_lens // block_size - (residual_blocks - 1)


def read_sequence_blocks(pages: Pages, ids: jax.Array, logical: jax.Array,
                         seq_lens: jax.Array, *, heads_first: bool = False) -> jax.Array:
    """f32 [..., n, block_size, Hkv, D] blocks ``ids`` (int32 [..., n]) at logical block indices
    ``logical`` (like ``ids``) of sequences of kv length ``seq_lens`` (int32 [...]): a KIVI
    block reads its residual only inside its sequence's residual window (``read_pages``).
    ``heads_first``: [..., n, Hkv, block_size, D]."""
    if not isinstance(pages, QuantizedPages):
        return read_pages(pages, ids, heads_first=heads_first)
    first = window_first(seq_lens, pages.shape[1], pages.residual_blocks)
    return read_pages(pages, ids, logical >= first[..., None], heads_first=heads_first)


def _assign_slots(p: QuantizedPages, blocks: jax.Array, need: jax.Array, touched: jax.Array
                  ) -> tuple[QuantizedPages, jax.Array]:
    """Gives each ``blocks[i]`` with ``need[i]`` a residual slot (distinct blocks assumed).

    Free slots go first, then the least recently written ones not in ``touched`` (bool [R]);
    a victim's old block loses its slot. The new slots are zeroed.

    Returns:
      (pages with res_slot/res_owner/residual updated, int32 [K] slot per block, 0 where not
      ``need``).
    """
    r = p.res_owner.shape[0]
    rank = jnp.cumsum(need) - 1
    key = jnp.where(p.res_owner == 0, -1, p.res_stamp)
    key = jnp.where(touched | (jnp.arange(r) == 0), jnp.iinfo(jnp.int32).max, key)
    order = jnp.argsort(key)
    slots = jnp.where(need, order[jnp.clip(rank, 0, r - 1)], 0)
    drop = jnp.where(need, slots, r)                   # out of range: dropped by the scatters
    old = p.res_owner[slots]
    n = p.res_slot.shape[0]
    stolen = need & (old > 0) & (p.res_slot[old] == slots)
    res_slot = p.res_slot.at[jnp.where(stolen, old, n)].set(0, mode="drop")
    res_slot = res_slot.at[jnp.where(need, blocks, n)].set(slots, mode="drop")
    owner = p.res_owner.at[drop].set(blocks, mode="drop")
    residual = p.residual.at[drop].set(0, mode="drop")
    return dataclasses.replace(p, res_slot=res_slot, res_owner=owner, residual=residual), slots


def set_at(a: jax.Array, index, values: jax.Array, **kw) -> jax.Array:
    """``a.at[index].set(values, **kw)`` (values cast to a's dtype), with a float array of fewer
    than 32 bits (bf16, f16, fp8 pools; bf16 scales) scattered as its bits: XLA's CPU backend
    runs a bf16/f16/fp8 scatter by converting the whole array to f32 and back around it, a copy
    of the pool and back on every write (a bf16-cache decode step at batch 8 took 5.8x the f32
    one). The bitcasts are free and keep the update in place under donation."""
    values = jnp.asarray(values).astype(a.dtype)
    if not (jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize < 4):
        return a.at[index].set(values, **kw)
    bits = jnp.dtype(f"uint{8 * a.dtype.itemsize}")
    out = jax.lax.bitcast_convert_type(a, bits).at[index].set(
        jax.lax.bitcast_convert_type(values, bits), **kw)
    return jax.lax.bitcast_convert_type(out, a.dtype)


def _write_tokens(p: QuantizedPages, new: jax.Array, blk: jax.Array, off: jax.Array
                  ) -> QuantizedPages:
    """fp8/int8: quantize each token on write (per-token-per-head scale)."""
    data, scale, _ = _quantize_blocks(p, new)
    out = dataclasses.replace(p, data=set_at(p.data, (blk, off), data))
    if scale is not None:
        out = dataclasses.replace(out, scale=set_at(p.scale, (blk, off), scale))
    return out


def _residual_window(p: QuantizedPages, blk, off, md: AttentionMetadata | None):
    """Where each written token stands in its sequence's residual window.

    Returns:
      keep: bool [T], the token's block is inside the window after this step (None without
        ``md``: R = 1, the block stays unless it seals in this step).
      release: int32 [T], the block leaving the window when this token seals its block (0: none).
      live: int32 [S * R] the blocks of every window of the step (0 padding), to re-stamp.
    """
    bs, r = p.data.shape[1], p.residual_blocks
    seals_own = off == bs - 1
    if md is None:                     # R = 1: the window is the unsealed block alone
        if r != 1:
            raise ValueError(f"residual_blocks={r} > 1 needs the step's AttentionMetadata")
        return None, jnp.where(seals_own, blk, 0), jnp.zeros(0, jnp.int32)
    qsl, lens, tables = md.query_start_loc, md.seq_lens, md.block_tables
    t = jnp.arange(blk.shape[0], dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(qsl[1:], t, side="right"), 0, lens.shape[0] - 1)
    pos = lens[seq] - (qsl[seq + 1] - qsl[seq]) + (t - qsl[seq])               # [T]
    keep = pos // bs >= window_first(lens, bs, r)[seq]
    out = pos // bs + 1 - r
    release = jnp.where(seals_own & (out >= 0), tables[seq, jnp.maximum(out, 0)], 0)
    win = window_first(lens, bs, r)[:, None] + jnp.arange(r, dtype=jnp.int32)   # [S, R]
    ok = (win >= 0) & (win < (lens[:, None] + bs - 1) // bs)
    live = jnp.where(ok, jnp.take_along_axis(tables, jnp.clip(win, 0, tables.shape[1] - 1),
                                             axis=1), 0)
    return keep, release, live.reshape(-1)


def _write_kivi(p: QuantizedPages, new: jax.Array, blk: jax.Array, off: jax.Array,
                md: AttentionMetadata | None) -> QuantizedPages:
    """int4/int2: tokens of blocks inside their residual window go to the residual; blocks whose
    last slot is written in this step are quantized whole (residual tokens + this step's tokens)
    and become sealed; blocks leaving the window give their slot back."""
    n, bs = p.data.shape[:2]
    r = p.res_owner.shape[0]
    t = new.shape[0]
    old_slot = p.res_slot
    keep, release, live = _residual_window(p, blk, off, md)
    # a block is written if it is not sealed or starts at offset 0 in this step (reallocated); a
    # write into a sealed block (the recomputed last token of a fully cached prompt) is dropped
    # and the block keeps its codes, so cached blocks stay bit-exact
    starts = jnp.zeros(n, bool).at[blk].max(off == 0)
    valid = (blk != 0) & (~p.sealed[blk] | starts[blk])
    last = valid & (off == bs - 1)
    seals = jnp.zeros(n, bool).at[blk].max(last)[blk] & valid                  # [T]
    keep = valid & (~seals if keep is None else keep)
    # seal: the blocks whose last slot is written now, at most one per token (static bound);
    # their full-precision tokens come from the residual as it was before this step
    m = min(t, n)
    (last_tok,) = jnp.nonzero(last, size=m, fill_value=0)
    sealed = jnp.where(last[last_tok], blk[last_tok], 0)                       # [M], 0 = padding
    full = p.residual[old_slot[sealed]].astype(jnp.float32)                    # [M, bs, Hkv, D]
    pos = jnp.zeros(n, jnp.int32).at[sealed].set(jnp.arange(m, dtype=jnp.int32))
    full = full.at[jnp.where(seals, pos[blk], m), off].set(new.astype(jnp.float32), mode="drop")
    data, scale, zero = _quantize_blocks(p, full)
    # release the slots of blocks leaving their window
    rel = jnp.where(last, release, 0)
    rel_slot = old_slot[rel]
    p = dataclasses.replace(p, res_slot=old_slot.at[jnp.where(rel > 0, rel, n)].set(0, mode="drop"),
                            res_owner=p.res_owner.at[jnp.where(rel_slot > 0, rel_slot, r)].set(
                                0, mode="drop"))
    # residual slots for blocks inside the window that have none (a block's tokens are contiguous)
    first = keep & jnp.concatenate([jnp.ones(1, bool), blk[1:] != blk[:-1]])
    touched = jnp.zeros(r, bool).at[old_slot[blk]].set(valid).at[p.res_slot[live]].set(True)
    p, _ = _assign_slots(p, blk, first & (p.res_slot[blk] == 0), touched)
    res_idx = jnp.where(keep, p.res_slot[blk], r)
    residual = p.residual.at[res_idx, off].set(new.astype(p.residual.dtype), mode="drop")
    stamp = p.res_stamp.at[res_idx].set(p.clock + 1, mode="drop")
    live_slot = p.res_slot[live]
    stamp = stamp.at[jnp.where(live_slot > 0, live_slot, r)].set(p.clock + 1, mode="drop")
    is_sealed = p.sealed.at[jnp.where(starts, jnp.arange(n), n)].set(False, mode="drop")
    return dataclasses.replace(
        p, data=p.data.at[sealed].set(data), scale=p.scale.at[sealed].set(scale),
        zero=p.zero.at[sealed].set(zero), residual=residual, res_stamp=stamp,
        sealed=is_sealed.at[sealed].set(True).at[0].set(False), clock=p.clock + 1)


def write_layer(pool: Pages, new: jax.Array, slot_mapping: jax.Array,
                md: AttentionMetadata | None = None) -> Pages:
    """Scatters new K (or V) rows of one layer into its pool by slot (quantizing on write).

    Args:
      pool: [num_blocks, block_size, num_kv_heads, head_dim] array, ``HNDPages`` or
        ``QuantizedPages``.
      new: [T, num_kv_heads, head_dim], cast to the pool dtype (or quantized).
      slot_mapping: int32 [T], ``block_id * block_size + offset``; padding tokens point into block
      0. md: the step's metadata; needed by KIVI pools with ``residual_blocks > 1`` (each token's
        sequence, position and block table place it in its residual window).

    Returns:
      The updated pool (in place under donation).
    """
    block_size = pool.shape[1]
    blk, off = slot_mapping // block_size, slot_mapping % block_size
    if isinstance(pool, HNDPages):
        return HNDPages(set_at(pool.data, (blk, slice(None), off), new))
    if not isinstance(pool, QuantizedPages):
        return set_at(pool, (blk, off), new)
    if pool.residual is None:
        return _write_tokens(pool, new, blk, off)
    return _write_kivi(pool, new, blk, off, md)


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
        return tuple(_float_tokens(p[layer], blocks, off) for p in (cache.k, cache.v))
    nb = -(-length // cache.block_size)
    ids = block_table[:nb]
    k, v = (read_pages(p, ids).reshape(nb * cache.block_size, *p.shape[2:])[:length]
            for p in (cache.k[layer], cache.v[layer]))
    return k, v


def _float_tokens(pool: jax.Array | HNDPages, blk: jax.Array, off: jax.Array) -> jax.Array:
    """[T, Hkv, D] the tokens of a float pool at blocks ``blk`` and offsets ``off`` (int32 [T]),
    in the pool's dtype."""
    if isinstance(pool, HNDPages):
        return pool.data[blk, :, off]
    return pool[blk, off]


def _copy_pool(p: Pages, src: jax.Array, dst: jax.Array) -> Pages:
    if isinstance(p, HNDPages):
        return HNDPages(_copy_pool(p.data, src, dst))
    if not isinstance(p, QuantizedPages):
        return set_at(p, dst, p[src])
    out = dataclasses.replace(p, data=set_at(p.data, dst, p.data[src]))
    if p.scale is not None:
        out = dataclasses.replace(out, scale=set_at(p.scale, dst, p.scale[src]))
    if p.zero is not None:
        out = dataclasses.replace(out, zero=set_at(p.zero, dst, p.zero[src]))
    if p.residual is None:
        return out
    out = dataclasses.replace(out, sealed=p.sealed.at[dst].set(p.sealed[src]))
    src_slot = p.res_slot[src]
    touched = jnp.zeros(p.res_owner.shape[0], bool).at[src_slot].set(True)
    out = dataclasses.replace(out, res_slot=out.res_slot.at[dst].set(0))
    out, slots = _assign_slots(out, dst, src_slot > 0, touched)
    r = p.res_owner.shape[0]
    residual = out.residual.at[jnp.where(src_slot > 0, slots, r)].set(
        p.residual[src_slot], mode="drop")
    stamp = out.res_stamp.at[jnp.where(src_slot > 0, slots, r)].set(p.clock, mode="drop")
    return dataclasses.replace(out, residual=residual, res_stamp=stamp)


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
    return PagedKVCache(k=tuple(_copy_pool(p, src, dst) for p in cache.k),
                        v=tuple(_copy_pool(p, src, dst) for p in cache.v),
                        bounds=tuple(copy_key_bounds(b, src, dst) for b in cache.bounds))


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
        return _float_tokens(k_pages, blk, off).astype(jnp.float32)
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
