"""Quest-style query-aware sparse paged decode attention: the pure-jnp reference (the spec).

Design notes: docs/attention.md."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxkv.attention.reference import (cap_logits, check_shapes, last_tokens, online_softmax_step,
                                       softmax_init, softmax_result)
from jaxkv.kvcache.key_bounds import (KeyBounds, copy_key_bounds, init_key_bounds,
                                      refresh_key_bounds, update_key_bounds, written_keys)
from jaxkv.kvcache.pools import Pages, QuantizedPages, read_pages, take_blocks, window_first

__all__ = ["KeyBounds", "init_key_bounds", "written_keys", "update_key_bounds",
           "refresh_key_bounds", "copy_key_bounds",
           "key_bounds", "page_bounds", "page_scores", "min_budget", "select_pages",
           "quest_select", "check_selection", "sparse_decode_reference",
           "quest_decode_reference", "sparse_rows"]

_HIGHEST = jax.lax.Precision.HIGHEST


def sparse_rows(query_start_loc: jax.Array, seq_lens: jax.Array,
                num_drafts: jax.Array | None = None, width: int = 1):
    """The query tokens of a ragged step that attend to a Quest selection: the ones a run
    without speculation computes as decode steps (a step whose query is one token).

    A sequence's drafts (its last ``num_drafts`` query tokens) each stand for a later decode
    step, so each attends to its own selection at its own length; the token before them does
    too when it is the sequence's only other query token (a decode that verifies drafts), and
    stays dense when it ends a prefill chunk. Only the last ``width`` tokens of a sequence are
    candidates (``width`` >= 1 + every ``num_drafts``: the step's logits width).

    Args:
      query_start_loc: int32 [S + 1] cumulative query lengths.
      seq_lens: int32 [S] kv lengths (0: a padding sequence).
      num_drafts: int32 [S] drafts per sequence, or None (no drafts).
      width: candidates per sequence (static).

    Returns:
      ``(rows, lens, all_sparse)``: int32 [S * width] the token row of each sequence's last
      ``width`` tokens (in order; out of range below its first token), int32 [S * width] the kv
      length each such token attends to (its position + 1), 0 where it stays dense or is no
      token; bool [S] whether every query token of the sequence is sparse.
    """
    drafts = 0 if num_drafts is None else num_drafts                           # [S]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]                        # [S]
    all_sparse = (q_lens - drafts == 1) & (seq_lens > 0)
    rows, pos, valid = last_tokens(query_start_loc, seq_lens, width)          # [S, W] each
    draft = pos >= (seq_lens - drafts)[:, None]
    sparse = valid & (draft | all_sparse[:, None]) & (seq_lens[:, None] > 0)
    lens = jnp.where(sparse, pos + 1, 0)
    return rows.reshape(-1), lens.reshape(-1), all_sparse


def key_bounds(k_pages: Pages, block_tables: jax.Array, seq_lens: jax.Array) -> KeyBounds:
    """Bounds from scratch: per block, the min/max over the positions ``< seq_lens[s]`` of every
    sequence s whose table holds it (the oracle of ``update_key_bounds``).

    Args:
      k_pages: [num_blocks, block_size, Hkv, D] pool, any format (read by ``read_pages``).
      block_tables: int32 [S, max_blocks].
      seq_lens: int32 [S].

    Returns:
      ``KeyBounds``; blocks holding no live position of any sequence are 0.
    """
    n, bs, _, _ = k_pages.shape
    x = read_pages(k_pages, block_tables)                         # [S, B, bs, Hkv, D]
    pos = jnp.arange(block_tables.shape[1] * bs, dtype=jnp.int32).reshape(-1, bs)
    live = (pos[None] < seq_lens[:, None, None])[..., None, None]  # [S, B, bs, 1, 1]
    lo = jnp.where(live, x, jnp.inf).min(axis=2)                   # [S, B, Hkv, D]
    hi = jnp.where(live, x, -jnp.inf).max(axis=2)
    shape = (n, *lo.shape[2:])
    kmin = jnp.full(shape, jnp.inf).at[block_tables].min(lo)
    kmax = jnp.full(shape, -jnp.inf).at[block_tables].max(hi)
    written = jnp.isfinite(kmin)
    return KeyBounds(kmin=jnp.where(written, kmin, 0.0), kmax=jnp.where(written, kmax, 0.0))


def _kivi_bounds(pages: QuantizedPages, scale: jax.Array, zero: jax.Array):
    """(lo, hi) f32 [..., Hkv, D] of KIVI key statistics ``scale``/``zero`` [..., n, Hkv, C]
    (per channel: n = 1, C = D; per token: n = block_size, C = D / G), over the block's tokens."""
    s, z = scale.astype(jnp.float32), zero.astype(jnp.float32)
    hi = pages.format.qmax * s + z                    # the largest code, dequantized
    if pages.axis == "token":
        z = jnp.repeat(z, pages.group_size, axis=-1)
        hi = jnp.repeat(hi, pages.group_size, axis=-1)
    return z.min(axis=-3), hi.max(axis=-3)


def page_bounds(bounds: KeyBounds | QuantizedPages, block_tables: jax.Array):
    """The key bounds of each sequence's pages.

    Args:
      bounds: the ``KeyBounds`` of a float/fp8/int8 pool, or the KIVI (int4/int2) K pool itself
        (bounds derived from its stored scale and zero point; meaningful for sealed blocks).
      block_tables: int32 [S, max_blocks].

    Returns:
      (lo, hi) f32 [S, max_blocks, Hkv, D].

    Raises:
      ValueError: for an fp8/int8 pool (it keeps ``KeyBounds``).
    """
    if isinstance(bounds, QuantizedPages):
        if not bounds.format.kivi:
            raise ValueError(f"{bounds.fmt} pools keep KeyBounds (update_key_bounds); only KIVI "
                             f"pools derive them from their statistics")
        return _kivi_bounds(bounds, take_blocks(bounds.scale, block_tables),
                            take_blocks(bounds.zero, block_tables))
    return bounds.kmin[block_tables], bounds.kmax[block_tables]


def page_scores(q: jax.Array, bounds: KeyBounds | QuantizedPages,
                block_tables: jax.Array) -> jax.Array:
    """Quest's page criticality, an upper bound of the logits a page's keys can give.

    ``score[s, h, p] = max_g Σ_c max(q_gc kmin_c, q_gc kmax_c)`` over the G query heads g of kv
    head h, computed as ``max(q, 0) . kmax + min(q, 0) . kmin`` (the same products: two dots
    instead of a [.., G, D] elementwise max per page). Raw ``q . k`` units (no ``sm_scale``).

    Args:
      q: [S, num_heads, head_dim] decode queries, any float dtype.
      bounds: ``KeyBounds`` or a KIVI K pool (see ``page_bounds``).
      block_tables: int32 [S, max_blocks].

    Returns:
      f32 [S, num_kv_heads, max_blocks]; pages past a sequence's end score whatever their
      (padding) block holds: ``select_pages`` masks them.
    """
    lo, hi = page_bounds(bounds, block_tables)                  # [S, P, Hkv, D]
    S, Hq, D = q.shape
    Hkv = lo.shape[2]
    qg = q.astype(jnp.float32).reshape(S, Hkv, Hq // Hkv, D)     # [S, Hkv, G, D]
    s = jnp.einsum("shgd,sphd->shgp", jnp.maximum(qg, 0.0), hi, precision=_HIGHEST) + \
        jnp.einsum("shgd,sphd->shgp", jnp.minimum(qg, 0.0), lo, precision=_HIGHEST)
    return s.max(axis=2)                                        # [S, Hkv, P]


def min_budget(block_size: int, *, num_sinks: int = 0, recent: int = 1,
               residual_blocks: int = 1) -> int:
    """Pages every selection may have to force: the sink pages plus the larger of the pages the
    last ``recent`` tokens can span and the KIVI residual window (the smallest valid budget)."""
    recent_pages = -(-(recent - 1) // block_size) + 1
    return -(-num_sinks // block_size) + max(recent_pages, residual_blocks)


def select_pages(scores: jax.Array, seq_lens: jax.Array, *, block_size: int, budget: int,
                 num_sinks: int = 0, recent: int = 1, residual_blocks: int = 1):
    """The pages each (sequence, kv head) attends to: forced pages, then the best-scored ones.

    Forced (always selected): the pages holding the first ``num_sinks`` positions (attention
    sinks), the pages holding the last ``recent`` positions (the current token included) and the
    KIVI residual window (logical pages from ``seq_len // block_size - (residual_blocks - 1)``,
    whose blocks may be unsealed or read from the residual). The other live pages fill the rest
    of the ``budget`` by descending score, ties to the lower page. Pages at or past
    ``cdiv(seq_len, block_size)`` are never selected.

    Args:
      scores: f32 [S, Hkv, max_blocks] (``page_scores``).
      seq_lens: int32 [S] kv lengths including the current token (0: a padding sequence).
      block_size: tokens per page.
      budget: pages per (sequence, kv head) (static), >= ``min_budget(...)``.
      num_sinks: sink positions (tokens).
      recent: recent positions (tokens, >= 1: the current token).
      residual_blocks: the KIVI residual window R of the pool (1 for other formats).

    Returns:
      (pages int32 [S, Hkv, budget] logical page ids, ascending in the first ``count`` entries,
      0 after; count int32 [S, Hkv] = min(budget, live pages)).

    Raises:
      ValueError: for ``recent < 1``, ``num_sinks < 0`` or a budget below ``min_budget``.
    """
    if recent < 1 or num_sinks < 0:
        raise ValueError(f"recent={recent} must be >= 1 and num_sinks={num_sinks} >= 0")
    need = min_budget(block_size, num_sinks=num_sinks, recent=recent,
                      residual_blocks=residual_blocks)
    if budget < need:
        raise ValueError(f"budget={budget} pages cannot hold the {need} pages that sinks "
                         f"({num_sinks} tokens), the recent window ({recent} tokens) and the "
                         f"residual window ({residual_blocks} blocks) may force")
    P = scores.shape[-1]
    logical = jnp.arange(P, dtype=jnp.int32)                                     # [P]
    lens = seq_lens[:, None]                                                     # [S, 1]
    live = logical < (lens + block_size - 1) // block_size                       # [S, P]
    first_recent = jnp.maximum(lens - recent, 0) // block_size
    forced = (logical < -(-num_sinks // block_size)) | (logical >= first_recent) \
        | (logical >= window_first(lens, block_size, residual_blocks))
    key = jnp.where((forced & live)[:, None], jnp.inf,
                    jnp.where(live[:, None], scores, -jnp.inf))                  # [S, Hkv, P]
    k = min(budget, P)
    top, idx = jax.lax.top_k(key, k)                # ties: the lower index first
    picked = top > -jnp.inf                                                      # [S, Hkv, k]
    count = picked.sum(axis=-1).astype(jnp.int32)
    idx = jnp.sort(jnp.where(picked, idx, P), axis=-1)                           # picked first
    pages = jnp.where(jnp.arange(k) < count[..., None], idx, 0).astype(jnp.int32)
    return jnp.pad(pages, ((0, 0), (0, 0), (0, budget - k))), count


def _residual_blocks(pages: Pages) -> int:
    """The KIVI residual window R of a pool (1 for a pool without a residual)."""
    if isinstance(pages, QuantizedPages) and pages.residual is not None:
        return pages.residual_blocks
    return 1


def quest_select(q: jax.Array, k_pages: Pages, block_tables: jax.Array, seq_lens: jax.Array, *,
                 budget: int, bounds: KeyBounds | None = None, num_sinks: int = 0,
                 recent: int = 1):
    """``select_pages(page_scores(...))`` for one layer: the pages a decode step attends to.

    Args:
      q: [S, num_heads, head_dim] decode queries.
      k_pages: the layer's K pool (any format; sets block_size and the KIVI residual window).
      block_tables: int32 [S, max_blocks].
      seq_lens: int32 [S] kv lengths including the current token.
      budget: pages per (sequence, kv head) (static).
      bounds: the pool's ``KeyBounds``; None for a KIVI pool (derived from its statistics).
      num_sinks, recent: forced sink / recent positions (tokens), see ``select_pages``.

    Returns:
      (pages int32 [S, Hkv, budget], count int32 [S, Hkv]) as ``select_pages``.
    """
    if bounds is None:
        if not (isinstance(k_pages, QuantizedPages) and k_pages.format.kivi):
            raise ValueError("bounds=None derives the bounds of a KIVI (int4/int2) K pool; "
                             "float, fp8 and int8 pools need their KeyBounds")
        bounds = k_pages
    return select_pages(page_scores(q, bounds, block_tables), seq_lens,
                        block_size=k_pages.shape[1], budget=budget, num_sinks=num_sinks,
                        recent=recent, residual_blocks=_residual_blocks(k_pages))


def check_selection(pages, count, num_seqs: int, num_kv_heads: int) -> None:
    """Raises ValueError unless ``pages`` is int32 [S, Hkv, K] and ``count`` int32 [S, Hkv]."""
    if pages.ndim != 3 or pages.shape[:2] != (num_seqs, num_kv_heads):
        raise ValueError(f"pages must be [S, num_kv_heads, K] = [{num_seqs}, {num_kv_heads}, K], "
                         f"got {pages.shape}")
    if count.shape != (num_seqs, num_kv_heads):
        raise ValueError(f"count must be [S, num_kv_heads] = [{num_seqs}, {num_kv_heads}], "
                         f"got {count.shape}")
    for name, a in (("pages", pages), ("count", count)):
        if a.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {a.dtype}")


def sparse_decode_reference(q: jax.Array, k_pages: Pages, v_pages: Pages,
                            block_tables: jax.Array, seq_lens: jax.Array, pages: jax.Array,
                            count: jax.Array, *, sm_scale: float | None = None,
                            soft_cap: float | None = None, return_lse: bool = False):
    """Decode attention over exactly the selected pages of each kv head (the sparse spec).

    The token of sequence s sits at position ``seq_lens[s] - 1``; kv head h's query heads attend
    to the positions ``< seq_lens[s]`` of logical pages ``pages[s, h, :count[s, h]]``.

    Args:
      q: [S, num_heads, head_dim] one query token per sequence.
      k_pages, v_pages: [num_blocks, block_size, Hkv, head_dim] one layer's pools, arrays or
        ``QuantizedPages`` (read by ``jaxkv.kvcache.pools.read_pages``; a KIVI page inside the
        sequence's residual window from the full-precision residual, as the dense reference).
      block_tables: int32 [S, max_blocks] physical block of each logical page.
      seq_lens: int32 [S] kv lengths including the current token (0: padding, gives zeros).
      pages: int32 [S, Hkv, K] logical pages (entries from ``count`` on are ignored).
      count: int32 [S, Hkv] valid entries of ``pages``.
      sm_scale: softmax scale, default ``1/sqrt(head_dim)``.
      soft_cap: if set, logits become ``soft_cap * tanh(logits / soft_cap)``.
      return_lse: also return the log-sum-exp of the (scaled, capped) logits.

    Returns:
      out [S, num_heads, head_dim] in q's dtype, and with ``return_lse`` lse f32 [S, num_heads]
      (-inf where nothing was attended).
    """
    S = block_tables.shape[0]
    if q.ndim != 3 or q.shape[0] != S:
        raise ValueError(f"q must be [S, num_heads, head_dim] with S = {S}, got {q.shape}")
    check_shapes(q, k_pages, v_pages, block_tables, seq_lens, jnp.arange(S + 1))
    _, Hq, D = q.shape
    _, bs, Hkv, _ = k_pages.shape
    check_selection(pages, count, S, Hkv)
    K = pages.shape[2]
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    picked = jnp.arange(K) < count[..., None]                                    # [S, Hkv, K]
    logical = jnp.where(picked, pages, 0)
    ids = jnp.take_along_axis(block_tables[:, None, :], logical, axis=2)          # [S, Hkv, K]
    kv_pos = logical[..., None] * bs + jnp.arange(bs, dtype=jnp.int32)           # [S, Hkv, K, bs]
    mask = picked[..., None] & (kv_pos < seq_lens[:, None, None, None])
    window = logical >= window_first(seq_lens, bs, _residual_blocks(k_pages))[:, None, None]

    def read(pool):
        """f32 [S, Hkv, K * bs, D]: kv head h's rows of its own pages."""
        heads = [read_pages(pool, ids[:, h], window[:, h])[..., h, :] for h in range(Hkv)]
        return jnp.stack(heads, axis=1).reshape(S, Hkv, K * bs, D)

    mask = mask.reshape(S, Hkv, 1, K * bs)                                       # [S, Hkv, 1, K*bs]
    k = read(k_pages)
    v = jnp.where(mask[:, :, 0, :, None], read(v_pages), 0.0)    # p = 0 * stale NaN would be NaN
    qg = q.astype(jnp.float32).reshape(S, Hkv, Hq // Hkv, D) * scale             # [S, Hkv, G, D]
    s = jnp.einsum("shgd,shnd->shgn", qg, k)                                     # [S, Hkv, G, K*bs]
    carry = online_softmax_step(softmax_init(qg.shape[:3], D), cap_logits(s, soft_cap), mask,
                                lambda p: jnp.einsum("shgn,shnd->shgd", p, v))
    out, lse = softmax_result(carry)
    out = out.reshape(S, Hq, D).astype(q.dtype)
    return (out, lse.reshape(S, Hq)) if return_lse else out


def quest_decode_reference(q: jax.Array, k_pages: Pages, v_pages: Pages,
                           block_tables: jax.Array, seq_lens: jax.Array, *, budget: int,
                           bounds: KeyBounds | None = None, num_sinks: int = 0, recent: int = 1,
                           sm_scale: float | None = None, soft_cap: float | None = None,
                           return_lse: bool = False):
    """Quest decode attention: bounds -> page scores -> selection -> sparse attention.

    Args:
      q, k_pages, v_pages, block_tables, seq_lens, sm_scale, soft_cap, return_lse: as in
        ``sparse_decode_reference``.
      budget, bounds, num_sinks, recent: as in ``quest_select``.

    Returns:
      As ``sparse_decode_reference``; with a budget of at least ``max_blocks`` pages every live
      page is selected and the result is the dense decode attention.
    """
    pages, count = quest_select(q, k_pages, block_tables, seq_lens, budget=budget,
                                bounds=bounds, num_sinks=num_sinks, recent=recent)
    return sparse_decode_reference(q, k_pages, v_pages, block_tables, seq_lens, pages, count,
                                   sm_scale=sm_scale, soft_cap=soft_cap, return_lse=return_lse)
