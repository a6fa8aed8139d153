"""Weights kept quantized: ``QuantizedWeight``, a params leaf holding a GGUF's Q8_0 / Q4_0 /
Q4_1 blocks as stored (Q4_K's and Q6_K's repacked), an MXFP4 checkpoint's experts (gpt-oss), or
what ``jaxkv.model.quantize`` makes of float weights at load.

A weight ``[N, K]`` (rows = output channels) is stored as codes along K, one scale (and
minimum) per ``group`` values of a row (a multiple of 32, or 16 for Q6_K; the last group may
be partial, as compressed-tensors' ``ceil(K / group)`` scales); GGUF's blocks are groups of
32 (llama.cpp's ggml-common.h), repacked by ``from_gguf`` into separate arrays, the same bytes, bit-exact:

    qs  int8 [N, K] (Q8_0), uint8 [N, K / 2] (Q4_0, Q4_1, MXFP4: each 32 values' 16 bytes
        as GGUF stores a block, the low nibbles its elements 0-15, the high ones 16-31) or
        float8_e4m3fn [N, K] (F8_E4M3)
    d   float16 [N, G]  each group's scale, G = ceil(K / group) (MXFP4: uint8 E8M0 exponents)
    m   float16 [N, G]  each group's minimum (Q4_1; None otherwise)

    value = q * d (Q8_0, F8_E4M3),  (q - 8) * d (Q4_0),  q * d + m (Q4_1),
            FP4[q] * 2^(d - 127) (MXFP4: e2m1 codes, ``FP4_VALUES``; d = 0 is 2^-127)

A GGUF Q4_K tensor (super-blocks of 256: f16 ``d`` and ``dmin``, eight 6-bit sub-block scales
``sc`` and minima ``mn``, 4-bit codes; ``x = d*sc * q - dmin*mn``) is repacked by ``from_q4_k``
as Q4_1 in groups of 32 with float32 ``d = d*sc`` and ``m = -(dmin*mn)``, each product computed
in float32 as ggml computes it: both are exact (11-bit by 6-bit significands), ``q * d`` is
exact too, so ``q * d + m`` rounds once, as ggml's ``d*sc * q - dmin*mn`` does, bit-exact.
That costs 6 bits a weight (0.75 bytes; Q4_K's own layout 4.5, the float32 weight 32); keeping
the super-block layout would save 1.5 bits a weight at the price of a kernel of its own.
A Q6_K tensor (super-blocks of 256: 6-bit codes, sixteen int8 scales ``sc`` of 16 values, an
f16 ``d``; ``x = d*sc * (q - 32)``) is repacked by ``from_q6_k`` as Q8_0 codes ``q - 32`` in
groups of 16 (the one group below 32, two scales a block) with float32 ``d = d*sc`` (exact),
bit-exact as one rounding of the same product: 10 bits a weight (1.25 bytes; Q6_K's 6.5625).

``shape`` is the logical shape of the float parameter it stands for (``llama.param_shapes``):
the model reads a linear weight as ``[K..., N...]`` (``linear.linear``) and the embedding as
``[V, E]`` = ``[N, K]`` (``rows``, ``linear.linear_t``). A mixture's X experts are one stack
(``stack``): each array gains a leading axis (qs [X, N, K...], d and m [X, N, G]) and the
shape is the experts' ``[X, K, N]``; ``expert(g)`` is one of them. The arrays are numpy at
load and jax arrays in the params; the class is a pytree whose leaves are the arrays.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.model.quantization import BLOCK     # values per GGUF block; groups are multiples

BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1", "MXFP4")   # GGUF types kept in their own blocks
KEPT_TYPES = (*BLOCK_TYPES, "Q4_K", "Q6_K")  # the GGUF types kept quantized (K-quants repacked)
NIBBLE_TYPES = ("Q4_0", "Q4_1", "MXFP4")    # two 4-bit codes a byte
# e2m1 codes 0..15: sign bit 3, two exponent bits, one mantissa bit
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "MXFP4": 17}
_SCALE_BYTES = {"Q8_0": 2, "Q4_0": 2, "Q4_1": 2, "MXFP4": 1}   # f16, or MXFP4's E8M0 byte
_Q4_K_BYTES = 144                           # its bytes: d, dmin, 12 of scales, 128 of codes
_Q6_K_BYTES = 210                           # Q6_K's: 128 of low 4 bits, 64 of high 2, 16 scales, d


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized weight (see the module docstring); ``qtype``, ``shape`` and ``group`` are
    static."""

    qs: object                                            # [N, K] or uint8 [N, K / 2]
    d: object                                             # f16 [N, G] (Q4_K's: f32)
    m: object                                             # f16 [N, G] or None (Q4_K's: f32)
    qtype: str = dataclasses.field(metadata=dict(static=True))
    shape: tuple = dataclasses.field(metadata=dict(static=True))
    group: int = dataclasses.field(default=BLOCK, metadata=dict(static=True))

    @property
    def rows(self) -> int:
        """N: the stored rows (output channels; of each expert of a stack)."""
        return int(self.qs.shape[-2])

    @property
    def cols(self) -> int:
        """K: values per stored row (the contracted axis)."""
        return int(self.qs.shape[-1]) * (2 if self.qtype in NIBBLE_TYPES else 1)

    @property
    def stacked(self) -> bool:
        """Whether this is a stack of experts (``stack``)."""
        return len(self.qs.shape) == 3

    def expert(self, g) -> "QuantizedWeight":
        """Expert ``g`` (an int or a traced index) of a stack, read as ``[K, N]``."""
        return dataclasses.replace(self.map_rows(lambda a: a[g]), shape=tuple(self.shape[1:]))

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays (a GGUF's: the file's bytes for these rows)."""
        return sum(int(a.nbytes) for a in (self.qs, self.d, self.m) if a is not None)

    @property
    def dtype(self):
        """The dtype of what it dequantizes to."""
        return jnp.dtype(jnp.float32)

    def __getitem__(self, index):
        """``w[...]`` is ``w`` (how ``nnx.Param`` hands out its value)."""
        if index is not Ellipsis:
            raise TypeError("a QuantizedWeight is read whole (w[...]); use rows() to gather rows")
        return self

    def reshape(self, *shape) -> "QuantizedWeight":
        """The same blocks under another logical shape (one ``-1`` allowed)."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        size = math.prod(self.shape)
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            shape = tuple(size // known if s == -1 else s for s in shape)
        if math.prod(shape) != size:
            raise ValueError(f"cannot reshape a QuantizedWeight of shape {self.shape} to {shape}")
        return dataclasses.replace(self, shape=tuple(int(s) for s in shape))

    def map_rows(self, fn) -> "QuantizedWeight":
        """``fn`` applied to each array along its rows (a row permutation, a gather)."""
        return dataclasses.replace(self, qs=fn(self.qs), d=fn(self.d),
                                   m=None if self.m is None else fn(self.m))

    def out_shape(self) -> tuple:
        """The logical trailing axes that hold N when read as a linear weight ``[K..., N...]``."""
        for i in range(len(self.shape) + 1):
            if math.prod(self.shape[:i]) == self.cols and math.prod(self.shape[i:]) == self.rows:
                return tuple(self.shape[i:])
        raise ValueError(f"shape {self.shape} does not split into K={self.cols} then "
                         f"N={self.rows}")


def stack(ws: list[QuantizedWeight]) -> QuantizedWeight:
    """X numpy weights [N, K] of one qtype and group (a mixture's experts, each as stored
    ``[out, in]``) as one stack of shape (X, K, N)."""
    first = ws[0]
    if any((w.qtype, w.group, w.rows, w.cols) != (first.qtype, first.group, first.rows,
                                                  first.cols) for w in ws):
        raise ValueError("a stack of experts needs one qtype, group and shape, got "
                         f"{sorted({(w.qtype, w.group, w.rows, w.cols) for w in ws})}")
    arrays = {k: None if getattr(first, k) is None else np.stack([getattr(w, k) for w in ws])
              for k in ("qs", "d", "m")}
    return QuantizedWeight(**arrays, qtype=first.qtype, shape=(len(ws), first.cols, first.rows),
                           group=first.group)


def kept_bytes(qtype: str, n_bytes: int, n_elements: int) -> int:
    """Bytes a GGUF tensor of ``qtype`` (a ``KEPT_TYPES`` name; ``n_bytes`` in the file) takes
    kept: its own bytes, Q4_K's repacked (4-bit codes, f32 scale and minimum per 32)."""
    return {"Q4_K": n_elements * 3 // 4, "Q6_K": n_elements * 5 // 4}.get(qtype, n_bytes)


def from_gguf(data: np.ndarray, qtype: str) -> QuantizedWeight:
    """Repacks a GGUF tensor's bytes uint8 [N, K / 32 * block_bytes] (``ReaderTensor.data``;
    Q4_K: [N, K / 256 * 144], ``from_q4_k``) into a numpy ``QuantizedWeight`` of logical
    shape (N, K). An MXFP4 block is its E8M0 byte and 16 bytes of codes in Q4's nibble order;
    ggml's ``2 x FP4`` codes times ``2^(e - 128)`` are this module's ``FP4 x 2^(e - 127)``."""
    if qtype in ("Q4_K", "Q6_K"):
        return (from_q4_k if qtype == "Q4_K" else from_q6_k)(data)
    data = np.asarray(data, np.uint8)
    n, sb = data.shape[0], _SCALE_BYTES[qtype]
    blocks = data.reshape(n, -1, _BLOCK_BYTES[qtype])                 # [N, K / 32, bytes]
    d = np.ascontiguousarray(blocks[..., 0:sb])
    d = d[..., 0] if qtype == "MXFP4" else d.view(np.float16)[..., 0]
    m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0] if qtype == "Q4_1" else None
    qs = np.ascontiguousarray(blocks[..., 2 * sb if qtype == "Q4_1" else sb:]).reshape(n, -1)
    if qtype == "Q8_0":
        qs = qs.view(np.int8)
    return QuantizedWeight(qs, d, m, qtype, (n, blocks.shape[1] * BLOCK))


def from_q4_k(data: np.ndarray) -> QuantizedWeight:
    """Q4_K bytes uint8 [N, K / 256 * 144] as Q4_1 in groups of 32 with float32 ``d = d*sc``
    and ``m = -(dmin*mn)`` (module docstring), bit-exact to ggml's ``dequantize_row_q4_K``."""
    data = np.asarray(data, np.uint8)
    n = data.shape[0]
    blocks = data.reshape(n, -1, _Q4_K_BYTES)                         # [N, S, 144]
    d, dmin = (np.ascontiguousarray(blocks[..., i:i + 2]).view(np.float16).astype(np.float32)
               for i in (0, 2))                                        # [N, S, 1]
    sc, mn = _q4_k_scales(blocks[..., 4:16])                           # [N, S, 8]
    q = blocks[..., 16:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
    codes = (q & 0xF).reshape(n, -1)                  # [N, K]: sub-block 2j low nibbles, 2j+1 high
    return QuantizedWeight(pack_nibbles(codes), (d * sc).reshape(n, -1),
                           -(dmin * mn).reshape(n, -1), "Q4_1", (n, codes.shape[1]))


def from_q6_k(data: np.ndarray) -> QuantizedWeight:
    """Q6_K bytes uint8 [N, K / 256 * 210] as Q8_0 codes ``q - 32`` in groups of 16 with float32
    ``d = d*sc`` (module docstring), bit-exact to ggml's ``dequantize_row_q6_K``."""
    data = np.asarray(data, np.uint8)
    n = data.shape[0]
    blocks = data.reshape(n, -1, _Q6_K_BYTES)                         # [N, S, 210]
    ql, qh = blocks[..., :128], blocks[..., 128:192]
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    d = np.ascontiguousarray(blocks[..., 208:]).view(np.float16).astype(np.float32)
    # each 128 values: ql's 64 bytes low nibbles then high, qh's 32 bytes 2 bits at a time
    lo = (ql.reshape(n, -1, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]) & 0xF
    hi = (qh.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    q = lo.reshape(n, -1, 2, 4, 32) | (hi.reshape(n, -1, 2, 4, 32) << 4)
    codes = (q.astype(np.int8) - np.int8(32)).reshape(n, -1)          # [N, K]
    return QuantizedWeight(codes, (d * sc).reshape(n, -1), None, "Q8_0", (n, codes.shape[1]), 16)


def _q4_k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes [..., 12] as eight 6-bit scales and minima, float32 [..., 8] each
    (ggml's ``get_scale_min_k4``: sub-blocks 0-3 in the low 6 bits of bytes 0-3 and 4-7, 4-7
    in the nibbles of bytes 8-11 with their top 2 bits in bytes 0-3's and 4-7's top bits)."""
    s = s.astype(np.uint8)
    lo_sc, lo_mn, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo_sc & 63, (hi & 0xF) | ((lo_sc >> 6) << 4)], axis=-1)
    mn = np.concatenate([lo_mn & 63, (hi >> 4) | ((lo_mn >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def to_gguf(w: QuantizedWeight) -> np.ndarray:
    """The GGUF bytes uint8 [N, K / 32 * block_bytes] of numpy ``w`` (``from_gguf``'s inverse)."""
    n, nb = w.rows, w.cols // BLOCK
    parts = [np.asarray(w.d).view(np.uint8).reshape(n, nb, -1)]
    if w.m is not None:
        parts.append(np.asarray(w.m).view(np.uint8).reshape(n, nb, 2))
    parts.append(np.asarray(w.qs).view(np.uint8).reshape(n, nb, -1))
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 [N, K / 2] of 4-bit codes [N, K] in GGUF's order: each 32 values' byte j holds
    element j (low nibble) and element j + 16 (high)."""
    q = np.asarray(q).astype(np.uint8).reshape(len(q), -1, BLOCK)
    return (q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)).reshape(len(q), -1)


def _codes(xp, qs, qtype: str, n: int):
    """float32 [N, K / 32, 32] codes (Q4_0: already less 8), with ``xp`` numpy or jax.numpy."""
    if qtype in ("Q8_0", "F8_E4M3"):
        return qs.reshape(n, -1, BLOCK).astype(xp.float32)
    q = qs.reshape(n, -1, BLOCK // 2)
    q = xp.concatenate([q & 0xF, q >> 4], axis=-1)                    # elements 0-15, 16-31
    if qtype == "MXFP4":
        return xp.asarray(FP4_VALUES)[q.astype(xp.int32)]
    if qtype == "Q4_0":
        q = q.astype(xp.int8) - xp.int8(8)
    return q.astype(xp.float32)


def e8m0_scales(xp, e):
    """float32 ``2^(e - 127)`` of E8M0 exponents ``e`` (uint8; 0 is 2^-127, a subnormal; 255,
    NaN in the format, reads as 2^128 = inf, as transformers' ``ldexp``)."""
    bits = e.astype(xp.uint32) << 23
    subnormal = xp.asarray(np.uint32(0x00400000))                     # 2^-127
    return (xp.where(e == 0, subnormal, bits)).view(xp.float32)


def _per_block(xp, a, w: QuantizedWeight):
    """float32 [N, K / u, 1]: each u-value unit's entry of ``a`` [N, G] (its group's); u is a
    block (32) or, for group 16, half of one."""
    u = min(w.group, BLOCK)
    a = e8m0_scales(xp, a) if w.qtype == "MXFP4" else a.astype(xp.float32)
    a = xp.repeat(a, w.group // u, axis=1)[:, :w.cols // u]
    return a[..., None]


def _dequantize(xp, w: QuantizedWeight):
    """float32 [N, K] with ``xp`` numpy or jax.numpy (ggml's order of ops)."""
    n, u = w.qs.shape[0], min(w.group, BLOCK)
    out = _codes(xp, w.qs, w.qtype, n).reshape(n, -1, u) * _per_block(xp, w.d, w)
    if w.m is not None:
        out = out + _per_block(xp, w.m, w)
    return out.reshape(n, w.cols)


def dequantize_numpy(w: QuantizedWeight) -> np.ndarray:
    """float32 [N, K], as ggml's ``dequantize_row_*`` (the ``gguf`` package's order of ops)."""
    return _dequantize(np, jax.tree.map(np.asarray, w))


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """``dtype`` [N, K] (jax.numpy; the fallback of the kernels and the embedding rows)."""
    return _dequantize(jnp, w).astype(dtype)


def rows(w, ids: jax.Array) -> jax.Array:
    """``w[ids]`` of an embedding ``[V, E]`` (a float array or a QuantizedWeight): [T, E]."""
    if isinstance(w, QuantizedWeight):
        return dequantize(w.map_rows(lambda a: a[ids]))
    return w[ids]


def to_device(w: QuantizedWeight, shape: tuple) -> QuantizedWeight:
    """A numpy ``QuantizedWeight`` as jax arrays under the logical ``shape``."""
    return dataclasses.replace(w.map_rows(jnp.asarray), shape=tuple(shape))
