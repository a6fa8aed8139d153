"""Multi-head latent attention (DeepSeek) over a paged latent pool: every token of a layer
caches one "head" ``latent = [c_kv | k_rope]`` of ``Lkv + R`` values, the K pool of a
``KVCacheSpec`` with one kv head and ``v_head_dim = 0`` (jaxkv/model/mla.py writes it): floats,
or fp8 codes with one scale per token over the whole latent, which every path here reads
dequantized (``read_pages``; the CPU kernel and the Pallas kernel in their tiles).

Absorbed (the decode form, the only one that reads just the latent): W_UK folded into the
query, so all N heads score the one latent head (MQA, qk width Lkv + R), the latent's first Lkv
channels are the values, and W_UV is applied after::

    q_lat[t, n] = W_UK[:, n, :] @ q_nope[t, n]                      [T, N, Lkv]
    o_lat[t, n] = softmax_j(s [q_lat | q_rope][t, n] . latent[j]) latent[j, :Lkv]
    o[t, n]     = o_lat[t, n] @ W_UV[:, n, :]                       [T, N, V]

Expanded (MHA, the prefill form): ``k_j = [c_kv_j @ W_UK | k_rope_j]``, ``v_j = c_kv_j @ W_UV``
per head; the same attention up to rounding (``mla_attention_expanded``, checked against it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.attention.dispatch import paged_attention
from jaxkv.attention.reference import token_layout
from jaxkv.kvcache.metadata import AttentionMetadata
from jaxkv.kvcache.pools import HNDPages, Pages, read_pages


def absorb_query(q_nope: jax.Array, q_rope: jax.Array, w_uk: jax.Array) -> jax.Array:
    """The latent-space query ``[q_nope @ W_UK^T | q_rope]``: q_nope [T, N, P], q_rope
    [T, N, R], w_uk [Lkv, N, P] -> [T, N, Lkv + R] in q's dtype."""
    q_lat = jnp.einsum("tnp,lnp->tnl", q_nope, w_uk.astype(q_nope.dtype))
    return jnp.concatenate([q_lat, q_rope.astype(q_lat.dtype)], axis=-1)


def mla_attention_reference(q: jax.Array, pool: Pages, block_tables: jax.Array,
                            seq_lens: jax.Array, query_start_loc: jax.Array, *,
                            kv_lora_rank: int, sm_scale: float) -> jax.Array:
    """Absorbed MLA over the paged latent pool, pure jnp (the specification): every token's
    heads attend to all latents of its sequence up to its own position.

    Args:
      q: [T, N, Lkv + R] latent-space queries (``absorb_query``); rows past
        ``query_start_loc[-1]`` are padding.
      pool: the layer's latent pool [num_blocks, block_size, 1, Lkv + R] (array, HNDPages or
        fp8 QuantizedPages).
      block_tables, seq_lens, query_start_loc: the step's ragged layout (as
        ``jaxkv.attention.reference.paged_attention_reference``).
      kv_lora_rank: Lkv, the latent's value channels.
      sm_scale: the softmax scale (``jaxkv.model.mla.softmax_scale``).

    Returns:
      o_lat [T, N, Lkv] in q's dtype (zeros for padding tokens).
    """
    T = q.shape[0]
    S, B = block_tables.shape
    latent = read_pages(pool, block_tables)                         # f32 [S, B, bs, 1, Lkv + R]
    latent = latent.reshape(S, -1, latent.shape[-1])                # [S, B bs, Lkv + R]
    seq, q_pos, valid = token_layout(query_start_loc, seq_lens, T)
    keys = latent[seq]                                              # [T, B bs, Lkv + R]
    s = jnp.einsum("tnd,tjd->tnj", q.astype(jnp.float32), keys) * sm_scale
    kv_pos = jnp.arange(keys.shape[1], dtype=jnp.int32)
    seen = (kv_pos[None, :] <= q_pos[:, None]) & valid[:, None]     # [T, B bs]
    s = jnp.where(seen[:, None, :], s, -jnp.inf)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True, initial=-1e30))
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)            # 0 rows stay 0
    o = jnp.einsum("tnj,tjl->tnl", p, keys[..., :kv_lora_rank])
    return o.astype(q.dtype)


