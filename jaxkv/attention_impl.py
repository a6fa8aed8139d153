"""The explicit ``impl=`` choice of paged attention: the jnp reference or the Pallas kernels.

The one module that sees both sides, so the arrows run one way::

    model / step / sharding ──► attention_impl ──► attention (the spec)
                                      │                  ▲
                                      └──► pallas ───────┘  (merge_attention_states)
"""

from __future__ import annotations

from jaxkv.attention import paged_attention_reference
from jaxkv.config import ATTENTION_IMPLS


def paged_attention(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, *,
                    impl: str = "reference", interpret: bool = False, **options):
    """Ragged paged attention with an explicit implementation choice.

    Args:
      q, k_pages, v_pages, block_tables, seq_lens, query_start_loc: as in
        ``jaxkv.attention.paged_attention_reference``.
      impl: ``"reference"`` (pure jnp) or ``"pallas"`` (jaxkv.pallas kernels).
      interpret: run the Pallas kernel in interpret mode (CPU).
      **options: ``sm_scale``, ``sliding_window``, ``num_sinks``, ``soft_cap``.

    Returns:
      [T, num_heads, head_dim] in q's dtype.

    Raises:
      ValueError: an unknown ``impl``, or inputs whose shapes disagree.
    """
    if impl == "reference":
        return paged_attention_reference(q, k_pages, v_pages, block_tables, seq_lens,
                                         query_start_loc, **options)
    if impl == "pallas":
        from jaxkv.pallas import ragged_paged_attention  # imported lazily: Pallas is GPU-only code

        return ragged_paged_attention(q, k_pages, v_pages, block_tables, seq_lens,
                                      query_start_loc, interpret=interpret, **options)
    raise ValueError(f"impl={impl!r} is not an attention implementation; choose one of {ATTENTION_IMPLS}")
