"""Quantizing float weights at load (``LLM(quantization=...)``) into ``QuantizedWeight``s,
which the CPU and GPU kernels read as they read a GGUF's blocks:

    int8   symmetric, one scale per output channel          qtype Q8_0, group K
    fp8    e4m3, one scale per output channel               qtype F8_E4M3, group K
    int4   asymmetric (scale and minimum) per group of K    qtype Q4_1, group 32 / 64 / 128...
                                                            (the last group of a row may be
                                                            partial)

The dense layers' projections are quantized (q, k, v, o; gate, up, down; DeepSeek's shared
experts) and a mixture's experts, each expert as a matrix of its own (``EXPERT``: Mixtral's,
Qwen3-MoE's and DeepSeek's per-expert tensors), as vLLM's weight-only methods and
llm-compressor's recipes do: the embedding is read a few rows a step, the head (tied to it or
not) is the most sensitive product of the model (llm-compressor's ``ignore: ["lm_head"]``),
and norms, biases, routers, MLA's latent projections and gpt-oss's stacked experts keep
``dtype``. Scales are float16 (GGUF's), each code computed against its rounded scale.
"""

from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np

from jaxkv.model.architectures import ARCHITECTURES
from jaxkv.model.quantization import DEFAULT_GROUP, METHODS
from jaxkv.model.quantized import BLOCK, QuantizedWeight, pack_nibbles

FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)     # 448
DENSE = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|"
                   r"mlp\.(shared_experts\.)?(gate|up|down)_proj)\.weight")
EXPERT = re.compile(r"model\.layers\.\d+\.\w+\.experts\.\d+\.\w+\.weight")


def experts_quantized(config) -> bool:
    """Whether ``quantize_tensors`` quantizes a ``ModelConfig``'s experts (per-expert tensors;
    not gpt-oss's stacks)."""
    moe = ARCHITECTURES[config.architecture].moe
    return bool(config.num_experts) and moe is not None and not moe.gpt_oss


def quantizable(name: str) -> bool:
    """Whether ``quantize_tensors`` quantizes the tensor of HF name ``name``."""
    return DENSE.fullmatch(name) is not None or EXPERT.fullmatch(name) is not None


def quantize(w: np.ndarray, method: str, group: int = DEFAULT_GROUP) -> QuantizedWeight:
    """float [N, K] -> a numpy ``QuantizedWeight`` of logical shape (N, K) (``METHODS``;
    ``group`` is int4's). K must be a multiple of 32."""
    w = np.asarray(w, np.float32)
    if method == "int8":
        d, codes = _scaled(w, 127.0)
        return QuantizedWeight(np.rint(np.clip(codes, -127, 127)).astype(np.int8), d, None,
                               "Q8_0", w.shape, w.shape[1])
    if method == "fp8":
        d, codes = _scaled(w, FP8_MAX)
        return QuantizedWeight(np.clip(codes, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn),
                               d, None, "F8_E4M3", w.shape, w.shape[1])
    if method == "int4":
        return _int4(w, group)
    raise ValueError(f"quantization={method!r}: one of {', '.join(METHODS)}")


def _scaled(w: np.ndarray, top: float) -> tuple[np.ndarray, np.ndarray]:
    """(f16 [N, 1] scales that map each row's largest magnitude to ``top``, f32 [N, K] codes
    before rounding: w over the rounded scale; 0 in an all-zero row)."""
    d = (np.abs(w).max(axis=1, keepdims=True) / top).astype(np.float16)
    d32 = d.astype(np.float32)
    return d, np.divide(w, d32, out=np.zeros_like(w), where=d32 > 0)


def _int4(w: np.ndarray, group: int) -> QuantizedWeight:
    """Q4_1's formula in groups of ``group``: ``q = round((w - min) / d)`` in 0..15,
    ``d = (max - min) / 15``; packed as GGUF packs each 32 values (``quantized``). A partial
    last group is padded with its last value (which changes neither its min nor its max)."""
    n, k = w.shape
    groups = -(-k // group)
    g = np.pad(w, ((0, 0), (0, groups * group - k)), mode="edge").reshape(n, groups, group)
    lo, hi = g.min(axis=-1), g.max(axis=-1)                         # [N, G]
    d, m = ((hi - lo) / 15).astype(np.float16), lo.astype(np.float16)
    d32, m32 = d.astype(np.float32)[..., None], m.astype(np.float32)[..., None]
    q = np.divide(g - m32, d32, out=np.zeros_like(g), where=d32 > 0)
    q = np.clip(np.rint(q), 0, 15).reshape(n, -1)[:, :k]
    return QuantizedWeight(pack_nibbles(q), d, m, "Q4_1", w.shape, group)


def quantize_tensors(tensors: dict, method: str, group: int, source: str) -> dict:
    """``tensors`` (HF names -> float [out, in] arrays) with the dense projections and the
    experts (``quantizable``) quantized by ``quantize``.

    Raises:
      ValueError: naming ``quantization`` and the tensor, where its K is not a multiple of 32
        (the kernels' blocks).
    """
    out = dict(tensors)
    for name, w in tensors.items():
        if not quantizable(name) or isinstance(w, QuantizedWeight):
            continue
        if w.ndim != 2 or w.shape[1] % BLOCK:
            raise ValueError(f"{source}: quantization={method!r}: tensor {name!r} "
                             f"{list(w.shape)} has K={w.shape[-1]}, not a multiple of {BLOCK}")
        out[name] = quantize(w, method, group)
    return out


def nbytes(method: str, n: int, k: int, group: int) -> int:
    """Bytes of a [n, k] weight as ``quantize(w, method, group)`` stores it."""
    if method == "int4":
        return n * k // 2 + 2 * 2 * n * -(-k // group)      # codes, f16 scales and minima
    return n * k + 2 * n                                    # codes, f16 scales


def stored_bytes(shapes: dict, method: str, group: int, dtype_bytes: int) -> int:
    """Bytes of the tensors of ``shapes`` (HF name -> shape, ``weights.expected_shapes``)
    after ``quantize_tensors``, the others in a dtype of ``dtype_bytes``."""
    return sum(nbytes(method, *shape, group) if quantizable(name) else
               math.prod(shape) * dtype_bytes for name, shape in shapes.items())


def what(config) -> str:
    """The tensors ``quantize_tensors`` quantizes in a ``ModelConfig``'s model, in words."""
    return "dense projections" + (" and experts" if experts_quantized(config) else "")


def describe(method: str, group: int, config) -> str:
    """What ``method`` stores of a ``ModelConfig``'s model, in words (the planner's weights
    format)."""
    how = f"groups of {group}" if method == "int4" else "per channel"
    return f"{method} ({how}) {what(config)}"
