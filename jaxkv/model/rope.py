"""Rotary position embeddings in HF's rotate-half (NeoX) pairing, with Llama-3, linear or YaRN
frequency scaling.

Pairing: dimension ``i`` rotates with ``i + D/2`` (GGUF files store llama.cpp's interleaved
pairing; the GGUF loader un-permutes q/k rows into this layout, so one convention serves all).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.model.config import ModelConfig


def inv_frequencies(config: ModelConfig, local: bool = False) -> np.ndarray:
    """Inverse frequencies float32 [rope_dim // 2] (``head_dim``, or MLA's rotary part): the full
    layers' (scaled when ``config.rope_scaling`` is set), or with ``local`` the sliding layers'
    own (``rope_local_theta``, unscaled: Gemma 3)."""
    D = config.rope_dim
    theta = config.rope_local_theta if local else config.rope_theta
    inv = 1.0 / (theta ** (np.arange(0, D, 2, dtype=np.int64).astype(np.float32) / D))
    rs = None if local else config.rope_scaling
    if rs is None:
        return inv.astype(np.float32)
    if rs.rope_type == "linear":
        return (inv / rs.factor).astype(np.float32)
    if rs.rope_type == "yarn":
        return _yarn(inv, D, theta, rs)
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(inv: np.ndarray, D: int, theta: float, rs) -> np.ndarray:
    """YaRN's frequencies (HF's ``_compute_yarn_parameters``): interpolated by ``factor`` below
    the correction range of ``beta_fast``/``beta_slow`` rotations over the original context,
    kept above it, a linear ramp between."""
    def dim(rotations):
        return D * math.log(rs.original_max_position_embeddings
                            / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim(rs.beta_fast), dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    ramp = np.clip((np.arange(D // 2, dtype=np.float32) - low)
                   / (high - low if high != low else 0.001), 0, 1)      # 1: interpolate
    return (inv / rs.factor * ramp + inv * (1 - ramp)).astype(np.float32)


def attention_factor(config: ModelConfig) -> float:
    """What YaRN multiplies the cosines and sines by (so the logits by its square):
    ``attention_factor``, else DeepSeek's ``mscale(mscale) / mscale(mscale_all_dim)``, else
    ``0.1 ln(factor) + 1``; 1 for other scalings."""
    rs = config.rope_scaling
    if rs is None or rs.rope_type != "yarn":
        return 1.0
    if rs.attention_factor is not None:
        return rs.attention_factor
    if rs.mscale and rs.mscale_all_dim:      # DeepSeek: 1 when the two are equal
        return yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)
    return yarn_mscale(rs.factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 mscale ln(factor) + 1`` (1 when ``factor <= 1``)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rotation(positions: jax.Array, inv_freq: np.ndarray,
             scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """The cosines and sines of ``positions``' rotation angles, computed once per forward and
    shared by every layer (so no layer evaluates a transcendental per element of its q and k).

    Args:
      positions: int32 [T].
      inv_freq: float32 [D // 2].
      scale: both multiplied by it (YaRN's ``attention_factor``).

    Returns:
      (cos, sin), each float32 [T, 1, 2, D // 2]: ``(cos, cos)`` and ``(-sin, sin)`` over the
      two halves of a head (the factors of ``x`` and of its halves swapped, in ``rotate``).
    """
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]   # [T, D/2]
    cos, sin = jnp.cos(angles)[:, None, None, :], jnp.sin(angles)[:, None, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return jnp.concatenate([cos, cos], axis=2), jnp.concatenate([-sin, sin], axis=2)


def rotate(x: jax.Array, rot: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotates ``x`` [T, H, D] by ``rot = rotation(positions, inv_freq)``; [T, H, D] in x's
    dtype (computed in float32): ``(x1 cos - x2 sin, x2 cos + x1 sin)`` for halves x1, x2, as
    ``x * (cos, cos) + swap(x) * (-sin, sin)`` (a reversed axis of two halves, which XLA's CPU
    fusions vectorize, unlike a concatenate of the two results)."""
    cos, sin = rot
    T, H, D = x.shape
    halves = x.astype(jnp.float32).reshape(T, H, 2, D // 2)
    return (halves * cos + halves[:, :, ::-1, :] * sin).reshape(T, H, D).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates ``x`` by its positions.

    Args:
      x: [T, H, D] queries or keys.
      positions: int32 [T].
      inv_freq: float32 [D // 2].

    Returns:
      [T, H, D] in x's dtype (the rotation is computed in float32).
    """
    return rotate(x, rotation(positions, inv_freq))
