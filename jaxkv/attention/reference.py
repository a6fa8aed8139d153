"""Paged attention over a ragged batch: the pure-jnp reference (the specification).

Design notes: docs/attention.md."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxkv.kvcache.pools import QuantizedPages, read_pages, residual_window

def check_shapes(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc):
    """Raises ValueError unless the inputs have the shapes ``paged_attention_reference`` takes."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, num_heads, head_dim], got shape {q.shape}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages/v_pages must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {k_pages.shape} and {v_pages.shape}")
    if q.shape[2] != k_pages.shape[3]:
        raise ValueError(f"head_dim mismatch: q has {q.shape[2]}, k_pages has {k_pages.shape[3]}")
    if q.shape[1] % k_pages.shape[2]:
        raise ValueError(f"num_heads={q.shape[1]} is not a multiple of num_kv_heads={k_pages.shape[2]}")
    if block_tables.ndim != 2 or seq_lens.shape != (block_tables.shape[0],):
        raise ValueError(f"block_tables [S, max_blocks] and seq_lens [S] disagree: "
                         f"{block_tables.shape} vs {seq_lens.shape}")
    if query_start_loc.shape != (block_tables.shape[0] + 1,):
        raise ValueError(f"query_start_loc must be [S + 1] = [{block_tables.shape[0] + 1}], "
                         f"got {query_start_loc.shape}")


def check_sink_queries(q, q_sinks) -> None:
    """Raises ValueError unless ``q_sinks`` is None or shaped like ``q``."""
    if q_sinks is not None and q_sinks.shape != q.shape:
        raise ValueError(f"q_sinks must be shaped like q {q.shape}, got {q_sinks.shape}")


def token_layout(query_start_loc: jax.Array, seq_lens: jax.Array, num_tokens: int):
    """Per-token sequence index, kv position and validity of a ragged batch.

    Args:
      query_start_loc: int32 [S + 1].
      seq_lens: int32 [S].
      num_tokens: T (static).

    Returns:
      (seq_idx int32 [T], q_pos int32 [T], valid bool [T]); padding tokens (t >= qsl[-1]) are
      invalid and get seq_idx clipped into range.
    """
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    num_seqs = seq_lens.shape[0]
    seq_idx = jnp.searchsorted(query_start_loc[1:], t, side="right").astype(jnp.int32)
    valid = seq_idx < num_seqs
    seq_idx = jnp.minimum(seq_idx, num_seqs - 1)
    q_len = query_start_loc[seq_idx + 1] - query_start_loc[seq_idx]
    q_pos = seq_lens[seq_idx] - q_len + (t - query_start_loc[seq_idx])
    return seq_idx, q_pos, valid


def last_tokens(query_start_loc: jax.Array, seq_lens: jax.Array, width: int):
    """The last ``width`` query tokens of every sequence of a ragged batch (a speculative
    step's token and its drafts when ``width`` is the step's logits width).

    Args:
      query_start_loc: int32 [S + 1].
      seq_lens: int32 [S].
      width: W (static).

    Returns:
      (rows int32 [S, W] token rows, in order; positions int32 [S, W] their kv positions;
      valid bool [S, W]: a query token of the sequence, not before its first one).
    """
    back = width - 1 - jnp.arange(width, dtype=jnp.int32)              # [W] tokens after it
    q_lens = query_start_loc[1:] - query_start_loc[:-1]                # [S]
    return (query_start_loc[1:, None] - 1 - back, seq_lens[:, None] - 1 - back,
            back[None, :] < q_lens[:, None])


def visible(q_pos: jax.Array, kv_pos: jax.Array, *, sliding_window: int | None,
            num_sinks: int) -> jax.Array:
    """Mask of kv positions a query at ``q_pos`` attends to (broadcasting; both int32)."""
    mask = kv_pos <= q_pos
    if sliding_window is not None:
        in_window = q_pos - kv_pos < sliding_window
        if num_sinks:
            in_window = in_window | (kv_pos < num_sinks)
        mask = mask & in_window
    return mask


