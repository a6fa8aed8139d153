"""One layer's attention over its paged pools: dense (``dispatch.paged_attention``), dense with
H2O's attention mass per block or with gpt-oss's learned sinks, or with the decode tokens on
their Quest pages. The model calls ``attend``; which runs is static (the step's options)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.attention import quest
from jaxkv.attention.dispatch import paged_attention
from jaxkv.attention.mass import block_attention_mass
from jaxkv.attention.options import AttentionOptions, QuestOptions
from jaxkv.kvcache.metadata import AttentionMetadata


def attend(q, k_pool, v_pool, bounds, md: AttentionMetadata, *, options: AttentionOptions,
           impl, interpret, attention=paged_attention, sparse: QuestOptions | None = None,
           row_queries: int = 1, q_sinks=None, sink_logits=None):
    """One layer's attention; this step's K/V already written to ``k_pool``, ``v_pool``.

    Args:
      q: [T, Hq, D] rotated queries; ``q_sinks``: the same scored against the sinks
        (StreamingLLM's positions within the cache), or None.
      bounds: the layer's Quest ``KeyBounds`` (None for a KIVI pool or without Quest).
      options: window, sinks and ``observe`` (return H2O's block mass); ``sparse``: Quest.
      impl, interpret, attention: the dense attention (``attention`` may be a sharded one);
        ``row_queries``: its layout hint (``jaxkv.attention.dispatch``).
      sink_logits: f32 [Hq] a learned logit per head that joins every softmax with no value
        (gpt-oss), or None.

    Returns:
      (o [T, Hq, D], block mass f32 [S, max_blocks] or None).
    """
    kw = dict(sliding_window=options.sliding_window, num_sinks=options.num_sinks)
    kw.update({k: v for k, v in (("sm_scale", options.sm_scale), ("soft_cap", options.soft_cap))
               if v is not None})
    if q_sinks is not None:
        kw["q_sinks"] = q_sinks
    if sparse is not None:
        o, _ = quest_attention(q, k_pool, v_pool, bounds, md, sparse=sparse, impl=impl,
                               interpret=interpret, attention=attention,
                               row_queries=row_queries, **kw)
        return o, None
    if sink_logits is not None:
        o, lse = attention(q, k_pool, v_pool, md.block_tables, md.seq_lens, md.query_start_loc,
                           impl=impl, interpret=interpret, return_lse=True,
                           row_queries=row_queries, decode_only=md.decode_only, **kw)
        return with_sinks(o, lse, sink_logits), None
    if options.observe:   # H2O's statistic: the mass each block got, from the lse
        o, lse = attention(q, k_pool, v_pool, md.block_tables, md.seq_lens, md.query_start_loc,
                           impl=impl, interpret=interpret, return_lse=True,
                           row_queries=row_queries, decode_only=md.decode_only, **kw)
        return o, block_attention_mass(q, k_pool, md.block_tables, md.seq_lens,
                                       md.query_start_loc, lse, observe=options.observe, **kw)
    return attention(q, k_pool, v_pool, md.block_tables, md.seq_lens, md.query_start_loc,
                     impl=impl, interpret=interpret, row_queries=row_queries,
                     decode_only=md.decode_only, **kw), None


def with_sinks(o, lse, sink_logits):
    """Attention with a sink logit ``s_h`` in each head's softmax, from the one without it:
    ``p_j = e^{x_j} / (sum_k e^{x_k} + e^{s_h})``, so ``o * sigmoid(lse - s_h)``.

    Args:
      o: [T, Hq, D]; lse: f32 [T, Hq] (-inf: padding, which stays 0); sink_logits: [Hq].
    """
    keep = jax.nn.sigmoid(lse - sink_logits.astype(jnp.float32)[None, :])      # [T, Hq]
    return (o.astype(jnp.float32) * keep[..., None]).astype(o.dtype)


def _sparse_decode(q, k_pool, v_pool, tables, lens, pages, count, *, impl, interpret):
    """Decode attention over the selected pages: the jnp spec, or the Pallas kernel."""
    if impl == "pallas":
        from jaxkv.attention.pallas import sparse_paged_decode_attention  # lazily: GPU-only
        return sparse_paged_decode_attention(q, k_pool, v_pool, tables, lens, pages, count,
                                             interpret=interpret)
    return quest.sparse_decode_reference(q, k_pool, v_pool, tables, lens, pages, count)


def quest_attention(q, k_pool, v_pool, bounds, md: AttentionMetadata, *,
                    sparse: QuestOptions, impl, interpret, attention=paged_attention,
                    row_queries: int = 1, **options):
    """Ragged attention whose decode tokens (and verified drafts) attend only to their Quest
    pages (``quest.sparse_rows``: each at its own length, as the decode step it stands for).

    Args:
      q: [T, Hq, D] rotated queries of the step.
      k_pool, v_pool: the layer's pools, this step's K/V already written.
      bounds: the layer's ``KeyBounds`` (updated with this step's keys), or None for a KIVI
        pool (bounds from its scale/zero).
      md: the step's metadata (``md.num_drafts``: the drafts of each sequence, or None).
      sparse: budget (pages), sinks and recent window (static).
      impl, interpret, attention, options: the dense attention of the prefill chunks.
      row_queries: the step's logits width W (static): the last W tokens of each sequence are
        the candidates for sparse attention, and the dense attention's layout hint.

    Returns:
      (o [T, Hq, D], (pages int32 [S * W, Hkv, budget], count int32 [S * W, Hkv]) the
      selection of each sequence's last W tokens, count 0 for tokens that stay dense).
    """
    T = q.shape[0]
    rows, lens, all_sparse = quest.sparse_rows(md.query_start_loc, md.seq_lens, md.num_drafts,
                                               row_queries)                 # [S * W], [S]
    q_lens = md.query_start_loc[1:] - md.query_start_loc[:-1]
    dense_lens = jnp.where(all_sparse, q_lens, md.seq_lens)     # all sparse: null blocks only
    dense_tables = jnp.where(all_sparse[:, None], 0, md.block_tables)
    o = attention(q, k_pool, v_pool, dense_tables, dense_lens, md.query_start_loc, impl=impl,
                  interpret=interpret, row_queries=row_queries, decode_only=md.decode_only,
                  **options)
    tables = jnp.repeat(md.block_tables, row_queries, axis=0)                   # [S * W, B]
    q_rows = q[jnp.clip(rows, 0, T - 1)]                                         # [S * W, Hq, D]
    pages, count = quest.quest_select(q_rows, k_pool, tables, lens,
                                      budget=sparse.budget, bounds=bounds,
                                      num_sinks=sparse.num_sinks, recent=sparse.recent)
    out = _sparse_decode(q_rows, k_pool, v_pool, tables, lens, pages, count, impl=impl,
                         interpret=interpret)
    o = o.at[jnp.where(lens > 0, rows, T)].set(out.astype(o.dtype), mode="drop")
    return o, (pages, count)
