"""Weights kept in GGUF's quantized blocks (Q8_0, Q4_0, Q4_1): ``QuantizedWeight``, a params leaf.

A GGUF stores a weight ``[N, K]`` (rows = output channels) as blocks of 32 values along K
(llama.cpp's ggml-common.h). ``from_gguf`` repacks each row's blocks into separate
arrays, the same bytes, bit-exact to dequantize:

    qs  int8 [N, K] (Q8_0) or uint8 [N, K / 2] (Q4_0, Q4_1: a block's 16 bytes as stored,
        the low nibbles its elements 0-15, the high ones 16-31)
    d   float16 [N, K / 32]  each block's scale
    m   float16 [N, K / 32]  each block's minimum (Q4_1; None otherwise)

    value = q * d (Q8_0),  (q - 8) * d (Q4_0),  q * d + m (Q4_1)

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

BLOCK = 32                                  # values per block, every kept type
KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1")       # the GGUF types kept quantized
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A weight in GGUF blocks (see the module docstring); ``qtype`` and ``shape`` are static."""

    qs: object                                            # int8 [N, K] or uint8 [N, K / 2]
    d: object                                             # f16 [N, K / 32]
    m: object                                             # f16 [N, K / 32] or None
    qtype: str = dataclasses.field(metadata=dict(static=True))
    shape: tuple = dataclasses.field(metadata=dict(static=True))

    @property
    def rows(self) -> int:
        """N: the stored rows (output channels)."""
        return int(self.qs.shape[0])

    @property
    def cols(self) -> int:
        """K: values per stored row (the contracted axis)."""
        return int(self.d.shape[1]) * BLOCK

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays (the GGUF's bytes for these rows)."""
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


def _codes(xp, qs, qtype: str, n: int, nb: int):
    """float32 [N, K / 32, 32] codes (Q4_0: already less 8), with ``xp`` numpy or jax.numpy."""
    if qtype == "Q8_0":
        return qs.reshape(n, nb, BLOCK).astype(xp.float32)
    q = qs.reshape(n, nb, BLOCK // 2)
    q = xp.concatenate([q & 0xF, q >> 4], axis=-1)                    # elements 0-15, 16-31
    if qtype == "Q4_0":
        return (q.astype(xp.int8) - xp.int8(8)).astype(xp.float32)
    return q.astype(xp.float32)


def dequantize_numpy(w: QuantizedWeight) -> np.ndarray:
    """float32 [N, K], as ggml's ``dequantize_row_*`` (the ``gguf`` package's order of ops)."""
    n, nb = w.rows, w.cols // BLOCK
    q = _codes(np, np.asarray(w.qs), w.qtype, n, nb)
    d = np.asarray(w.d).astype(np.float32)[..., None]
    out = d * q if w.qtype != "Q8_0" else q * d
    if w.m is not None:
        out = out + np.asarray(w.m).astype(np.float32)[..., None]
    return out.reshape(n, w.cols)


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """``dtype`` [N, K] (jax.numpy; the fallback of the CPU kernel and the embedding rows)."""
    n, nb = w.qs.shape[0], w.d.shape[1]
    q = _codes(jnp, w.qs, w.qtype, n, nb)
    out = q * w.d.astype(jnp.float32)[..., None]
    if w.m is not None:
        out = out + w.m.astype(jnp.float32)[..., None]
    return out.reshape(n, nb * BLOCK).astype(dtype)


def rows(w, ids: jax.Array) -> jax.Array:
    """``w[ids]`` of an embedding ``[V, E]`` (a float array or a QuantizedWeight): [T, E]."""
    if isinstance(w, QuantizedWeight):
        return dequantize(w.map_rows(lambda a: a[ids]))
    return w[ids]


def to_device(w: QuantizedWeight, shape: tuple) -> QuantizedWeight:
    """A numpy ``QuantizedWeight`` as jax arrays under the logical ``shape``."""
    return dataclasses.replace(w.map_rows(jnp.asarray), shape=tuple(shape))
