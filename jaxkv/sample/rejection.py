"""Verification of draft tokens inside the jitted step: exact speculative sampling (Leviathan,
Kalman, Matias, ICML 2023; Chen et al. 2023) for drafts that are point masses.

Design notes: docs/speculative-decoding.md."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def num_accepted(target_tokens: jax.Array, draft_token_ids: jax.Array,
                 num_drafts: jax.Array) -> jax.Array:
    """How many tokens each sequence emits: 1 + its leading drafts equal to the target before them.

    Args:
      target_tokens: int32 [S, W], row ``(s, j)`` the token sampled after draft ``j`` (``j = 0``:
        after the last known token), drawn as non-speculative decoding draws it.
      draft_token_ids: int32 [S, W - 1], draft ``j + 1`` of each sequence (padding anything).
      num_drafts: int32 [S], drafts of each sequence (``<= W - 1``); 0 emits 1 token.

    Returns:
      int32 [S] in ``[1, 1 + num_drafts]``: sequence ``s`` emits ``target_tokens[s, :n[s]]``.
    """
    width = target_tokens.shape[1]
    real = jnp.arange(width - 1, dtype=jnp.int32)[None, :] < num_drafts[:, None]   # [S, W - 1]
    match = (draft_token_ids == target_tokens[:, :-1]) & real
    return 1 + jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1, dtype=jnp.int32)
