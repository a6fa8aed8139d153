"""MXFP4 checkpoints (OCP microscaling FP4, gpt-oss's experts): kept in their 4-bit codes
(``QuantizedWeight`` qtype ``"MXFP4"``), or de-quantized to float32 at load.

An HF checkpoint with ``quantization_config.quant_method == "mxfp4"`` stores a weight ``W``
[X, in, out] as ``W_blocks`` uint8 [X, out, in / 32, 16] and ``W_scales`` uint8
[X, out, in / 32]: 32 FP4 (e2m1) codes per block, two per byte (the low nibble first), and one
power-of-two scale per block, ``2 ** (scale - 127)`` (E8M0)::

    W[x, 32 * g + 2 * b + n, o] = FP4[nibble n of blocks[x, o, g, b]] * 2 ** (scales[x, o, g] - 127)

Kept, the codes are repacked into GGUF's nibble order (``quantized.pack_nibbles``: byte j of a
block holds elements j and j + 16), the same 4.25 bits a weight, and the scales stay E8M0.
"""

from __future__ import annotations

import numpy as np

from jaxkv.model.quantized import BLOCK, FP4_VALUES, QuantizedWeight, pack_nibbles


def _check(blocks: np.ndarray, scales: np.ndarray) -> None:
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape} "
                         f"(want blocks = scales + (16,))")


def _codes(blocks: np.ndarray) -> np.ndarray:
    """uint8 [..., in] e2m1 codes of ``blocks`` uint8 [..., in / 32, 16], in order."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)        # [..., G, 16, 2]
    return codes.reshape(*blocks.shape[:-2], -1)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 ``[..., in]`` of ``blocks`` uint8 ``[..., in / 32, 16]`` and ``scales`` uint8
    ``[..., in / 32]`` (rows in the checkpoint's ``[X, out]`` order)."""
    _check(blocks, scales)
    values = FP4_VALUES[_codes(blocks)].reshape(*scales.shape, 32)     # [..., G, 32]
    with np.errstate(over="ignore"):   # scale 255 (6 * 2^128) is inf, as in transformers
        values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*scales.shape[:-1], -1)


def keep(blocks: np.ndarray, scales: np.ndarray) -> QuantizedWeight:
    """A stack of X experts ``blocks`` uint8 [X, out, in / 32, 16], ``scales`` [X, out, in / 32]
    as a numpy ``QuantizedWeight`` (qtype MXFP4, group 32) of logical shape [X, in, out]:
    codes [X, out, in / 2] in GGUF's nibble order, the E8M0 scales as stored. Bit-exact:
    ``quantized.dequantize`` of it equals ``dequantize``."""
    _check(blocks, scales)
    x, out, groups = scales.shape
    codes = _codes(np.asarray(blocks, np.uint8)).reshape(x * out, groups * BLOCK)
    qs = pack_nibbles(codes).reshape(x, out, -1)
    return QuantizedWeight(qs, np.ascontiguousarray(scales, np.uint8), None, "MXFP4",
                           (x, groups * BLOCK, out), BLOCK)


def nbytes(shape: tuple) -> int:
    """Bytes of a kept MXFP4 weight of logical ``shape`` [..., in, out]: half a byte a value
    and a byte a 32."""
    n = int(np.prod(shape))
    return n // 2 + n // BLOCK


def convert_checkpoint(tensors: dict[str, np.ndarray], source: str,
                       keep_quantized: bool = False) -> dict[str, np.ndarray]:
    """``tensors`` with every ``W_blocks`` / ``W_scales`` pair replaced by ``W`` [X, in, out]:
    float32, the layout of the same weight unquantized, or with ``keep_quantized`` a numpy
    ``QuantizedWeight`` (``keep``).

    Raises:
      ValueError: a ``_blocks`` tensor without its ``_scales`` (or the reverse), naming it and
        ``source``.
    """
    out = {k: v for k, v in tensors.items() if not k.endswith(("_blocks", "_scales"))}
    names = {k.rsplit("_", 1)[0] for k in tensors if k.endswith(("_blocks", "_scales"))}
    for name in sorted(names):
        if f"{name}_blocks" not in tensors or f"{name}_scales" not in tensors:
            raise ValueError(f"{source}: MXFP4 weight {name!r} needs both {name}_blocks and "
                             f"{name}_scales")
        blocks, scales = tensors[f"{name}_blocks"], tensors[f"{name}_scales"]
        if keep_quantized and blocks.ndim == 4:
            out[name] = keep(blocks, scales)
            continue
        w = dequantize(blocks, scales)                                  # [X, out, in]
        out[name] = np.ascontiguousarray(np.swapaxes(w, -1, -2))
    return out