def kv_tile_range(q_first, kv_end, *, block_kv: int, sliding_window: int | None,
                  num_sinks: int):
    """The kv tiles that rows with positions in ``[q_first, kv_end)`` can see.

    Elementwise: int32 scalars or arrays of one shape (one range per element), or Python ints.

    Returns ``(sink_tiles, window_first, count)`` like ``q_first``: loop step
    ``v in [0, count)`` visits tile ``tile_index(v, sink_tiles, window_first)``, i.e. the sink
    tiles ``[0, sink_tiles)`` then the window tiles ``[window_first, cdiv(kv_end, block_kv))``;
    the two ranges never overlap.
    """
    end_tile = jax.lax.div(kv_end + block_kv - 1, block_kv)
    if sliding_window is None:
        return 0, 0, end_tile
    start_tile = jax.lax.div(jnp.maximum(q_first - sliding_window + 1, 0), block_kv)
    if num_sinks == 0:
        return 0, start_tile, jnp.maximum(end_tile - start_tile, 0)
    sink_tiles = jnp.minimum(-(-num_sinks // block_kv), end_tile)
    window_first = jnp.maximum(start_tile, sink_tiles)
    return sink_tiles, window_first, sink_tiles + jnp.maximum(end_tile - window_first, 0)


def tile_index(v, sink_tiles, window_first):
    """kv tile visited at loop step ``v`` (see ``kv_tile_range``)."""
    if isinstance(sink_tiles, int) and sink_tiles == 0:
        return window_first + v
    return jnp.where(v < sink_tiles, v, window_first + v - sink_tiles)


def cap_logits(s: jax.Array, soft_cap: float | None) -> jax.Array:
    """``soft_cap * tanh(s / soft_cap)`` (logits unchanged without a cap)."""
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def softmax_init(shape: tuple[int, ...], head_dim: int):
    """Empty online-softmax state of rows ``shape``: f32 (m -inf, l 0, acc 0 [*shape, head_dim])."""
    return (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, head_dim), jnp.float32))


def online_softmax_step(carry, s: jax.Array, mask: jax.Array, attend):
    """One kv chunk of the online softmax (f32 accumulators).

    Args:
      carry: (m [...], l [...], acc [..., D]) running max, sum and unnormalized output.
      s: f32 [..., n] the chunk's (scaled, capped) logits.
      mask: bool broadcastable to ``s``: the positions each row sees.
      attend: ``p`` f32 [..., n] -> f32 [..., D], the weighted sum of the chunk's values.

    Returns:
      The updated carry.
    """
    m, l, acc = carry
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)
    return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + attend(p)


def softmax_result(carry) -> tuple[jax.Array, jax.Array]:
    """(out f32 [..., D], lse f32 [...]) of an online-softmax state: 0 and -inf for rows that
    saw nothing."""
    m, l, acc = carry
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    out = jnp.where(seen[..., None], acc / l_safe[..., None], 0.0)
    return out, jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)


