"""A mixture-of-experts feed-forward layer (Mixtral, Qwen3-MoE, gpt-oss): a router picks
``top_k`` experts per token, and each expert's SwiGLU runs on exactly the rows routed to it.

The step's ``T x top_k`` assignments are sorted by expert, so every expert owns one contiguous
run of rows (``group_sizes``), and each of the three products is one grouped matmul over those
runs (jaxkv/model/grouped_matmul.py). Design notes: docs/runtime.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.model.grouped_matmul import grouped_matmul


def route(logits: jax.Array, top_k: int, normalize: bool,
          topk_first: bool = False) -> tuple[jax.Array, jax.Array]:
    """The experts of each token and their weights: softmax over every expert, the ``top_k``
    largest, renormalised to sum to 1 when ``normalize`` (Mixtral always, Qwen3-MoE by
    ``norm_topk_prob``); with ``topk_first`` the ``top_k`` largest logits, softmaxed among
    themselves (gpt-oss).

    Args:
      logits: f32 [T, X] router logits.

    Returns:
      (weights f32 [T, top_k], experts int32 [T, top_k]).
    """
    if topk_first:
        top, experts = lax.top_k(logits, top_k)
        return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32)
    weights, experts = lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """Mixtral's and Qwen3-MoE's expert activation: ``silu(gate) * up``."""
    return jax.nn.silu(gate) * up


def clamped_swiglu(gate: jax.Array, up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """gpt-oss's: ``(up + 1) * gate * sigmoid(alpha * gate)``, gate clamped above at
    ``limit`` and up to ``[-limit, limit]``."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(gate * alpha)


def experts_mlp(x: jax.Array, weights: jax.Array, experts: jax.Array, gate: jax.Array,
                up: jax.Array, down: jax.Array, *, biases=None, act=swiglu) -> jax.Array:
    """``sum_j weights[t, j] * MLP_{experts[t, j]}(x[t])`` for every token t.

    Args:
      x: [T, E] the normalised residual stream.
      weights, experts: [T, k] from ``route``.
      gate, up: [X, E, F] the experts' projections; down: [X, F, E].
      biases: None, or the experts' (gate [X, F], up [X, F], down [X, E]) biases (gpt-oss).
      act: ``act(gate, up)`` -> [., F]: ``swiglu`` or a ``clamped_swiglu`` partial.

    Returns:
      [T, E] in x's dtype.
    """
    T, k = experts.shape
    flat = experts.reshape(-1)                                            # [A = T * k]
    order = jnp.argsort(flat, stable=True)                                # by expert
    token = order // k                                                    # [A]
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)   # [X]
    rows = x[token]                                                       # [A, E]
    g, u = grouped_matmul(rows, gate, sizes), grouped_matmul(rows, up, sizes)   # [A, F] x 2
    if biases is not None:
        expert = flat[order]                                              # [A] sorted
        g, u = g + biases[0][expert], u + biases[1][expert]
    out = grouped_matmul(act(g, u), down, sizes)                          # [A, E]
    if biases is not None:
        out = out + biases[2][expert]
    out = out * weights.reshape(-1)[order][:, None]
    return jnp.zeros((T, x.shape[1]), out.dtype).at[token].add(out).astype(x.dtype)

