"""Sparse paged decode attention on GPU: only the selected pages are read, Pallas (Triton).

Design notes: docs/attention.md."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxkv.attention.pallas.decode import (DecodeConfig, default_num_splits, merge_splits,
                                           split_k_outputs)
from jaxkv.attention.pallas.kv_format import KvLayout, kv_operands
from jaxkv.attention.pallas.kv_walk import (attend_tiles, finalize, init_carry, run_tiles,
                                            split_steps)
from jaxkv.attention.pallas.ragged import (check_kv_inputs, check_options, check_page_ids,
                                           check_seq_lens, is_concrete, next_pow2, whole_block)
from jaxkv.attention.quest import check_selection


# The sparse kernel walks its selected pages in kv tiles tuned by the same fields as the dense
# decode kernel's (block_kv, num_warps, num_stages).
SparseConfig = DecodeConfig


def _sparse_kernel(
    # inputs
    q_ref,       # [G_pad, D] the kv-head group of one sequence's token
    tables_ref,  # int32 [S, max_blocks]
    lens_ref,    # int32 [S]
    pages_ref,   # int32 [S, Hkv, K] selected logical pages
    count_ref,   # int32 [S, Hkv] valid entries of pages
    *refs,       # inputs: the kv operands of kv_format.kv_operands; outputs: o f32 [G_pad, D]
                 #   normalized partial output of this split, lse f32 [G_pad] (-inf if it saw
                 #   nothing)
    num_splits: int, block_kv: int, sm_scale: float, soft_cap: float | None,
    layout: KvLayout):
    *kv_refs, o_ref, lse_ref = refs
    seq, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_size, K = kv_refs[0].shape[1], pages_ref.shape[2]
    rows = q_ref.shape[0]
    kv_len = lens_ref[seq]
    count = count_ref[seq, head]
    num_tiles = lax.div(count * block_size + block_kv - 1, block_kv)
    v_start, v_stop = split_steps(num_tiles, split, num_splits)
    tile_at = run_tiles(lambda e: pages_ref[seq, head, jnp.minimum(e, K - 1)], count,
                        block_kv=block_kv, block_size=block_size, max_blocks=tables_ref.shape[1])
    q = tuple(q_ref[:, pl.ds(c[0], c[1])] for c in layout.chunks)               # [rows, w] each
    q_pos = jnp.full((rows,), kv_len - 1, jnp.int32)                            # [rows]
    carry = attend_tiles(q, q_pos, seq, kv_len, head, kv_refs, tables_ref,
                         init_carry(rows, layout), v_start, v_stop, tile_at, 0,
                         sm_scale=sm_scale, sliding_window=None, num_sinks=0,
                         soft_cap=soft_cap, layout=layout)
    out, lse = finalize(carry)
    for (ch0, width, _, _), o in zip(layout.chunks, out):
        o_ref[:, pl.ds(ch0, width)] = o
    lse_ref[...] = lse


@functools.partial(jax.jit, static_argnames=(
    "num_splits", "sm_scale", "soft_cap", "interpret", "config", "layout"))
def _sparse_call(q, kv_ops, block_tables, seq_lens, pages, count, *, num_splits, sm_scale,
                 soft_cap, interpret, config, layout):
    S, Hq, D = q.shape
    Hkv = kv_ops[0].shape[2]
    G = Hq // Hkv
    G_pad = max(16, next_pow2(G))
    q4 = jnp.pad(q.reshape(S, Hkv, G, D), ((0, 0), (0, 0), (0, G_pad - G), (0, 0)))

    kernel = functools.partial(_sparse_kernel, num_splits=num_splits, block_kv=config.block_kv,
                               sm_scale=sm_scale, soft_cap=soft_cap, layout=layout)
    outs, lses = pl.pallas_call(
        kernel,
        grid=(S, Hkv, num_splits),
        in_specs=[pl.BlockSpec((None, None, G_pad, D), lambda s, h, j: (s, h, 0, 0))]
        + [whole_block(a.shape) for a in (block_tables, seq_lens, pages, count, *kv_ops)],
        **split_k_outputs(num_splits, S, Hkv, G_pad, D),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret,
        name="jaxkv_sparse_paged_decode_attention",
    )(q4, block_tables, seq_lens, pages, count, *kv_ops)

    return merge_splits(outs, lses, G, q)


def _check_selection(pages, count, num_seqs: int, num_kv_heads: int, max_blocks: int) -> None:
    """Shapes and dtypes of the selection, and (when concrete) its ranges."""
    check_selection(pages, count, num_seqs, num_kv_heads)
    if not is_concrete(pages, count):
        return
    pages_np, count_np = np.asarray(pages), np.asarray(count)
    if count_np.size and (count_np.min() < 0 or count_np.max() > pages.shape[2]):
        raise ValueError(f"count must lie in [0, K = {pages.shape[2]}], got values in "
                         f"[{count_np.min()}, {count_np.max()}]")
    used = np.arange(pages.shape[2]) < count_np[..., None]
    bad = used & ((pages_np < 0) | (pages_np >= max_blocks))
    if bad.any():
        s, h, e = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"pages[{s}, {h}, {e}] = {int(pages_np[s, h, e])} is not a logical page "
                         f"in [0, max_blocks = {max_blocks})")


def sparse_paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                  block_tables: jax.Array, seq_lens: jax.Array,
                                  pages: jax.Array, count: jax.Array, *,
                                  num_splits: int | None = None, sm_scale: float | None = None,
                                  soft_cap: float | None = None, return_lse: bool = False,
                                  interpret: bool = False, config: SparseConfig | None = None):
    """One decode token per sequence over the selected pages only (Quest sparse attention).

    Equals ``jaxkv.attention.quest.sparse_decode_reference``: kv head h of sequence s attends to
    the positions ``< seq_lens[s]`` of logical pages ``pages[s, h, :count[s, h]]``.

    Args:
      q: [S, num_heads, head_dim] float32/bfloat16/float16, one query token per sequence.
      k_pages, v_pages: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype; one layer's
        page pool (block 0 is the null block), or ``jaxkv.kvcache.pools.QuantizedPages`` (fp8/int8
        codes, packed KIVI int4/int2 with the full-precision residual; dequantized in-kernel).
        head_dim must be a power of two >= 16.
      block_tables: int32 [S, max_blocks] page ids in ``[0, num_blocks)`` (padding entries 0).
      seq_lens: int32 [S] kv length of each sequence including this step's token (0: padding).
      pages: int32 [S, num_kv_heads, K] logical pages in ``[0, max_blocks)`` of each kv head
        (``jaxkv.attention.quest.quest_select``); entries from ``count`` on are never read.
      count: int32 [S, num_kv_heads] valid entries of ``pages``, in ``[0, K]``.
      num_splits: programs per (sequence, kv head) along the selected run (split-K); default
        ``default_num_splits`` for a run of ``K * block_size`` positions.
      sm_scale: softmax scale, default ``1/sqrt(head_dim)``.
      soft_cap: if set, logits become ``soft_cap * tanh(logits / soft_cap)``.
      return_lse: also return the log-sum-exp of the (scaled, capped) logits.
      interpret: run in Pallas interpret mode (CPU).
      config: kv tile size and Triton launch parameters; default ``SparseConfig()``.

    Returns:
      out [S, num_heads, head_dim] in q's dtype, and with ``return_lse`` also lse float32
      [S, num_heads] (-inf where nothing was attended).

    Raises:
      ValueError: on inconsistent shapes, dtypes or options, ``num_splits < 1``, and, when the
        metadata are concrete (not traced), page ids, lengths, counts or selected pages out of
        range.
    """
    if q.ndim != 3 or q.shape[0] != block_tables.shape[0]:
        raise ValueError(f"q must be [S, num_heads, head_dim] with S = {block_tables.shape[0]} "
                         f"(block_tables rows), got shape {q.shape}")
    kv_ops, layout = kv_operands(k_pages, v_pages)
    check_kv_inputs(q.shape, q.dtype, k_pages, v_pages, block_tables, seq_lens)
    check_options(sm_scale, None, 0, soft_cap)
    config = config or SparseConfig()
    S, _, D = q.shape
    num_blocks, block_size, Hkv, _ = k_pages.shape
    _check_selection(pages, count, S, Hkv, block_tables.shape[1])
    if num_splits is None:
        num_splits = default_num_splits(S, Hkv, pages.shape[2] * block_size, config.block_kv)
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    if is_concrete(block_tables, seq_lens):
        check_page_ids(block_tables, num_blocks)
        check_seq_lens(seq_lens, block_tables.shape[1], block_size)
    out, lse = _sparse_call(
        q, kv_ops, block_tables, seq_lens, pages, count, num_splits=num_splits, layout=layout,
        sm_scale=1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale),
        soft_cap=soft_cap, interpret=interpret, config=config)
    return (out, lse) if return_lse else out
