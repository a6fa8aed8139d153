"""Verification of draft tokens inside the jitted step: exact speculative sampling (Leviathan,
Kalman, Matias, ICML 2023; Chen et al. 2023) for drafts that are point masses.

A sequence ``s`` of a step carries ``k = num_drafts[s]`` draft tokens ``d_1 .. d_k`` after its last
known token, and the step computes the target model's logits at its ``1 + k`` positions (row ``j``
follows ``d_1 .. d_j``). Row ``j``'s sampling distribution ``p_j`` is the softmax of
``sampling.process_logits`` with that row's own history (the drafts before it count as generated
tokens: penalties, ``min_tokens`` and the seeded key ``fold_in(seed, step + j)`` all see them).

The rule. A draft ``d ~ q_j`` is accepted with probability ``min(1, p_j(d) / q_j(d))``; at the
first rejection the emitted token is drawn from ``norm(max(0, p_j - q_j))``; when all ``k`` are
accepted a bonus token is drawn from ``p_k``. Each emitted token is then distributed exactly as
non-speculative sampling would draw it. For a point-mass draft (the n-gram proposer, or any
deterministic proposer) ``q_j = delta_d``: accept with probability ``p_j(d)``, else draw from
``p_j`` with ``d`` removed and renormalised.

How it is computed here: by coupling. ``sampling.sample`` draws a target token ``t_j ~ p_j`` at
every row with exactly the randomness non-speculative decoding uses for that output position
(the argmax for greedy rows; argmax of logits + Gumbel noise otherwise), and ``d_{j+1}`` is
accepted iff ``d_{j+1} == t_j``. That is the rule above:

    P(accept)              = P(t_j = d)            = p_j(d)  = min(1, p_j(d) / q_j(d))
    P(t_j = x | rejected)  = p_j(x) / (1 - p_j(d))  (x != d)  = norm(max(0, p_j - q_j))(x)

The step emits ``t_0 .. t_{a-1}``: the ``a - 1`` accepted drafts (equal to their targets), then
the correction (the target where the first draft was rejected) or the bonus token ``t_k``. For
greedy rows this is "accept while the target argmax matches". Because each emitted token is the
very token non-speculative decoding draws with the same key, greedy and seeded outputs do not
depend on the drafts at all (up to floating-point differences of the wider verify step), and a
seeded row stays independent of its batch neighbours. Reusing the key of a rejected position in
the next step is sound: whether that position was discarded depended only on the noise of the
positions before it.

A proposer with a non-degenerate ``q`` (a sampled draft model) needs the general rule with
``q``'s probabilities; that proposer is not part of this slice.
"""

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
