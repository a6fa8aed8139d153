"""Ragged paged attention on GPU: one Pallas (Triton) launch for prefill chunks and decodes.

Design notes: docs/attention.md."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxkv.attention.kv_chunks import kept_blocks
from jaxkv.attention.pallas.kv_format import (QUANTIZED_CODE_DTYPES, KvLayout, check_head_dim,
                                              kv_operands, pool_dtype)
from jaxkv.attention.pallas.kv_walk import attend_tiles, finalize, init_carry, kv_walk
from jaxkv.attention.reference import check_sink_queries

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def check_tuning(config, pow2_fields: tuple[str, ...]) -> None:
    """Validates a kernel tuning dataclass: power-of-two tile sizes, ``block_kv >= 16``, stages."""
    for name in pow2_fields:
        if not is_pow2(getattr(config, name)):
            raise ValueError(f"{name}={getattr(config, name)} must be a power of two")
    if config.block_kv < 16:
        raise ValueError(f"block_kv={config.block_kv} must be >= 16 (Triton dot minimum)")
    if config.num_stages < 1:
        raise ValueError(f"num_stages={config.num_stages} must be >= 1")


@dataclasses.dataclass(frozen=True)
class RaggedConfig:
    """Tuning of the ragged kernel (static; one compilation per distinct value).

    Attributes:
      block_q: query tokens per q tile; a tile has ``block_q * G_pad`` rows (G_pad = the GQA group
        padded to a power of two), which must be a power of two >= 16 (Triton's dot minimum).
      block_kv: kv positions per kv tile (power of two >= 16).
      num_warps: Triton warps per program.
      num_stages: Triton software-pipelining stages of the kv loop.
    """

    block_q: int
    block_kv: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        check_tuning(self, ("block_q", "block_kv", "num_warps"))


def default_ragged_config(num_tokens: int, num_seqs: int, group: int,
                          head_dim: int) -> RaggedConfig:
    """Block sizes by shape: 16-row tiles for decode-heavy steps, 64-row tiles for prefill.

    Args:
      num_tokens: T, the padded token count of the step.
      num_seqs: S, the padded sequence count.
      group: G = num_heads // num_kv_heads.
      head_dim: D.
    """
    g_pad = next_pow2(group)
    rows = 16 if num_tokens <= 2 * num_seqs else 64
    block_q = max(1, rows // g_pad)
    block_kv = 64 if head_dim >= 128 or rows >= 64 else 128
    return RaggedConfig(block_q=block_q, block_kv=block_kv, num_warps=4,
                        num_stages=2 if head_dim >= 128 else 3)


# --------------------------------------------------------------------------------------------
# input checks (shared with decode.py)
# --------------------------------------------------------------------------------------------


def is_concrete(*arrays) -> bool:
    return not any(isinstance(a, jax.core.Tracer) for a in arrays)


def check_page_ids(block_tables, num_blocks: int) -> None:
    """Raises ValueError if a concrete block table holds a page id outside ``[0, num_blocks)``.

    The kernels clamp page ids into range (a GPU would otherwise fault on a wild id, and interpret
    mode clamps silently anyway), so a bad table would read the wrong page without this check.

    Args:
      block_tables: int32 [S, max_blocks], concrete (not a tracer).
      num_blocks: number of pages in the pool (block 0, the null block, included).
    """
    tables = np.asarray(block_tables)
    bad = (tables < 0) | (tables >= num_blocks)
    if bad.any():
        s, b = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"block_tables[{s}, {b}] = {int(tables[s, b])} is not a page id in "
                         f"[0, {num_blocks}) ({int(bad.sum())} bad entries)")


def check_kv_inputs(q_shape, q_dtype, k_pages, v_pages, block_tables, seq_lens) -> None:
    """Static checks of the pools and the per-sequence metadata shared by both kernels."""
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages/v_pages must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {k_pages.shape} and {v_pages.shape}")
    k_dtype, v_dtype = pool_dtype(k_pages), pool_dtype(v_pages)
    if k_dtype != v_dtype or (k_dtype != q_dtype and k_dtype not in QUANTIZED_CODE_DTYPES):
        raise ValueError(f"q, k_pages, v_pages must share one dtype (or the pools hold quantized "
                         f"codes), got {q_dtype}, {k_dtype}, {v_dtype}")
    if q_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {q_dtype} is not supported; use float32, bfloat16 or float16")
    num_heads, head_dim = q_shape[-2:]
    if head_dim != k_pages.shape[3]:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, k_pages has {k_pages.shape[3]}")
    check_head_dim(head_dim)
    if num_heads % k_pages.shape[2]:
        raise ValueError(f"num_heads={num_heads} is not a multiple of "
                         f"num_kv_heads={k_pages.shape[2]}")
    if block_tables.ndim != 2 or seq_lens.shape != (block_tables.shape[0],):
        raise ValueError(f"block_tables [S, max_blocks] and seq_lens [S] disagree: "
                         f"{block_tables.shape} vs {seq_lens.shape}")
    for name, a in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if a.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {a.dtype}")


def check_options(sm_scale, sliding_window, num_sinks, soft_cap) -> None:
    """Range checks of the attention options shared by both kernels."""
    if sm_scale is not None and not sm_scale > 0:
        raise ValueError(f"sm_scale={sm_scale} must be > 0")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window} must be >= 1")
    if num_sinks < 0:
        raise ValueError(f"num_sinks={num_sinks} must be >= 0")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap={soft_cap} must be > 0")


def check_seq_lens(seq_lens, max_blocks: int, block_size: int) -> None:
    """Raises ValueError unless every concrete kv length fits its block table."""
    lens = np.asarray(seq_lens)
    if lens.size and (lens.min() < 0 or lens.max() > max_blocks * block_size):
        raise ValueError(f"seq_lens must lie in [0, max_blocks * block_size = "
                         f"{max_blocks * block_size}], got {lens.tolist()}")


def _check_query_start_loc(query_start_loc, seq_lens, num_tokens: int) -> None:
    qsl, lens = np.asarray(query_start_loc), np.asarray(seq_lens)
    q_lens = np.diff(qsl)
    if qsl[0] != 0 or (q_lens < 0).any() or qsl[-1] > num_tokens:
        raise ValueError(f"query_start_loc must rise from 0 to at most T={num_tokens}, "
                         f"got {qsl.tolist()}")
    if (q_lens > lens).any():
        s = int(np.argmax(q_lens > lens))
        raise ValueError(f"sequence {s} has q_len {int(q_lens[s])} > seq_len {int(lens[s])}")


# --------------------------------------------------------------------------------------------
# kernel
# --------------------------------------------------------------------------------------------


def _ragged_kernel(
    # inputs
    tiles_ref,   # int32 [num_tiles, 4]: seq, first token, valid tokens, kv position of first token
    q_ref,       # [Hkv, T_pad * G_pad, D]
    tables_ref,  # int32 [S, max_blocks]
    lens_ref,    # int32 [S]
    *refs,       # inputs: [without a window: kept_blocks' order int32 [S, max_blocks] and
                 #   kept_before int32 [S, max_blocks + 1]], [the sink queries, like q_ref, if
                 #   rescore] and the kv operands of kv_format.kv_operands;
                 #   outputs: o [Hkv, T_pad * G_pad, D], lse f32 [Hkv, T_pad * G_pad]
    block_q: int, group_pad: int, block_kv: int, sm_scale: float,
    sliding_window: int | None, num_sinks: int, soft_cap: float | None,
    layout: KvLayout, rescore: bool):
    kept_refs, refs = (refs[:2], refs[2:]) if sliding_window is None else ((), refs)
    qs_ref, refs = (refs[0], refs[1:]) if rescore else (None, refs)
    *kv_refs, o_ref, lse_ref = refs
    tile, head = pl.program_id(0), pl.program_id(1)
    seq, tok0 = tiles_ref[tile, 0], tiles_ref[tile, 1]
    n_valid, q_first = tiles_ref[tile, 2], tiles_ref[tile, 3]
    rows = block_q * group_pad
    row_ids = pl.ds(tok0 * group_pad, rows)

    q = tuple(q_ref[head, row_ids, pl.ds(c[0], c[1])] for c in layout.chunks)  # [rows, w] each
    qs = None if qs_ref is None else tuple(qs_ref[head, row_ids, pl.ds(c[0], c[1])]
                                           for c in layout.chunks)
    row_tok = lax.div(jnp.arange(rows, dtype=jnp.int32), group_pad)              # [rows]
    q_pos = q_first + row_tok                                                    # [rows]
    tile_at, sink_tiles, count = kv_walk(
        seq, q_first, q_first + n_valid, kept_refs, block_kv=block_kv,
        block_size=kv_refs[0].shape[1], max_blocks=tables_ref.shape[1],
        sliding_window=sliding_window, num_sinks=num_sinks)
    carry = attend_tiles(q, q_pos, seq, lens_ref[seq], head, kv_refs, tables_ref,
                         init_carry(rows, layout), 0, count, tile_at, sink_tiles,
                         sm_scale=sm_scale, sliding_window=sliding_window, num_sinks=num_sinks,
                         soft_cap=soft_cap, layout=layout, q_sinks=qs)
    out, lse = finalize(carry)

    # rows past the tile's tokens belong to the next sequence's tiles: never write them
    row_ok = row_tok < n_valid                                                   # [rows]
    for (ch0, width, _, _), o in zip(layout.chunks, out):
        plgpu.store(o_ref.at[head, row_ids, pl.ds(ch0, width)], o.astype(o_ref.dtype),
                    mask=jnp.broadcast_to(row_ok[:, None], (rows, width)))
    plgpu.store(lse_ref.at[head, row_ids], lse, mask=row_ok)


# --------------------------------------------------------------------------------------------
# wrapper
# --------------------------------------------------------------------------------------------


def whole_block(shape) -> pl.BlockSpec:
    """The whole array as one block: with the Triton lowering a block is just a base pointer,
    so pools, tables and the ragged q/o buffers are indexed in-kernel (no copies)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def kept_operands(block_tables, sliding_window: int | None) -> tuple:
    """The kept walk's kernel inputs: ``()`` with a sliding window, else ``kept_blocks``'
    (order int32 [S, max_blocks], kept_before int32 [S, max_blocks + 1])."""
    order, kept_before = kept_blocks(block_tables, sliding_window)
    return () if order is None else (order, kept_before)


def _tile_schedule(query_start_loc, seq_lens, num_tiles: int, block_q: int):
    """int32 [num_tiles, 4] rows (seq, first token, valid tokens, kv position of first token).

    Sequence s gets cdiv(q_len_s, block_q) consecutive tiles; tiles past the last one are empty
    (n_valid = 0, so the kernel visits no kv tile and stores nothing).
    """
    num_seqs = seq_lens.shape[0]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]                  # [S]
    tiles_per_seq = (q_lens + block_q - 1) // block_q                    # [S]
    tile_end = jnp.cumsum(tiles_per_seq)                                 # [S]
    i = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.searchsorted(tile_end, i, side="right").astype(jnp.int32)
    used = seq < num_seqs
    seq = jnp.minimum(seq, num_seqs - 1)
    local = i - (tile_end[seq] - tiles_per_seq[seq])                     # tile index within seq
    tok0 = query_start_loc[seq] + local * block_q
    n_valid = jnp.where(used, jnp.minimum(block_q, q_lens[seq] - local * block_q), 0)
    q_first = jnp.where(used, seq_lens[seq] - q_lens[seq] + local * block_q, 0)
    return jnp.stack([seq, jnp.where(used, tok0, 0), n_valid, q_first], axis=1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "num_sinks", "soft_cap", "interpret", "config", "layout"))
