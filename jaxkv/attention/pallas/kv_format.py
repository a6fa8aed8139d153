"""How the kernels read a kv tile from any pool format: float, fp8/int8 codes, or packed KIVI.

Design notes: docs/attention.md."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxkv.kvcache.spec import KV_FORMATS, KVCacheSpec, KVFormat

# Pool code dtypes dequantized in-kernel (fp8_e4m3, fp8_e5m2, int8; KIVI int4/int2 are uint8).
QUANTIZED_CODE_DTYPES = tuple(dict.fromkeys(jnp.dtype(f.storage) for f in KV_FORMATS.values()
                                            if f.quantized))
MIN_CHUNK = 16     # Triton's smallest dot dimension
# Channels per head-dim chunk of an fp8/int8 pool. Triton dequantizes a whole dot operand in
# registers before its mma loop, so a [block_kv, 128] int8 tile of K, then of V, is 64 codes a
# thread (4 warps, block_kv 64) held as separate 16-bit registers with their scaled bf16 copies:
# the split-K decode kernel needed 168-183 registers and spilled with jax 0.12's Triton.
# 64-channel chunks halve that operand (the decode kernel takes 128 registers with jax 0.10.2
# and 0.12; docs/gpu.md "Newer JAX").
DEQUANT_CHUNK = 64


@dataclasses.dataclass(frozen=True)
class KvLayout:
    """Static description of a pool format, as the kernels need it (hashable: a jit static arg).

    Attributes:
      head_dim: D, unpacked channels per vector.
      chunks: ``(ch0, width, byte0, part)`` per head-dim chunk (see the module docstring):
        the whole head_dim for a float pool, ``DEQUANT_CHUNK`` channels for fp8/int8.
      scaled: fp8/int8 pools with per-token-per-head scales.
      static_scale: fp8 pools with one fixed per-tensor scale.
      bits: 4 or 2 for KIVI pools, else 0.
      group_size: channels per per-token group of a KIVI pool.
      axes: (k_axis, v_axis) of a KIVI pool, ``"channel"`` or ``"token"``.
      residual_blocks: the KIVI residual window R: a page is read from the residual only if it
        has a slot and is one of the sequence's pages from ``kv_len // block_size - (R - 1)`` on.
    """

    head_dim: int
    chunks: tuple[tuple[int, int, int, int], ...]
    scaled: bool = False
    static_scale: float | None = None
    bits: int = 0
    group_size: int = 0
    axes: tuple[str, str] = ("token", "token")
    residual_blocks: int = 1

    @property
    def operands_per_pool(self) -> int:
        """Kernel operands of each of K and V (codes, then scales, zeros, residual, res_slot)."""
        if self.bits:
            return 5
        return 2 if self.scaled else 1


def pool_dtype(pages):
    """The element dtype of a float pool, the stored code dtype of a ``QuantizedPages``."""
    data = getattr(pages, "data", None)
    return pages.dtype if data is None else data.dtype


def float_layout(head_dim: int) -> KvLayout:
    """The layout of a plain float pool (one chunk, no dequantization)."""
    return KvLayout(head_dim=head_dim, chunks=((0, head_dim, 0, 0),))


def check_head_dim(head_dim: int) -> None:
    """Raises ValueError unless ``head_dim`` is a power of two >= 16 (Triton block shapes)."""
    if head_dim < MIN_CHUNK or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim} must be a power of two >= {MIN_CHUNK} (Triton "
                         f"block shapes)")


def kivi_chunk_width(fmt: KVFormat, head_dim: int, group_size: int,
                     residual_full_precision: bool = True) -> int:
    """Channels per head-dim chunk of a packed int4/int2 pool: ``min(G, D * bits / 8)``.

    Raises:
      ValueError: for the residual-off ablation (``residual_full_precision=False``), and if the
        width is below 16 (Triton's dot minimum), naming head_dim and group_size.
    """
    if not residual_full_precision:
        raise ValueError("residual_full_precision=False (the residual-off ablation) is served by "
                         "attention_impl='reference' only")
    n = fmt.per_byte
    width = min(group_size, head_dim // n)
    if width < MIN_CHUNK:
        raise ValueError(f"kv_cache_dtype={fmt.name!r} with head_dim={head_dim} and "
                         f"group_size={group_size} gives {width}-channel chunks; the Pallas "
                         f"kernels need >= {MIN_CHUNK} (head_dim >= {MIN_CHUNK * n}, group_size "
                         f">= {MIN_CHUNK}); use attention_impl='reference'")
    return width


def check_pallas_support(spec: KVCacheSpec, whole_heads: bool = True) -> None:
    """Raises ValueError if the Pallas kernels cannot read the pools of ``spec`` (checked on the
    spec, before anything is allocated): head_dim must be a power of two >= 16 where a kernel
    reads whole heads (``whole_heads``; a latent pool is read in chunks of its own); KIVI pools
    need head-dim chunks of >= 16 channels and the full-precision residual
    (``kivi_chunk_width``); no 1-byte array may be of 2-4 GiB (``check_offsets``); the pools
    must be NHD."""
    if spec.layout != "nhd":
        raise ValueError(f"kv_layout={spec.layout!r}: the Pallas kernels read NHD pools; use "
                         f"kv_layout='nhd' (the default with attention_impl='pallas')")
    if whole_heads:
        check_head_dim(spec.head_dim)
    if spec.format.kivi:
        kivi_chunk_width(spec.format, spec.head_dim, spec.group_size,
                         spec.residual_full_precision)
    arrays = [a for axis in spec.axes for a in spec.block_arrays(axis).values()]
    check_offsets([jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in arrays])


def check_offsets(operands) -> None:
    """Raises ValueError for a 1-byte operand of more than 2 GiB and at most 4 GiB.

    The Triton lowering indexes arrays of at most 2^32 bytes with 32-bit element offsets, which
    Triton adds to the base pointer as signed numbers: past 2^31 elements (only possible for 1-byte
    codes) the top of the pool would be read at negative offsets.
    """
    for a in operands:
        if a.dtype.itemsize == 1 and 2 ** 31 < a.size * a.dtype.itemsize <= 2 ** 32:
            raise ValueError(f"a {a.dtype} pool operand of shape {a.shape} is "
                             f"{a.size / 2 ** 30:.2f} GiB; the Triton kernels address 1-byte pools "
                             f"of 2-4 GiB with overflowing int32 offsets: use fewer blocks "
                             f"(<= 2 GiB per layer) or more than 4 GiB per layer")


def kv_operands(k_pages, v_pages):
    """Kernel operands of one layer's pools: (k operands + v operands, ``KvLayout``).

    Float pools pass [k, v]. fp8/int8 ``jaxkv.kvcache.pools.QuantizedPages`` pass their codes
    [num_blocks, block_size, Hkv, D] and bf16 per-token scales [num_blocks, block_size, Hkv, 1]
    (none with a static scale). KIVI int4/int2 pools pass, for K then V: packed codes
    uint8 [num_blocks, block_size, Hkv, D * bits / 8], scale and zero (bf16, per channel
    [num_blocks, 1, Hkv, D] or per token [num_blocks, block_size, Hkv, D / G]), the residual
    [num_res, block_size, Hkv, D] and res_slot int32 [num_blocks].

    Raises:
      ValueError: for the residual-off ablation pools (``residual_full_precision=False``), for
        head_dim chunks narrower than 16 channels (e.g. int2 with head_dim < 64), and for code
        pools ``check_offsets`` refuses.
    """
    from jaxkv.kvcache.pools import HNDPages, QuantizedPages

    if isinstance(k_pages, HNDPages):
        raise ValueError("the Pallas kernels read NHD pools, not HNDPages (kv_layout='hnd')")
    if not isinstance(k_pages, QuantizedPages):
        return [k_pages, v_pages], float_layout(k_pages.shape[-1])
    d = k_pages.head_dim
    if k_pages.residual is None:
        scaled = k_pages.scale is not None
        ops = [k_pages.data, k_pages.scale, v_pages.data, v_pages.scale] if scaled else \
            [k_pages.data, v_pages.data]
        check_offsets(ops)
        width = DEQUANT_CHUNK if d % DEQUANT_CHUNK == 0 else d
        return ops, KvLayout(head_dim=d, chunks=tuple((ch0, width, 0, 0)
                                                      for ch0 in range(0, d, width)),
                             scaled=scaled, static_scale=k_pages.static_scale)
    bits = k_pages.format.bits
    n = 8 // bits
    width = kivi_chunk_width(k_pages.format, d, k_pages.group_size,
                             k_pages.residual_full_precision and v_pages.residual_full_precision)
    chunks = tuple((part * (d // n) + byte0, width, byte0, part)
                   for part in range(n) for byte0 in range(0, d // n, width))
    ops = []
    for p in (k_pages, v_pages):
        ops += [p.data, p.scale, p.zero, p.residual, p.res_slot]
    check_offsets(ops)
    return ops, KvLayout(head_dim=d, chunks=chunks, bits=bits, group_size=k_pages.group_size,
                         axes=(k_pages.axis, v_pages.axis),
                         residual_blocks=k_pages.residual_blocks)


def split_refs(kv_refs, layout: KvLayout):
    """(k refs, v refs): the kernel's kv operand refs split per pool."""
    n = layout.operands_per_pool
    return tuple(kv_refs[:n]), tuple(kv_refs[n:2 * n])


def load_chunk(pool_refs, layout: KvLayout, axis: str, chunk, page, slot, head, dtype,
               in_window=None):
    """One kv tile of one head-dim chunk, [block_kv, width] in ``dtype``.

    Args:
      pool_refs: the refs of one pool (``split_refs``).
      layout: the pool format.
      axis: the pool's KIVI grouping (``layout.axes[0]`` for K, ``[1]`` for V).
      chunk: ``(ch0, width, byte0, part)``.
      page, slot: int32 [block_kv] page id and in-page offset of each kv position.
      head: the kv head.
      dtype: the dtype the tile is returned in (q's).
      in_window: bool [block_kv], the position's page is inside the sequence's KIVI residual
        window (KIVI pools only).
    """
    ch0, width, byte0, part = chunk
    if not layout.bits:
        x = pool_refs[0][page, slot, head, pl.ds(ch0, width)]                    # [bkv, w]
        if len(pool_refs) == 1 and layout.static_scale is None:
            return x
        x = x.astype(jnp.float32)
        if len(pool_refs) == 2:
            x = x * pool_refs[1][page, slot, head, :].astype(jnp.float32)       # [bkv, 1]
        else:
            x = x * layout.static_scale
        return x.astype(dtype)
    data_ref, scale_ref, zero_ref, res_ref, res_slot_ref = pool_refs
    codes = data_ref[page, slot, head, pl.ds(byte0, width)]                      # uint8 [bkv, w]
    codes = (codes >> (part * layout.bits)) & ((1 << layout.bits) - 1)
    if axis == "channel":
        idx = (page, 0, head, pl.ds(ch0, width))                                 # [bkv, w]
    else:
        idx = (page, slot, head, pl.ds(ch0 // layout.group_size, 1))             # [bkv, 1]
    x = codes.astype(jnp.float32) * scale_ref[idx].astype(jnp.float32) \
        + zero_ref[idx].astype(jnp.float32)
    res_slot = res_slot_ref[page]                                                # [bkv]
    res = res_ref[res_slot, slot, head, pl.ds(ch0, width)].astype(jnp.float32)   # [bkv, w]
    use_res = (res_slot > 0) & in_window                                         # [bkv]
    return jnp.where(use_res[:, None], res, x).astype(dtype)
