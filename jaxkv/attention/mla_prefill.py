"""MLA's expanded (MHA) form for prefill over the paged latent pool: a sequence's latents are
up-projected once per kv chunk to per-head keys ``[c_kv @ W_UK | k_rope]`` and values
``c_kv @ W_UV`` that all of its query tiles then attend to (the same attention as
``jaxkv.attention.mla.mla_attention_expanded``, the spec, chunked and ragged).

Multiply-adds per head for q query tokens of one sequence over J kv positions::

    absorbed  q J (2 Lkv + R)              scores and values both Lkv (+ R) wide
    expanded  J Lkv (P + V) + q J (P + R + V)   up-projection once, then MHA

so the expanded form is cheaper once ``q > Lkv (P + V) / (2 Lkv - P - V)`` (171 for
DeepSeek's Lkv 512, P = V = 128), whatever J. On CPU (fp32, bench/mla_prefill.py) the measured
crossovers, 89 to 225 tokens over 16 and 32 heads at J = 1K and 4K (two runs under load),
bracket it, so ``expanded_min_tokens`` is the model's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.attention.reference import online_softmax_step, softmax_init, softmax_result
from jaxkv.kvcache.pools import Pages, read_pages


def expanded_min_tokens(kv_lora_rank: int, nope_dim: int, v_dim: int) -> int:
    """The fewest query tokens of one sequence in a step for which the expanded form is cheaper
    (at least 2: a decode token always attends absorbed)."""
    denom = 2 * kv_lora_rank - nope_dim - v_dim
    if denom <= 0:
        return 2
    return max(2, round(kv_lora_rank * (nope_dim + v_dim) / denom))


def _up_project(latent: jax.Array, w_uk: jax.Array, w_uv: jax.Array):
    """latent f32 [C, Lkv + R] -> head-major keys' nope part [N, C, P], values [N, C, V] and
    the shared rotary key [C, R]."""
    Lkv = w_uk.shape[0]
    c_kv = latent[:, :Lkv]
    return (jnp.einsum("cl,lnp->ncp", c_kv, w_uk.astype(jnp.float32)),
            jnp.einsum("cl,lnv->ncv", c_kv, w_uv.astype(jnp.float32)), latent[:, Lkv:])


def mla_prefill_attention(q_nope: jax.Array, q_rope: jax.Array, pool: Pages, w_uk: jax.Array,
                          w_uv: jax.Array, block_tables: jax.Array, seq_lens: jax.Array,
                          query_start_loc: jax.Array, chosen: jax.Array, *, sm_scale: float,
                          block_q: int = 128, kv_chunk: int = 256) -> jax.Array:
    """The expanded MLA attention of the tokens of the ``chosen`` sequences.

    Loops (dynamic trip counts, so the cost follows the step's real lengths, not its padded
    shapes): every chosen sequence, every kv chunk of ``kv_chunk`` positions up to its length
    (up-projected once), every ``block_q``-token query tile that sees the chunk.

    Args:
      q_nope: [T, N, P]; q_rope: [T, N, R] rotated.
      pool: the latent pool [num_blocks, block_size, 1, Lkv + R] (array or HNDPages), this
        step's latents already written.
      w_uk, w_uv: [Lkv, N, P] and [Lkv, N, V].
      block_tables, seq_lens, query_start_loc: the step's ragged layout.
      chosen: bool [S]: the sequences this form computes.
      sm_scale: the softmax scale.

    Returns:
      o f32 [T, N, V]: zeros for the tokens of other sequences and padding.
    """
    T, N, P = q_nope.shape
    S, max_blocks = block_tables.shape
    bs = pool.shape[1]
    cb = max(1, min(kv_chunk // bs, max_blocks))                     # blocks per kv chunk
    C = cb * bs
    tables = jnp.pad(block_tables, ((0, 0), (0, -max_blocks % cb)))
    bq = min(block_q, T)
    q = jnp.concatenate([q_nope, q_rope], -1).astype(jnp.float32) * sm_scale
    q = jnp.pad(q, ((0, bq), (0, 0), (0, 0))).transpose(1, 0, 2)    # [N, T + bq, P + R]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]

    def one_sequence(s, state):
        first_pos = seq_lens[s] - q_lens[s]                          # kv position of token 0

        def chunk(c, state):
            ids = jax.lax.dynamic_slice(tables[s], (c * cb,), (cb,))
            k_nope, v, k_rope = _up_project(read_pages(pool, ids).reshape(C, -1), w_uk, w_uv)
            kv_pos = c * C + jnp.arange(C)

            def query_tile(i, state):
                start = query_start_loc[s] + i * bq
                row = i * bq + jnp.arange(bq)
                mask = (kv_pos[None, :] <= first_pos + row[:, None]) & (row < q_lens[s])[:, None]
                qt = jax.lax.dynamic_slice_in_dim(q, start, bq, axis=1)     # [N, bq, P + R]
                scores = (jnp.einsum("nqp,ncp->nqc", qt[..., :P], k_nope)
                          + jnp.einsum("nqr,cr->nqc", qt[..., P:], k_rope))
                carry = [jax.lax.dynamic_slice_in_dim(x, start, bq, axis=1) for x in state]
                carry = online_softmax_step(carry, scores, mask[None],
                                            lambda p: jnp.einsum("nqc,ncv->nqv", p, v))
                return tuple(jax.lax.dynamic_update_slice_in_dim(x, y, start, axis=1)
                             for x, y in zip(state, carry))

            # tiles whose last token sits before the chunk see none of it
            first_tile = jnp.maximum(0, (c * C - first_pos) // bq)
            return jax.lax.fori_loop(first_tile, -(-q_lens[s] // bq), query_tile, state)

        def run(state):
            return jax.lax.fori_loop(0, -(-seq_lens[s] // C), chunk, state)

        return jax.lax.cond(chosen[s] & (q_lens[s] > 0), run, lambda st: st, state)

    state = softmax_init((N, T + bq), w_uv.shape[-1])               # head-major rows
    out, _ = softmax_result(jax.lax.fori_loop(0, S, one_sequence, state))
    return out[:, :T].transpose(1, 0, 2)