def _ragged_call(q, q_sinks, kv_ops, block_tables, seq_lens, query_start_loc, *, sm_scale,
                 sliding_window, num_sinks, soft_cap, interpret, config, layout):
    T, Hq, D = q.shape
    Hkv = kv_ops[0].shape[2]
    G = Hq // Hkv
    G_pad = next_pow2(G)
    block_q = config.block_q
    T_pad = T + block_q        # a tile starting at any token < T reads block_q tokens in bounds
    num_tiles = max(1, min(T, -(-T // block_q) + seq_lens.shape[0]))


    def rows_of(x):   # rows[h, t * G_pad + g] = x[t, h * G + g]   ->  [Hkv, T_pad * G_pad, D]
        x = jnp.pad(x.reshape(T, Hkv, G, D), ((0, T_pad - T), (0, 0), (0, G_pad - G), (0, 0)))
        return x.transpose(1, 0, 2, 3).reshape(Hkv, T_pad * G_pad, D)

    q_rows = rows_of(q)
    extra = kept_operands(block_tables, sliding_window)
    extra += () if q_sinks is None else (rows_of(q_sinks),)
    tiles = _tile_schedule(query_start_loc, seq_lens, num_tiles, block_q)

    kernel = functools.partial(
        _ragged_kernel, block_q=block_q, group_pad=G_pad, block_kv=config.block_kv,
        sm_scale=sm_scale, sliding_window=sliding_window, num_sinks=num_sinks, soft_cap=soft_cap,
        layout=layout, rescore=q_sinks is not None)
    o_rows, lse_rows = pl.pallas_call(
        kernel,
        grid=(num_tiles, Hkv),
        in_specs=[whole_block(a.shape)
                  for a in (tiles, q_rows, block_tables, seq_lens, *extra, *kv_ops)],
        out_specs=[whole_block((Hkv, T_pad * G_pad, D)), whole_block((Hkv, T_pad * G_pad))],
        out_shape=[jax.ShapeDtypeStruct((Hkv, T_pad * G_pad, D), q.dtype),
                   jax.ShapeDtypeStruct((Hkv, T_pad * G_pad), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        interpret=interpret,
        name="jaxkv_ragged_paged_attention",
    )(tiles, q_rows, block_tables, seq_lens, *extra, *kv_ops)

    # tokens no tile wrote (padding after qsl[-1]) hold garbage: zero them, as the spec says
    valid = jnp.arange(T) < query_start_loc[-1]                                  # [T]
    out = o_rows.reshape(Hkv, T_pad, G_pad, D)[:, :T, :G].transpose(1, 0, 2, 3).reshape(T, Hq, D)
    lse = lse_rows.reshape(Hkv, T_pad, G_pad)[:, :T, :G].transpose(1, 0, 2).reshape(T, Hq)
    out = jnp.where(valid[:, None, None], out, jnp.zeros((), q.dtype))
    lse = jnp.where(valid[:, None], lse, -jnp.inf)
    return out, lse


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           block_tables: jax.Array, seq_lens: jax.Array,
                           query_start_loc: jax.Array, *, sm_scale: float | None = None,
                           sliding_window: int | None = None, num_sinks: int = 0,
                           soft_cap: float | None = None, return_lse: bool = False,
                           interpret: bool = False, config: RaggedConfig | None = None,
                           q_sinks: jax.Array | None = None):
    """Ragged paged attention (prefill chunks and decode tokens in one launch), Pallas on GPU.

    Same semantics as ``jaxkv.attention.reference.paged_attention_reference``: token t of sequence s
    sits at kv position ``seq_lens[s] - q_len[s] + i`` and sees positions up to itself, restricted
    to the last ``sliding_window`` positions (itself included) except the first ``num_sinks`` ones.
    Without a window the kernel walks only each sequence's kept (non-null) blocks.

    Args:
      q: [T, num_heads, head_dim] float32/bfloat16/float16 queries of every token of the step;
        tokens ``t >= query_start_loc[-1]`` are padding.
      k_pages, v_pages: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype; one layer's
        page pool (block 0 is the null block), or fp8/int8 ``jaxkv.kvcache.pools.QuantizedPages``
        (dequantized in-kernel). head_dim must be a power of two >= 16.
      block_tables: int32 [S, max_blocks] physical page of each logical block; every entry must be
        a page id in ``[0, num_blocks)`` (padding entries 0).
      seq_lens: int32 [S] kv length of each sequence including this step's tokens.
      query_start_loc: int32 [S + 1] cumulative query lengths (0 first, non-decreasing).
      sm_scale: softmax scale, default ``1/sqrt(head_dim)``.
      sliding_window: attend to the last ``sliding_window`` positions only (itself included).
      num_sinks: with a window, the first ``num_sinks`` positions stay visible (attention sinks).
      soft_cap: if set, logits become ``soft_cap * tanh(logits / soft_cap)``.
      return_lse: also return the log-sum-exp of the (scaled, capped) logits.
      interpret: run in Pallas interpret mode (CPU).
      config: block sizes and Triton launch parameters; default ``default_ragged_config``.
      q_sinks: optional, like q: with a window, the queries that score the first
        ``num_sinks`` positions (StreamingLLM's positions within the cache); default q.

    Returns:
      out [T, num_heads, head_dim] in q's dtype (zeros for padding tokens), and with
      ``return_lse`` also lse float32 [T, num_heads] (-inf for padding tokens).

    Raises:
      ValueError: on inconsistent shapes, dtypes or options, a tile config whose row count
        ``block_q * G_pad`` is not a power of two >= 16, and, when the metadata are concrete
        (not traced), page ids out of range or inconsistent lengths.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [T, num_heads, head_dim], got shape {q.shape}")
    kv_ops, layout = kv_operands(k_pages, v_pages)
    check_kv_inputs(q.shape, q.dtype, k_pages, v_pages, block_tables, seq_lens)
    if query_start_loc.shape != (block_tables.shape[0] + 1,):
        raise ValueError(f"query_start_loc must be [S + 1] = [{block_tables.shape[0] + 1}], "
                         f"got {query_start_loc.shape}")
    if query_start_loc.dtype != jnp.int32:
        raise ValueError(f"query_start_loc must be int32, got {query_start_loc.dtype}")
    check_options(sm_scale, sliding_window, num_sinks, soft_cap)
    check_sink_queries(q, q_sinks)
    T, Hq, D = q.shape
    G_pad = next_pow2(Hq // k_pages.shape[2])
    config = config or default_ragged_config(T, block_tables.shape[0], Hq // k_pages.shape[2], D)
    rows = config.block_q * G_pad
    if not is_pow2(rows) or rows < 16:
        raise ValueError(f"block_q={config.block_q} x padded group {G_pad} = {rows} rows; "
                         f"a q tile needs a power of two >= 16 rows")
    if is_concrete(block_tables, seq_lens, query_start_loc):
        check_page_ids(block_tables, k_pages.shape[0])
        check_seq_lens(seq_lens, block_tables.shape[1], k_pages.shape[1])
        _check_query_start_loc(query_start_loc, seq_lens, T)
    rescore = q_sinks is not None and sliding_window is not None and num_sinks > 0
    out, lse = _ragged_call(
        q, q_sinks if rescore else None, kv_ops, block_tables, seq_lens, query_start_loc,
        layout=layout,
        sm_scale=1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale),
        sliding_window=sliding_window, num_sinks=num_sinks if sliding_window is not None else 0,
        soft_cap=soft_cap, interpret=interpret, config=config)
    return (out, lse) if return_lse else out
