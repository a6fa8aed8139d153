"""The explicit ``impl=`` choice of paged attention: the jnp reference, the grouped XLA path
(CPU) or the Pallas kernels (GPU).

The one module that sees every implementation, so the arrows run one way::

    layer / step / sharding ──► dispatch ──► reference (the spec)
                                   │ │           ▲
                                   │ └──► grouped ──┤  (masks, online softmax; kv_chunks)
                                   └──► pallas/ ───┘  (merge_attention_states; kv_chunks)
"""

from __future__ import annotations

from jaxkv.attention import ATTENTION_IMPLS
from jaxkv.attention.grouped import paged_attention_grouped
from jaxkv.attention.reference import paged_attention_reference


def paged_attention(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, *,
                    impl: str = "reference", interpret: bool = False, row_queries: int = 1,
                    decode_only: bool = False, **options):
    """Ragged paged attention with an explicit implementation choice.

    Args:
      q, k_pages, v_pages, block_tables, seq_lens, query_start_loc: as in
        ``jaxkv.attention.reference.paged_attention_reference``.
      impl: ``"reference"`` (pure jnp, the specification), ``"grouped"`` (the KV gathered once
        per sequence, jaxkv.attention.grouped; the fast path on CPU) or ``"pallas"``
        (jaxkv.attention.pallas kernels, GPU).
      interpret: run the Pallas kernel in interpret mode (CPU).
      row_queries: how many trailing tokens of each sequence the grouped path computes as
        rows, with its decode tokens (static; a speculative step's ``1 + k``); a layout hint
        that does not change the result, which the other implementations do not need.
      decode_only: the caller's promise that every sequence has at most one query token,
        sequence s's being ``q[s]`` (static; ``AttentionMetadata.decode_only``): the Pallas
        path then runs the split-K decode kernel instead of the ragged one.
      **options: ``sm_scale``, ``sliding_window``, ``num_sinks``, ``soft_cap``, ``q_sinks``.

    Returns:
      [T, num_heads, head_dim] in q's dtype.

    Raises:
      ValueError: an unknown ``impl``, or inputs whose shapes disagree.
    """
    if impl == "reference":
        return paged_attention_reference(q, k_pages, v_pages, block_tables, seq_lens,
                                         query_start_loc, **options)
    if impl == "grouped":
        return paged_attention_grouped(q, k_pages, v_pages, block_tables, seq_lens,
                                       query_start_loc, row_queries=row_queries, **options)
    if impl == "pallas":
        from jaxkv.attention import pallas  # lazily: GPU-only code

        kernel = pallas.decode_step_attention if decode_only else pallas.ragged_paged_attention
        return kernel(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc,
                      interpret=interpret, **options)
    raise ValueError(f"impl={impl!r} is not an attention implementation; choose one of "
                     f"{ATTENTION_IMPLS}")
