"""The model's dense products, ``x @ w``: on CPU, a step of a few rows takes the C++ kernel.

XLA's CPU GEMM runs a few-row product far below its large-batch speed;
``jaxkv.cpu_kernels.matmul`` reads each weight row by row into the partial sums of all the
step's rows, faster there (BENCHMARKS.md, "Grouped CPU attention and the C++ kernels").
``linears`` gives several weights of one x to one kernel call. It is taken where

* JAX's default backend is the CPU and the kernels are built (``cpu_kernels.native()``),
* the step has ``MIN_ROWS`` to ``SMALL_ROWS`` rows (decided at trace time: the row count is
  static),
* x and w are float32, and
* one device computes the step (a sharded weight stays with XLA's partitioned dot).

Elsewhere (GPU, bf16 weights, larger steps, tensor parallelism) it is ``x @ w``.

A quantized weight (``jaxkv.model.quantized.QuantizedWeight``) takes a fused-dequant kernel for
up to ``QUANT_KERNEL_ROWS`` rows on one device: on CPU the C++ one (``cpu_kernels.quant_matmuls``,
where the kernels are native and x is float32), on GPU the Pallas one
(``quantized_matmul.quantized_matmul``, where N is a multiple of 64). Elsewhere, and for a
larger prefill step, it is dequantized and multiplied (``x @ dequantize(w).T``: XLA's GEMM,
1.8x faster than the CPU kernel at 512 rows and more, the dequantization a small part of it;
equal at 128 rows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv import cpu_kernels
from jaxkv.model.quantized import QuantizedWeight, dequantize
from jaxkv.model.quantized_matmul import quantized_matmul

MIN_ROWS, SMALL_ROWS = 2, 32
QUANT_KERNEL_ROWS = 128


def _native(x: jax.Array, w: jax.Array) -> bool:
    return (x.ndim == 2 and MIN_ROWS <= x.shape[0] <= SMALL_ROWS and x.dtype == jnp.float32
            and w.dtype == jnp.float32 and jax.device_count() == 1 and cpu_kernels.native())


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [T, K] contracted with w's first axis: w [K, N] -> [T, N], w [K, H, D] -> [T, H, D]
    (a projection to heads; the kernel reads w as [K, H * D], a bitcast)."""
    return linears(x, (w,))[0]


def linears(x: jax.Array, ws) -> tuple[jax.Array, ...]:
    """``linear(x, w)`` for each weight of ``ws`` (a layer's q/k/v, the MLP's gate and up); on
    the kernel's path one call computes them all (``cpu_kernels.matmuls``), which saves a
    k or v projection most of its time (a call of its own costs ~40 us, its weight ~30 us)."""
    ws = tuple(ws)
    if any(isinstance(w, QuantizedWeight) for w in ws):
        return _mixed(x, ws)
    if all(_native(x, w) for w in ws):
        out = cpu_kernels.matmuls(x, [w.reshape(w.shape[0], -1) for w in ws])
        return tuple(o.reshape(x.shape[0], *w.shape[1:]) for o, w in zip(out, ws))
    return tuple(jnp.tensordot(x, w, axes=1) for w in ws)


def linear_t(x: jax.Array, w_t: jax.Array) -> jax.Array:
    """``x @ w_t.T`` without materializing the transpose on the kernel's path: x [T, K],
    w_t [N, K] (e.g. the embedding [V, E] as a tied head) -> [T, N]."""
    if isinstance(w_t, QuantizedWeight):
        return _quantized(x, (w_t,))[0]
    if _native(x, w_t):
        return cpu_kernels.matmul(x, w_t, transposed_w=True)
    return x @ w_t.T


def on_gpu() -> bool:
    """Whether a step traced now runs on a GPU (JAX's default backend; decided at trace time)."""
    return jax.default_backend() == "gpu"


def _mixed(x: jax.Array, ws: tuple) -> tuple[jax.Array, ...]:
    """``linears`` of quantized weights (read as ``[K..., N...]``) and float ones, in order."""
    quant = [i for i, w in enumerate(ws) if isinstance(w, QuantizedWeight)]
    out = dict(zip(quant, _quantized(x, [ws[i] for i in quant])))
    floats = [i for i in range(len(ws)) if i not in out]
    if floats:
        out |= dict(zip(floats, linears(x, [ws[i] for i in floats])))
    return tuple(out[i].reshape(x.shape[0], *ws[i].out_shape()) if i in quant else out[i]
                 for i in range(len(ws)))


def _quantized(x: jax.Array, ws) -> list[jax.Array]:
    """``x [T, K] @ dequantize(w).T`` -> [T, N] for each quantized weight: up to
    ``QUANT_KERNEL_ROWS`` rows on one device, one C++ kernel call per qtype and group (CPU) or a
    Pallas call per weight (GPU); else dequantize-then-dot in x's dtype."""
    small = x.ndim == 2 and x.shape[0] <= QUANT_KERNEL_ROWS and jax.device_count() == 1
    if small and on_gpu():
        return [quantized_matmul(x, w) if w.rows % 64 == 0 else x @ dequantize(w, x.dtype).T
                for w in ws]
    if not (small and x.dtype == jnp.float32 and cpu_kernels.native()):
        return [x @ dequantize(w, x.dtype).T for w in ws]
    out = {}
    for kind in dict.fromkeys((w.qtype, w.group) for w in ws):
        same = [i for i, w in enumerate(ws) if (w.qtype, w.group) == kind]
        out |= dict(zip(same, cpu_kernels.quant_matmuls(x, [ws[i] for i in same])))
    return [out[i] for i in range(len(ws))]
