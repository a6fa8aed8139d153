"""One layer's pool of KV pages in any format: a plain array (NHD), ``HNDPages`` (head-major
floats) or ``QuantizedPages`` (codes, scales, KIVI's full-precision residual), with the pure
reads and writes every format shares. A token lives at slot ``block * block_size + offset``;
the layouts, the KIVI residual window and its slots: docs/kv-cache.md."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jaxkv.kvcache import quant
from jaxkv.kvcache.metadata import AttentionMetadata
from jaxkv.kvcache.spec import KVCacheSpec, KVFormat, get_format


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


def zeros_pool(spec: KVCacheSpec, axis: str, value: bool = False) -> Pages:
    """One layer's zeroed K (``axis = spec.axes[0]``) or V (``spec.axes[1]``, ``value``) pool:
    the arrays ``spec.block_arrays(axis, value)`` and ``spec.residual_arrays()`` list."""
    arrays = {name: jnp.zeros(shape, dtype) for name, (shape, dtype)
              in {**spec.block_arrays(axis, value), **spec.residual_arrays()}.items()}
    if not spec.format.quantized:
        return HNDPages(arrays["data"]) if spec.layout == "hnd" else arrays["data"]
    return QuantizedPages(**{f: arrays.get(f) for f in _POOL_FIELDS}, fmt=spec.kv_cache_dtype,
                          axis=axis, group_size=spec.token_group_size,
                          residual_full_precision=spec.residual_full_precision,
                          static_scale=spec.static_scale,
                          head_dim=spec.v_head_dim if value else spec.head_dim,
                          residual_blocks=spec.residual_blocks)


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
    empty = zeros_pool(spec, spec.axes[0])
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


def float_tokens(pool: jax.Array | HNDPages, blk: jax.Array, off: jax.Array) -> jax.Array:
    """[T, Hkv, D] the tokens of a float pool at blocks ``blk`` and offsets ``off`` (int32 [T]),
    in the pool's dtype."""
    if isinstance(pool, HNDPages):
        return pool.data[blk, :, off]
    return pool[blk, off]


def copy_pool(p: Pages, src: jax.Array, dst: jax.Array) -> Pages:
    if isinstance(p, HNDPages):
        return HNDPages(copy_pool(p.data, src, dst))
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
