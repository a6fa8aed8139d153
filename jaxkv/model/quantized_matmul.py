"""``x @ dequantize(w).T`` for a quantized weight (jaxkv/model/quantized.py) on the GPU: a
Pallas (Triton) kernel that reads each 32-value block's codes and its group's scale once and
dequantizes them in registers, so a step streams the stored bytes (Q4_1: 5 bits a weight,
int4 in groups of 128: 4.25) instead of a float copy.

Grid (row tiles, column tiles); a program walks K one 32-value block at a time: its codes
``[bn, 32]`` (Q4: the 16 stored bytes, low nibbles the block's elements 0-15, high nibbles
16-31, each half a ``[bm, 16] x [16, bn]`` product with the matching half of x; F8_E4M3:
float8 codes converted), scaled per output column by its group's ``d``; Q4_0 subtracts 8
from the codes, Q4_1 adds ``m`` times the block's row sums of x, MXFP4 decodes its e2m1 codes
and its E8M0 scales (``2^(d - 127)``); Q8_0 codes in groups of 16 (a
GGUF Q6_K repacked) take each half block's product with its own scale. Accumulation is
float32, so the result equals dequantize-then-dot up to summation order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxkv.model.quantized import BLOCK, QuantizedWeight

_HALF = BLOCK // 2


def quantized_matmul(x: jax.Array, w: QuantizedWeight, *, interpret: bool = False,
                     bn: int | None = None) -> jax.Array:
    """x [M, K] (float32 or bfloat16) times ``w``'s dequantized [N, K], transposed: [M, N] in
    x's dtype.

    Args:
      interpret: run the kernel in Pallas interpret mode (CPU tests).
      bn: output columns per program (default: 128, or 64 where N is not a multiple of 128).

    Raises:
      ValueError: N not a multiple of 64 (real models' widths are), or K not ``w``'s.
    """
    M, K = x.shape
    N = w.rows
    bn = bn or (128 if N % 128 == 0 else 64)
    if N % bn or K != w.cols:
        raise ValueError(f"quantized_matmul needs N={N} a multiple of {bn} and x's K={K} equal "
                         f"to the weight's {w.cols}")
    bm = min(32, max(16, 1 << (M - 1).bit_length()))     # Triton's dot: at least 16 rows
    rows = -(-M // bm) * bm
    m = w.m if w.m is not None else w.d                   # a placeholder Q4_1 alone reads
    out = pl.pallas_call(
        functools.partial(_kernel, qtype=w.qtype, group=w.group, bm=bm, bn=bn),
        grid=(rows // bm, N // bn),
        in_specs=[_whole(s) for s in ((rows, K), w.qs.shape, w.d.shape, m.shape)],
        out_specs=_whole((rows, N)),
        out_shape=jax.ShapeDtypeStruct((rows, N), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="jaxkv_quantized_matmul",
    )(jnp.pad(x, ((0, rows - M), (0, 0))), w.qs, w.d, m)
    return out[:M]


def _whole(shape) -> pl.BlockSpec:
    """The whole array as one block (with the Triton lowering, a base pointer)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _dot_t(a, b):
    """a [R, k] times b [C, k] transposed: f32 [R, C] (float32 inputs at full precision, not
    TF32)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _fp4(q, dtype):
    """e2m1 codes q int32 (0..15) as ``dtype``: sign bit 3, exponent bits 2-1, mantissa bit 0
    (``quantized.FP4_VALUES``)."""
    mag, e = q & 7, (q & 7) >> 1
    m = (mag & 1).astype(jnp.float32)
    v = jnp.where(e == 0, 0.5 * m, (2 + m) * jnp.left_shift(1, e).astype(jnp.float32) * 0.25)
    return jnp.where((q & 8) != 0, -v, v).astype(dtype)


def _scales(d, qtype: str):
    """float32 of a block's scales ``d`` [bn] (MXFP4: E8M0 exponents, ``2^(d - 127)``)."""
    if qtype != "MXFP4":
        return d.astype(jnp.float32)
    e = d.astype(jnp.int32)
    return lax.bitcast_convert_type(jnp.where(e == 0, 1 << 22, e << 23), jnp.float32)


def _kernel(x_ref, qs_ref, d_ref, m_ref, o_ref, *, qtype: str, group: int, bm: int, bn: int):
    """Blocks of 32 values along K; their scale (and minimum) is group ``b // gb``'s (group
    16: each half block's own)."""
    i, j = pl.program_id(0), pl.program_id(1)
    r, c = pl.ds(i * bm, bm), pl.ds(j * bn, bn)
    dtype = x_ref.dtype
    gb = max(group // BLOCK, 1)

    def block(b, acc):                                              # acc f32 [bm, bn]
        if group == _HALF:                                          # Q8_0 codes, two scales
            for h in range(2):
                k = pl.ds(b * BLOCK + h * _HALF, _HALF)
                q = qs_ref[c, k].astype(dtype)                      # [bn, 16]
                acc = acc + _dot_t(x_ref[r, k], q) * d_ref[c, 2 * b + h].astype(
                    jnp.float32)[None, :]
            return acc
        d = _scales(d_ref[c, b // gb], qtype)                       # [bn]
        if qtype in ("Q8_0", "F8_E4M3"):
            q = qs_ref[c, pl.ds(b * BLOCK, BLOCK)].astype(dtype)   # [bn, 32]
            return acc + _dot_t(x_ref[r, pl.ds(b * BLOCK, BLOCK)], q) * d[None, :]
        lo = x_ref[r, pl.ds(b * BLOCK, _HALF)]                      # [bm, 16]: elements 0-15
        hi = x_ref[r, pl.ds(b * BLOCK + _HALF, _HALF)]              # [bm, 16]: 16-31
        q = qs_ref[c, pl.ds(b * _HALF, _HALF)]                      # uint8 [bn, 16]
        q_lo, q_hi = (q & 0xF).astype(jnp.int32), (q >> 4).astype(jnp.int32)
        if qtype == "Q4_0":
            q_lo, q_hi = q_lo - 8, q_hi - 8
        decode = functools.partial(_fp4, dtype=dtype) if qtype == "MXFP4" else (
            lambda q: q.astype(dtype))
        part = _dot_t(lo, decode(q_lo)) + _dot_t(hi, decode(q_hi))
        acc = acc + part * d[None, :]
        if qtype == "Q4_1":
            sums = (jnp.sum(lo.astype(jnp.float32), axis=1)
                    + jnp.sum(hi.astype(jnp.float32), axis=1))      # [bm]
            acc = acc + sums[:, None] * m_ref[c, b // gb].astype(jnp.float32)[None, :]
        return acc

    blocks = x_ref.shape[1] // BLOCK
    acc = lax.fori_loop(0, blocks, block, jnp.zeros((bm, bn), jnp.float32))
    o_ref[r, c] = acc.astype(o_ref.dtype)
