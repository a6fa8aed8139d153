"""MXFP4 checkpoints (OCP microscaling FP4, gpt-oss's experts): de-quantized to float32 at load.

An HF checkpoint with ``quantization_config.quant_method == "mxfp4"`` stores a weight ``W``
[X, in, out] as ``W_blocks`` uint8 [X, out, in / 32, 16] and ``W_scales`` uint8
[X, out, in / 32]: 32 FP4 (e2m1) codes per block, two per byte (the low nibble first), and one
power-of-two scale per block, ``2 ** (scale - 127)`` (E8M0)::

    W[x, 32 * g + 2 * b + n, o] = FP4[nibble n of blocks[x, o, g, b]] * 2 ** (scales[x, o, g] - 127)
"""

from __future__ import annotations

import numpy as np

# e2m1 codes 0..15: sign bit 3, two exponent bits, one mantissa bit
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 ``[..., in]`` of ``blocks`` uint8 ``[..., in / 32, 16]`` and ``scales`` uint8
    ``[..., in / 32]`` (rows in the checkpoint's ``[X, out]`` order)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape} "
                         f"(want blocks = scales + (16,))")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)        # [..., G, 16, 2]
    values = FP4_VALUES[codes].reshape(*scales.shape, 32)          # [..., G, 32]
    with np.errstate(over="ignore"):   # scale 255 (6 * 2^128) is inf, as in transformers
        values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*scales.shape[:-1], -1)


def dequantize_checkpoint(tensors: dict[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
    """``tensors`` with every ``W_blocks`` / ``W_scales`` pair replaced by float32 ``W``
    [X, in, out], the layout of the same weight unquantized.

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
        w = dequantize(tensors[f"{name}_blocks"], tensors[f"{name}_scales"])   # [X, out, in]
        out[name] = np.ascontiguousarray(np.swapaxes(w, -1, -2))
    return out
