"""Ragged paged attention that reads each sequence's KV once: the fast path on CPU (plain XLA).

Design notes: docs/attention.md."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxkv import cpu_kernels
from jaxkv.attention.kv_chunks import chunk_positions, kept_blocks, visited_chunks
from jaxkv.attention.reference import (cap_logits, check_shapes, check_sink_queries, last_tokens,
                                       online_softmax_step, softmax_init, softmax_result,
                                       tile_index, visible)
from jaxkv.kvcache.pools import HNDPages, Pages, QuantizedPages, read_sequence_blocks


# Bytes of K (or V) one step of the row path gathers: they stay in cache between the gather
# and the contractions that read it (0.25-2 MiB time alike; 4 MiB and more are slower).
_ROW_CHUNK_BYTES = 1 << 20


def _row_chunk_blocks(chunk: int, num_seqs: int, block_size: int, num_kv_heads: int,
                      head_dim: int) -> int:
    """Blocks per kv chunk of the row path: ``chunk`` halved while the f32 K chunk of all
    ``num_seqs`` rows exceeds ``_ROW_CHUNK_BYTES`` (at least 1)."""
    rows, row_bytes = chunk, num_seqs * block_size * num_kv_heads * head_dim * 4
    while rows > 1 and rows * row_bytes > _ROW_CHUNK_BYTES:
        rows = -(-rows // 2)
    return rows


def kernel_pools(k_pages: Pages, v_pages: Pages) -> dict | None:
    """The pools as ``jaxkv.cpu_kernels``' attention reads them (keyword arguments ``k``, ``v``
    and, for int8/fp8 codes, ``k_scale``, ``v_scale`` or ``static_scale``), or None where it
    cannot: a head-major pool of f32, bf16 or f16, or an fp8/int8 ``QuantizedPages`` with one
    scale per token and head (or a fixed scale) and no residual; not KIVI's int4/int2, not the
    NHD float pools of the Pallas layout."""
    if isinstance(k_pages, HNDPages) and isinstance(v_pages, HNDPages):
        ok = k_pages.dtype in (jnp.float32, *cpu_kernels.HEAD_MAJOR_CODES)
        return dict(k=k_pages.data, v=v_pages.data) if ok else None
    if not (isinstance(k_pages, QuantizedPages) and isinstance(v_pages, QuantizedPages)):
        return None
    if (k_pages.data.dtype not in cpu_kernels.TOKEN_MAJOR_CODES or k_pages.axis != "token"
            or k_pages.residual is not None or k_pages.static_scale != v_pages.static_scale):
        return None
    if k_pages.static_scale is not None:
        return dict(k=k_pages.data, v=v_pages.data, static_scale=k_pages.static_scale)
    if k_pages.scale.shape[-1] != 1 or v_pages.scale.shape[-1] != 1:  # groups within a token
        return None
    return dict(k=k_pages.data, v=v_pages.data, k_scale=k_pages.scale, v_scale=v_pages.scale)


def native_rows(k_pages: Pages, v_pages: Pages) -> bool:
    """True when the rows can run as the C++ kernel (``jaxkv.cpu_kernels.paged_rows``, windows,
    sinks and sink queries included): pools it reads (``kernel_pools``) and
    ``cpu_kernels.native()``."""
    return kernel_pools(k_pages, v_pages) is not None and cpu_kernels.native()


def native_tiles(k_pages: Pages, v_pages: Pages) -> bool:
    """True when the tiles can run as the C++ kernel (``jaxkv.cpu_kernels.paged_tiles``): as
    ``native_rows``, with blocks of 16 positions and a head dim of 64 or 128."""
    _, bs, _, D = k_pages.shape
    return bs == 16 and D in (64, 128) and native_rows(k_pages, v_pages)


def merge_units(carry, rows: jax.Array, s: jax.Array, attend):
    """One step of the online softmax for units that each add a kv chunk to one row.

    Several units may add to the same row in one step: every row's new max is taken over its
    units first (a scatter-max), so each unit's probabilities are relative to its row's new max
    and the sums simply add (scatter-adds).

    Args:
      carry: (m [R, ...], l [R, ...], acc [R, ..., D]) every row's running max, sum and
        unnormalized output (``softmax_init``).
      rows: int32 [N] the row of each unit; ``R`` (out of range) drops the unit.
      s: f32 [N, n, ...] each unit's (scaled, capped) logits over its ``n`` kv positions,
        -inf where masked.
      attend: ``p`` f32 [N, n, ...] -> f32 [N, ..., D], the weighted sum of the unit's values.

    Returns:
      The updated carry.
    """
    m, l, acc = carry
    m_new = m.at[rows].max(s.max(1), mode="drop")
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - jnp.take(m_safe, rows, axis=0, mode="clip")[:, None])   # [N, n, ...]
    alpha = jnp.exp(m - m_safe)
    return (m_new, (alpha * l).at[rows].add(p.sum(1), mode="drop"),
            (alpha[..., None] * acc).at[rows].add(attend(p), mode="drop"))


def paged_attention_grouped(q: jax.Array, k_pages: Pages, v_pages: Pages,
                            block_tables: jax.Array, seq_lens: jax.Array,
                            query_start_loc: jax.Array, *, sm_scale: float | None = None,
                            sliding_window: int | None = None, num_sinks: int = 0,
                            soft_cap: float | None = None, kv_chunk_blocks: int | None = None,
                            block_q: int = 128, return_lse: bool = False,
                            q_sinks: jax.Array | None = None, row_queries: int = 1):
    """Ragged paged attention with the KV gathered per sequence (see the module docstring).

    Args:
      q: [T, num_heads, head_dim] queries of every token of the step (padding after qsl[-1]).
      k_pages, v_pages: [num_blocks, block_size, num_kv_heads, head_dim] one layer's pool, an
        array or a ``jaxkv.kvcache.pools.QuantizedPages``.
      block_tables: int32 [S, max_blocks] physical block of each logical block (0 = null block).
      seq_lens: int32 [S] kv length of each sequence including this step's tokens.
      query_start_loc: int32 [S + 1] cumulative query lengths.
      sm_scale: softmax scale, default ``1/sqrt(head_dim)``.
      sliding_window: attend to the last ``sliding_window`` positions only (itself included).
      num_sinks: with a window, the first ``num_sinks`` positions stay visible (attention sinks).
      soft_cap: if set, logits become ``soft_cap * tanh(logits / soft_cap)``.
      kv_chunk_blocks: blocks per kv chunk (static); default covers ~256 positions.
      block_q: query tokens per tile of the prefill path (static; at most T).
      return_lse: also return the log-sum-exp of the (scaled, capped) logits.
      q_sinks: optional [T, num_heads, head_dim]: the queries that score the first
        ``num_sinks`` positions (StreamingLLM's positions within the cache); default q. Only
        the sink chunks compute the second set of scores.
      row_queries: the last ``row_queries`` tokens of each sequence are rows (static): a
        speculative step's ``1 + k`` tokens (W = 1 + k, the step's logits width) then read
        their sequence's KV once, together, instead of the last one as a row and the drafts as
        a mostly padding tile over the same KV.

    Returns:
      out [T, num_heads, head_dim] in q's dtype (zeros for padding tokens), and with
      ``return_lse`` also lse f32 [T, num_heads] (-inf for padding tokens).
    """
    check_shapes(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc)
    check_sink_queries(q, q_sinks)
    T, Hq, D = q.shape
    _, bs, Hkv, _ = k_pages.shape
    S, max_blocks = block_tables.shape
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    chunk = min(kv_chunk_blocks or max(1, 256 // bs), max_blocks)     # blocks per tile chunk
    row_chunk = chunk if kv_chunk_blocks else _row_chunk_blocks(chunk, S, bs, Hkv, D)
    # pad the table so every chunk of either path is full; padded entries point at the null block
    width = -(-max_blocks // math.lcm(chunk, row_chunk)) * math.lcm(chunk, row_chunk)
    tables = jnp.pad(block_tables, ((0, 0), (0, width - max_blocks)))
    bq = min(block_q, T)
    mask_opts = dict(sliding_window=sliding_window, num_sinks=num_sinks)
    # without a window: chunks of each row's kept blocks (order, kept_before: [S, width(+1)])
    order, kept_before = kept_blocks(tables, sliding_window)

    q_lens = query_start_loc[1:] - query_start_loc[:-1]                # [S]

    def grouped(x):                                                    # [T, Hkv, G, D]
        return x.astype(jnp.float32).reshape(T, Hkv, G, D) * scale

    def padded(x):               # [T + bq, Hkv, G, D]: a tile's bq-token slice never clamps
        return None if x is None else jnp.pad(x, ((0, bq), (0, 0), (0, 0), (0, 0)))

    qg = grouped(q)
    rescore = q_sinks is not None and sliding_window is not None and num_sinks > 0
    qsg = grouped(q_sinks) if rescore else None
    qg_tiles, qsg_tiles = padded(qg), padded(qsg)    # read by the XLA tiles only

    def with_sinks(any_sink, s, kv_pos, sink_scores, expand):
        """``s`` with the sink positions scored by the sink queries, if ``any_sink`` (a bool
        scalar: the chunk, or one of the chunks, is a sink chunk)."""
        if not rescore:
            return s
        return jax.lax.cond(any_sink,
                            lambda: jnp.where(expand(kv_pos < num_sinks), sink_scores(), s),
                            lambda: s)

    # rows: the last R query tokens of every sequence, at kv positions seq_len - R .. seq_len - 1
    R = row_queries
    has_q = q_lens > 0                                                 # [S]
    last, row_pos, row_valid = last_tokens(query_start_loc, seq_lens, R)   # [S, R] each
    last = jnp.where(row_valid, last, T + bq)                          # (T + bq: no token)

    def row_queries_of(x):                                             # [S, Hkv, R * G, D]
        return x[jnp.minimum(last, T - 1)].transpose(0, 2, 1, 3, 4).reshape(S, Hkv, R * G, D)

    row_q = row_queries_of(qg)
    row_qs = row_queries_of(qsg) if rescore else None
    rc = row_chunk * bs                                                # kv positions per chunk
    sinks, first, count = visited_chunks(seq_lens - jnp.minimum(q_lens, R), seq_lens,
                                         kept_before, chunk=row_chunk, block_size=bs,
                                         **mask_opts)
    count = jnp.where(has_q, count, 0)                                 # [S] chunks of each row
    unit_end = jnp.cumsum(count)                                       # [S] units: see below

    def row_step(i, carry):                                      # carry: [S, Hkv, R * G] rows
        # units i*S .. i*S + S - 1 of the (row, chunk) list, every row's chunks end to end
        u = i * S + jnp.arange(S, dtype=jnp.int32)                     # [S] unit ids
        valid = u < unit_end[-1]
        r = jnp.minimum(jnp.searchsorted(unit_end, u, side="right"), S - 1)  # [S] unit's row
        v = u - (unit_end[r] - count[r])                               # [S] its step there
        unit_sinks, unit_first = (x if isinstance(x, int) else x[r] for x in (sinks, first))
        c = tile_index(v, unit_sinks, unit_first)                      # [S] its chunk
        logical, kv_pos = chunk_positions(None if order is None else order[r], c, row_chunk,
                                          bs)                          # [S, chunk], [S, rc]
        ids = jnp.take_along_axis(tables[r], logical, axis=1, mode="clip")
        ids = jnp.where(valid[:, None], ids, 0)                        # past the list: null
        k, vv = (read_sequence_blocks(p, ids, logical, seq_lens[r], heads_first=True)
                 for p in (k_pages, v_pages))                          # [S, n, Hkv, bs, D]

        def scores(qr):                                                # [S, rc, Hkv, R * G]
            return jnp.einsum("shgd,snhbd->snbhg", qr, k).reshape(S, rc, Hkv, R * G)

        s = with_sinks(jnp.any(v < unit_sinks), scores(row_q[r]), kv_pos,
                       lambda: scores(row_qs[r]), lambda m: m[:, :, None, None])
        kept = jnp.repeat(ids != 0, bs, axis=1)                        # [S, rc] not dropped
        mask = (visible(row_pos[r][:, None, :], kv_pos[:, :, None], **mask_opts)
                & (valid[:, None] & kept)[:, :, None] & row_valid[r][:, None, :])  # [S, rc, R]
        mask = jnp.repeat(mask, G, axis=-1)[:, :, None, :]             # [S, rc, 1, R * G]
        s = jnp.where(mask, cap_logits(s, soft_cap), -jnp.inf)
        return merge_units(carry, jnp.where(valid, r, S), s, lambda p: jnp.einsum(
            "snbhg,snhbd->shgd", p.reshape(S, row_chunk, bs, Hkv, R * G), vv))

    def xla_rows():                                        # [S, Hkv, R * G, D], [S, Hkv, R * G]
        return softmax_result(jax.lax.fori_loop(0, -(-unit_end[-1] // S), row_step,
                                                softmax_init((S, Hkv, R * G), D)))

    if native_rows(k_pages, v_pages):                     # the C++ kernel on CPU
        row_out, row_lse = cpu_kernels.paged_rows(
            row_q, tables=tables, row_pos=jnp.where(row_valid, row_pos, -1), q_sinks=row_qs,
            **mask_opts, soft_cap=soft_cap, **kernel_pools(k_pages, v_pages))
    else:
        row_out, row_lse = xla_rows()
    row_out = row_out.reshape(S, Hkv, R, G, D).transpose(0, 2, 1, 3, 4)    # [S, R, Hkv, G, D]
    row_lse = row_lse.reshape(S, Hkv, R, G).transpose(0, 2, 1, 3)          # [S, R, Hkv, G]

    # tiles: the other tokens of each sequence, block_q at a time
    body = jnp.maximum(q_lens - R, 0)                                  # [S] tokens before the rows
    per_seq = (body + bq - 1) // bq                                    # [S] tiles of each sequence
    tile_end = jnp.cumsum(per_seq)                                     # [S]
    tile_rows = jnp.arange(bq, dtype=jnp.int32)                        # [bq]
    C = chunk * bs                                                     # kv positions per chunk

    def tile(i, acc):
        out, lse = acc                                                 # [T + bq, Hkv, G(, D)]
        seq = jnp.sum(tile_end <= i)                                   # the tile's sequence
        local = i - (tile_end[seq] - per_seq[seq])                     # its tile index there
        tok0 = query_start_loc[seq] + local * bq
        n_valid = jnp.minimum(bq, body[seq] - local * bq)
        q_first = seq_lens[seq] - q_lens[seq] + local * bq
        q_pos = q_first + tile_rows                                    # [bq]
        row_ok = tile_rows < n_valid                                   # [bq]
        qt = jax.lax.dynamic_slice_in_dim(qg_tiles, tok0, bq)          # [bq, Hkv, G, D]
        qst = jax.lax.dynamic_slice_in_dim(qsg_tiles, tok0, bq) if rescore else None
        seq_order = None if order is None else order[seq]              # [width]
        t_sinks, t_first, t_count = visited_chunks(
            q_first, q_first + n_valid, None if order is None else kept_before[seq],
            chunk=chunk, block_size=bs, **mask_opts)

        def kv_step(v, carry):                                         # carry: [Hkv, bq, G] rows
            c = tile_index(v, t_sinks, t_first)
            logical, kv_pos = chunk_positions(seq_order, c, chunk, bs)  # [chunk], [C]
            ids = tables[seq][logical]
            k, vv = (read_sequence_blocks(p, ids, logical, seq_lens[seq], heads_first=True)
                     for p in (k_pages, v_pages))                      # [chunk, Hkv, bs, D]

            def scores(qx):                                            # [Hkv, bq, G, C]
                return jnp.einsum("qhgd,nhbd->hqgnb", qx, k).reshape(Hkv, bq, G, C)

            s = with_sinks(v < t_sinks, scores(qt), kv_pos, lambda: scores(qst), lambda m: m)
            kept = jnp.repeat(ids != 0, bs)                            # [C] not dropped
            mask = visible(q_pos[:, None], kv_pos[None, :], **mask_opts) & row_ok[:, None] \
                & kept[None, :]
            return online_softmax_step(carry, cap_logits(s, soft_cap), mask[None, :, None, :],
                                       lambda p: jnp.einsum("hqgnb,nhbd->hqgd",
                                                            p.reshape(Hkv, bq, G, chunk, bs), vv))

        o, l = softmax_result(jax.lax.fori_loop(0, t_count, kv_step,
                                                softmax_init((Hkv, bq, G), D)))
        keep = row_ok[:, None, None]                                   # rows of the next sequence
        o = jnp.where(keep[..., None], o.transpose(1, 0, 2, 3),
                      jax.lax.dynamic_slice_in_dim(out, tok0, bq))
        l = jnp.where(keep, l.transpose(1, 0, 2), jax.lax.dynamic_slice_in_dim(lse, tok0, bq))
        return (jax.lax.dynamic_update_slice_in_dim(out, o, tok0, 0),
                jax.lax.dynamic_update_slice_in_dim(lse, l, tok0, 0))

    def xla_tiles():                                      # [T, Hkv, G, D], [T, Hkv, G]
        acc = (jnp.zeros((T + bq, Hkv, G, D), jnp.float32),
               jnp.full((T + bq, Hkv, G), -jnp.inf, jnp.float32))
        out, lse = jax.lax.fori_loop(0, tile_end[-1], tile, acc)
        return out[:T], lse[:T]

    if native_tiles(k_pages, v_pages):                    # the C++ kernel on CPU
        out, lse = cpu_kernels.paged_tiles(qg, tables=tables, query_start_loc=query_start_loc,
                                           seq_lens=seq_lens, body=body, q_sinks=qsg,
                                           **mask_opts, soft_cap=soft_cap,
                                           **kernel_pools(k_pages, v_pages))
    else:
        out, lse = xla_tiles()
    out = out.at[last].set(row_out, mode="drop").reshape(T, Hq, D).astype(q.dtype)
    if not return_lse:
        return out
    return out, lse.at[last].set(row_lse, mode="drop").reshape(T, Hq)
