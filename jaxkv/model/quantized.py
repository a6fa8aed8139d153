"""Weights kept quantized: ``QuantizedWeight``, a params leaf holding a GGUF's Q8_0 / Q4_0 /
Q4_1 blocks as stored, or what ``jaxkv.model.quantize`` makes of float weights at load.

A weight ``[N, K]`` (rows = output channels) is stored as codes along K, one scale (and
minimum) per ``group`` values of a row (a multiple of 32; the last group may be partial, as
compressed-tensors' ``ceil(K / group)`` scales); GGUF's blocks are groups of 32 (llama.cpp's
ggml-common.h), repacked by ``from_gguf`` into separate arrays, the same bytes, bit-exact:

    qs  int8 [N, K] (Q8_0), uint8 [N, K / 2] (Q4_0, Q4_1: each 32 values' 16 bytes as
        GGUF stores a block, the low nibbles its elements 0-15, the high ones 16-31) or
        float8_e4m3fn [N, K] (F8_E4M3)
    d   float16 [N, G]  each group's scale, G = ceil(K / group)
    m   float16 [N, G]  each group's minimum (Q4_1; None otherwise)

    value = q * d (Q8_0, F8_E4M3),  (q - 8) * d (Q4_0),  q * d + m (Q4_1)

``shape`` is the logical shape of the float parameter it stands for (``llama.param_shapes``):
the model reads a linear weight as ``[K..., N...]`` (``linear.linear``) and the embedding as
``[V, E]`` = ``[N, K]`` (``rows``, ``linear.linear_t``). The arrays are numpy at load and jax
arrays in the params; the class is a pytree whose leaves are the arrays.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.model.quantization import BLOCK     # values per GGUF block; groups are multiples

KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1")       # the GGUF types kept quantized
CODE_TYPES = (*KEPT_TYPES, "F8_E4M3")       # how codes decode (module docstring)
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized weight (see the module docstring); ``qtype``, ``shape`` and ``group`` are
    static."""

    qs: object                                            # [N, K] or uint8 [N, K / 2]
    d: object                                             # f16 [N, G]
    m: object                                             # f16 [N, G] or None
    qtype: str = dataclasses.field(metadata=dict(static=True))
    shape: tuple = dataclasses.field(metadata=dict(static=True))
    group: int = dataclasses.field(default=BLOCK, metadata=dict(static=True))

    @property
    def rows(self) -> int:
        """N: the stored rows (output channels)."""
        return int(self.qs.shape[0])

    @property
    def cols(self) -> int:
        """K: values per stored row (the contracted axis)."""
        return int(self.qs.shape[1]) * (2 if self.qtype in ("Q4_0", "Q4_1") else 1)

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


def block_bytes(qtype: str) -> int:
    """Bytes of one 32-value block of ``qtype`` (a ``KEPT_TYPES`` name)."""
    return _BLOCK_BYTES[qtype]


def from_gguf(data: np.ndarray, qtype: str) -> QuantizedWeight:
    """Repacks a GGUF tensor's bytes uint8 [N, K / 32 * block_bytes] (``ReaderTensor.data``)
    into a numpy ``QuantizedWeight`` of logical shape (N, K)."""
    data = np.asarray(data, np.uint8)
    n = data.shape[0]
    blocks = data.reshape(n, -1, _BLOCK_BYTES[qtype])                 # [N, K / 32, bytes]
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0] if qtype == "Q4_1" else None
    qs = np.ascontiguousarray(blocks[..., 4 if qtype == "Q4_1" else 2:]).reshape(n, -1)
    if qtype == "Q8_0":
        qs = qs.view(np.int8)
    return QuantizedWeight(qs, d, m, qtype, (n, blocks.shape[1] * BLOCK))


def to_gguf(w: QuantizedWeight) -> np.ndarray:
    """The GGUF bytes uint8 [N, K / 32 * block_bytes] of numpy ``w`` (``from_gguf``'s inverse)."""
    n, nb = w.rows, w.cols // BLOCK
    parts = [np.asarray(w.d).view(np.uint8).reshape(n, nb, 2)]
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
    if qtype == "Q4_0":
        q = q.astype(xp.int8) - xp.int8(8)
    return q.astype(xp.float32)


def _per_block(xp, a, w: QuantizedWeight):
    """float32 [N, K / 32, 1]: each 32-value block's entry of ``a`` [N, G] (its group's)."""
    a = xp.repeat(a.astype(xp.float32), w.group // BLOCK, axis=1)[:, :w.cols // BLOCK]
    return a[..., None]


def dequantize_numpy(w: QuantizedWeight) -> np.ndarray:
    """float32 [N, K], as ggml's ``dequantize_row_*`` (the ``gguf`` package's order of ops)."""
    out = _codes(np, np.asarray(w.qs), w.qtype, w.rows) * _per_block(np, np.asarray(w.d), w)
    if w.m is not None:
        out = out + _per_block(np, np.asarray(w.m), w)
    return out.reshape(w.rows, w.cols)


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """``dtype`` [N, K] (jax.numpy; the fallback of the kernels and the embedding rows)."""
    n = w.qs.shape[0]
    out = _codes(jnp, w.qs, w.qtype, n) * _per_block(jnp, w.d, w)
    if w.m is not None:
        out = out + _per_block(jnp, w.m, w)
    return out.reshape(n, w.cols).astype(dtype)


def rows(w, ids: jax.Array) -> jax.Array:
    """``w[ids]`` of an embedding ``[V, E]`` (a float array or a QuantizedWeight): [T, E]."""
    if isinstance(w, QuantizedWeight):
        return dequantize(w.map_rows(lambda a: a[ids]))
    return w[ids]


def to_device(w: QuantizedWeight, shape: tuple) -> QuantizedWeight:
    """A numpy ``QuantizedWeight`` as jax arrays under the logical ``shape``."""
    return dataclasses.replace(w.map_rows(jnp.asarray), shape=tuple(shape))
