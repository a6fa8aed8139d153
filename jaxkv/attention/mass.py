"""Attention mass per KV block: the statistic heavy-hitter eviction (H2O) ranks blocks by.

Design notes: docs/attention.md."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxkv.attention.kv_chunks import chunk_positions, kept_blocks, visited_chunks
from jaxkv.attention.reference import cap_logits, check_shapes, tile_index, visible
from jaxkv.kvcache.pools import Pages, read_sequence_blocks


def block_attention_mass(q: jax.Array, k_pages: Pages, block_tables: jax.Array,
                         seq_lens: jax.Array, query_start_loc: jax.Array, lse: jax.Array, *,
                         observe: int = 1, sm_scale: float | None = None,
                         sliding_window: int | None = None, num_sinks: int = 0,
                         soft_cap: float | None = None, q_sinks: jax.Array | None = None,
                         kv_chunk_blocks: int | None = None) -> jax.Array:
    """Attention mass of each sequence's last ``observe`` query tokens on each logical block.

    Args:
      q: [T, num_heads, head_dim] the step's queries (as given to the attention).
      k_pages: [num_blocks, block_size, num_kv_heads, head_dim] one layer's key pool, an array
        or a ``QuantizedPages``.
      block_tables: int32 [S, max_blocks] (0 = the null block: padding or dropped, never seen).
      seq_lens: int32 [S] kv lengths including this step's tokens.
      query_start_loc: int32 [S + 1].
      lse: f32 [T, num_heads] the attention's log-sum-exp of each token (``return_lse``).
      observe: query tokens per sequence observed (static, >= 1): its last ones this step.
      sm_scale, sliding_window, num_sinks, soft_cap, q_sinks: as the attention had them.
      kv_chunk_blocks: blocks per kv chunk (static); default covers ~256 positions.

    Returns:
      f32 [S, max_blocks]: mass per logical block; 0 for blocks no observed token sees.
    """
    check_shapes(q, k_pages, k_pages, block_tables, seq_lens, query_start_loc)
    if observe < 1:
        raise ValueError(f"observe={observe} must be >= 1")
    T, Hq, D = q.shape
    _, bs, Hkv, _ = k_pages.shape
    S, max_blocks = block_tables.shape
    G = Hq // Hkv
    w = observe
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    chunk = min(kv_chunk_blocks or max(1, 256 // bs), max_blocks)
    width = -(-max_blocks // chunk) * chunk
    tables = jnp.pad(block_tables, ((0, 0), (0, width - max_blocks)))
    rescore = q_sinks is not None and sliding_window is not None and num_sinks > 0
    opts = dict(sliding_window=sliding_window, num_sinks=num_sinks)

    # the observed tokens: the last w of each sequence (fewer when its chunk is shorter)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]                   # [S]
    j = jnp.arange(w, dtype=jnp.int32)                                    # [w]
    tok = query_start_loc[1:, None] - w + j[None, :]                      # [S, w]
    ok = j[None, :] >= w - q_lens[:, None]                                # [S, w]
    tok = jnp.clip(tok, 0, T - 1)
    pos = seq_lens[:, None] - w + j[None, :]                              # [S, w] kv positions

    def grouped(x):                                                       # [S, w, Hkv, G, D]
        return x.astype(jnp.float32)[tok].reshape(S, w, Hkv, G, D) * scale

    qo = grouped(q)
    qso = grouped(q_sinks) if rescore else None
    lo = jnp.where(ok[..., None], lse[tok], jnp.inf).reshape(S, w, Hkv, G)  # inf: weight 0
    first_pos = jnp.where(q_lens > 0, seq_lens - jnp.minimum(q_lens, w), seq_lens)
    C = chunk * bs
    order, kept_before = kept_blocks(tables, sliding_window)
    sinks, first, count = visited_chunks(first_pos, seq_lens, kept_before, chunk=chunk,
                                         block_size=bs, **opts)
    count = jnp.where(q_lens > 0, count, 0)                               # [S]
    rows = jnp.arange(S, dtype=jnp.int32)[:, None]                        # [S, 1]

    def body(v, out):                                                     # out: [S, width]
        c = jnp.broadcast_to(tile_index(v, sinks, first), (S,))           # chunk of each seq
        logical, kv_pos = chunk_positions(order, c, chunk, bs)           # [S, chunk], [S, C]
        ids = jnp.take_along_axis(tables, logical, axis=1, mode="clip")
        live = (v < count)[:, None]                                       # [S, 1]
        ids = jnp.where(live, ids, 0)
        k = read_sequence_blocks(k_pages, ids, logical, seq_lens).reshape(S, C, Hkv, D)
        s = jnp.einsum("swhgd,snhd->swhgn", qo, k)                         # [S, w, Hkv, G, C]
        if rescore:
            s = jnp.where((kv_pos < num_sinks)[:, None, None, None, :],
                          jnp.einsum("swhgd,snhd->swhgn", qso, k), s)
        seen = (visible(pos[:, :, None], kv_pos[:, None, :], **opts)      # [S, w, C]
                & jnp.repeat(ids != 0, bs, axis=1)[:, None, :] & live[:, :, None])
        p = jnp.where(seen[:, :, None, None, :],
                      jnp.exp(cap_logits(s, soft_cap) - lo[..., None]), 0.0)
        per_block = p.sum((1, 2, 3)).reshape(S, chunk, bs).sum(-1)        # [S, chunk]
        return out.at[rows, logical].add(jnp.where(live, per_block, 0.0), mode="drop")

    out = jax.lax.fori_loop(0, jnp.max(count), body, jnp.zeros((S, width), jnp.float32))
    return out[:, :max_blocks]