def mla_attention(q_nope: jax.Array, q_rope: jax.Array, pool: Pages, w_uk: jax.Array,
                  w_uv: jax.Array, md: AttentionMetadata, *, sm_scale: float, impl: str,
                  interpret: bool = False, attention=paged_attention,
                  row_queries: int = 1) -> jax.Array:
    """A layer's MLA in the absorbed form, reading only the latent pool (this step's latents
    already written).

    ``impl="reference"`` runs ``mla_attention_reference``; ``"grouped"`` (the CPU path) the
    paged attention with the latent as both K and V (one kv head shared by the N query heads;
    the output's last R channels dropped), through ``attention`` (``dispatch.paged_attention``'s
    signature); ``"pallas"``: a decode-only step (``md.decode_only``) runs the Pallas MLA decode
    kernel (``jaxkv.attention.pallas.mla_decode``, in interpret mode with ``interpret``), other
    steps the grouped path; its pool must be NHD (an HNDPages pool is refused on every step, so
    a wrong layout fails at the first step rather than at the first decode).

    Args:
      q_nope: [T, N, P]; q_rope: [T, N, R] rotated.
      pool: the latent pool [num_blocks, block_size, 1, Lkv + R] (any ``LATENT_FORMATS``).
      w_uk, w_uv: [Lkv, N, P] and [Lkv, N, V], ``kv_b_proj``'s halves.
      md: the step's metadata.

    Returns:
      o [T, N, V] in q_nope's dtype.
    """
    Lkv = w_uk.shape[0]
    q = absorb_query(q_nope, q_rope, w_uk)                           # [T, N, Lkv + R]
    if impl == "reference":
        o_lat = mla_attention_reference(q, pool, md.block_tables, md.seq_lens,
                                        md.query_start_loc, kv_lora_rank=Lkv, sm_scale=sm_scale)
    elif impl == "pallas" and isinstance(pool, HNDPages):
        raise ValueError("attention_impl='pallas' reads NHD latent pools, not HNDPages "
                         "(kv_layout='hnd'); use kv_layout='nhd'")
    elif impl == "pallas" and md.decode_only:
        from jaxkv.attention.pallas.mla_decode import mla_decode_step  # lazily: GPU-only code

        o_lat = mla_decode_step(q, pool, md.block_tables, md.seq_lens, md.query_start_loc,
                                kv_lora_rank=Lkv, sm_scale=sm_scale, interpret=interpret)
    elif impl in ("grouped", "pallas"):
        o_lat = attention(q, pool, pool, md.block_tables, md.seq_lens, md.query_start_loc,
                          impl="grouped", interpret=interpret, row_queries=row_queries,
                          decode_only=md.decode_only, sm_scale=sm_scale)[..., :Lkv]
    else:
        raise ValueError(f"attention_impl={impl!r} has no MLA path; supported for MLA models: "
                         f"'grouped', 'pallas', 'reference'")
    return jnp.einsum("tnl,lnv->tnv", o_lat, w_uv.astype(o_lat.dtype))


def mla_attention_expanded(q_nope: jax.Array, q_rope: jax.Array, pool: Pages, w_uk: jax.Array,
                           w_uv: jax.Array, block_tables: jax.Array, seq_lens: jax.Array,
                           query_start_loc: jax.Array, *, sm_scale: float) -> jax.Array:
    """MLA in the expanded (MHA) form, pure jnp: every sequence's latents up-projected to
    per-head keys ``[c_kv @ W_UK | k_rope]`` and values ``c_kv @ W_UV``, then causal attention.

    Args: as ``mla_attention`` (the step's layout given as arrays).

    Returns:
      o f32 [T, N, V] (zeros for padding tokens).
    """
    T, Lkv = q_nope.shape[0], w_uk.shape[0]
    S = block_tables.shape[0]
    latent = read_pages(pool, block_tables)
    latent = latent.reshape(S, -1, latent.shape[-1])                # [S, J, Lkv + R]
    c_kv, k_rope = latent[..., :Lkv], latent[..., Lkv:]
    k_nope = jnp.einsum("sjl,lnp->sjnp", c_kv, w_uk.astype(jnp.float32))
    v = jnp.einsum("sjl,lnv->sjnv", c_kv, w_uv.astype(jnp.float32))
    seq, q_pos, valid = token_layout(query_start_loc, seq_lens, T)
    s = (jnp.einsum("tnp,tjnp->tnj", q_nope.astype(jnp.float32), k_nope[seq])
         + jnp.einsum("tnr,tjr->tnj", q_rope.astype(jnp.float32), k_rope[seq])) * sm_scale
    kv_pos = jnp.arange(latent.shape[1], dtype=jnp.int32)
    seen = (kv_pos[None, :] <= q_pos[:, None]) & valid[:, None]
    s = jnp.where(seen[:, None, :], s, -jnp.inf)
    p = jnp.where(seen[:, None, :], jax.nn.softmax(s, axis=-1), 0.0)
    p = jnp.nan_to_num(p)                                           # padding rows: all masked
    return jnp.einsum("tnj,tjnv->tnv", p, v[seq])