def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                              block_tables: jax.Array, seq_lens: jax.Array,
                              query_start_loc: jax.Array, *, sm_scale: float | None = None,
                              sliding_window: int | None = None, num_sinks: int = 0,
                              soft_cap: float | None = None, kv_chunk_blocks: int | None = None,
                              return_lse: bool = False, q_sinks: jax.Array | None = None):
    """Ragged paged attention, pure jnp (the specification the kernels are tested against).

    Args:
      q: [T, num_heads, head_dim] queries of every token of the step (padding after qsl[-1]).
      k_pages, v_pages: [num_blocks, block_size, num_kv_heads, head_dim] one layer's pool, an
        array or a ``jaxkv.kvcache.pools.QuantizedPages`` (dequantized block by block, see
        ``jaxkv.kvcache.pools.read_pages``).
      block_tables: int32 [S, max_blocks] physical block of each logical block (0 = null block:
        padding past the sequence, or a block a retention policy dropped, never seen).
      seq_lens: int32 [S] kv length of each sequence including this step's tokens.
      query_start_loc: int32 [S + 1] cumulative query lengths.
      sm_scale: softmax scale, default ``1/sqrt(head_dim)``.
      sliding_window: attend to the last ``sliding_window`` positions only (itself included).
      num_sinks: with a window, the first ``num_sinks`` positions stay visible (attention sinks).
      soft_cap: if set, logits become ``soft_cap * tanh(logits / soft_cap)``.
      kv_chunk_blocks: blocks per online-softmax step (static); default covers ~256 positions.
      return_lse: also return the log-sum-exp of the (scaled, capped) logits.
      q_sinks: optional [T, num_heads, head_dim], like q: with a window, the queries that
        score the first ``num_sinks`` positions (StreamingLLM's positions within the cache: q
        rotated to its position in the cache, see jaxkv/retention/streaming.py); default q.

    Returns:
      out [T, num_heads, head_dim] in q's dtype (zeros for padding tokens), and with
      ``return_lse`` also lse f32 [T, num_heads] (-inf for padding tokens).
    """
    check_shapes(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc)
    check_sink_queries(q, q_sinks)
    T, Hq, D = q.shape
    _, bs, Hkv, _ = k_pages.shape
    G = Hq // Hkv
    max_blocks = block_tables.shape[1]
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    chunk = kv_chunk_blocks or max(1, 256 // bs)
    chunk = min(chunk, max_blocks)
    num_chunks = -(-max_blocks // chunk)
    # pad the table so every chunk is full; padded entries point at the null block (masked by position)
    tables = jnp.pad(block_tables, ((0, 0), (0, num_chunks * chunk - max_blocks)))

    seq_idx, q_pos, valid = token_layout(query_start_loc, seq_lens, T)
    qg = q.astype(jnp.float32).reshape(T, Hkv, G, D) * scale      # [T, Hkv, G, D]
    rescore = q_sinks is not None and sliding_window is not None and num_sinks > 0
    if rescore:
        qsg = q_sinks.astype(jnp.float32).reshape(T, Hkv, G, D) * scale  # [T, Hkv, G, D]

    def read_chunk(pages, ids, c):
        """f32 [T, chunk, bs, Hkv, D]: a float pool is gathered per token; a quantized one is
        dequantized once per sequence (KIVI: its residual window in full precision), then
        handed to that sequence's tokens."""
        if isinstance(pages, QuantizedPages):
            logical = c * chunk + jnp.arange(chunk, dtype=jnp.int32)               # [chunk]
            window = residual_window(seq_lens, logical, bs, pages.residual_blocks)  # [S, chunk]
            return read_pages(pages, ids, window)[seq_idx]
        return read_pages(pages, ids[seq_idx])

    def body(c, carry):                                   # carry: softmax_init((T, Hkv, G), D)
        ids = jax.lax.dynamic_slice_in_dim(tables, c * chunk, chunk, axis=1)       # [S, chunk]
        k = read_chunk(k_pages, ids, c).reshape(T, chunk * bs, Hkv, D)
        v = read_chunk(v_pages, ids, c).reshape(T, chunk * bs, Hkv, D)
        s = jnp.einsum("thgd,tnhd->thgn", qg, k)                  # [T, Hkv, G, chunk*bs]
        kv_pos = c * chunk * bs + jnp.arange(chunk * bs, dtype=jnp.int32)
        if rescore:
            s = jnp.where(kv_pos < num_sinks, jnp.einsum("thgd,tnhd->thgn", qsg, k), s)
        kept = jnp.repeat(ids != 0, bs, axis=1)[seq_idx]          # [T, chunk*bs] not dropped
        mask = visible(q_pos[:, None], kv_pos[None, :], sliding_window=sliding_window,
                       num_sinks=num_sinks) & valid[:, None] & kept  # [T, chunk*bs]
        return online_softmax_step(carry, cap_logits(s, soft_cap), mask[:, None, None, :],
                                   lambda p: jnp.einsum("thgn,tnhd->thgd", p, v))

    # walk only the chunks that hold a live position of some sequence (a data-dependent bound)
    num_live = jnp.minimum((jnp.max(seq_lens) + chunk * bs - 1) // (chunk * bs), num_chunks)
    carry = jax.lax.fori_loop(0, num_live, body, softmax_init((T, Hkv, G), D))
    out, lse = softmax_result(carry)
    out = out.reshape(T, Hq, D).astype(q.dtype)
    return (out, lse.reshape(T, Hq)) if return_lse else out


def merge_attention_states(outs: jax.Array, lses: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Merges attention results over disjoint kv ranges (split-K, cascade/shared prefix).

    Each part n is a softmax-normalized output over its own kv subset with that subset's
    log-sum-exp; the merge weights part n by ``exp(lse_n - lse)``, with ``lse = log Σ_n
    exp(lse_n)``. Parts that saw nothing (lse -inf) get weight 0; if every part is empty the result
    is out 0 and lse -inf, like the reference for a token that sees no kv position.

    Args:
      outs: [N, ..., head_dim] normalized partial outputs (any float dtype).
      lses: f32 [N, ...] their log-sum-exps (-inf for an empty part).

    Returns:
      (out [..., head_dim] in outs' dtype, lse f32 [...]).
    """
    if outs.shape[:-1] != lses.shape:
        raise ValueError(f"outs [N, ..., head_dim] and lses [N, ...] disagree: "
                         f"{outs.shape} vs {lses.shape}")
    lses = lses.astype(jnp.float32)
    m = lses.max(axis=0)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lses - m_safe)                                   # [N, ...], 0 for empty parts
    total = w.sum(axis=0)
    seen = total > 0
    total_safe = jnp.where(seen, total, 1.0)
    out = (w[..., None] * outs.astype(jnp.float32)).sum(axis=0) / total_safe[..., None]
    lse = jnp.where(seen, m_safe + jnp.log(total_safe), -jnp.inf)
    return out.astype(outs.dtype), lse
