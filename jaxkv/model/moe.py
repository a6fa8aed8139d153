"""A mixture-of-experts feed-forward layer (Mixtral, Qwen3-MoE): a softmax router picks
``top_k`` experts per token, and each expert's SwiGLU runs on exactly the rows routed to it.

The step's ``T x top_k`` assignments are sorted by expert, so every expert owns one contiguous
run of rows (``group_sizes``), and each of the three products is one grouped matmul over those
runs: ``jax.lax.ragged_dot`` on GPU; on CPU (where XLA expands ragged_dot into a dense product
with every expert) a loop over row tiles of the experts the step uses. Design notes:
docs/runtime.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.model.linear import linear


def route(logits: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """The experts of each token and their weights: softmax over every expert, the ``top_k``
    largest, renormalised to sum to 1 when ``normalize`` (Mixtral always, Qwen3-MoE by
    ``norm_topk_prob``).

    Args:
      logits: f32 [T, X] router logits.

    Returns:
      (weights f32 [T, top_k], experts int32 [T, top_k]).
    """
    weights, experts = lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def experts_mlp(x: jax.Array, weights: jax.Array, experts: jax.Array, gate: jax.Array,
                up: jax.Array, down: jax.Array) -> jax.Array:
    """``sum_j weights[t, j] * SwiGLU_{experts[t, j]}(x[t])`` for every token t.

    Args:
      x: [T, E] the normalised residual stream.
      weights, experts: [T, k] from ``route``.
      gate, up: [X, E, F] the experts' projections; down: [X, F, E].

    Returns:
      [T, E] in x's dtype.
    """
    T, k = experts.shape
    flat = experts.reshape(-1)                                            # [A = T * k]
    order = jnp.argsort(flat, stable=True)                                # by expert
    token = order // k                                                    # [A]
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)   # [X]
    rows = x[token]                                                       # [A, E]
    h = jax.nn.silu(grouped_matmul(rows, gate, sizes)) * grouped_matmul(rows, up, sizes)
    out = grouped_matmul(h, down, sizes) * weights.reshape(-1)[order][:, None]   # [A, E]
    return jnp.zeros((T, x.shape[1]), out.dtype).at[token].add(out).astype(x.dtype)


def grouped_matmul(rows: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """rows [A, K] whose first ``group_sizes[0]`` rows go to ``w[0]`` [K, N], the next
    ``group_sizes[1]`` to ``w[1]``, ... -> [A, N] (rows past ``sum(group_sizes)``: zeros)."""
    if jax.default_backend() == "cpu":
        return _tiled_grouped_matmul(rows, w, group_sizes)
    return lax.ragged_dot(rows, w, group_sizes)


def _tiled_grouped_matmul(rows, w, group_sizes):
    """``grouped_matmul`` as a loop over row tiles: group g's rows in ``cdiv(size_g, R)`` tiles
    of R rows, each one product with ``w[g]``; groups of no rows cost nothing."""
    A, X = rows.shape[0], w.shape[0]
    R = min(128, max(8, 1 << max(0, (A // X - 1).bit_length())))         # rows a tile
    tiles = (group_sizes + R - 1) // R                                    # [X]
    tile_end = jnp.cumsum(tiles)                                          # [X]
    starts = jnp.cumsum(group_sizes) - group_sizes                        # [X]
    padded = jnp.pad(rows, ((0, R), (0, 0)))                              # [A + R, K]

    def tile(i, out):
        g = jnp.minimum(jnp.searchsorted(tile_end, i, side="right"), X - 1)
        j = i - (tile_end[g] - tiles[g])                                  # tile within group
        r0 = starts[g] + j * R
        y = linear(lax.dynamic_slice_in_dim(padded, r0, R), w[g])        # [R, N]
        keep = (jnp.arange(R) < group_sizes[g] - j * R)[:, None]
        old = lax.dynamic_slice_in_dim(out, r0, R)
        return lax.dynamic_update_slice_in_dim(out, jnp.where(keep, y.astype(out.dtype), old),
                                               r0, 0)

    dtype = jnp.result_type(rows.dtype, w.dtype)
    out = lax.fori_loop(0, tile_end[-1], tile, jnp.zeros((A + R, w.shape[2]), dtype))
    return out[:A]
