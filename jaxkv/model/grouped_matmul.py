"""The grouped matmul of a mixture of experts: ``rows`` sorted by group (expert), group g's
run of rows times ``w[g]``, touching only the groups that have rows.

Both paths walk the same schedule of row tiles (``tile_schedule``): group g's rows in
``cdiv(size_g, R)`` tiles of R rows. On CPU a loop over the used tiles; on GPU a Pallas
(Triton) kernel with one program per (row tile, column tile) that reads its group's weight
columns once. ``jax.lax.ragged_dot`` is neither: XLA (CPU, and GPU at jax 0.10.2) expands it
into a product of the rows with every group's weight, masked (X times the work, and every
expert's weights read at each step).

Quantized experts (a stacked ``QuantizedWeight``, ``LLM(quantization=...)``) take the loop on
every platform, each tile's product the fused-dequant kernel of ``linear`` (the C++ one on CPU,
the Pallas w8a16 / w4a16 one on GPU): only the used experts' codes are read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxkv.model.linear import linear
from jaxkv.model.quantized import QuantizedWeight


def grouped_matmul(rows: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                   impl: str | None = None, interpret: bool = False) -> jax.Array:
    """rows [A, K] whose first ``group_sizes[0]`` rows go to ``w[0]`` [K, N], the next
    ``group_sizes[1]`` to ``w[1]``, ... -> [A, N] in their result dtype (rows past
    ``sum(group_sizes)``: zeros).

    Args:
      impl: ``"tiles"`` (the loop, CPU), ``"pallas"`` (the kernel, GPU); default by the
        platform the program is lowered for (``lax.platform_dependent``: a deviceless GPU
        compile gets the kernel), the kernel only where K and N are multiples of 16
        (Triton's dot), else ``ragged_dot``.
      interpret: run the Pallas kernel in interpret mode (CPU tests).
    """
    if isinstance(w, QuantizedWeight):
        return _tiles(rows, w, group_sizes)
    if impl is None:
        K, N = w.shape[1:]
        gpu = (functools.partial(_pallas, interpret=False) if K % 16 == 0 == N % 16
               else lax.ragged_dot)
        return lax.platform_dependent(rows, w, group_sizes, cpu=_tiles, default=gpu)
    if impl == "tiles":
        return _tiles(rows, w, group_sizes)
    if impl == "pallas":
        return _pallas(rows, w, group_sizes, interpret=interpret)
    raise ValueError(f"impl={impl!r}: choose 'tiles' or 'pallas'")


def rows_per_tile(num_rows: int, num_groups: int) -> int:
    """R: the rows a group gets on average, a power of two in [16, 128] (Triton's dot needs
    at least 16; a decode step's few rows a group waste the rest of their tile)."""
    return min(128, max(16, 1 << max(0, (num_rows // num_groups - 1).bit_length())))


def tile_schedule(group_sizes: jax.Array, num_tiles: int, R: int) -> tuple[jax.Array, jax.Array]:
    """(int32 [num_tiles, 3] rows (group, first row, valid rows) of the row tiles, the number
    of used tiles): group g's rows in ``cdiv(size_g, R)`` consecutive tiles, the tiles past
    the used ones empty (valid rows 0)."""
    X = group_sizes.shape[0]
    tiles = (group_sizes + R - 1) // R                                     # [X]
    tile_end = jnp.cumsum(tiles)                                           # [X]
    starts = jnp.cumsum(group_sizes) - group_sizes                         # [X]
    i = jnp.arange(num_tiles, dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(tile_end, i, side="right"), X - 1)   # [num_tiles]
    j = i - (tile_end[g] - tiles[g])                                       # tile within group
    used = i < tile_end[-1]
    first = jnp.where(used, starts[g] + j * R, 0)
    valid = jnp.where(used, jnp.minimum(R, group_sizes[g] - j * R), 0)
    return jnp.stack([g, first, valid], axis=1).astype(jnp.int32), tile_end[-1]


def _tiles(rows, w, group_sizes):
    """The CPU path: a loop over the used row tiles, one [R, K] x [K, N] product each."""
    A, X = rows.shape[0], w.shape[0]
    R = rows_per_tile(A, X)
    sched, used = tile_schedule(group_sizes, -(-A // R) + X, R)
    padded = jnp.pad(rows, ((0, R), (0, 0)))                               # [A + R, K]

    def tile(i, out):
        g, r0, n = sched[i, 0], sched[i, 1], sched[i, 2]
        wg = w.expert(g) if isinstance(w, QuantizedWeight) else w[g]       # [K, N]
        y = linear(lax.dynamic_slice_in_dim(padded, r0, R), wg)           # [R, N]
        old = lax.dynamic_slice_in_dim(out, r0, R)
        keep = (jnp.arange(R) < n)[:, None]
        return lax.dynamic_update_slice_in_dim(out, jnp.where(keep, y.astype(out.dtype), old),
                                               r0, 0)

    dtype = jnp.result_type(rows.dtype, w.dtype)
    return lax.fori_loop(0, used, tile, jnp.zeros((A + R, w.shape[2]), dtype))[:A]


def _block(n: int, sizes: tuple[int, ...]) -> int | None:
    return next((b for b in sizes if n % b == 0), None)


def _pallas(rows, w, group_sizes, *, interpret: bool):
    """The GPU path: grid (row tiles, column tiles); a program multiplies its R rows by its
    group's [K, bn] weight columns, bk at a time, and stores its valid rows."""
    A, K = rows.shape
    X, _, N = w.shape
    bk, bn = _block(K, (64, 32, 16)), _block(N, (128, 64, 32, 16))
    if bk is None or bn is None:       # Triton's dot needs 16-multiples: widths of real models
        raise ValueError(f"grouped_matmul(impl='pallas') needs K={K} and N={N} multiples of 16")
    R = rows_per_tile(A, X)
    num_tiles = -(-A // R) + X
    sched, _ = tile_schedule(group_sizes, num_tiles, R)
    dtype = jnp.result_type(rows.dtype, w.dtype)
    out = pl.pallas_call(
        functools.partial(_kernel, R=R, bk=bk, bn=bn),
        grid=(num_tiles, N // bn),
        in_specs=[_whole(s) for s in (sched.shape, (A + R, K), w.shape)],
        out_specs=_whole((A + R, N)),
        out_shape=jax.ShapeDtypeStruct((A + R, N), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="jaxkv_grouped_matmul",
    )(sched, jnp.pad(rows, ((0, R), (0, 0))), w)
    return jnp.where((jnp.arange(A) < jnp.sum(group_sizes))[:, None], out[:A], 0)


def _whole(shape) -> pl.BlockSpec:
    """The whole array as one block (with the Triton lowering, a base pointer)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _kernel(sched_ref, x_ref, w_ref, o_ref, *, R: int, bk: int, bn: int):
    i, j = pl.program_id(0), pl.program_id(1)
    g, r0, n = sched_ref[i, 0], sched_ref[i, 1], sched_ref[i, 2]

    @pl.when(n > 0)
    def _():
        def step(k, acc):                                                   # acc f32 [R, bn]
            x = x_ref[pl.ds(r0, R), pl.ds(k * bk, bk)]                      # [R, bk]
            wk = w_ref[g, pl.ds(k * bk, bk), pl.ds(j * bn, bn)]             # [bk, bn]
            return acc + jnp.dot(x, wk, preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, x_ref.shape[1] // bk, step, jnp.zeros((R, bn), jnp.float32))
        keep = jnp.broadcast_to((jnp.arange(R) < n)[:, None], (R, bn))
        plgpu.store(o_ref.at[pl.ds(r0, R), pl.ds(j * bn, bn)], acc.astype(o_ref.dtype),
                    mask=keep)
