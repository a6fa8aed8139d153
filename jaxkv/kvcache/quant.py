"""KV quantization formats and the pure quantize / dequantize / pack functions.

Design notes: docs/kv-cache.md."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.kvcache.spec import SCALE_STORAGE, KVFormat

SCALE_DTYPE = jnp.dtype(SCALE_STORAGE)


def _grouped(x: jax.Array, group_size: int | None) -> jax.Array:
    """[..., D] -> [..., D / G, G] (``group_size`` None: [..., 1, D])."""
    d = x.shape[-1]
    g = d if group_size is None else group_size
    if d % g:
        raise ValueError(f"group_size={g} does not divide head_dim={d}")
    return x.reshape(*x.shape[:-1], d // g, g)


def quantize(x: jax.Array, fmt: KVFormat, *, axis: int = -1, group_size: int | None = None,
             static_scale: float | None = None):
    """Quantizes ``x`` with one scale (and zero) per group.

    Args:
      x: float [..., D] values.
      fmt: a quantized format (``jaxkv.kvcache.spec.KV_FORMATS``).
      axis: ``-1``: groups of ``group_size`` channels within each vector (per-token); any other
        axis: the statistics run over that whole axis (per-channel over tokens, KIVI keys).
      group_size: channels per group for ``axis=-1`` (default: all of D).
      static_scale: a fixed per-tensor scale (symmetric formats only); no scale is returned.

    Returns:
      (codes, scale, zero): codes in ``fmt.storage`` shaped like ``x`` (not packed); scale and zero
      bf16 with the reduced axis kept as size 1 (``[..., D / G]`` for ``axis=-1``); zero is None for
      symmetric formats, scale is None with ``static_scale``.
    """
    xf = x.astype(jnp.float32)
    if static_scale is not None:
        if fmt.kivi:
            raise ValueError(f"static_scale applies to symmetric formats, not {fmt.name}")
        return _encode(xf / static_scale, fmt), None, None
    per_token = axis in (-1, x.ndim - 1)
    xg = _grouped(xf, group_size) if per_token else xf
    red = -1 if per_token else axis
    if fmt.kivi:                                    # asymmetric: min/max, zero point
        lo, hi = xg.min(red, keepdims=True), xg.max(red, keepdims=True)
        scale = ((hi - lo) / fmt.qmax).astype(SCALE_DTYPE)
        zero = lo.astype(SCALE_DTYPE)
        s, z = scale.astype(jnp.float32), zero.astype(jnp.float32)
        codes = jnp.clip(jnp.round((xg - z) / jnp.where(s > 0, s, 1.0)), 0, fmt.qmax)
        codes = codes.astype(jnp.uint8)
    else:
        scale = (jnp.abs(xg).max(red, keepdims=True) / fmt.qmax).astype(SCALE_DTYPE)
        zero = None
        s = scale.astype(jnp.float32)
        codes = _encode(xg / jnp.where(s > 0, s, 1.0), fmt)
    if per_token:
        codes = codes.reshape(x.shape)
        scale = scale[..., 0]
        zero = None if zero is None else zero[..., 0]
    return codes, scale, zero


def _encode(y: jax.Array, fmt: KVFormat) -> jax.Array:
    """Scaled f32 values -> symmetric codes (rounded and clipped for int8, cast for fp8)."""
    y = jnp.clip(y, -fmt.qmax, fmt.qmax)
    if jnp.issubdtype(fmt.storage, jnp.integer):
        y = jnp.round(y)
    return y.astype(fmt.storage)


def dequantize(codes: jax.Array, scale: jax.Array | None, zero: jax.Array | None,
               fmt: KVFormat, *, axis: int = -1, static_scale: float | None = None
               ) -> jax.Array:
    """Inverse of ``quantize``: f32 values shaped like ``codes`` (unpacked).

    Args:
      codes: [..., D] codes as returned by ``quantize`` (or ``unpack``-ed).
      scale, zero: as returned by ``quantize`` (per-token: [..., D / G]; other axis: size-1 there).
      fmt: the format.
      axis: the axis given to ``quantize``.
      static_scale: the fixed per-tensor scale, if one was used.
    """
    c = codes.astype(jnp.float32)
    if static_scale is not None:
        return c * static_scale
    s = scale.astype(jnp.float32)
    z = None if zero is None else zero.astype(jnp.float32)
    if axis in (-1, codes.ndim - 1):
        g = codes.shape[-1] // scale.shape[-1]
        s = jnp.repeat(s, g, axis=-1)
        z = None if z is None else jnp.repeat(z, g, axis=-1)
    return c * s if z is None else c * s + z


def pack(codes: jax.Array, bits: int) -> jax.Array:
    """uint8 codes [..., D] (values < 2^bits) -> uint8 [..., D * bits / 8], split-parts layout.

    Part k (channels ``[k D/n, (k+1) D/n)``, n = 8 / bits) goes to bits ``[k bits, (k+1) bits)``.
    """
    if bits >= 8:
        return codes
    n = 8 // bits
    parts = jnp.split(codes.astype(jnp.uint8), n, axis=-1)
    out = parts[0]
    for k in range(1, n):
        out = out | (parts[k] << (k * bits))
    return out


def unpack(packed: jax.Array, bits: int) -> jax.Array:
    """Inverse of ``pack``: uint8 [..., D * bits / 8] -> uint8 codes [..., D]."""
    if bits >= 8:
        return packed
    mask = (1 << bits) - 1
    return jnp.concatenate([(packed >> (k * bits)) & mask for k in range(8 // bits)], axis=-1)


def error_bound(x: jax.Array, scale: jax.Array, zero: jax.Array | None,
                fmt: KVFormat) -> jax.Array:
    """Elementwise bound on ``|x - dequantize(quantize(x))|`` (see the module table).

    Args:
      x: the values.
      scale, zero: the stored bf16 scale and zero point, broadcast to ``x`` (zero None if
        symmetric).
      fmt: the format.

    The bf16 rounding of the stored scale and zero point can push the ends of a group's range
    past the last code; that clip adds at most ``2^-7 (|x| + |zero| + scale qmax)``.
    """
    ax = jnp.abs(x.astype(jnp.float32))
    s = scale.astype(jnp.float32)
    if jnp.issubdtype(fmt.storage, jnp.floating):        # fp8: half an ulp, or a subnormal step
        fi = jnp.finfo(fmt.storage)
        return ax * (float(fi.eps) / 2) + s * float(fi.smallest_subnormal)
    z = 0.0 if zero is None else jnp.abs(zero.astype(jnp.float32))
    return s * 0.5 + (ax + z + s * fmt.qmax) * 2.0 ** -7
